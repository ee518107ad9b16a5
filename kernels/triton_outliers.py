"""Triton kernels of the outlier tokens' selection (`outliers.settle`, its oracle): one launch per update, one program
per (row, KV head) that walks the update's candidates in order and keeps its set in registers (the torch version
takes some 30 small ops per layer and step, each a launch on a GPU); and a decode step's write that judges the token
it gives codes in the same launch (`write_and_settle`: `triton_write.write_kv`, then `settle`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .outliers import OutlierSet
from .triton_common import encoding, rotation
from .triton_launch import Launch, launch_all, next_power_of_2, plane_strides, planes
from .triton_write import check_write, move_positions, write_decode_token
from .view import KVView


@triton.jit
def _set_state(kept_ptr, score_ptr, norms_ptr, n_sw, j, j_ok):
    """A (row, KV head)'s outlier set: kept tokens, their scores, the running sum and count of the key norms."""
    kept = tl.load(kept_ptr + j, mask=j_ok, other=-1)
    scores = tl.load(score_ptr + j, mask=j_ok, other=float("inf"))  # (past the count: never the weakest)
    return kept, scores, tl.load(norms_ptr), tl.load(norms_ptr + n_sw)


@triton.jit
def _evict(kept, scores, first_visible, scale_bits_ptr, s_st, sign, offset, ring, slots):
    """The kept tokens before `first_visible` leave the set; in a linear buffer (`ring` 0) their slots are still
    theirs, their key scales made positive again (see `outliers.evict`)."""
    gone = (kept >= 0) & (kept < first_visible)
    if ring == 0:
        slot = kept - offset
        mine = gone & (slot >= 0) & (slot < slots)
        at = scale_bits_ptr + slot * s_st
        tl.store(at, tl.load(at, mask=mine, other=0) & ~sign, mask=mine)
    return tl.where(gone, -1, kept), tl.where(gone, float("-inf"), scores)


@triton.jit
def _race(t, key, kept, scores, total, seen, j, first_real, first_visible, EVICT: tl.constexpr):
    """Token `t` (-1: none), its exact key `key` `[BLOCK_D]`, in the race: the norms' running sum and count after
    it, whether it enters the set, the slot it takes there (the weakest's), the token it replaces (-1: none), its
    score."""
    norm = tl.sum(tl.abs(key.to(tl.float32)), axis=0)
    valid = (t >= 0) & (t >= first_real) & (norm < float("inf"))  # (NaN compares False)
    if EVICT:
        valid = valid & (t >= first_visible)
    total = tl.where(valid, total + norm, total)
    seen = tl.where(valid, seen + 1.0, seen)
    score = -norm * seen / tl.maximum(total, 1e-30)
    weakest = tl.min(scores, axis=0)
    slot = tl.min(tl.where(scores == weakest, j, j.shape[0]), axis=0).to(tl.int64)
    old = tl.sum(tl.where(j == slot, kept, 0), axis=0)
    return total, seen, valid & (score > weakest), slot, old, score


@triton.jit
def _keep(t, slot, old, key, value, kv_ptr, o_sw, o_st, scale_bits_ptr, s_st, sign, offset, ring, d, d_ok):
    """Token `t` takes `slot` of the set from `old` (-1: none): `old`'s key scale positive again, `t`'s negative,
    its exact key and value in the slot."""
    if old >= 0:
        at = scale_bits_ptr + _slot(old, offset, ring) * s_st
        tl.store(at, tl.load(at) & ~sign)
    at = scale_bits_ptr + _slot(t, offset, ring) * s_st
    tl.store(at, tl.load(at) | sign)
    tl.store(kv_ptr + slot * o_st + d, key.to(kv_ptr.dtype.element_ty), mask=d_ok)
    tl.store(kv_ptr + o_sw + slot * o_st + d, value.to(kv_ptr.dtype.element_ty), mask=d_ok)


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
    kept, scores, total, seen = _set_state(kept_ptr, score_ptr, norms_ptr + b * n_sb + h * n_sh, n_sw, j, j_ok)
    first_real = tl.load(first_real_ptr + b)
    if EVICT:
        if VISIBLE_ON_DEVICE:
            first_visible = tl.load(visible_ptr)
        kept, scores = _evict(kept, scores, first_visible, scale_ptr, s_st, sign, offset, ring, slots)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    for i in range(candidates):  # (64-bit offsets: a prompt's candidates may pass 2^31 elements)
        row = tl.cast(i, tl.int64) * c_st
        if CONSECUTIVE:
            t = first_position + i
        else:
            t = tl.load(positions_ptr + i)
        key = tl.load(cand_ptr + row + d, mask=d_ok, other=0.0)
        total, seen, enters, slot, old, score = _race(t, key, kept, scores, total, seen, j, first_real,
                                                      first_visible, EVICT)  # fmt: skip
        if enters:
            value = tl.load(cand_ptr + c_sw + row + d, mask=d_ok, other=0.0)
            _keep(t, slot, old, key, value, kv_ptr, o_sw, o_st, scale_ptr, s_st, sign, offset, ring, d, d_ok)
            kept = tl.where(j == slot, t, kept)
            scores = tl.where(j == slot, score, scores)
    tl.store(kept_ptr + j, kept, mask=j_ok)
    tl.store(score_ptr + j, scores, mask=j_ok)
    tl.store(norms_ptr + b * n_sb + h * n_sh, total)
    tl.store(norms_ptr + n_sw + b * n_sb + h * n_sh, seen)


