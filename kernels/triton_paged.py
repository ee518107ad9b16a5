"""Triton kernels over paged FP8 rows (continuous batching): the row writer, and attention with varlen queries
and keys read through read indices.

The rows, their geometry in the pages and what each request sees are `paged.py`'s (the torch codec and
attention these kernels reproduce). One program handles `BLOCK_M` rows of one request and one KV head, a row being a
(query position, query head of the group) pair, so a GQA group reads each K/V tile once. As in
`triton_attention`: codes are converted by the hardware on CUDA (e4m3fn, e5m2) or by exact bit operations
(`decode_codes`), dots run in fp16 (fp32 for fp32 queries), per-token scales multiply scores and probabilities,
per-head scales the query and the output. The cached keys are read from the pages in tiles of consecutive slots
of one page when the page size allows it (`page_tile_tokens`): one physical index per tile, the value plane's
channels as 16-byte vectors along the tokens; this step's keys from the new rows after them. A request's recent
and sink tokens held in the model's dtype (`paged.RecentRows`) are left out of the codes' loops and read after
them, in the same online softmax, as the dense kernel reads its recent and sink buffers; so are its outlier tokens,
left out of the codes' tiles by their positions. A decode step of few long requests is split over the keys
(flash-decoding), its partial results merged by `triton_attention`'s reduce.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .formats import StorageFormat
from .paged import ROW_ALIGNMENT, PageGeometry, RecentRows, row_size
from .triton_attention import reduce_blocks, reduce_launch, split_count
from .triton_common import (
    LOG2E, attend_full_precision, attend_tile, block_sizes, check_search_energy, clamp_fp16, decode_codes,
    decode_settings, encode, encoding, hadamard, query_target, register_room, rotated_query, rotation,
    search_weights, tile_tokens, token_scales, zero_columns,
)
from .targets import GpuTarget, sum_rows
from .triton_launch import Launch, cdiv, check_grid, compiled_occupancy, launch_all, next_power_of_2
from .triton_search import KERNEL_ROWS, add_head_query_energy

BLOCK_T = 16  # tokens per program of the row writer
# registers of the split decode kernel (NVIDIA): ptxas' own choice for the per-token head_dim 128 one, 128 for 4
# blocks per SM, spilled 8 B / 12 B; under 168, 148 and 3 blocks, no spill (gpu_static, sm_90). On 100 KB SMs
# (sm_86, sm_89, sm_120), whose shared memory holds 4 head_dim-64 blocks whatever the registers, 168 spilled 8-16 B
# in sm_86's head_dim 64 split decodes: 255 there
SPLIT_MAX_REGISTERS = 168
# head_dim (its power of 2) from which the paged kernel loads the new rows' V tiles as columns, as K's: each
# token's row is then worked out in one register layout, where two layouts each did it for their tokens
# (gpu_static, sm_90, 64 decode requests, static / per-token scales, measured when every key was read from rows:
# d128 0.240 / 0.296 -> 0.217 / 0.282 SASS instructions per KV byte, d256 0.241 / 0.270 -> 0.216 / 0.255; at d64
# the transposition costs more than it saves, 0.173 -> 0.209)
V_AS_COLUMNS_FROM = 128


@triton.jit
def _scale_at(ptr, ok, ALIGNED: tl.constexpr = False):
    """The fp32 scales stored at byte pointers `ptr` (4 little-endian bytes each); one 4-byte load each when the
    rows are `ALIGNED` (the scales then start on 4 bytes)."""
    if ALIGNED:
        scale = tl.load(ptr.to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    else:
        bits = tl.load(ptr, mask=ok, other=0).to(tl.int32)
        bits |= tl.load(ptr + 1, mask=ok, other=0).to(tl.int32) << 8
        bits |= tl.load(ptr + 2, mask=ok, other=0).to(tl.int32) << 16
        bits |= tl.load(ptr + 3, mask=ok, other=0).to(tl.int32) << 24
        scale = bits.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _attend_codes(
    q, acc, m_i, l_i, k_codes, v_codes, k_scale, v_scale, t, t_ok, q_pos, row_ok, window, PER_TOKEN: tl.constexpr,
    IS_FLOAT: tl.constexpr, HW_CONVERT: tl.constexpr, FP16_SHIFT: tl.constexpr, NAN_MASK: tl.constexpr,
    NAN_CODE: tl.constexpr, HAS_WINDOW: tl.constexpr, ZERO_UNREAD: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr, ONE_POSITION: tl.constexpr,
):  # fmt: skip
    """A tile of keys `t` (`k_codes` `[D, N]`, `v_codes` `[N, D]`, those of `t_ok` read) into the softmax;
    ZERO_UNREAD: the values of the others are zeroed (loaded whole, they may hold anything). ONE_POSITION: `q_pos`
    is the rows' one query position (a decode step), which no key passed here follows: one `[N]` rule for all
    (d128 decode with static scales: 0.105 -> 0.099 instructions per KV byte; d64 130 -> 128 registers, 6 -> 8
    blocks per SM, gpu_static)."""
    k = decode_codes(k_codes, IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE, DOT)
    v = decode_codes(v_codes, IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE, DOT)
    if ZERO_UNREAD:
        v = zero_columns(v, t_ok)
    if ONE_POSITION:  # (rows past the last: never stored)
        seen = t_ok & (t > q_pos - window) if HAS_WINDOW else t_ok
        visible = tl.broadcast_to(seen[None, :], (row_ok.shape[0], t.shape[0]))
    else:
        visible = (t[None, :] <= q_pos[:, None]) & t_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            visible = visible & (t[None, :] > q_pos[:, None] - window)
    return attend_tile(q, acc, m_i, l_i, k, v, k_scale, v_scale, visible, 1.0, PER_TOKEN, PER_TOKEN, False,
                       PRECISION, False)  # fmt: skip


@triton.jit
def _program_rows(q_start, q_len, first_row, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """A program's rows, (query position, query head of the KV head's group) pairs: the position, the head within
    the group, which rows exist, and the token index of each."""
    rows = first_row + tl.arange(0, BLOCK_M)
    pos = rows // GROUP
    return pos, rows % GROUP, rows < q_len * GROUP, (q_start + pos).to(tl.int64)


@triton.jit
def _scaled_query(q_ptr, query_args, q_rows, member, row_ok, q_scale, DOT: tl.constexpr, Q_HEADS: tl.constexpr,
                  ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr):  # fmt: skip
    """The rows' queries times `q_scale`, rotated with ROTATE_STAGES, in the dots' type. The rotated rows are read
    back from the scratch (`rotated_query`) at their own (token, query head): a scratch of the query's size, where
    one per program is sized by the grid of the longest request's rows."""
    q_st, q_sh, scratch_ptr, d, d_ok = query_args
    q = tl.load(q_ptr + q_rows[:, None] * q_st + member[:, None] * q_sh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * q_scale  # fmt: skip
    if ROTATE_STAGES > 0:
        scratch = scratch_ptr + (q_rows * Q_HEADS + member)[:, None] * d.shape[0] + d[None, :]
        q = rotated_query(q, scratch, row_ok[:, None], ROTATE_STAGES, ROTATE_NORM)
    if DOT == tl.float16:
        q = clamp_fp16(q)
    return q.to(DOT)


@triton.jit
def _held_keys(meta_ptr, request, requests):
    """A request's held full-precision keys (`paged.RecentRows.requests`): the end of its sink keys, the first key
    read from its recent rows, the position of its first key, and its slot."""
    meta = meta_ptr + request
    key_start = tl.load(meta + 3 * requests)
    recent_lo = tl.maximum(tl.load(meta + 2 * requests) - key_start, 0)
    return tl.load(meta + requests), recent_lo, key_start, tl.load(meta).to(tl.int64)


@triton.jit
def _outlier_keys(pos_ptr, key_start, count, BLOCK: tl.constexpr):
    """The key indices of a request's outlier tokens of one KV head (`pos_ptr`: their positions, `count` of them),
    -1 where a slot is empty, `[BLOCK]`."""
    slot = tl.arange(0, BLOCK)
    t = tl.load(pos_ptr + slot, mask=slot < count, other=-1)
    return tl.where(t >= 0, t - key_start, -1)


@triton.jit
def _not_outliers(t, outlier_keys):
    """Which of keys `t` `[N]` are none of `outlier_keys` `[O]` (read from the held rows instead of their codes).
    gpu_static, sm_90, 64 decode requests, recent 128 + sinks 4 + 16 outliers, d64 / d128 / d256: this comparison
    0.165 / 0.134 / 0.131 instructions per KV byte (without outliers 0.114 / 0.111 / 0.112), no spill; the tile's
    outliers as bits of an int64 0.131 / 0.122 / 0.121 but spilled 8-32 B under the split kernel's 168 registers;
    the comparison only in the tiles holding one (a branch) 0.174 / 0.142 / 0.129."""
    return tl.max((t[:, None] == outlier_keys[None, :]).to(tl.int32), axis=1) == 0


@triton.jit
def _attend_held(
    q, acc, m_i, l_i, rows_ptr, kv_head, recent_slots, sink_end, recent_lo, key_start, k_end, fp_weight, q_pos,
    row_ok, d, d_ok, n, window, outlier_pos_ptr, outlier_row, outlier_slots, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
    ONE_POSITION: tl.constexpr, HAS_OUTLIERS: tl.constexpr,
):  # fmt: skip
    """A request's held recent and sink tokens (its slot's rows at `rows_ptr`) into the softmax, in values: their
    scores times `fp_weight`. ONE_POSITION: `q_pos` is the rows' one query position (a decode step).
    HAS_OUTLIERS: then its `outlier_slots` outlier tokens of the KV head, from row `outlier_row` on (positions at
    `outlier_pos_ptr`)."""
    row = 2 * KV_HEADS * HEAD_DIM
    k_rows = rows_ptr + kv_head * HEAD_DIM
    v_rows = k_rows + KV_HEADS * HEAD_DIM
    weight = tl.full(n.shape, fp_weight, tl.float32)
    # (`k_rows` stands in for the mask arguments, unused without HAS_MASK; the window is the visibility rule's)
    for n0 in tl.range(recent_lo, k_end, n.shape[0], num_stages=1):
        t = n0 + n
        acc, m_i, l_i = attend_full_precision(
            q, acc, m_i, l_i, k_rows, v_rows, (key_start + t) % recent_slots, t, t < k_end, row, 1, d, d_ok, weight,
            q_pos, row_ok, k_rows, 0, 0, 0, 0, 0, 0, window, 0, sink_end, 1.0, False, HAS_WINDOW, True, True, False,
            ONE_POSITION, False, PRECISION, DOT,
        )  # fmt: skip
    for n0 in tl.range(0, tl.minimum(sink_end, k_end), n.shape[0], num_stages=1):
        t = n0 + n
        acc, m_i, l_i = attend_full_precision(
            q, acc, m_i, l_i, k_rows, v_rows, recent_slots + t, t, t < tl.minimum(sink_end, k_end), row, 1, d, d_ok,
            weight, q_pos, row_ok, k_rows, 0, 0, 0, 0, 0, 0, window, 0, sink_end, 1.0, False, HAS_WINDOW, True, False,
            False, ONE_POSITION, False, PRECISION, DOT,
        )  # fmt: skip
    if HAS_OUTLIERS:  # (coded tokens: before k_end, the causal and window rules the codes' own)
        for n0 in tl.range(0, tl.where(k_end > 0, outlier_slots, 0), n.shape[0], num_stages=1):
            slot = n0 + n
            t = tl.load(outlier_pos_ptr + slot, mask=slot < outlier_slots, other=-1) - key_start
            acc, m_i, l_i = attend_full_precision(
                q, acc, m_i, l_i, k_rows, v_rows, outlier_row + slot, t, (t >= 0) & (t < k_end), row, 1, d, d_ok,
                weight, q_pos, row_ok, k_rows, 0, 0, 0, 0, 0, 0, window, 0, sink_end, 1.0, False, HAS_WINDOW, False,
                False, False, ONE_POSITION, False, PRECISION, DOT,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _page_tile(
    q, acc, m_i, l_i, n0, phys, tile_args, BLOCK_STRIDE: tl.constexpr, PER_TOKEN: tl.constexpr, IS_FLOAT: tl.constexpr,
    HW_CONVERT: tl.constexpr, FP16_SHIFT: tl.constexpr, NAN_MASK: tl.constexpr, NAN_CODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, ALIGNED: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr, ALL_IN: tl.constexpr, ONE_POSITION: tl.constexpr, HAS_OUTLIERS: tl.constexpr,
):  # fmt: skip
    """Keys `[n0, n0 + BLOCK_N)` of the pages into the softmax, those in `[k_lo, pages_end)` (ALL_IN: all of them).
    PAGE_TILES: the tile is consecutive slots of one page, read whole from the first one's physical index (values:
    16-byte vectors of each channel along the tokens); else each key's slot from its own. HAS_OUTLIERS: the
    request's outlier tokens (`outlier_keys`) are loaded but not seen (read from the held rows)."""
    (read_ptr, k_lo, pages_end, pages_ptr, codes_ptr, channel, n, d_ok, layer_offset, bytes_per_block, row_bytes,
     page_size, value_bytes, value_boost, kv_head, q_pos, row_ok, window, outlier_keys) = tile_args  # fmt: skip
    t, t_ok = tile_tokens(n0, n, k_lo, pages_end, ALL_IN)
    if PAGE_TILES:
        slot = tl.multiple_of(phys % BLOCK_STRIDE, n.shape[0]) + n
    else:
        slot = phys % BLOCK_STRIDE
    # (a constant divisor: a multiply-high, where a runtime one took ~20 instructions per token)
    page = (phys // BLOCK_STRIDE).to(tl.int64) * bytes_per_block + layer_offset
    k_row = page + slot * row_bytes
    value_plane = page + page_size * row_bytes
    if ALIGNED:  # rows start on 16 bytes: the K codes load as 16-byte vectors, copied asynchronously
        k_row = tl.multiple_of(k_row, 16)
    k_codes = tl.load(codes_ptr + k_row[None, :] + channel, mask=t_ok[None, :] & d_ok[:, None], other=0.0)
    # a token's value element e at `value_plane + e * page_size + slot`; a page tile's are read whole, the slots
    # out of [k_lo, pages_end) zeroed after decoding (they may hold anything, NaN codes too)
    v_mask = d_ok[:, None] if PAGE_TILES else t_ok[None, :] & d_ok[:, None]
    v_codes = tl.load(codes_ptr + value_plane + slot[None, :] + channel * page_size, mask=v_mask, other=0.0)
    if PER_TOKEN:
        k_scale = _scale_at(pages_ptr + k_row + value_bytes + 4 * kv_head, t_ok, ALIGNED)
        v_scale = _scale_at(pages_ptr + value_plane + value_bytes * page_size + 4 * (kv_head * page_size + slot),
                            t_ok, ALIGNED) * value_boost  # fmt: skip
    else:  # per head: folded into the query (K) and the output (V)
        k_scale = 1.0
        v_scale = 1.0
    if HAS_OUTLIERS:  # (the loads' masks stay `t_ok`: a whole page tile's loads unmasked)
        t_ok = t_ok & _not_outliers(t, outlier_keys)
    return _attend_codes(
        q, acc, m_i, l_i, k_codes, tl.trans(v_codes), k_scale, v_scale, t, t_ok, q_pos, row_ok, window, PER_TOKEN,
        IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE, HAS_WINDOW, PAGE_TILES and not ALL_IN, DOT, PRECISION,
        ONE_POSITION,
    )  # fmt: skip


@triton.jit
def _write_rows_kernel(
    states_ptr, rows_ptr, stats_ptr, k_scale_ptr, v_scale_ptr, pages_ptr, write_ptr, energy_ptr, s_sp, s_sh, s_st,
    tokens, layer_offset, bytes_per_block,
    ROW_BYTES: tl.constexpr, VALUE_BYTES: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, PER_TOKEN: tl.constexpr, CLIP: tl.constexpr,
    IS_FLOAT: tl.constexpr, MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr,
    NORMAL_OFFSET: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr, BLOCK_STRIDE: tl.constexpr, ROTATE_STAGES: tl.constexpr,
    ROTATE_NORM: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    """One KV head of one plane (keys / values) of `BLOCK_T` tokens: codes (and per-token-head scale bytes)
    into the rows and into the pages at the physical indices `write_ptr` (`paged.PageGeometry`'s bytes: key rows,
    transposed value planes); clipped and non-finite counts added to `stats_ptr` (int64 `[2, 2]`). Rotated first
    with ROTATE_STAGES (`triton_common.hadamard`); per-token scales searched among SEARCH candidates, the keys'
    weighted by the queries' energy at `energy_ptr` (fp32 `[kv_heads, HEAD_DIM]`, `triton_common.token_scales`)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    plane = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < tokens
    valid = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(states_ptr + plane.to(tl.int64) * s_sp + head.to(tl.int64) * s_sh + t.to(tl.int64)[:, None] * s_st + d[None, :], mask=valid,
                other=0.0).to(tl.float32)  # fmt: skip
    if ROTATE_STAGES > 0:
        x = hadamard(x, ROTATE_STAGES, ROTATE_NORM)
    row = rows_ptr + t.to(tl.int64) * 2 * ROW_BYTES + plane * ROW_BYTES
    # where each token's codes and scale go in its page: element e at `code_at + e * element_stride`
    phys = tl.load(write_ptr + t, mask=t_ok, other=0)
    slot = phys % BLOCK_STRIDE
    plane_at = pages_ptr + (phys // BLOCK_STRIDE) * bytes_per_block + layer_offset + plane * PAGE_SIZE * ROW_BYTES
    is_key = plane == 0  # key rows; values head_dim-major
    code_at = plane_at + tl.where(is_key, slot * ROW_BYTES, slot)
    element_stride = tl.where(is_key, 1, PAGE_SIZE)
    if PER_TOKEN:
        scale_at = plane_at + tl.where(is_key, slot * ROW_BYTES + VALUE_BYTES + 4 * head,
                                       VALUE_BYTES * PAGE_SIZE + 4 * (head * PAGE_SIZE + slot))  # fmt: skip
        weight = 1
        if SEARCH > 1:
            weight = tl.where(is_key, search_weights(energy_ptr + head * HEAD_DIM, d, d < HEAD_DIM), 1)
        scale = token_scales(x, weight, True, SEARCH, CLIP, IS_FLOAT, MAX, ROW_MAX, ROUND_SHIFT, MIN_NORMAL,
                             SUB_MAGIC)  # (bf16 values: the dense cache's)  # fmt: skip
        bits = scale.to(tl.int32, bitcast=True)
        for byte in tl.static_range(4):
            scale_byte = ((bits >> (8 * byte)) & 0xFF).to(tl.uint8)
            tl.store(row + VALUE_BYTES + 4 * head + byte, scale_byte, mask=t_ok)
            tl.store(scale_at + byte, scale_byte, mask=t_ok)
        y = tl.math.div_rn(x, scale[:, None])
    else:
        scale = tl.where(is_key, tl.load(k_scale_ptr + head), tl.load(v_scale_ptr + head))
        y = tl.math.div_rn(x, scale)
    n_clipped = tl.sum(tl.where(valid & (tl.abs(y) > CLIP), 1, 0))
    tl.atomic_add(stats_ptr + plane * 2, n_clipped.to(tl.int64), mask=n_clipped > 0)
    n_nonfinite = tl.sum(tl.where(valid & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0))
    tl.atomic_add(stats_ptr + plane * 2 + 1, n_nonfinite.to(tl.int64), mask=n_nonfinite > 0)
    code = encode(y, IS_FLOAT, MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE,
                  SIGNED_ZERO)  # fmt: skip
    tl.store(row[:, None] + head * HEAD_DIM + d[None, :], code.to(tl.uint8), mask=valid)
    tl.store(code_at[:, None] + (head * HEAD_DIM + d[None, :]) * element_stride, code.to(tl.uint8), mask=valid)


def write_rows(
    states: torch.Tensor,
    fmt: StorageFormat,
    stats: torch.Tensor,
    static_scales: tuple[torch.Tensor, torch.Tensor] | None,
    pages: torch.Tensor,
    geometry: PageGeometry,
    index: torch.Tensor,
    rotate: bool = False,
    scale_search: int = 0,
    search_energy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Page rows `[tokens, 2, row_bytes]` (uint8) of `states` (`[2, kv_heads, tokens, head_dim]`, keys then
    values): codes of every KV head, then (per-token-head scales, `static_scales` None) one fp32 scale per head;
    bit-identical to `paged.encode_rows`; also stored in `pages` at the int64 physical indices `index`, as
    `geometry.write` stores them. Adds clipped and non-finite counts to `stats` (int64 `[2, 2]`, on the states'
    device). `rotate`: codes of the states times a Hadamard matrix (`paged.RowLayout.rotate`); `scale_search`:
    per-token scales searched among that many candidates, the keys' weighted by `search_energy` (fp32 `[kv_heads,
    head_dim]`, `paged.RowLayout.scale_search`)."""
    rows, launch = plan_write_rows(states, fmt, stats, static_scales, pages, geometry, index, rotate, scale_search,
                                   search_energy)  # fmt: skip
    if launch is not None:
        launch_all([launch], states.device)
    return rows


def plan_write_rows(states, fmt, stats, static_scales, pages, geometry, index, rotate: bool = False,
                    scale_search: int = 0, search_energy=None) -> tuple[torch.Tensor, Launch | None]:  # fmt: skip
    """The rows of `write_rows` and the launch that fills them and the pages (None: no token)."""
    _, kv_heads, tokens, head_dim = states.shape
    if states.stride(-1) != 1:
        raise ValueError("states must be contiguous in its last dim (head_dim)")
    per_token = static_scales is None
    if scale_search > 1:
        if not per_token:
            raise ValueError(f"scale_search={scale_search} searches per-token scales; these rows have static ones")
        check_search_energy(search_energy, kv_heads, head_dim, f"scale_search={scale_search}")
    value_bytes = kv_heads * head_dim
    row_bytes = row_size(value_bytes, kv_heads if per_token else 0)
    rows = torch.zeros(tokens, 2, row_bytes, dtype=torch.uint8, device=states.device)
    if tokens == 0:
        return rows, None
    k_scale, v_scale = static_scales if static_scales is not None else (stats, stats)
    launch = Launch(_write_rows_kernel, (cdiv(tokens, BLOCK_T), kv_heads, 2), (
        states, rows, stats, k_scale, v_scale, pages, index, search_energy if scale_search > 1 else stats,
        states.stride(0), states.stride(1), states.stride(2), tokens, geometry.layer_offset, geometry.bytes_per_block,
    ), dict(
        ROW_BYTES=row_bytes, VALUE_BYTES=value_bytes, PAGE_SIZE=geometry.page_size, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_T=BLOCK_T, PER_TOKEN=per_token, CLIP=fmt.clip_bound,
        BLOCK_STRIDE=geometry.block_stride, **encoding(fmt), **rotation(rotate, head_dim), SEARCH=scale_search,
    ))  # fmt: skip
    return rows, launch


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, pages_ptr, read_ptr, cu_q_ptr, k_first_ptr, past_ptr, k_scale_ptr, v_scale_ptr,
    recent_ptr, recent_meta_ptr, q_scratch_ptr, part_acc_ptr, part_stats_ptr, outlier_pos_ptr, energy_ptr,
    q_st, q_sh, o_st, o_sh, score_scale, window, layer_offset, bytes_per_block, value_boost, out_factor,
    code_factor, new_offset, requests, recent_slots, recent_rows_per_slot, outlier_slots, num_splits, q_tokens,
    BLOCK_STRIDE: tl.constexpr, PAGE_SIZE: tl.constexpr, ROW_BYTES: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_TOKEN: tl.constexpr, IS_FLOAT: tl.constexpr,
    HW_CONVERT: tl.constexpr, CODE_TYPE: tl.constexpr, FP16_SHIFT: tl.constexpr, NAN_MASK: tl.constexpr,
    NAN_CODE: tl.constexpr, HAS_WINDOW: tl.constexpr, ALIGNED: tl.constexpr, V_AS_COLUMNS: tl.constexpr,
    HAS_RECENT: tl.constexpr, KV_HEADS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    STAGES: tl.constexpr, PAGE_TILES: tl.constexpr, NEW_IN_PAGES: tl.constexpr, ONE_POSITION: tl.constexpr,
    ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr, SPLIT: tl.constexpr, HAS_OUTLIERS: tl.constexpr,
    OUTLIER_BLOCK: tl.constexpr, SUMS: tl.constexpr, SUM_ROWS: tl.constexpr,
):  # fmt: skip
    """Program (request, KV head, row block). Rows are (query position, query head of the KV head's group) pairs,
    position-major, as in `_attention_kernel`: every head of a GQA group shares each K/V tile. With HAS_RECENT,
    the request's held recent and sink tokens are read from `recent_ptr`'s model-dtype rows after the codes.
    HAS_OUTLIERS (with HAS_RECENT): per KV head, the request's outlier tokens (positions at `outlier_pos_ptr`,
    int32 `[slots, KV_HEADS, outlier_slots]`; `OUTLIER_BLOCK` a power of 2 at least `outlier_slots`) are left out
    of the codes' tiles by their positions, loaded once (the pages are shared: nothing in them marks a token),
    and read from the held rows after the recent and sink tokens.
    Rotated codes (ROTATE_STAGES): the codes' scores are those of the rotated query (`q_scratch_ptr`: fp32
    `[tokens, q_heads, BLOCK_D]`), their share of the output is rotated back before the held tokens join it.
    SPLIT (decode steps, one row block): program (request, KV head, KV split); each split reads its share of the
    pages' keys (the last one the new rows and held tokens too) and writes its partial result (the output before
    the softmax's division, running max and sum) for `_reduce_kernel` to merge.
    SUMS: the step's queries added to a searched layer's sums at `energy_ptr` (fp32 `[KV_HEADS, HEAD_DIM]`,
    `hf_fp8kv/scale_search.py`) by the first program of each KV head, every one of the `q_tokens` rows (padding
    too, as the dense caches count theirs), SUM_ROWS at a time in a fixed order (the row writer, a launch before,
    has read the sums)."""
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SUMS:
        if (request == 0) & (tl.program_id(2) == 0):
            c = tl.arange(0, BLOCK_D)
            add_head_query_energy(energy_ptr + kv_head * HEAD_DIM, q_ptr, energy_ptr, q_st, q_sh, 0, 1, kv_head,
                                  q_tokens * GROUP, GROUP, 1, c, c < HEAD_DIM, False, 0, 1.0, SUM_ROWS)  # fmt: skip
    first_row = 0 if SPLIT else tl.program_id(2) * BLOCK_M
    q_start = tl.load(cu_q_ptr + request)
    q_len = tl.load(cu_q_ptr + request + 1) - q_start
    if first_row >= q_len * GROUP:
        return
    past = tl.load(past_ptr + request)
    k_first = tl.load(k_first_ptr + request).to(tl.int64)

    # the group's first query head in an int64 base (query heads x their stride can pass 2^31), the rest from there
    q_group_ptr = q_ptr + (kv_head * GROUP).to(tl.int64) * q_sh
    q_scratch_ptr += (kv_head * GROUP).to(tl.int64) * BLOCK_D
    pos, member, row_ok, q_rows = _program_rows(q_start, q_len, first_row, BLOCK_M, GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_scale = score_scale  # softmax scale, log2(e), the decode's factor; per-head scales: the K scale
    if not PER_TOKEN:
        q_scale *= tl.load(k_scale_ptr + kv_head)
    query_args = (q_st, q_sh, q_scratch_ptr, d, d_ok)
    q = _scaled_query(q_group_ptr, query_args, q_rows, member, row_ok, q_scale, DOT, KV_HEADS * GROUP, ROTATE_STAGES,
                      ROTATE_NORM)  # fmt: skip
    q_pos = past if ONE_POSITION else past + pos  # each query's own key index (a decode step: one for all)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_end = past + (tl.minimum(first_row + BLOCK_M, q_len * GROUP) - 1) // GROUP + 1  # none after the last query
    k_lo = 0  # the first key read from the codes
    if HAS_WINDOW:
        window_lo = past + first_row // GROUP - window + 1
        k_lo = tl.maximum(window_lo, 0)
    # the keys read from the codes: [k_lo, codes_end) (key indices; the others are held in full precision)
    codes_end = k_end
    outlier_keys = 0  # (a placeholder without HAS_OUTLIERS)
    if HAS_RECENT:
        sink_end, recent_lo, key_start, recent_slot = _held_keys(recent_meta_ptr, request, requests)
        codes_end = tl.minimum(k_end, recent_lo)
        k_lo = tl.maximum(k_lo, sink_end)
        if HAS_OUTLIERS:
            outlier_keys = _outlier_keys(outlier_pos_ptr + (recent_slot * KV_HEADS + kv_head) * outlier_slots,
                                         key_start, outlier_slots, OUTLIER_BLOCK)  # fmt: skip
    # the page bytes as the codes `decode_codes` takes (a typed load, as in `_attention_kernel`): the fp8 type for
    # the hardware conversion, uint8 for the byte permutes, else int8 bits (`DecodeSettings.code_view`)
    codes_ptr = pages_ptr.to(tl.pointer_type(CODE_TYPE))
    channel = kv_head * HEAD_DIM + d[:, None]  # [D, 1]: a K row's codes; the V plane's rows of the tokens' values
    # the keys read from the pages: the past ones, and (NEW_IN_PAGES) this step's, the others from the new rows
    # (with NEW_IN_PAGES the new rows' loop is not compiled in: d128 decode with static scales 164 -> 128 registers,
    # 3 -> 4 blocks per SM, the chunked prefill 224 -> 177 registers, gpu_static)
    pages_end = tl.minimum(codes_end, past + q_len if NEW_IN_PAGES else past)
    n = tl.arange(0, BLOCK_N)
    # The keys in the pages, in tiles of BLOCK_N keys. PAGE_TILES: BLOCK_N consecutive slots of one page, from a
    # multiple of BLOCK_N (transformers' allocators fill a request's pages slot by slot), the tiles from the one
    # holding `k_lo`: the whole tiles in a loop reading every slot, the partial ones at either end (at most 2)
    # masked and not pipelined (pipelined: d64 decode 128 -> 134 registers, 8 -> 6 blocks per SM, gpu_static);
    # else every tile masked, each token's slot read on its own. A tile's physical indices are loaded one tile
    # ahead, into registers: loaded in the iteration that uses them, the codes' copies waited for them (gpu_static:
    # `DEPBAR.LE SB0, 0`, one tile in flight), two this way
    read_ptr += k_first
    # the keys read from the pages by this program: [pages_lo, pages_end); with SPLIT, the split's share, in whole
    # tiles from the one holding `k_lo` (the codes' loops as they are, over a narrower range)
    pages_lo = k_lo
    new_end = codes_end  # the end of the keys read from the new rows, and of the held ones: the last split's
    held_end = k_end
    if SPLIT:
        split = tl.program_id(2)
        origin = k_lo
        if PAGE_TILES:
            origin -= tl.load(read_ptr + k_lo, mask=k_lo < pages_end, other=0).to(tl.int32) % BLOCK_N
        span = tl.cdiv(tl.cdiv(tl.maximum(pages_end - origin, 0), BLOCK_N), num_splits) * BLOCK_N
        # (the split's first key in int64, narrowed once it is a key index: no 32-bit product reaches an offset)
        split_lo = (origin + split.to(tl.int64) * span).to(tl.int32)
        pages_lo = tl.maximum(k_lo, split_lo)
        pages_end = tl.minimum(pages_end, split_lo + span)
        new_end = tl.where(split == num_splits - 1, codes_end, 0)
        held_end = tl.where(split == num_splits - 1, k_end, 0)
    tile_args = (read_ptr, pages_lo, pages_end, pages_ptr, codes_ptr, channel, n, d_ok, layer_offset, bytes_per_block,
                 ROW_BYTES, PAGE_SIZE, KV_HEADS * HEAD_DIM, value_boost, kv_head, q_pos, row_ok, window,
                 outlier_keys)  # fmt: skip
    if PAGE_TILES:
        tile_lo = pages_lo - tl.load(read_ptr + pages_lo, mask=pages_lo < pages_end, other=0).to(tl.int32) % BLOCK_N
        whole_lo = tile_lo + tl.where(tile_lo < pages_lo, BLOCK_N, 0)
        whole_hi = tl.maximum(tile_lo + (pages_end - tile_lo) // BLOCK_N * BLOCK_N, whole_lo)
        phys_next = tl.load(read_ptr + whole_lo, mask=whole_lo < whole_hi, other=0)
        for n0 in tl.range(whole_lo, whole_hi, BLOCK_N, num_stages=STAGES):
            phys = phys_next.to(tl.int32)
            phys_next = tl.load(read_ptr + n0 + BLOCK_N, mask=n0 + BLOCK_N < whole_hi, other=0)
            acc, m_i, l_i = _page_tile(
                q, acc, m_i, l_i, n0, phys, tile_args, BLOCK_STRIDE, PER_TOKEN, IS_FLOAT, HW_CONVERT, FP16_SHIFT,
                NAN_MASK, NAN_CODE, HAS_WINDOW, ALIGNED, DOT, PRECISION, True, True, ONE_POSITION, HAS_OUTLIERS,
            )  # fmt: skip
        before = (tile_lo < tl.minimum(whole_lo, pages_end)).to(tl.int32)  # a partial tile before the whole ones
        for i in tl.range(0, before + tl.cdiv(pages_end - whole_hi, BLOCK_N), num_stages=1):
            n0 = tl.where(i < before, tile_lo, whole_hi + (i - before) * BLOCK_N)
            first = tl.maximum(n0, pages_lo)  # the tile's first slot, from its first key read
            phys = (tl.load(read_ptr + first) - (first - n0)).to(tl.int32)
            acc, m_i, l_i = _page_tile(
                q, acc, m_i, l_i, n0, phys, tile_args, BLOCK_STRIDE, PER_TOKEN, IS_FLOAT, HW_CONVERT, FP16_SHIFT,
                NAN_MASK, NAN_CODE, HAS_WINDOW, ALIGNED, DOT, PRECISION, True, False, ONE_POSITION, HAS_OUTLIERS,
            )  # fmt: skip
    else:
        phys_next = tl.load(read_ptr + pages_lo + n, mask=pages_lo + n < pages_end, other=0)
        for n0 in tl.range(pages_lo, pages_end, BLOCK_N, num_stages=STAGES):
            phys = phys_next.to(tl.int32)
            phys_next = tl.load(read_ptr + n0 + BLOCK_N + n, mask=n0 + BLOCK_N + n < pages_end, other=0)
            acc, m_i, l_i = _page_tile(
                q, acc, m_i, l_i, n0, phys, tile_args, BLOCK_STRIDE, PER_TOKEN, IS_FLOAT, HW_CONVERT, FP16_SHIFT,
                NAN_MASK, NAN_CODE, HAS_WINDOW, ALIGNED, DOT, PRECISION, False, False, ONE_POSITION, HAS_OUTLIERS,
            )  # fmt: skip
    if not NEW_IN_PAGES:  # this step's keys, from the new rows (token-major values)
        for n0 in tl.range(tl.maximum(k_lo, past), new_end, BLOCK_N, num_stages=STAGES):
            t = n0 + n
            t_ok = t < new_end
            k_row = new_offset + (q_start + t - past).to(tl.int64) * 2 * ROW_BYTES
            v_row = k_row + ROW_BYTES
            if ALIGNED:
                k_row = tl.multiple_of(k_row, 16)
                v_row = tl.multiple_of(v_row, 16)
            k_codes = tl.load(codes_ptr + k_row[None, :] + channel, mask=t_ok[None, :] & d_ok[:, None], other=0.0)
            if V_AS_COLUMNS:  # the V tile loaded as K's, [D, N]: the tokens' rows are computed in one layout only
                v_codes = tl.trans(tl.load(codes_ptr + v_row[None, :] + channel, mask=t_ok[None, :] & d_ok[:, None],
                                           other=0.0))  # fmt: skip
            else:
                v_codes = tl.load(codes_ptr + v_row[:, None] + kv_head * HEAD_DIM + d[None, :],
                                  mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            if PER_TOKEN:
                k_scale = _scale_at(pages_ptr + k_row + KV_HEADS * HEAD_DIM + 4 * kv_head, t_ok, ALIGNED)
                v_scale = _scale_at(pages_ptr + v_row + KV_HEADS * HEAD_DIM + 4 * kv_head, t_ok, ALIGNED) * value_boost
            else:
                k_scale = 1.0
                v_scale = 1.0
            if HAS_OUTLIERS:
                t_ok = t_ok & _not_outliers(t, outlier_keys)
            acc, m_i, l_i = _attend_codes(
                q, acc, m_i, l_i, k_codes, v_codes, k_scale, v_scale, t, t_ok, q_pos, row_ok, window, PER_TOKEN,
                IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE, HAS_WINDOW, False, DOT, PRECISION, ONE_POSITION,
            )  # fmt: skip
    out_scale = out_factor
    if not PER_TOKEN:
        out_scale *= tl.load(v_scale_ptr + kv_head)
    acc = acc * out_scale
    if ROTATE_STAGES > 0:  # the codes' share rotated back, before the held tokens join it
        acc = hadamard(acc, ROTATE_STAGES, ROTATE_NORM)
    # the rows worked out again after the codes' loops, from a fresh load (volatile: not merged with the first one;
    # kept across the loops, their token indices spilled 8 B at head_dim 128 with per-token scales, gpu_static)
    q_start = tl.load(cu_q_ptr + request, volatile=True)
    _, member, row_ok, q_rows = _program_rows(q_start, q_len, first_row, BLOCK_M, GROUP)
    if HAS_RECENT:  # the held tokens, in values: their scores times 1 / (the query's K scale and code factor)
        # (loaded again: kept across the codes' loop, they spilled at head_dim 128 with static scales, gpu_static)
        sink_end, recent_lo, key_start, recent_slot = _held_keys(recent_meta_ptr, request, requests)
        k_head = 1.0 if PER_TOKEN else tl.load(k_scale_ptr + kv_head)
        if ROTATE_STAGES > 0 or (HAS_WINDOW and ONE_POSITION and not HAS_OUTLIERS):  # their scores: the query
            # as it came, loaded again from `q_ptr` itself (gpu_static: the group's base kept across the loops
            # spilled 32 B in sm_90's rotated d128 decode with recent 32 + sinks 4; the query kept across them,
            # 32 B on sm_90 and 16 B on sm_100 in the sliding per-token decode with recent 128, none reloaded.
            # Reloaded everywhere: sm_90's head_dim 64 decodes with held tokens went 6 -> 8 blocks per SM with
            # per-token scales, 8 -> 6 with static ones, the chunked prefill's loop 3-13% longer (sm_90, sm_100),
            # and with outlier tokens, at the split kernel's 168 registers, it spilled 64-80 B where kept 0-20 B)
            q = _scaled_query(q_ptr, query_args, q_rows, (kv_head * GROUP + member).to(tl.int64), row_ok,
                              score_scale * k_head, DOT, KV_HEADS * GROUP, 0, 1.0)  # fmt: skip
        acc, m_i, l_i = _attend_held(
            q, acc, m_i, l_i, recent_ptr + recent_slot * recent_rows_per_slot * 2 * KV_HEADS * HEAD_DIM, kv_head,
            recent_slots, sink_end, recent_lo, key_start, held_end, 1.0 / (k_head * code_factor), q_pos, row_ok, d,
            d_ok, n, window, outlier_pos_ptr + (recent_slot * KV_HEADS + kv_head) * outlier_slots,
            recent_rows_per_slot - outlier_slots, outlier_slots, KV_HEADS, HEAD_DIM, HAS_WINDOW, PRECISION, DOT,
            ONE_POSITION, HAS_OUTLIERS,
        )  # fmt: skip
    if SPLIT:  # rows (token, query head) as `_reduce_kernel` reads them, each split's in turn
        part = (q_rows * (KV_HEADS * GROUP) + kv_head * GROUP + member) * num_splits + tl.program_id(2)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stats_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_stats_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptr += (kv_head * GROUP).to(tl.int64) * o_sh  # (here: a base kept across the loops costs registers)
        tl.store(out_ptr + q_rows[:, None] * o_st + member[:, None] * o_sh + d[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


def paged_attention_tiles(
    rows: int, head_dim: int, target: GpuTarget | None = None, crowded: bool = False
) -> tuple[int, int, int, dict]:
    """`(BLOCK_M, BLOCK_N, BLOCK_D, launch options)` of the paged kernel for `rows` rows per KV head: those of
    `_attention_kernel` for decode, but 32-token tiles of 4 warps at head_dim 256, and 32-row prefill programs. The
    paged loop carries each token's page arithmetic and the next tile's page indices besides the codes.
    gpu_static, sm_90, GQA 8, 3 stages: at head_dim 256, 64-token tiles of 4 warps spilled 248 B and 8 warps fit
    one block per SM (32 tokens, 4 warps: 2 blocks, 0.24-0.27 instructions per KV byte); in prefill, 128 rows of 8
    warps spilled 68-308 B, 64 rows of 4 warps 208-308 B (32 rows of 4 warps: no spill, 2 blocks per SM, 0.37 at
    head_dim 128; at 256 with 32-token tiles, 0.32-0.35, where 64-token ones spilled 364 B). `crowded`: rotated
    codes with held tokens, whose prefill runs 32-token tiles (64: 255 registers and a 184 B spill at head_dim 128;
    32: 210, none, 0.192 -> 0.244 instructions per KV byte)."""
    block_m, block_n, block_d, options = block_sizes(min(rows, 64), head_dim, target=target)
    if rows > 64:
        block_m, options = 32, dict(options, num_warps=4)
        block_n = 32 if crowded else block_n
        if target is not None and not target.is_amd:  # ptxas capped sm_100's at 168 registers and spilled 12 B;
            options["maxnreg"] = 255  # 188 under 255, 2 blocks per SM (sm_90's: 186 without a cap; gpu_static)
    if block_d > 128:
        block_n, options = 32, register_room(dict(options, num_warps=4), target)
    return block_m, block_n, block_d, options


def page_tile_tokens(block_n: int, page_size: int, window: int | None) -> int | None:
    """Tokens of the paged kernel's tiles of consecutive slots: `block_n` or a smaller power of 2 dividing the
    page size (and a sliding layer's window, where its ring of slots wraps), at least 16 (a 16-byte vector of each
    value channel); None: no such tile, each token's slot is read on its own."""
    tile = math.gcd(block_n, page_size, window or 0)
    return tile if tile >= 16 else None


def sums_in_paged_launch(rows: int, rotate: bool) -> bool:
    """Whether the paged attention launch can add a step's queries to a searched layer's sums, `rows` of them per
    KV head (`hf_fp8kv/scale_search.py`), where a launch of their own did: unrotated ones (the query is rotated on
    the way), as many as the sums' own kernel takes (`triton_search.KERNEL_ROWS`: one program walks them)."""
    return not rotate and rows <= KERNEL_ROWS


def paged_attention(
    query: torch.Tensor,
    pages: torch.Tensor,
    new_rows: torch.Tensor,
    read_index: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    k_first: torch.Tensor,
    past: torch.Tensor,
    *,
    fmt: StorageFormat,
    kv_heads: int,
    layer_offset: int,
    bytes_per_block: int,
    block_stride: int,
    page_size: int,
    scaling: float,
    window: int | None = None,
    static_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_q_len: int | None = None,
    recent: RecentRows | None = None,
    new_in_pages: bool = False,
    rotate: bool = False,
    max_k_len: int | None = None,
    num_splits: int | None = None,
    search_energy: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 attention output `[tokens, q_heads, head_dim]` of `query` `[tokens, q_heads, head_dim]` (every
    request's rows, `cu_seq_lens_q` int32 `[requests + 1]`) over paged rows (see the module docstring).

    `pages`: the uint8 page bytes; `new_rows`: uint8 `[tokens, 2, row_bytes]`; `read_index`: int64 physical indices,
    each page's tokens in its consecutive slots (as transformers' allocators place them; with `window`, a sliding
    layer's ring of `window` slots); `k_first` / `past`: int32 `[requests]`; `static_scales`: fp32 `[kv_heads]` K and
    V scales (None: per-token-head scales stored in the rows); `recent`: the requests' recent, sink and outlier tokens in the
    model's dtype (contiguous rows); `new_in_pages`: each request's `read_index` entries go on after its past keys
    with this step's, whose rows are in the pages already (a full-attention layer: transformers writes the new
    tokens before reading), and those keys are read there; `rotate`: the codes hold the keys and values times a
    Hadamard matrix (`paged.RowLayout.rotate`). Codes in the fp8 formats or int8. A decode step (one query per
    request) is split over the keys (flash-decoding, then `_reduce_kernel`) when `num_splits` says so, else by
    `split_count` on a GPU when `max_k_len` (an upper bound of the requests' keys) is given. `search_energy`: a
    searched layer's sums, to which the launch adds the step's queries (`sums_in_paged_launch`).
    """
    out, launches = plan_paged_attention(
        query, pages, new_rows, read_index, cu_seq_lens_q, k_first, past, fmt=fmt, kv_heads=kv_heads,
        layer_offset=layer_offset, bytes_per_block=bytes_per_block, block_stride=block_stride, page_size=page_size,
        scaling=scaling, window=window, static_scales=static_scales, max_q_len=max_q_len, recent=recent,
        new_in_pages=new_in_pages, rotate=rotate, max_k_len=max_k_len, num_splits=num_splits,
        search_energy=search_energy,
    )  # fmt: skip
    launch_all(launches, query.device)
    return out


def plan_paged_attention(
    query, pages, new_rows, read_index, cu_seq_lens_q, k_first, past, *, fmt: StorageFormat, kv_heads: int,
    layer_offset: int, bytes_per_block: int, block_stride: int, page_size: int, scaling: float,
    window: int | None = None, static_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_q_len: int | None = None, recent: RecentRows | None = None, new_in_pages: bool = False,
    rotate: bool = False, max_k_len: int | None = None, num_splits: int | None = None,
    resident_slots: int | None = None, target: GpuTarget | None = None, search_energy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[Launch]]:  # fmt: skip
    """The output of `paged_attention` and the launches that fill it (none: nothing to attend; with KV splits, the
    attention's and the reduce's); `target` plans that GPU's code path for tensors that are not on it, with
    `resident_slots` its resident blocks of the kernel (`benchmarks/gpu_static.py`); `search_energy`: a searched
    layer's sums, to which the attention launch adds the step's queries (`sums_in_paged_launch`)."""
    tokens, q_heads, head_dim = query.shape
    row_bytes = new_rows.shape[-1]
    value_bytes = kv_heads * head_dim
    per_token = static_scales is None
    if row_bytes != row_size(value_bytes, kv_heads if per_token else 0):
        scale_bytes = " + 4 scale bytes per KV head" if per_token else ""
        raise ValueError(
            f"new_rows has rows of {row_bytes} bytes: expected {value_bytes} codes{scale_bytes} ({kv_heads} heads x "
            f"{head_dim}), padded to {ROW_ALIGNMENT} bytes"
        )
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the {kv_heads} KV heads")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last dim (head_dim)")
    for name, tensor in (("pages", pages), ("new_rows", new_rows)):
        if tensor.dtype != torch.uint8 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous uint8, got {tensor.dtype}")
    if recent is not None and (recent.rows.shape[1:] != (2, kv_heads, head_dim) or not recent.rows.is_contiguous()):
        raise ValueError(
            f"recent.rows must be contiguous [rows, 2, {kv_heads}, {head_dim}], got {tuple(recent.rows.shape)}"
        )
    if search_energy is not None:
        if not sums_in_paged_launch(tokens * q_heads // kv_heads, rotate):
            raise ValueError(f"the paged attention adds no rotated queries, nor more than {KERNEL_ROWS} "
                             "rows per KV head, to search_energy (`sums_in_paged_launch`)")  # fmt: skip
        check_search_energy(search_energy, kv_heads, head_dim, "the paged attention's query sums")
    requests = cu_seq_lens_q.numel() - 1
    if max_q_len is None:
        max_q_len = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max()) if requests else 0
    out = torch.zeros(tokens, q_heads, head_dim, dtype=torch.float32, device=query.device)
    if requests == 0 or max_q_len == 0:
        return out, []
    group = q_heads // kv_heads
    target = target or query_target(query)
    block_m, block_n, block_d, options = paged_attention_tiles(group * max_q_len, head_dim, target,
                                                               rotate and recent is not None)  # fmt: skip
    block_d = max(block_d, 16)
    page_tile = page_tile_tokens(block_n, page_size, window)
    block_n = page_tile or block_n
    decode = decode_settings(fmt, query, per_token, target)
    _, code_factor, dot, value_boost, _ = decode
    k_scale, v_scale = static_scales if static_scales is not None else (out, out)
    if not read_index.numel():  # no cached tokens this step: a placeholder the kernel never reads
        read_index = past.new_zeros(1, dtype=torch.int64)
    # (row blocks last: on the x axis, the d64 decode kernel with per-token scales held 150 registers, not 122)
    grid = (requests, kv_heads, cdiv(group * max_q_len, block_m))
    check_grid(grid, "paged attention (requests, KV heads, row blocks of the longest request's queries)")
    can_split = max_q_len == 1 and grid[2] == 1  # a decode step: one row block per (request, KV head)
    # the new rows are read through `pages`' pointer, at their byte distance from it (one base for both)
    new_offset = new_rows.data_ptr() - pages.data_ptr()
    offsets = (row_bytes, layer_offset, bytes_per_block, new_offset)
    aligned = all(n % ROW_ALIGNMENT == 0 for n in offsets) and value_bytes % 4 == 0  # 16-byte rows, 4-byte scales
    recent_args = (out, out, 1, 1) if recent is None else (
        recent.rows, recent.requests, recent.recent or 1, recent.per_slot
    )  # fmt: skip  (placeholders the kernel never reads without HAS_RECENT)
    outliers = recent is not None and recent.outliers > 0
    if outliers and (recent.outlier_pos.dtype != torch.int32 or not recent.outlier_pos.is_contiguous()):
        raise ValueError(f"recent.outlier_pos must be contiguous int32, got {recent.outlier_pos.dtype}")
    outlier_args = (recent.outlier_pos, recent.outliers) if outliers else (past, 0)  # (a placeholder without)
    scratch = torch.empty(tokens, q_heads, block_d, device=query.device) if rotate else out  # the rotated query's

    def arguments(part_acc: torch.Tensor = out, part_stats: torch.Tensor = out, splits: int = 1) -> tuple:
        """The kernel's arguments; `part_acc` / `part_stats`: the splits' partial results (placeholders without)."""
        return (
            query, out, pages, read_index, cu_seq_lens_q, k_first, past, k_scale, v_scale, *recent_args[:2], scratch,
            part_acc, part_stats, outlier_args[0], out if search_energy is None else search_energy, query.stride(0),
            query.stride(1), out.stride(0), out.stride(1),
            scaling * LOG2E.value * code_factor, window or 0, layer_offset, bytes_per_block, value_boost,
            code_factor / value_boost, code_factor, new_offset, requests, *recent_args[2:], outlier_args[1], splits,
            tokens,
        )  # fmt: skip

    constexprs = dict(
        BLOCK_STRIDE=block_stride, PAGE_SIZE=page_size, ROW_BYTES=row_bytes, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n, PER_TOKEN=per_token, IS_FLOAT=fmt.is_float, HW_CONVERT=decode.hw_convert,
        CODE_TYPE=decode.code_view, FP16_SHIFT=fmt.fp16_shift, NAN_MASK=fmt.nan_code_mask,
        NAN_CODE=fmt.nan_code, HAS_WINDOW=bool(window), ALIGNED=aligned, V_AS_COLUMNS=block_d >= V_AS_COLUMNS_FROM,
        HAS_RECENT=recent is not None, KV_HEADS=kv_heads, DOT=dot, PRECISION=decode.precision,
        PAGE_TILES=page_tile is not None, NEW_IN_PAGES=new_in_pages, ONE_POSITION=max_q_len == 1,
        **rotation(rotate, head_dim), SPLIT=False, HAS_OUTLIERS=outliers,
        OUTLIER_BLOCK=next_power_of_2(recent.outliers) if outliers else 1, SUMS=search_energy is not None,
        SUM_ROWS=sum_rows(target), **options,
    )  # fmt: skip
    attention = Launch(_paged_attention_kernel, grid, arguments(), constexprs)
    split_options = dict(constexprs, SPLIT=True)
    if target is not None and not target.is_amd and "maxnreg" not in split_options:
        split_options["maxnreg"] = 255 if target.limits.shared <= 100 * 1024 else SPLIT_MAX_REGISTERS
    splits = 1
    if can_split and num_splits is not None:
        splits = max(1, num_splits)
    elif can_split and max_k_len and target is not None:
        if resident_slots is None:  # the split kernel's (the grid does not change its code)
            probe = Launch(_paged_attention_kernel, (requests, kv_heads, 2), arguments(), split_options)
            resident_slots = target.sms * _blocks_per_sm(probe, target, query.device)
        held_tiles = cdiv(recent.per_slot * recent.rows.element_size(), block_n) if recent else 0
        splits = split_count(tokens * kv_heads, cdiv(max_k_len, block_n) + held_tiles, resident_slots)
    if splits == 1:
        return out, [attention]
    rows = tokens * q_heads
    part_acc = torch.empty(rows * splits * block_d, dtype=torch.float32, device=query.device)
    part_stats = torch.empty(rows * splits * 2, dtype=torch.float32, device=query.device)
    split = Launch(_paged_attention_kernel, (requests, kv_heads, splits), arguments(part_acc, part_stats, splits),
                   split_options)  # fmt: skip
    reduce = reduce_launch(part_acc, part_stats, None, out, (out.stride(0), out.stride(1), 0, out.stride(2)),
                           (tokens, q_heads, 1, head_dim), splits, block_d, reduce_blocks(rows, block_d))  # fmt: skip
    return out, [split, reduce]


def _blocks_per_sm(launch: Launch, target: GpuTarget, device: torch.device) -> int:
    """Resident blocks per SM of `launch`'s kernel on `device`, read once per constexprs and device: a fact of the
    compiled code (as Triton's own cache of compiled kernels), the same for every caller and thread; a decode step
    would otherwise pay a compile lookup per layer."""
    key = (device, tuple(sorted(launch.kwargs.items())))
    if key not in _BLOCKS_PER_SM:
        _BLOCKS_PER_SM[key] = compiled_occupancy(launch, target, device)
    return _BLOCKS_PER_SM[key]


_BLOCKS_PER_SM: dict[tuple, int] = {}
