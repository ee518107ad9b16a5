"""Triton kernels over paged FP8 rows (continuous batching): the row encoder, and attention with varlen queries
and keys read through read indices.

Layout (see `hf_fp8kv/continuous_batching.py`): a page row is one token's keys (or values) of one layer,
`[codes of every KV head | fp32 scale per KV head]` (per-token-head scales) or `[codes]` (static scales). The
row of the token at physical index `p` lives at byte `(p // block_stride) * bytes_per_block + layer_offset +
plane * page_size * row_bytes + (p % block_stride) * row_bytes` of the pages (plane 0: keys, 1: values).

Request r owns query rows `[cu_q[r], cu_q[r + 1])` and sees `past[r] + q_len` keys: the first `past[r]` from the
pages through `read_index[k_first[r] : k_first[r] + past[r]]`, the last `q_len` from `new_rows` (this step's
tokens, already encoded as rows `[tokens, 2, row_bytes]`), causally (query i is key `past + i`), and within
`window` keys when it is > 0. One program handles `BLOCK_M` query rows of one request and one query head; codes
are decoded by exact bit operations (`decode_codes`), dots run in fp32, scales multiply scores and probabilities.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .formats import StorageFormat
from .triton_attention import attend_tile, decode_codes
from .triton_launch import cdiv, next_power_of_2
from .triton_write import encode, encoding

LOG2E = tl.constexpr(math.log2(math.e))
BLOCK_M = 16
BLOCK_N = 32
BLOCK_T = 16  # tokens per program of the row encoder
TINY_SCALE = 2.0**-126  # reference.TINY_SCALE: an all-zero row's scale


@triton.jit
def _row_scale(row_ptr, ok, value_bytes, kv_head):
    """The fp32 scale stored after the codes of `row_ptr`'s rows (4 little-endian bytes per KV head)."""
    base = row_ptr + value_bytes + 4 * kv_head
    bits = tl.load(base, mask=ok, other=0).to(tl.int32)
    bits |= tl.load(base + 1, mask=ok, other=0).to(tl.int32) << 8
    bits |= tl.load(base + 2, mask=ok, other=0).to(tl.int32) << 16
    bits |= tl.load(base + 3, mask=ok, other=0).to(tl.int32) << 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _encode_rows_kernel(
    states_ptr, rows_ptr, stats_ptr, k_scale_ptr, v_scale_ptr, s_sp, s_sh, s_st, tokens, row_bytes, value_bytes,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, DYNAMIC: tl.constexpr, CLIP: tl.constexpr,
    IS_FLOAT: tl.constexpr, MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr,
    NORMAL_OFFSET: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr,
):  # fmt: skip
    """One KV head of one plane (keys / values) of `BLOCK_T` tokens: codes (and per-token-head scale bytes)
    into the rows; clipped and non-finite counts added to `stats_ptr` (int64 `[2, 2]`)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    plane = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < tokens
    valid = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(states_ptr + plane * s_sp + head * s_sh + t.to(tl.int64)[:, None] * s_st + d[None, :], mask=valid,
                other=0.0).to(tl.float32)  # fmt: skip
    row = rows_ptr + t.to(tl.int64) * 2 * row_bytes + plane * row_bytes
    if DYNAMIC:
        magnitude = tl.abs(x)
        amax = tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=1)  # NaN and inf ignored
        scale = tl.maximum(tl.math.div_rn(amax, ROW_MAX), TINY_SCALE)
        bits = scale.to(tl.int32, bitcast=True)
        for byte in tl.static_range(4):
            tl.store(row + value_bytes + 4 * head + byte, ((bits >> (8 * byte)) & 0xFF).to(tl.uint8), mask=t_ok)
        y = tl.math.div_rn(x, scale[:, None])
    else:
        scale = tl.where(plane == 0, tl.load(k_scale_ptr + head), tl.load(v_scale_ptr + head))
        y = tl.math.div_rn(x, scale)
    n_clipped = tl.sum(tl.where(valid & (tl.abs(y) > CLIP), 1, 0))
    tl.atomic_add(stats_ptr + plane * 2, n_clipped.to(tl.int64), mask=n_clipped > 0)
    n_nonfinite = tl.sum(tl.where(valid & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0))
    tl.atomic_add(stats_ptr + plane * 2 + 1, n_nonfinite.to(tl.int64), mask=n_nonfinite > 0)
    code = encode(y, IS_FLOAT, MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE,
                  SIGNED_ZERO)  # fmt: skip
    tl.store(row[:, None] + head * HEAD_DIM + d[None, :], code.to(tl.uint8), mask=valid)


def encode_rows(
    states: torch.Tensor,
    fmt: StorageFormat,
    stats: torch.Tensor,
    static_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Page rows `[tokens, 2, row_bytes]` (uint8) of `states` (`[2, kv_heads, tokens, head_dim]`, keys then
    values): codes of every KV head, then (per-token-head scales, `static_scales` None) one fp32 scale per head;
    bit-identical to `reference.write_stacked`. Adds clipped and non-finite counts to `stats` (int64 `[2, 2]`,
    on the states' device)."""
    _, kv_heads, tokens, head_dim = states.shape
    if states.stride(-1) != 1:
        raise ValueError("states must be contiguous in its last dim (head_dim)")
    dynamic = static_scales is None
    value_bytes = kv_heads * head_dim
    row_bytes = value_bytes + (4 * kv_heads if dynamic else 0)
    rows = torch.empty(tokens, 2, row_bytes, dtype=torch.uint8, device=states.device)
    if tokens == 0:
        return rows
    k_scale, v_scale = static_scales if static_scales is not None else (stats, stats)
    constants = encoding(fmt)
    _encode_rows_kernel[(cdiv(tokens, BLOCK_T), kv_heads, 2)](
        states, rows, stats, k_scale, v_scale, states.stride(0), states.stride(1), states.stride(2), tokens,
        row_bytes, value_bytes, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_T=BLOCK_T,
        DYNAMIC=dynamic, CLIP=fmt.clip_bound, **constants,
    )  # fmt: skip
    return rows


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, pages_ptr, new_ptr, read_ptr, cu_q_ptr, k_first_ptr, past_ptr, k_scale_ptr, v_scale_ptr,
    q_st, q_sh, o_st, o_sh, scaling, window, layer_offset, bytes_per_block, block_stride, page_size, row_bytes,
    value_bytes, code_factor,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DYNAMIC: tl.constexpr, IS_FLOAT: tl.constexpr, FP16_SHIFT: tl.constexpr,
    NAN_MASK: tl.constexpr, NAN_CODE: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    head = tl.program_id(1)
    first_row = tl.program_id(2) * BLOCK_M
    q_start = tl.load(cu_q_ptr + request)
    q_len = tl.load(cu_q_ptr + request + 1) - q_start
    if first_row >= q_len:
        return
    past = tl.load(past_ptr + request)
    k_first = tl.load(k_first_ptr + request).to(tl.int64)
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_st + head * q_sh + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    q = q * (scaling * LOG2E * code_factor)
    q_pos = past + rows  # each query's own key index

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_end = past + tl.minimum(q_len, first_row + BLOCK_M)  # no key after the block's last query
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(past + first_row - window + 1, 0) // BLOCK_N * BLOCK_N
    if not DYNAMIC:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    for n0 in range(k_lo, k_end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < k_end
        in_pages = t_ok & (t < past)
        is_new = t_ok & (t >= past)
        phys = tl.load(read_ptr + k_first + t, mask=in_pages, other=0)
        page_row = (phys // block_stride) * bytes_per_block + layer_offset + (phys % block_stride) * row_bytes
        new_row = (q_start + t - past).to(tl.int64) * 2 * row_bytes
        k_page, k_new = pages_ptr + page_row, new_ptr + new_row
        v_page, v_new = k_page + page_size * row_bytes, k_new + row_bytes
        column = kv_head * HEAD_DIM + d[:, None]
        k_codes = tl.load(k_page[None, :] + column, mask=in_pages[None, :] & d_ok[:, None], other=0) + tl.load(
            k_new[None, :] + column, mask=is_new[None, :] & d_ok[:, None], other=0
        )  # [D, N]: each token from exactly one place
        v_column = kv_head * HEAD_DIM + d[None, :]
        v_codes = tl.load(v_page[:, None] + v_column, mask=in_pages[:, None] & d_ok[None, :], other=0) + tl.load(
            v_new[:, None] + v_column, mask=is_new[:, None] & d_ok[None, :], other=0
        )  # [N, D]
        k = decode_codes(k_codes.to(tl.int8, bitcast=True), IS_FLOAT, False, FP16_SHIFT, NAN_MASK, NAN_CODE,
                         tl.float32)  # fmt: skip
        v = decode_codes(v_codes.to(tl.int8, bitcast=True), IS_FLOAT, False, FP16_SHIFT, NAN_MASK, NAN_CODE,
                         tl.float32)  # fmt: skip
        if DYNAMIC:
            k_scale_t = _row_scale(k_page, in_pages, value_bytes, kv_head) + _row_scale(k_new, is_new, value_bytes,
                                                                                         kv_head)  # fmt: skip
            v_scale_t = _row_scale(v_page, in_pages, value_bytes, kv_head) + _row_scale(v_new, is_new, value_bytes,
                                                                                         kv_head)  # fmt: skip
        else:  # per head: the K scale as a per-token factor, the V scale applied to the output below
            k_scale_t = tl.full([BLOCK_N], 1.0, tl.float32) * k_scale
            v_scale_t = k_scale_t
        visible = (t[None, :] <= q_pos[:, None]) & t_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            visible = visible & (t[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, k, v, k_scale_t, v_scale_t, visible, 1.0, True, DYNAMIC, False,
                                     "ieee")  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if not DYNAMIC:
        out = out * v_scale
    out = out * code_factor
    tl.store(out_ptr + q_rows[:, None] * o_st + head * o_sh + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])


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
) -> torch.Tensor:
    """fp32 attention output `[tokens, q_heads, head_dim]` of `query` `[tokens, q_heads, head_dim]` (every
    request's rows, `cu_seq_lens_q` int32 `[requests + 1]`) over paged rows (see the module docstring).

    `pages`: the uint8 page bytes; `new_rows`: uint8 `[tokens, 2, row_bytes]`; `read_index`: int64 physical
    indices; `k_first` / `past`: int32 `[requests]`; `static_scales`: fp32 `[kv_heads]` K and V scales (None:
    per-token-head scales stored in the rows). Codes in the fp8 formats or int8.
    """
    tokens, q_heads, head_dim = query.shape
    row_bytes = new_rows.shape[-1]
    value_bytes = kv_heads * head_dim
    dynamic = static_scales is None
    if row_bytes != value_bytes + (4 * kv_heads if dynamic else 0):
        scale_bytes = " + 4 scale bytes per KV head" if dynamic else ""
        raise ValueError(
            f"new_rows has rows of {row_bytes} bytes: expected {value_bytes} codes{scale_bytes} ({kv_heads} heads x "
            f"{head_dim})"
        )
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the {kv_heads} KV heads")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last dim (head_dim)")
    for name, tensor in (("pages", pages), ("new_rows", new_rows)):
        if tensor.dtype != torch.uint8 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous uint8, got {tensor.dtype}")
    requests = cu_seq_lens_q.numel() - 1
    if max_q_len is None:
        max_q_len = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max()) if requests else 0
    out = torch.zeros(tokens, q_heads, head_dim, dtype=torch.float32, device=query.device)
    if requests == 0 or max_q_len == 0:
        return out
    k_scale, v_scale = static_scales if static_scales is not None else (out, out)
    code_factor = fmt.fp16_factor if fmt.is_float else 1.0  # the bit decode gives value / fp16_factor
    grid = (requests, q_heads, cdiv(max_q_len, BLOCK_M))
    if not read_index.numel():  # no cached tokens this step: a placeholder the kernel never reads
        read_index = past.new_zeros(1, dtype=torch.int64)
    _paged_attention_kernel[grid](
        query, out, pages, new_rows, read_index, cu_seq_lens_q, k_first, past,
        k_scale, v_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1), scaling, window or 0,
        layer_offset, bytes_per_block, block_stride, page_size, row_bytes, value_bytes, code_factor,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(next_power_of_2(head_dim), 16), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, DYNAMIC=dynamic, IS_FLOAT=fmt.is_float, FP16_SHIFT=fmt.fp16_shift,
        NAN_MASK=fmt.nan_code_mask, NAN_CODE=fmt.nan_code, HAS_WINDOW=bool(window),
        num_warps=8,  # sm_90, head_dim 128, per-token scales: 172 registers and no spill (4 warps: 255, 160 B spilled)
    )  # fmt: skip
    return out