@triton.jit(do_not_specialize=["end", "recent_start", "offset", "window"])  # (they move: one compile)
def _write_settle_kernel(
    new_k_ptr, new_v_ptr, k_codes_ptr, v_codes_ptr, k_scale_ptr, v_scale_ptr, recent_k_ptr, recent_v_ptr, stats_ptr,
    positions_ptr, first_real_ptr, kv_ptr, kept_ptr, score_ptr, norms_ptr, energy_ptr,
    nk_sb, nk_sh, nk_sd, nv_sb, nv_sh, nv_sd,
    c_sb, c_sh, c_st, c_sd,
    s_sb, s_sh, s_st,
    r_sb, r_sh, r_st, r_sd,
    o_sw, o_sb, o_sh, o_st,
    p_sb, p_sh, q_sb, q_sh, n_sw, n_sb, n_sh,
    heads, count, head_dim, end, recent_start, offset, slots, capacity, recent_slots, ring, window,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SCALE_BITS: tl.constexpr, STATIC: tl.constexpr,
    RING: tl.constexpr, HAS_RECENT: tl.constexpr, VALUE_TILED: tl.constexpr, EVICT: tl.constexpr,
    CLIP: tl.constexpr, ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr, IS_FLOAT: tl.constexpr,
    MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr, NORMAL_OFFSET: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGNED_ZERO: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    """Program (batch * kv_head,): a decode step's write (`write_decode_token`: the token entering the codes, the
    one the new token replaces in its recent slot, else the new token itself, quantized; the new token in that
    slot) and the entering token's turn in the outlier race (`_settle_kernel`'s, from its exact rows read before
    the write: no staging copy, no launch of its own). `end` / `recent_start`: the positions before the step
    (STATIC: on the device, moved past it by the launch's last program). EVICT (sliding layers): kept tokens the
    step's query does not see (before `end + 1 - window`) leave the set first. `ring`: the set's (`OutlierSet`)."""
    b = (tl.program_id(0) // heads).to(tl.int64)
    h = (tl.program_id(0) % heads).to(tl.int64)
    if STATIC:
        end = tl.load(positions_ptr).to(tl.int32)
        recent_start = tl.load(positions_ptr + 1).to(tl.int32)
    new_pos = end
    if HAS_RECENT:  # (as `_write_kernel`'s EVICT: the token the new one replaces, if it is still held)
        entering_pos = new_pos - recent_slots
        entering = (entering_pos >= recent_start) & (entering_pos >= (0 if RING else offset))
        new_recent_start = tl.maximum(recent_start, new_pos + 1 - recent_slots)
    else:
        entering_pos = new_pos
        entering = new_pos >= 0
        new_recent_start = new_pos + 1
    new_k_ptr += b * nk_sb + h * nk_sh
    new_v_ptr += b * nv_sb + h * nv_sh
    k_scale_ptr += b * s_sb + h * s_sh
    recent_k_ptr += b * r_sb + h * r_sh
    recent_v_ptr += b * r_sb + h * r_sh
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    if HAS_RECENT:
        slot_row = (new_pos % recent_slots).to(tl.int64) * r_st
        held = d_ok & (d * 0 + entering.to(tl.int32) != 0)  # (a tensor mask: the interpreter refuses a scalar's)
        key = tl.load(recent_k_ptr + slot_row + d * r_sd, mask=held, other=0.0)
        value = tl.load(recent_v_ptr + slot_row + d * r_sd, mask=held, other=0.0)
    else:
        key = tl.load(new_k_ptr + d * nk_sd, mask=d_ok, other=0.0)
        value = tl.load(new_v_ptr + d * nv_sd, mask=d_ok, other=0.0)
    write_decode_token(
        new_k_ptr, new_v_ptr, nk_sd, nv_sd, k_codes_ptr + b * c_sb + h * c_sh, v_codes_ptr + b * c_sb + h * c_sh,
        k_scale_ptr, v_scale_ptr + b * s_sb + h * s_sh, recent_k_ptr, recent_v_ptr, stats_ptr, c_st, c_sd, s_st,
        r_st, r_sd, d, d_ok, new_pos, entering_pos, entering, slots, offset, capacity, recent_slots, VALUE_TILED,
        HAS_RECENT, RING, True, CLIP, ROTATE_STAGES, ROTATE_NORM, IS_FLOAT, MAX, ROW_MAX, ROUND_SHIFT, NORMAL_OFFSET,
        MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE, SIGNED_ZERO, energy_ptr + h * head_dim, SEARCH,
    )  # fmt: skip
    j = tl.arange(0, BLOCK_N)
    j_ok = j < count
    kept_ptr += b * p_sb + h * p_sh
    score_ptr += b * q_sb + h * q_sh
    norms_ptr += b * n_sb + h * n_sh
    kv_ptr += b * o_sb + h * o_sh
    scale_bits_ptr = k_scale_ptr.to(tl.pointer_type(tl.int16 if SCALE_BITS == 16 else tl.int32))
    sign = -(1 << (SCALE_BITS - 1))
    kept, scores, total, seen = _set_state(kept_ptr, score_ptr, norms_ptr, n_sw, j, j_ok)
    first_visible = new_pos + 1 - window
    if EVICT:
        kept, scores = _evict(kept, scores, first_visible, scale_bits_ptr, s_st, sign, offset, ring, capacity)
    t = tl.where(entering, entering_pos, -1)
    total, seen, enters, slot, old, score = _race(t, key, kept, scores, total, seen, j, tl.load(first_real_ptr + b),
                                                  first_visible, EVICT)  # fmt: skip
    if enters:
        _keep(t, slot, old, key, value, kv_ptr, o_sw, o_st, scale_bits_ptr, s_st, sign, offset, ring, d, d_ok)
        kept = tl.where(j == slot, t, kept)
        scores = tl.where(j == slot, score, scores)
    tl.store(kept_ptr + j, kept, mask=j_ok)
    tl.store(score_ptr + j, scores, mask=j_ok)
    tl.store(norms_ptr, total)
    tl.store(norms_ptr + n_sw, seen)
    if STATIC:
        move_positions(positions_ptr, new_pos + 1, new_recent_start)


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


def write_and_settle(
    key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor, outliers: OutlierSet,
    first_real: torch.Tensor, window: int | None = None,
) -> None:  # fmt: skip
    """A decode step's `write_kv` and `settle` of the token it gives codes, in one launch (the same buffers, set
    and numbers as the two: `tests/kernels/test_outlier_selection.py`)."""
    launch_all([plan_write_settle(key, value, view, stats, outliers, first_real, window)], key.device)


def plan_write_settle(
    key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor, outliers: OutlierSet,
    first_real: torch.Tensor, window: int | None = None,
) -> Launch:  # fmt: skip
    """The launch of `write_and_settle`: `key`/`value` `[batch, kv_heads, 1, head_dim]`, `view` the buffers before
    the step (a static view's device positions too, which the launch moves), `first_real` `[batch]` each row's
    first token past padding and sinks, `window` a sliding layer's."""
    check_write(key, value, view, stats, view.static)
    batch, heads, new_tokens, head_dim = key.shape
    kv, kept, scores, norms, _, _, ring = outliers  # (its key scales: the view's, its offset the view's)
    if new_tokens != 1 or not view.per_token:
        raise ValueError(
            f"a write that settles outlier tokens takes one new token and per-token scales, got {new_tokens} tokens, "
            f"per_token={view.per_token}"
        )
    if kv.stride(-1) != 1 or kept.stride(-1) != 1 or scores.stride(-1) != 1:
        raise ValueError("outlier buffers need contiguous channels and slots")
    codes = view.codes.view(torch.uint8)
    scales = view.scales
    end, recent_start = (0, 0) if view.static else (int(view.end), int(view.recent_start))
    recent_slots = view.recent.shape[3] if view.recent is not None else 0
    return Launch(_write_settle_kernel, (batch * heads,), (
        key, value, codes[0], codes[1], scales[0], scales[1], *planes(view.recent, codes), stats,
        view.positions if view.static else stats, first_real, kv, kept, scores, norms,
        view.search_energy if view.scale_search > 1 else stats, *key.stride()[:2], key.stride(3),
        *value.stride()[:2], value.stride(3), *codes.stride()[1:],
        *scales[0].stride(), *plane_strides(view.recent), *kv.stride()[:2], kv.stride(2), kv.stride(3),
        *kept.stride()[:2], *scores.stride()[:2], *norms.stride(), heads, kept.shape[-1], head_dim, end, recent_start,
        view.offset, view.slots, view.codes.shape[3], recent_slots, ring, window or 0,
    ), dict(
        BLOCK_N=next_power_of_2(kept.shape[-1]), BLOCK_D=next_power_of_2(head_dim),
        SCALE_BITS=8 * scales.element_size(), STATIC=view.static, RING=view.ring, HAS_RECENT=recent_slots > 0,
        VALUE_TILED=view.value_tiled, EVICT=window is not None, CLIP=view.fmt.clip_bound,
        **rotation(view.rotate, head_dim), **encoding(view.fmt), SEARCH=view.scale_search, num_warps=1,
    ))  # fmt: skip
