"""Triton write kernel: store a layer's new keys and values (`KVView` buffers), both in one launch.

Without a recent buffer every new token is quantized into the codes. With one (R slots), a decode step's launch
moves the token leaving it from its slot into the codes and puts the new token in
that slot; a longer update first quantizes the recent buffer's leaving tokens (one launch), then stores the new
ones.

The codes are produced by integer arithmetic on the fp32 bits, not by a float -> fp8 cast: Triton 3.9's
interpreter mis-rounds that cast (carries into the exponent, ties, no saturation) and the GPU's plain fp32
division is approximate, so `x / scale` is `div_rn` and the rounding is done here. The result is
bit-identical to `reference.quantize` (torch's cast) on every input, NaN included (see its docstring).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .triton_common import (
    check_search_energy, code_offsets, encode, encoding, hadamard, rotation, search_weights, token_scales,
)
from .triton_launch import Launch, cdiv, launch_all, next_power_of_2, plane_strides, planes
from .view import KVView, coded_end, scale_dtypes

MAX_TILE = 4096  # elements of one program's [tokens, head_dim] tile
NEW, LEAVING = 0, 1  # what a launch stores: the new tokens, or the recent buffer's leaving tokens


@triton.jit
def _quantize_rows(x, rows_ok, valid, slot, codes_ptr, scale_ptr, stats_ptr, c_st, c_sd, s_st, d, tiled, capacity,
                   VALUE_TILED: tl.constexpr, PER_TOKEN: tl.constexpr, CLIP: tl.constexpr,
                   ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr, IS_FLOAT: tl.constexpr, MAX: tl.constexpr,
                   ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr, NORMAL_OFFSET: tl.constexpr,
                   MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
                   NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr, weight=1, SEARCH: tl.constexpr = 0):  # fmt: skip
    """Quantize rows `x` `[T, D]` (fp32) into codes at `slot` `[T]`; `rows_ok` `[T]`, `valid` `[T, D]`;
    `stats_ptr` at this program's (keys or values) counters: clipped, then non-finite; `tiled`: the codes are
    tiled values (VALUE_TILED buffers' value plane, of `capacity` slots); rotated first with ROTATE_STAGES;
    per-token scales searched among SEARCH candidates under the channels' `weight` (`token_scales`)."""
    if ROTATE_STAGES > 0:
        x = hadamard(x, ROTATE_STAGES, ROTATE_NORM)
    if PER_TOKEN:
        scale = token_scales(x, weight, scale_ptr.dtype.element_ty == tl.bfloat16, SEARCH, CLIP, IS_FLOAT, MAX,
                             ROW_MAX, ROUND_SHIFT, MIN_NORMAL, SUB_MAGIC)  # fmt: skip
        tl.store(scale_ptr + slot * s_st, scale, mask=rows_ok)
        y = tl.math.div_rn(x, scale[:, None])
    else:
        y = tl.math.div_rn(x, tl.load(scale_ptr))
    n_clipped = tl.sum(tl.where(valid & (tl.abs(y) > CLIP), 1, 0))
    tl.atomic_add(stats_ptr, n_clipped.to(tl.int64), mask=n_clipped > 0)
    n_nonfinite = tl.sum(tl.where(valid & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0))
    tl.atomic_add(stats_ptr + 1, n_nonfinite.to(tl.int64), mask=n_nonfinite > 0)
    code = encode(y, IS_FLOAT, MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE,
                  SIGNED_ZERO)  # fmt: skip
    offsets = code_offsets(slot, d, c_st, c_sd, capacity, VALUE_TILED and tiled)
    tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=valid)


