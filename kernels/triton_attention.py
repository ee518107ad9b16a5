"""Triton attention over the quantized cache: one flash-attention kernel for decode and prefill, plus a reduce.

Rows of a program are the (query position, query head) pairs of one KV head, position-major: every query head
of a GQA group shares each K/V load (GQA packing), and a decode step (one position) fills one row block. The
KV length is split across programs (flash-decoding) when the row blocks alone would leave the GPU idle; the
splits' partial results are merged by `_reduce_kernel`.

Codes are decoded in registers to fp16 by bit operations (exact, see `StorageFormat`), never dequantized in
memory; the scales are folded out of the inner loop: per-head K scale and the fp16 decode factor into the
score scale, per-token K scale times the score, per-token V scale into the probabilities, per-head V scale
into the output. The dot runs in the query's dtype (fp16/bf16 tensor cores) or in exact fp32 (`ieee`).

Prefill reads the codes too: the cache writes the new tokens first, with or without a past, so there is one read
path and a prompt's logits equal those of feeding it token by token.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .formats import StorageFormat
from .triton_launch import Launch
from .triton_write import check_codes

LOG2E = tl.constexpr(math.log2(math.e))  # softmax runs on exp2
MIN_ROWS = 16  # tl.dot needs 16 rows
REDUCE_TILE = 4096  # partial-result elements one reduce program merges


@triton.jit
def decode_tile(codes, IS_FLOAT: tl.constexpr, FP16_SHIFT: tl.constexpr, DOT: tl.constexpr):
    """A tile of int8-viewed codes as DOT values, exact: float codes as fp16 holding value / fp16_factor."""
    if IS_FLOAT:
        bits = codes.to(tl.int16) << FP16_SHIFT  # sign-extended: the sign lands on bit 15
        if FP16_SHIFT == 7:  # e4m3: it landed on bit 14 too
            bits = bits & -0x4001  # ~0x4000 as int16
        return bits.to(tl.float16, bitcast=True).to(DOT)
    return codes.to(DOT)


@triton.jit
def _tanh(x):
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def finalize(acc, m, l, sink, out_scale, HAS_SINKS: tl.constexpr):
    """The attention output from the running max `m` (log2 units), denominator `l` and unnormalised `acc`;
    rows that attend to nothing (fully masked) give 0."""
    if HAS_SINKS:
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l > 0, l, 1.0)
    return tl.where((l > 0)[:, None], acc / l_safe[:, None], 0.0) * out_scale[:, None]


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, mask_ptr, sinks_ptr, channel_ptr,
    out_ptr, part_acc_ptr, part_stats_ptr,
    q_sb, q_sh, q_sl, q_sd,
    c_sb, c_sh, c_st, c_sd,
    ks_sb, ks_sh, ks_st,
    vs_sb, vs_sh, vs_st,
    m_sb, m_sh, m_sl, m_st,
    o_sb, o_sh, o_sl, o_sd,
    kv_heads, length, q_len, head_dim, split_size, num_splits, window,
    score_scale, value_boost, out_factor, softcap,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FLOAT: tl.constexpr, FP16_SHIFT: tl.constexpr, PER_TOKEN_K: tl.constexpr, PER_TOKEN_V: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_CHANNEL_SCALE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (row block, batch * kv_head, split)."""
    DOT = q_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    b = (tl.program_id(1) // kv_heads).to(tl.int64)  # int64 bases: a cache can exceed 2^31 elements
    kv_head = tl.program_id(1) % kv_heads
    split = tl.program_id(2)
    q_ptr += b * q_sb
    k_ptr += b * c_sb + kv_head.to(tl.int64) * c_sh
    v_ptr += b * c_sb + kv_head.to(tl.int64) * c_sh
    k_scale_ptr += b * ks_sb + kv_head * ks_sh
    v_scale_ptr += b * vs_sb + kv_head * vs_sh
    mask_ptr += b * m_sb
    out_ptr += b * o_sb

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < GROUP * q_len
    q_pos = length - q_len + pos  # bottom-right alignment: the queries are the last q_len cached tokens
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim

    q = tl.load(
        q_ptr + head[:, None] * q_sh + pos[:, None] * q_sl + d[None, :] * q_sd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if HAS_CHANNEL_SCALE:
        channel = tl.load(channel_ptr + kv_head * head_dim + d, mask=d_ok, other=0.0)
        q = (q.to(tl.float32) * channel[None, :]).to(DOT)
    qk_scale = score_scale
    if not PER_TOKEN_K:
        qk_scale *= tl.load(k_scale_ptr)

    # the KV range of this split, narrowed to what the causal / window rule lets this row block see
    lo = split * split_size
    hi = tl.minimum(lo + split_size, length)
    if not HAS_MASK:
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, GROUP * q_len) - 1
        hi = tl.minimum(hi, length - q_len + last_row // GROUP + 1)
        if HAS_WINDOW:
            first_visible = length - q_len + (pid_m * BLOCK_M) // GROUP - window + 1
            lo = tl.maximum(lo, (first_visible // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        k = tl.load(
            k_ptr + j[None, :] * c_st + d[:, None] * c_sd, mask=j_ok[None, :] & d_ok[:, None], other=0
        )
        scores = tl.dot(q, decode_tile(k, IS_FLOAT, FP16_SHIFT, DOT), input_precision=PRECISION) * qk_scale
        if PER_TOKEN_K:
            scores *= tl.load(k_scale_ptr + j * ks_st, mask=j_ok, other=0.0)[None, :]
        if HAS_SOFTCAP:  # the score scale holds log2(e) only without softcap
            scores = softcap * _tanh(scores / softcap) * LOG2E
        if HAS_MASK:
            allowed = tl.load(
                mask_ptr + head[:, None] * m_sh + pos.to(tl.int64)[:, None] * m_sl + j[None, :] * m_st,
                mask=row_ok[:, None] & j_ok[None, :],
                other=0,
            )
            visible = allowed != 0
        else:
            visible = j[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                visible = visible & (j[None, :] > q_pos[:, None] - window)
        visible = visible & j_ok[None, :] & row_ok[:, None]
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PER_TOKEN_V:
            v_scale = tl.load(v_scale_ptr + j * vs_st, mask=j_ok, other=0.0)
            p = p * (v_scale * value_boost)[None, :]
        v = tl.load(
            v_ptr + j[:, None] * c_st + d[None, :] * c_sd, mask=j_ok[:, None] & d_ok[None, :], other=0
        )
        v = decode_tile(v, IS_FLOAT, FP16_SHIFT, DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
        m_i = m_new

    if SPLIT:
        row_index = ((b * kv_heads * GROUP + head) * q_len + pos) * num_splits + split
        tl.store(part_acc_ptr + row_index[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stats_ptr + row_index * 2, m_i, mask=row_ok)
        tl.store(part_stats_ptr + row_index * 2 + 1, l_i, mask=row_ok)
    else:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        else:
            sink = 0.0
        out_scale = tl.zeros([BLOCK_M], tl.float32) + out_factor
        if not PER_TOKEN_V:
            out_scale *= tl.load(v_scale_ptr)
        out = finalize(acc, m_i, l_i, sink, out_scale, HAS_SINKS)
        tl.store(
            out_ptr + head[:, None] * o_sh + pos[:, None] * o_sl + d[None, :] * o_sd,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _reduce_kernel(
    part_acc_ptr, part_stats_ptr, v_scale_ptr, sinks_ptr, out_ptr,
    vs_sb, vs_sh,
    o_sb, o_sh, o_sl, o_sd,
    out_rows, q_heads, q_len, head_dim, num_splits, out_factor,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PER_TOKEN_V: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Program (block of output rows (batch, q_head, position)): merge the splits' partial results."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < out_rows
    pos = rows % q_len
    head = (rows // q_len) % q_heads
    b = rows // (q_len * q_heads)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = rows[:, None] * num_splits + s[None, :]
    part_ok = row_ok[:, None] & (s < num_splits)[None, :]
    m_s = tl.load(part_stats_ptr + part * 2, mask=part_ok, other=float("-inf"))
    l_s = tl.load(part_stats_ptr + part * 2 + 1, mask=part_ok, other=0.0)
    acc_s = tl.load(part_acc_ptr + part[:, :, None] * BLOCK_D + d[None, None, :], mask=part_ok[:, :, None], other=0.0)
    m = tl.max(m_s, axis=1)
    weight = tl.exp2(m_s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l = tl.sum(l_s * weight, axis=1)
    acc = tl.sum(acc_s * weight[:, :, None], axis=1)
    out_scale = tl.zeros([BLOCK_R], tl.float32) + out_factor
    if not PER_TOKEN_V:
        out_scale *= tl.load(v_scale_ptr + b * vs_sb + (head // GROUP) * vs_sh, mask=row_ok, other=0.0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    else:
        sink = 0.0
    out = finalize(acc, m, l, sink, out_scale, HAS_SINKS)
    tl.store(
        out_ptr + (b * o_sb + head * o_sh + pos * o_sl)[:, None] + d[None, :] * o_sd,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (d < head_dim)[None, :],
    )


def attention(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    length: int,
    fmt: StorageFormat,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_channel_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of `query` over the first `length` cached tokens (see `ops.attend`); `num_splits` forces the
    number of KV splits (default: enough programs to fill the GPU)."""
    if num_splits is None:
        num_splits = default_splits(query, key_codes, length, query.device)
    out, launches = plan_attention(
        query, key_codes, value_codes, key_scale, value_scale, length, fmt, scaling=scaling, mask=mask,
        window=window, softcap=softcap, sinks=sinks, key_channel_scale=key_channel_scale, num_splits=num_splits,
    )  # fmt: skip
    for launch in launches:
        launch.run()
    return out


def block_sizes(rows: int, head_dim: int) -> tuple[int, int, int, dict]:
    """`(BLOCK_M, BLOCK_N, BLOCK_D, launch options)` of the attention kernel for `rows` query rows per KV head."""
    block_m = min(64, max(MIN_ROWS, triton.next_power_of_2(rows)))
    block_d = triton.next_power_of_2(head_dim)
    # register use from `ptxas -v` on sm_90 (AOT-compiled, not timed): these keep every row-block size within
    # 255 registers with at most 28 bytes of spill; 4 warps at head_dim 128 spill up to 292 bytes
    block_n = 32 if block_d > 128 else 64
    return block_m, block_n, block_d, dict(num_warps=4 if block_d <= 64 else 8, num_stages=2)


def split_count(programs: int, kv_blocks: int, sm_count: int) -> int:
    """KV splits that give about two waves of `programs` row-block programs on `sm_count` SMs."""
    return max(1, min(kv_blocks, math.ceil(2 * sm_count / programs)))


def default_splits(query: torch.Tensor, key_codes: torch.Tensor, length: int, device: torch.device) -> int:
    """The split count for this launch on `device` (one split off GPU)."""
    if device.type != "cuda":
        return 1
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key_codes.shape[1]
    block_m, block_n, _, _ = block_sizes(q_heads // kv_heads * q_len, head_dim)
    programs = batch * kv_heads * triton.cdiv(q_heads // kv_heads * q_len, block_m)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return split_count(programs, max(1, triton.cdiv(length, block_n)), sm_count)


def plan_attention(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    length: int,
    fmt: StorageFormat,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_channel_scale: torch.Tensor | None = None,
    num_splits: int = 1,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launches (attention, then the split reduce if any) that fill it."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key_codes.shape[1]
    _check_attention(query, key_codes, value_codes, key_scale, value_scale, length, fmt, sinks, key_channel_scale)
    group = q_heads // kv_heads
    rows = group * q_len
    block_m, block_n, block_d, launch = block_sizes(rows, head_dim)
    row_blocks = triton.cdiv(rows, block_m)
    kv_blocks = max(1, triton.cdiv(length, block_n))
    num_splits = max(1, min(num_splits, kv_blocks))
    split_size = triton.cdiv(kv_blocks, num_splits) * block_n
    num_splits = max(1, triton.cdiv(length, split_size))

    # written as [batch, q_len, q_heads, head_dim]: the layout the model's attention returns, no copy later
    out = query.new_empty(batch, q_len, q_heads, head_dim).transpose(1, 2)
    per_token_k, per_token_v = key_scale.shape[-1] > 1, value_scale.shape[-1] > 1
    ks_strides = key_scale.expand(batch, kv_heads, key_scale.shape[-1]).stride()
    vs_strides = value_scale.expand(batch, kv_heads, value_scale.shape[-1]).stride()
    if mask is not None:
        mask = _expand_mask(mask, batch, q_heads, q_len, length)
    mask_strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    if key_channel_scale is not None:
        key_channel_scale = key_channel_scale.float().contiguous()
    split = num_splits > 1
    part_acc = torch.empty(batch * q_heads * q_len * num_splits * block_d if split else 1, device=query.device)
    part_stats = torch.empty(batch * q_heads * q_len * num_splits * 2 if split else 1, device=query.device)
    # the fp16 decode of float codes is value / fp16_factor: the factor joins the scales
    score_scale = scaling * fmt.fp16_factor * (1.0 if softcap is not None else LOG2E.value)
    # per-token V scales (~amax / max) are boosted by a power of two near max before the probabilities go to
    # fp16/bf16, or e5m2's (max 57344) would leave them subnormal; the output divides it out
    value_boost = 2.0 ** math.floor(math.log2(fmt.max)) if per_token_v else 1.0
    out_factor = fmt.fp16_factor / value_boost
    common = dict(BLOCK_D=block_d, PER_TOKEN_V=per_token_v, HAS_SINKS=sinks is not None)
    launches = [Launch(_attention_kernel, (row_blocks, batch * kv_heads, num_splits), (
        query, key_codes.view(torch.int8), value_codes.view(torch.int8), key_scale, value_scale,
        mask if mask is not None else query, sinks if sinks is not None else query,
        key_channel_scale if key_channel_scale is not None else query,
        out, part_acc, part_stats,
        *query.stride(), *key_codes.stride(), *ks_strides, *vs_strides, *mask_strides, *out.stride(),
        kv_heads, length, q_len, head_dim, split_size, num_splits, window or 0,
        score_scale, value_boost, out_factor, softcap or 1.0,
    ), dict(
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, IS_FLOAT=fmt.is_float, FP16_SHIFT=fmt.fp16_shift,
        PER_TOKEN_K=per_token_k, HAS_MASK=mask is not None, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_CHANNEL_SCALE=key_channel_scale is not None, SPLIT=split,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **common, **launch,
    ))]  # fmt: skip
    if split:
        out_rows = batch * q_heads * q_len
        block_s = triton.next_power_of_2(num_splits)
        block_r = min(triton.next_power_of_2(out_rows), max(1, REDUCE_TILE // (block_s * block_d)))
        launches.append(Launch(_reduce_kernel, (triton.cdiv(out_rows, block_r),), (
            part_acc, part_stats, value_scale, sinks if sinks is not None else query, out,
            vs_strides[0], vs_strides[1], *out.stride(),
            out_rows, q_heads, q_len, head_dim, num_splits, out_factor,
        ), dict(GROUP=group, BLOCK_R=block_r, BLOCK_S=block_s, **common)))  # fmt: skip
    return out, launches


def _expand_mask(mask: torch.Tensor, batch: int, q_heads: int, q_len: int, length: int) -> torch.Tensor:
    """The bool mask as a `[batch, q_heads, q_len, length]` uint8 view (broadcast dims at stride 0)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True = attend), got {mask.dtype}")
    try:
        return mask.expand(batch, q_heads, q_len, length).view(torch.uint8)
    except RuntimeError:
        raise ValueError(
            f"mask {tuple(mask.shape)} does not broadcast to [batch, heads, q_len, length] = "
            f"{[batch, q_heads, q_len, length]}"
        ) from None


def _check_attention(query, key_codes, value_codes, key_scale, value_scale, length, fmt, sinks, key_channel_scale):
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key_codes.shape[1]
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype {query.dtype} is not fp16, bf16 or fp32")
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the cache's {kv_heads} KV heads")
    check_codes(key_codes, value_codes, fmt)
    if key_codes.shape[0] != batch or key_codes.shape[3] != head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not match the cache's codes {tuple(key_codes.shape)}")
    if not q_len <= length <= key_codes.shape[2]:
        raise ValueError(f"length {length} must cover the {q_len} query tokens and fit {key_codes.shape[2]} cached")
    for name, scale in (("key_scale", key_scale), ("value_scale", value_scale)):
        if scale.dtype != torch.float32 or scale.dim() != 3 or scale.shape[1] != kv_heads:
            raise ValueError(f"{name} must be fp32 [1 or batch, {kv_heads}, 1 or tokens], got {tuple(scale.shape)}")
    if sinks is not None and sinks.shape != (q_heads,):
        raise ValueError(f"sinks must have one logit per query head ({q_heads}), got {tuple(sinks.shape)}")
    if key_channel_scale is not None and key_channel_scale.shape != (kv_heads, head_dim):
        raise ValueError(f"key_channel_scale must be [{kv_heads}, {head_dim}], got {tuple(key_channel_scale.shape)}")
