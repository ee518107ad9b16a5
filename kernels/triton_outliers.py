"""Triton kernel of the outlier tokens' selection (`outliers.settle`, its oracle): one launch per update, one program
per (row, KV head) that walks the update's candidates in order and keeps its set in registers. The torch version
takes some 30 small ops per layer and step, each a launch on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .outliers import OutlierSet
from .triton_launch import Launch, launch_all, next_power_of_2


@triton.jit(do_not_specialize=["candidates", "offset", "first_position", "first_visible"])  # (they move: one compile)
def _settle_kernel(
    cand_ptr, positions_ptr, first_real_ptr, kv_ptr, kept_ptr, score_ptr, norms_ptr, scale_ptr, visible_ptr,
    c_sw, c_sb, c_sh, c_st,
    o_sw, o_sb, o_sh, o_st,
    p_sb, p_sh, q_sb, q_sh, n_sw, n_sb, n_sh,
    s_sb, s_sh, s_st,
    heads, candidates, count, head_dim, offset, ring, slots, first_position, first_visible,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SCALE_BITS: tl.constexpr, CONSECUTIVE: tl.constexpr,
    EVICT: tl.constexpr, VISIBLE_ON_DEVICE: tl.constexpr,
):  # fmt: skip
    """Program (batch * kv_head,). Channels are contiguous in the candidates and the outlier buffer. CONSECUTIVE:
    candidate i is token `first_position + i` (else `positions_ptr[i]`). EVICT: kept tokens before `first_visible`
    (VISIBLE_ON_DEVICE: `visible_ptr[0]`) leave the set first. Token t's code slot is `t % ring` (ring > 0) or
    `t - offset`, of `slots`. A key scale's sign is set on its bits (SCALE_BITS wide: bf16 or fp32): exact, where
    the interpreter's bf16 load-store is not."""
    b = (tl.program_id(0) // heads).to(tl.int64)
    h = (tl.program_id(0) % heads).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    j_ok = j < count
    kept_ptr += b * p_sb + h * p_sh
    score_ptr += b * q_sb + h * q_sh
    scale_ptr = (scale_ptr + b * s_sb + h * s_sh).to(tl.pointer_type(tl.int16 if SCALE_BITS == 16 else tl.int32))
    sign = -(1 << (SCALE_BITS - 1))  # the sign bit alone, as a signed integer of the scale's width
    cand_ptr += b * c_sb + h * c_sh
    kv_ptr += b * o_sb + h * o_sh
    kept = tl.load(kept_ptr + j, mask=j_ok, other=-1)
    scores = tl.load(score_ptr + j, mask=j_ok, other=float("inf"))  # (past the count: never the weakest)
    total = tl.load(norms_ptr + b * n_sb + h * n_sh)
    seen = tl.load(norms_ptr + n_sw + b * n_sb + h * n_sh)
    first_real = tl.load(first_real_ptr + b)
    if EVICT:
        if VISIBLE_ON_DEVICE:
            first_visible = tl.load(visible_ptr)
        gone = (kept >= 0) & (kept < first_visible)
        if ring == 0:  # a linear buffer: the slot is still the token's, made positive again (see `outliers.evict`)
            slot = kept - offset
            mine = gone & (slot >= 0) & (slot < slots)
            at = scale_ptr + slot * s_st
            tl.store(at, tl.load(at, mask=mine, other=0) & ~sign, mask=mine)
        kept = tl.where(gone, -1, kept)
        scores = tl.where(gone, float("-inf"), scores)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    for i in range(candidates):  # (64-bit offsets: a prompt's candidates may pass 2^31 elements)
        row = tl.cast(i, tl.int64) * c_st
        if CONSECUTIVE:
            t = first_position + i
        else:
            t = tl.load(positions_ptr + i)
        key = tl.load(cand_ptr + row + d, mask=d_ok, other=0.0)
        norm = tl.sum(tl.abs(key.to(tl.float32)), axis=0)
        valid = (t >= 0) & (t >= first_real) & (norm < float("inf"))  # (NaN compares False)
        if EVICT:
            valid = valid & (t >= first_visible)
        total = tl.where(valid, total + norm, total)
        seen = tl.where(valid, seen + 1.0, seen)
        score = -norm * seen / tl.maximum(total, 1e-30)
        weakest = tl.min(scores, axis=0)
        slot = tl.min(tl.where(scores == weakest, j, BLOCK_N), axis=0).to(tl.int64)
        if valid & (score > weakest):
            old = tl.sum(tl.where(j == slot, kept, 0), axis=0)
            if old >= 0:
                at = scale_ptr + _slot(old, offset, ring) * s_st
                tl.store(at, tl.load(at) & ~sign)
            at = scale_ptr + _slot(t, offset, ring) * s_st
            tl.store(at, tl.load(at) | sign)
            kept = tl.where(j == slot, t, kept)
            scores = tl.where(j == slot, score, scores)
            value = tl.load(cand_ptr + c_sw + row + d, mask=d_ok, other=0.0)
            tl.store(kv_ptr + slot * o_st + d, key.to(kv_ptr.dtype.element_ty), mask=d_ok)
            tl.store(kv_ptr + o_sw + slot * o_st + d, value.to(kv_ptr.dtype.element_ty), mask=d_ok)
    tl.store(kept_ptr + j, kept, mask=j_ok)
    tl.store(score_ptr + j, scores, mask=j_ok)
    tl.store(norms_ptr + b * n_sb + h * n_sh, total)
    tl.store(norms_ptr + n_sw + b * n_sb + h * n_sh, seen)


@triton.jit
def _slot(t, offset, ring):
    return tl.where(ring > 0, t % tl.maximum(ring, 1), t - offset)


def settle(
    outliers: OutlierSet, positions: torch.Tensor | int, candidates: torch.Tensor, first_real: torch.Tensor,
    first_visible: int | torch.Tensor | None = None,
) -> None:  # fmt: skip
    """`outliers.settle` in one launch (the same set, the same numbers; a tie with the weakest score keeps it)."""
    launch_all([plan_settle(outliers, positions, candidates, first_real, first_visible)], candidates.device)


def plan_settle(
    outliers: OutlierSet, positions: torch.Tensor | int, candidates: torch.Tensor, first_real: torch.Tensor,
    first_visible: int | torch.Tensor | None = None,
) -> Launch:  # fmt: skip
    """The launch of `settle`."""
    kv, kept, scores, norms, scales, offset, ring = outliers
    _, batch, heads, n, head_dim = candidates.shape
    if candidates.stride(-1) != 1 or kv.stride(-1) != 1 or kept.stride(-1) != 1 or scores.stride(-1) != 1:
        raise ValueError("outlier candidates and buffers need contiguous channels and slots")
    count, consecutive = kept.shape[-1], isinstance(positions, int)
    on_device = isinstance(first_visible, torch.Tensor)
    return Launch(_settle_kernel, (batch * heads,), (
        candidates, first_real if consecutive else positions, first_real, kv, kept, scores, norms, scales,
        first_visible.reshape(1) if on_device else first_real,
        *candidates.stride()[:4], *kv.stride()[:4], *kept.stride()[:2], *scores.stride()[:2], *norms.stride(),
        *scales.stride(), heads, n, count, head_dim, offset, ring, scales.shape[-1], positions if consecutive else 0,
        0 if on_device or first_visible is None else first_visible,
    ), dict(BLOCK_N=next_power_of_2(count), BLOCK_D=next_power_of_2(head_dim), SCALE_BITS=8 * scales.element_size(),
            CONSECUTIVE=consecutive, EVICT=first_visible is not None, VISIBLE_ON_DEVICE=on_device,
            num_warps=1))  # fmt: skip