@triton.jit
def write_decode_token(
    new_k_ptr, new_v_ptr, nk_sd, nv_sd, k_codes_ptr, v_codes_ptr, k_scale_ptr, v_scale_ptr, recent_k_ptr,
    recent_v_ptr, stats_ptr, c_st, c_sd, s_st, r_st, r_sd, d, d_ok, new_pos, entering_pos, entering, slots, offset,
    capacity, recent_slots,
    VALUE_TILED: tl.constexpr, HAS_RECENT: tl.constexpr, RING: tl.constexpr, PER_TOKEN: tl.constexpr,
    CLIP: tl.constexpr, ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr, IS_FLOAT: tl.constexpr,
    MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr, NORMAL_OFFSET: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGNED_ZERO: tl.constexpr, energy_ptr=None, SEARCH: tl.constexpr = 0,
):  # fmt: skip
    """A decode step's write of one (batch, KV head) row, for the program that then reads it (`_attention_kernel`
    with WRITE): the token `entering` the codes at `entering_pos` is quantized (with a recent buffer, the one the
    new token replaces in its slot; else the new token itself), then the new token `new_pos` takes its recent
    slot. The pointers are at the row's buffers; the codes may be typed fp8 (stored as their bytes). SEARCH: the
    per-token scales searched, the keys' weighted by the queries' energy at `energy_ptr` (`search_weights`)."""
    row = tl.arange(0, 1)
    ok = tl.zeros([1], tl.int32) + entering.to(tl.int32) != 0  # (a [1] mask: the interpreter refuses a scalar's)
    valid = ok[:, None] & d_ok[None, :]
    slot = (entering_pos % slots if RING else entering_pos - offset).to(tl.int64) + row
    if HAS_RECENT:
        r_slot = (new_pos % recent_slots).to(tl.int64)
        k_src, v_src, k_sd, v_sd = recent_k_ptr + r_slot * r_st, recent_v_ptr + r_slot * r_st, r_sd, r_sd
    else:
        k_src, v_src, k_sd, v_sd = new_k_ptr, new_v_ptr, nk_sd, nv_sd
    k_codes_ptr = k_codes_ptr.to(tl.pointer_type(tl.uint8))
    v_codes_ptr = v_codes_ptr.to(tl.pointer_type(tl.uint8))
    x = tl.load(k_src + row[:, None] * 0 + d[None, :] * k_sd, mask=valid, other=0.0).to(tl.float32)
    weight = search_weights(energy_ptr, d, d_ok) if SEARCH > 1 else 1
    _quantize_rows(x, ok, valid, slot, k_codes_ptr, k_scale_ptr, stats_ptr, c_st, c_sd, s_st, d, False, capacity,
                   VALUE_TILED, PER_TOKEN, CLIP, ROTATE_STAGES, ROTATE_NORM, IS_FLOAT, MAX, ROW_MAX, ROUND_SHIFT,
                   NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE, SIGNED_ZERO, weight,
                   SEARCH)  # fmt: skip
    tl.debug_barrier()  # (the keys' values dead before the values' are read: registers)
    x = tl.load(v_src + row[:, None] * 0 + d[None, :] * v_sd, mask=valid, other=0.0).to(tl.float32)
    _quantize_rows(x, ok, valid, slot, v_codes_ptr, v_scale_ptr, stats_ptr + 2, c_st, c_sd, s_st, d, True, capacity,
                   VALUE_TILED, PER_TOKEN, CLIP, ROTATE_STAGES, ROTATE_NORM, IS_FLOAT, MAX, ROW_MAX, ROUND_SHIFT,
                   NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE, SIGNED_ZERO, 1, SEARCH)  # fmt: skip
    if HAS_RECENT:
        tl.debug_barrier()  # every thread has read the leaving token before the new one takes its slot
        k = tl.load(new_k_ptr + d * nk_sd, mask=d_ok, other=0.0)
        tl.store(recent_k_ptr + r_slot * r_st + d * r_sd, k.to(recent_k_ptr.dtype.element_ty), mask=d_ok)
        v = tl.load(new_v_ptr + d * nv_sd, mask=d_ok, other=0.0)
        tl.store(recent_v_ptr + r_slot * r_st + d * r_sd, v.to(recent_v_ptr.dtype.element_ty), mask=d_ok)
    tl.debug_barrier()  # the codes, scales and recent slot written are seen by every thread of the program


@triton.jit(do_not_specialize=["end", "recent_start"])  # they move every step: one compile
def _write_kernel(
    key_ptr, value_ptr, k_codes_ptr, v_codes_ptr, k_scale_ptr, v_scale_ptr, recent_k_ptr, recent_v_ptr,
    stats_ptr, positions_ptr, energy_ptr,
    k_sb, k_sh, k_st, k_sd,
    v_sb, v_sh, v_st, v_sd,
    c_sb, c_sh, c_st, c_sd,
    s_sb, s_sh, s_st,
    r_sb, r_sh, r_st, r_sd,
    heads, new_tokens, head_dim, end, recent_start, offset, slots, capacity, recent_slots,
    VALUE_TILED: tl.constexpr, MODE: tl.constexpr, EVICT: tl.constexpr, HAS_RECENT: tl.constexpr, STATIC: tl.constexpr,
    RING: tl.constexpr, ADVANCE: tl.constexpr,
    PER_TOKEN: tl.constexpr, CLIP: tl.constexpr, ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FLOAT: tl.constexpr, MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr,
    NORMAL_OFFSET: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    """Program (token block, batch * head, 0 = keys / 1 = values). ADVANCE: the device positions move past the new
    tokens when every program has read them (the last program to take the ticket at `positions_ptr + 2`). SEARCH:
    per-token scales searched, the keys' weighted by the queries' energy (fp32 `[heads, head_dim]` at
    `energy_ptr`)."""
    b = (tl.program_id(1) // heads).to(tl.int64)  # int64 bases: a cache can exceed 2^31 elements
    h = (tl.program_id(1) % heads).to(tl.int64)
    which = tl.program_id(2)
    if STATIC:  # positions on the device (CUDA graphs)
        end = tl.load(positions_ptr)
        recent_start = tl.load(positions_ptr + 1)
    if which == 0:
        src, codes_ptr, scale_ptr, recent_ptr, sb, sh, st, sd = (
            key_ptr, k_codes_ptr, k_scale_ptr, recent_k_ptr, k_sb, k_sh, k_st, k_sd
        )
    else:
        src, codes_ptr, scale_ptr, recent_ptr, sb, sh, st, sd = (
            value_ptr, v_codes_ptr, v_scale_ptr, recent_v_ptr, v_sb, v_sh, v_st, v_sd
        )
    codes_ptr += b * c_sb + h * c_sh
    scale_ptr += b * s_sb + h * s_sh
    recent_ptr += b * r_sb + h * r_sh
    stats_ptr += which * 2
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    weight = tl.where(which == 0, search_weights(energy_ptr + h * head_dim, d, d_ok), 1) if SEARCH > 1 else 1
    new_recent_start = tl.maximum(recent_start, end + new_tokens - recent_slots)
    lowest = 0 if RING else offset  # a token before the first slot left a sliding window: nobody reads its codes
    if MODE == 1:  # the recent buffer's tokens that leave it: [recent_start, new_recent_start) of those it holds
        t = end - recent_slots + i
        ok = (i < recent_slots) & (t >= recent_start) & (t >= lowest) & (t < new_recent_start) & (t < end)
        r_slot = (t % recent_slots).to(tl.int64)
        x = tl.load(recent_ptr + r_slot[:, None] * r_st + d[None, :] * r_sd, mask=ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        slot = (t % slots if RING else t - offset).to(tl.int64)
        _quantize_rows(x, ok, ok[:, None] & d_ok[None, :], slot, codes_ptr, scale_ptr, stats_ptr, c_st, c_sd, s_st,
                       d, which == 1, capacity, VALUE_TILED, PER_TOKEN, CLIP, ROTATE_STAGES, ROTATE_NORM, IS_FLOAT, MAX,
                       ROW_MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE,
                       SIGNED_ZERO, weight, SEARCH)  # fmt: skip
    else:
        t = end + i
        row_ok = i < new_tokens
        if HAS_RECENT:
            r_slot = (t % recent_slots).to(tl.int64)
            if EVICT:  # the token this one replaces in its slot leaves the recent buffer now (n <= R: slots distinct)
                old = t - recent_slots
                leaving = row_ok & (old >= recent_start) & (old >= lowest)
                x_old = tl.load(recent_ptr + r_slot[:, None] * r_st + d[None, :] * r_sd,
                                mask=leaving[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
                slot_old = (old % slots if RING else old - offset).to(tl.int64)
                _quantize_rows(x_old, leaving, leaving[:, None] & d_ok[None, :], slot_old, codes_ptr, scale_ptr,
                               stats_ptr, c_st, c_sd, s_st, d, which == 1, capacity, VALUE_TILED, PER_TOKEN, CLIP,
                               ROTATE_STAGES, ROTATE_NORM, IS_FLOAT, MAX, ROW_MAX, ROUND_SHIFT, NORMAL_OFFSET,
                               MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE, SIGNED_ZERO, weight,
                               SEARCH)  # fmt: skip
        x_raw = tl.load(src + b * sb + h * sh + i.to(tl.int64)[:, None] * st + d[None, :] * sd,
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        direct = row_ok & (t < new_recent_start)
        slot = (t % slots if RING else t - offset).to(tl.int64)
        _quantize_rows(x_raw.to(tl.float32), direct, direct[:, None] & d_ok[None, :], slot, codes_ptr, scale_ptr,
                       stats_ptr, c_st, c_sd, s_st, d, which == 1, capacity, VALUE_TILED, PER_TOKEN, CLIP,
                       ROTATE_STAGES, ROTATE_NORM, IS_FLOAT, MAX, ROW_MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL,
                       SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE, SIGNED_ZERO, weight, SEARCH)  # fmt: skip
        if HAS_RECENT:
            kept = row_ok & (t >= new_recent_start)
            tl.store(recent_ptr + r_slot[:, None] * r_st + d[None, :] * r_sd,
                     x_raw.to(recent_ptr.dtype.element_ty), mask=kept[:, None] & d_ok[None, :])  # fmt: skip
    if ADVANCE:  # (a launch of its own before: a static cache's decode step took 4, gpu_static's step model)
        move_positions(positions_ptr, end + new_tokens, new_recent_start)


@triton.jit
def move_positions(positions_ptr, end, recent_start):
    """Store a static view's device positions `end`, `recent_start` once every program of the launch has read them:
    by the last program to take the ticket at `positions_ptr + 2` (set back to 0 for the next launch)."""
    tl.debug_barrier()
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    if tl.atomic_add(positions_ptr + 2, 1, sem="acq_rel") == programs - 1:
        tl.store(positions_ptr, end)
        tl.store(positions_ptr + 1, recent_start)
        tl.store(positions_ptr + 2, 0)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor, plans: dict | None = None,
    advance: bool = False,
) -> None:
    """Store the new tokens `key`/`value` `[batch, kv_heads, n, head_dim]` in `view`'s buffers (see
    `reference.write`). `plans` (a dict the caller keeps) memoizes the validated plan of each kind of call.
    `advance` (static views): the launch also moves the device positions past the new tokens (`end += n`,
    `recent_start` as the recent buffer's slots say), with the write ticket `positions[2]` (int64 [3])."""
    if plans is None:
        plan = WritePlan(key, value, view, stats, advance)
    else:
        shape = (key.shape, key.dtype, key.device, view.layout(), advance)
        plan = plans.get(shape)
        if plan is None:
            plan = plans[shape] = WritePlan(key, value, view, stats, advance)
    launch_all(plan.launches(key, value, view, stats), key.device)


def plan_write(
    key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor, advance: bool = False
) -> list[Launch]:
    """The launches of `write_kv`: the window's leaving tokens first when more than a window arrives at once,
    then the new tokens (which move the positions, with `advance`)."""
    return WritePlan(key, value, view, stats, advance).launches(key, value, view, stats)


class WritePlan:
    """What stays the same from one write to the next of one kind: validation, tile sizes, grids and constexprs."""

    def __init__(
        self, key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor, advance: bool = False
    ):
        check_write(key, value, view, stats, advance)
        batch, heads, new_tokens, head_dim = key.shape
        self.recent_slots = view.recent.shape[3] if view.recent is not None else 0
        block_d = next_power_of_2(head_dim)
        common = dict(
            EVICT=0 < new_tokens <= self.recent_slots, HAS_RECENT=self.recent_slots > 0, STATIC=view.static, RING=view.ring,
            VALUE_TILED=view.value_tiled,
            PER_TOKEN=view.per_token, CLIP=view.fmt.clip_bound, BLOCK_D=block_d, **encoding(view.fmt),
            **rotation(view.rotate, head_dim), SEARCH=view.scale_search,
        )  # fmt: skip
        modes = [(LEAVING, self.recent_slots)] if new_tokens > self.recent_slots > 0 else []
        modes.append((NEW, new_tokens))
        self.sizes = (heads, new_tokens, head_dim)
        self.kinds = []  # (grid, constexprs) of each launch
        # quarter tiles for a search: the searched 500-token write spilled 56 B on sm_80 at 128 registers with whole
        # ones, 4 B on sm_120 at 64 with half ones; with quarter ones 44-53 registers, no spill on any target
        # (scale_search_cost.py)
        tile = MAX_TILE // 4 if view.scale_search > 1 else MAX_TILE
        for mode, tokens in modes if new_tokens else ():
            block_t = min(next_power_of_2(tokens), max(1, tile // block_d))
            # 8 warps for a whole tile: with 4, the 500-token write over a recent buffer held 192 registers on sm_90
            # and spilled 24-32 B at 255 on sm_80 / sm_86 / sm_89; with 8, 106-158 (gpu_static)
            warps = 8 if block_t * block_d >= tile else 4
            self.kinds.append(((cdiv(tokens, block_t), batch * heads, 2),
                               dict(MODE=mode, BLOCK_T=block_t, num_warps=warps, ADVANCE=advance and mode == NEW,
                                    **common)))  # fmt: skip

    def launches(self, key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor) -> list[Launch]:
        tensors, strides, slots = view.derived(self, self._stored)
        end, recent_start = (0, 0) if view.static else (view.end, view.recent_start)
        args = (
            key, value, *tensors, stats, view.positions if view.positions is not None else stats,
            view.search_energy if view.scale_search > 1 else stats, *key.stride(),
            *value.stride(), *strides, *self.sizes, end, recent_start, view.offset, *slots, self.recent_slots,
        )  # fmt: skip
        return [Launch(_write_kernel, grid, args, constexprs) for grid, constexprs in self.kinds]

    def _stored(self, view: KVView) -> tuple:
        """The kernel arguments that depend only on the view's buffers (tensors, strides, slots held, slots
        allocated)."""
        codes = view.codes.view(torch.uint8)
        batch, heads = view.codes.shape[1:3]
        tensors = (codes[0], codes[1], view.scales[0], view.scales[1], *planes(view.recent, codes))
        strides = (
            *codes.stride()[1:], *view.scales[0].expand(batch, heads, -1).stride(), *plane_strides(view.recent)
        )  # fmt: skip
        return tensors, strides, (view.slots, view.codes.shape[3])


def check_write(key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor, advance: bool) -> None:
    """Refuse, by name, a write of `key`/`value` into `view` that the kernels cannot do (or would do wrong)."""
    if key.shape != value.shape or key.dtype != value.dtype:
        raise ValueError(f"key {tuple(key.shape)} {key.dtype} and value {tuple(value.shape)} {value.dtype} differ")
    batch, heads, new_tokens, head_dim = key.shape
    _, cache_batch, cache_heads, _, cache_dim = view.codes.shape
    if view.codes.dtype != view.fmt.dtype:
        raise ValueError(f"codes have dtype {view.codes.dtype}, format {view.fmt.name} stores {view.fmt.dtype}")
    if (cache_batch, cache_heads, cache_dim) != (batch, heads, head_dim):
        raise ValueError(f"new keys {tuple(key.shape)} do not fit the code buffers {tuple(view.codes.shape)}")
    recent_slots = view.recent.shape[3] if view.recent is not None else 0
    # (a static view's positions are on the device, read by the kernels alone: in a compiled graph's trace, fake)
    if not view.static and not view.ring:
        coded = coded_end(view.end, view.recent_start, new_tokens, recent_slots)
        if coded - view.offset > view.slots:
            raise ValueError(
                f"{new_tokens} new tokens at {view.end} overflow the code buffers' {view.slots} slots from "
                f"{view.offset}"
            )
    expected = (2, batch, heads, view.codes.shape[3]) if view.per_token else (2, 1, heads, 1)
    if view.scales.dtype not in scale_dtypes(view) or tuple(view.scales.shape) != expected:
        raise ValueError(
            f"scales must be fp32 (per-token: or bf16) {expected}, got {view.scales.dtype} {tuple(view.scales.shape)}"
        )
    view.check_layout()
    if view.scale_search > 1:
        check_search(view)
    if advance and (view.positions is None or view.positions.dtype != torch.int64 or view.positions.shape != (3,)):
        positions = None if view.positions is None else (view.positions.dtype, tuple(view.positions.shape))
        raise ValueError(f"a write that moves the positions needs int64 [3] device positions, got {positions}")
    if stats.dtype != torch.int64 or stats.shape != (2, 2):
        raise ValueError(f"stats must be an int64 [2, 2] counter, got {stats.dtype} {tuple(stats.shape)}")
    devices = {t.device for t in (key, value, view.codes, view.scales, stats)}
    if len(devices) > 1:
        raise ValueError(f"write tensors are on several devices: {sorted(map(str, devices))}")


def check_search(view: KVView) -> None:
    """Refuse, by name, a searched write without per-token scales or without the queries' energy it weighs by."""
    if not view.per_token:
        raise ValueError(f"scale_search={view.scale_search} searches per-token scales; this view has static ones")
    heads, head_dim = view.codes.shape[2], view.codes.shape[4]
    check_search_energy(view.search_energy, heads, head_dim, f"scale_search={view.scale_search}")
