"""The torch path the cache runs where Triton does not (the CPU): the oracle's bits (`reference`) in few ops
(rotated codes, `view.rotate`: the same Hadamard butterflies, `rotation.hadamard`, on whole tensors).

A decode step on the CPU is op-dispatch bound (docs/benchmarks.md), so codes are decoded by int16 bit operations
on an fp16 view (see `StorageFormat`), numbers are 0-dim tensors, and the common case (finite inputs, nothing
clipped) takes one reduction. The path is chosen once per call by the kind of positions (`_path`):

- host positions (dynamic buffers): Python ints, so only the tokens held are touched, by slices;
- device positions (static buffers: `torch.compile`, CUDA graphs): 0-dim device tensors, so every index is
  computed and nothing syncs with the host; every slot is read, under a mask of the tokens held.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Iterator, NamedTuple

import torch

from .formats import TINY_SCALE, StorageFormat, get_format
from .reference import attention, quantize, token_scale
from .rotation import hadamard
from .view import KVView, coded_end, token_major

# codes up to which the decode multiplies its fp16 (or int8) values by the scales in one mixed-dtype op; on
# more, a conversion then an fp32 multiply is faster (1 thread, 4096 tokens of SmolLM2's shapes, 1.6 M codes:
# 313 -> 208 us; a layer-step 1.74 -> 1.14 ms at 4k, 11.6 -> 8.2 ms at 16k), where a decode step's small tensors
# are op-dispatch bound (12.7 k codes: as fast either way)
MIXED_MULTIPLY_MAX = 1 << 14


# --- values in few ops ----------------------------------------------------------------------------------------
class Numbers(NamedTuple):
    fp16_shift: int | torch.Tensor
    clear_bit_14: int | torch.Tensor
    fp16_factor: float | torch.Tensor
    row_max: float | torch.Tensor
    tiny_scale: float | torch.Tensor


def constants(fmt: StorageFormat) -> Numbers:
    """The CPU path's numbers as 0-dim tensors (never written): an op given a Python number wraps it in a tensor
    first, 1.6 us of the 3 us such an op takes on a decode step's small tensors (1.3 us with a tensor). Inside a
    compiled graph, plain numbers (constants of the graph)."""
    if torch.compiler.is_compiling():
        return _numbers(fmt)
    return _as_tensors(fmt.name)  # looked up by name: hashing the format itself costs 2 us a call


def _numbers(fmt: StorageFormat) -> Numbers:
    return Numbers(fmt.fp16_shift, ~0x4000, fmt.fp16_factor, fmt.row_max, TINY_SCALE)


@functools.cache
def _as_tensors(name: str) -> Numbers:
    with torch.inference_mode(False):  # ordinary tensors, usable inside and outside inference mode
        return Numbers(*(
            torch.tensor(n, dtype=torch.int16 if isinstance(n, int) else torch.float32)
            for n in _numbers(get_format(name))
        ))  # fmt: skip


def write_stacked(
    states: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    fmt: StorageFormat,
    per_token: bool,
    stats: torch.Tensor,
    scale_dtype: torch.dtype | None = None,
) -> bool:
    """Quantize `states` (`[2, ...rows, D]`: keys then values) into `codes` (a view of the same shape); with
    `per_token`, store each row's scale into `scale` (`[2, ...rows, 1]`), else read it from there. Adds clipped
    and non-finite counts to `stats` (int64 `[2, 2]`: keys/values x clipped/non-finite). Returns whether any
    input was non-finite (so the reader knows NaN codes may exist). Per-token scales are rounded up to
    `scale_dtype` (default: the buffer's; pages hold bf16 values in fp32 bytes, the dense cache's scales).

    Bit-identical to `reference.dynamic_scale` + `reference.quantize`; the common case (finite inputs, nothing
    clipped) is found by one reduction and takes no counting ops.
    """
    if per_token:
        amax = torch.linalg.vector_norm(states, math.inf, dim=-1, keepdim=True, dtype=torch.float32)
        # NaN or inf anywhere: a non-finite largest amax; a row whose scale would fall below TINY_SCALE (all-zero
        # rows): a smallest amax below TINY_SCALE * row_max. Neither (the rule): no clamp, one op less
        finite, tiny_rows = True, True  # fake tensors (tracing): nothing to look at
        if not states.is_meta:
            low, high = torch.aminmax(amax)
            finite, tiny_rows = math.isfinite(high.item()), not low.item() >= TINY_SCALE * fmt.row_max
        if not finite:
            amax = states.float().abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=-1, keepdim=True)
        numbers = constants(fmt)
        rounded = (scale_dtype or scale.dtype) == torch.bfloat16
        row_scale = torch.div(amax, numbers.row_max, out=amax if rounded else scale)  # into the buffer if it can
        if tiny_rows or not finite:
            row_scale.clamp_min_(numbers.tiny_scale)
        if rounded:  # rounded up (the fp32 bits past bf16's carried up, then dropped)
            row_scale.view(torch.int32).add_(0xFFFF).bitwise_and_(-0x10000)
            scale.copy_(row_scale)
        scaled = states / row_scale
        ok = finite  # a finite row divided by its own amax never leaves the format's range
    else:
        scaled = states / scale
        low, high = torch.aminmax(scaled)  # NaN in, NaN out: the comparison below is then False
        ok = states.is_meta or bool(-fmt.clip_bound <= low.item() and high.item() <= fmt.clip_bound)
    nonfinite = False
    if not ok:
        counts = torch.stack([
            (scaled.abs() > fmt.clip_bound).flatten(1).sum(1), (~torch.isfinite(states)).flatten(1).sum(1)
        ], dim=1)  # fmt: skip
        stats += counts
        nonfinite = bool(counts[:, 1].any())
    if fmt.dtype == torch.float8_e4m3fn:
        codes.copy_(scaled)  # torch's cast saturates e4m3fn, inf included; NaN stays NaN
    elif fmt.is_float:
        codes.copy_(scaled.clamp_(-fmt.max, fmt.max))
    else:
        codes.copy_(scaled.clamp_(-fmt.max, fmt.max).round_().nan_to_num_(nan=0.0))
    return nonfinite


def dequantize_stacked(
    codes: torch.Tensor, scale: torch.Tensor, fmt: StorageFormat, has_nan: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`codes * scale` in fp32 (exactly `reference.dequantize`), for codes `[2, ...]` and a broadcasting `scale`
    (into `out` when given).

    Float codes are decoded through int16 bit operations and an fp16 view (see `StorageFormat`), the fp16
    factor folded into the scale multiply; `has_nan` adds the select that reads NaN codes as NaN.
    """
    numbers = constants(fmt)
    values = codes
    if fmt.is_float:
        values = codes.view(torch.int8).to(torch.int16).bitwise_left_shift_(numbers.fp16_shift)
        if fmt.fp16_shift == 7:  # e4m3: the sign landed on bit 14 too (sign extension); keep it on bit 15 only
            values.bitwise_and_(numbers.clear_bit_14)
        values = values.view(torch.float16)
        scale = scale * numbers.fp16_factor if fmt.fp16_factor != 1.0 else scale
    elif scale.dtype != torch.float32:
        scale = scale.float()  # int8 codes times bf16 scales would multiply in bf16 (fp16 ones promote to fp32)
    if codes.numel() < MIXED_MULTIPLY_MAX:
        values = torch.mul(values, scale, out=out)
    else:
        values = (values.float() if out is None else out.copy_(values)).mul_(scale)
    if has_nan and fmt.nan_code >= 0:
        code_bits = codes.view(torch.uint8) & fmt.nan_code_mask
        values = values.masked_fill_(code_bits == fmt.nan_code, math.nan)
    return values


def ring_pieces(first: int, stop: int, modulus: int) -> Iterator[tuple[int, int, int]]:
    """`(timeline start, timeline stop, slot)` runs of tokens `[first, stop)` in a ring of `modulus` slots."""
    while first < stop:
        slot = first % modulus
        run = min(stop - first, modulus - slot)
        yield first, first + run, slot
        first += run


def _scale_columns(view: KVView) -> torch.Tensor:
    """`view.scales` with a trailing dim, to broadcast against the codes' rows (a view kept in the view's memo:
    making it costs as much as a small op; a compiled graph makes its own)."""
    if torch.compiler.is_compiling():
        return _unsqueezed_scales(view)
    return view.derived(_scale_columns, _unsqueezed_scales, view.scales)


def _unsqueezed_scales(view: KVView) -> torch.Tensor:
    return view.scales.unsqueeze(-1)


# --- the cache's two operations ---------------------------------------------------------------------------------
def write(key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor) -> bool:
    """`reference.write`: store the new tokens `[end, end + n)` in the buffers of `view` (before the update);
    returns whether a non-finite input was seen (always True with device positions, which cannot check without
    a sync)."""
    return _path(view).write(torch.stack((key, value)), view, stats)


def attend(
    query: torch.Tensor,
    view: KVView,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.attend`: the visible tokens decoded (the full-precision ones laid beside or over them), then
    `reference.attention`; `[batch, q_heads, q_len, head_dim]` in the query's dtype."""
    path = _path(view)
    rotated = _attends_rotated(view)
    kv = HostPositions.materialize(view, rotated=True) if rotated else path.materialize(view)
    if view.key_channel_scale is not None:
        kv[0] *= view.key_channel_scale[None, :, None, :]
    keys, values = kv.unbind()
    mask, window = path.mask(query, view, mask, window, keys.shape[2])
    out = attention_in_space(rotated, query, keys, values, scaling=scaling, mask=mask, window=window,
                             softcap=softcap, sink_logits=sink_logits)  # fmt: skip
    return out if out.dtype == query.dtype else out.to(query.dtype)  # `to` costs 2 us even when it is a no-op


def attention_in_space(rotated: bool, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs):
    """`attention`; `rotated`: over keys and values in the rotated space of rotated codes, the query rotated into
    it and the output back (the torch paths' way to read rotated codes: the query and output rotated, not every
    decoded code; SmolLM2 at 2k tokens, one CPU thread: 2.6x DynamicCache's decode step the latter way)."""
    if not rotated:
        return attention(query, keys, values, **kwargs)
    return hadamard(attention(hadamard(query), keys, values, **kwargs))


def _attends_rotated(view: KVView) -> bool:
    """Whether `attend` works in the rotated space (`attention_in_space`): rotated codes with host positions, some
    of them held, no per-channel key scales (they apply to the keys rotated back). With no codes held nothing is
    rotated: a window over every token stays bit for bit the full-precision cache."""
    return (view.rotate and not view.static and view.key_channel_scale is None
            and (view.recent is None or view.recent_start > view.start))  # fmt: skip


def materialize(view: KVView) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 keys and values `[batch, kv_heads, tokens, head_dim]` of the visible tokens (`[start, end)` in
    order), or of every slot with device positions (their positions: `slot_positions`)."""
    if view.value_tiled:  # the Triton backend's buffers (the eager fallback's read): values made token-major first
        view = dataclasses.replace(view, codes=token_major(view.codes, True), value_tiled=False, memo=None)
    kv = _path(view).materialize(view)
    if view.key_channel_scale is not None:
        kv[0] *= view.key_channel_scale[None, :, None, :]
    keys, values = kv.unbind()
    return keys, values


def _path(view: KVView) -> type:
    if view.value_tiled:
        raise ValueError("the torch path reads token-major value codes; these are tiled (the Triton backend's)")
    return DevicePositions if view.static else HostPositions


class HostPositions:
    """Positions are Python ints (dynamic buffers): only the tokens held are touched, by slices."""

    @staticmethod
    def write(states: torch.Tensor, view: KVView, stats: torch.Tensor) -> bool:
        end, recent = view.end, view.recent
        if recent is None:  # pure FP8: every new token goes straight to the codes
            return HostPositions._quantize(states, end, view, stats)
        recent_slots, n = recent.shape[3], states.shape[3]
        new_recent_start = coded_end(end, view.recent_start, n, recent_slots)
        nonfinite = False
        # leaving (those before the first slot left a sliding window: nobody reads their codes)
        leaving = ring_pieces(max(view.recent_start, view.offset), min(new_recent_start, end), recent_slots)
        for first, stop, slot in leaving:
            nonfinite |= HostPositions._quantize(recent.narrow(3, slot, stop - first), first, view, stats)
        if new_recent_start > end:  # new tokens that are not among the newest `recent_slots`
            nonfinite |= HostPositions._quantize(states.narrow(3, 0, new_recent_start - end), end, view, stats)
        for first, stop, slot in ring_pieces(max(end, new_recent_start), end + n, recent_slots):
            recent.narrow(3, slot, stop - first).copy_(states.narrow(3, first - end, stop - first))
        return nonfinite

    @staticmethod
    def _quantize(rows: torch.Tensor, first: int, view: KVView, stats: torch.Tensor) -> bool:
        """`write_stacked` of tokens `[first, first + n)` (`rows`, `[2, batch, kv_heads, n, head_dim]`)."""
        n, slot = rows.shape[3], first - view.offset
        scale = _scale_columns(view)
        rows = hadamard(rows) if view.rotate else rows
        codes = view.codes.narrow(3, slot, n)
        if view.scale_search > 1:  # the searched scales, then a write under them
            row_scale = token_scale(rows, view)[..., None]
            scale.narrow(3, slot, n).copy_(row_scale)
            return write_stacked(rows, codes, row_scale, view.fmt, False, stats)
        return write_stacked(rows, codes, scale.narrow(3, slot, n) if view.per_token else scale, view.fmt,
                             view.per_token, stats)  # fmt: skip

    @staticmethod
    def materialize(view: KVView, rotated: bool = False) -> torch.Tensor:
        """The fp32 K/V of tokens `[start, end)` (`rotated`: all of them times the Hadamard matrix, the codes as
        they are decoded): the sinks every row shares (no padding) copied first, the codes
        between them and the recent tokens decoded straight into the result (the recent tokens have no codes),
        the recent tokens copied after them; when the rows' sinks differ, each row's are laid over afterwards.
        Decoding only the codes it needs took a layer-step with recent tokens from 108 to 103-105 us at the tiny
        Llama's shapes (`benchmarks/host_overhead.py`), from 2.7 to 1.7-2.0 ms at SmolLM2's at 4k tokens; a `cat`
        of the pieces was 98 us at the first but 5.0 ms at the second (one more pass over the result)."""
        start, end = view.start, view.end
        if view.recent is None and view.sinks is None and view.outliers is None:  # pure FP8: the decoded codes
            return HostPositions._decode(view, start, end, None, rotated)
        as_held = hadamard if rotated else torch.Tensor.float  # the full-precision tokens, in the result's space
        sinks = view.shared_sink_count()
        shared = sinks or 0
        codes = view.codes
        spare = view.outliers is not None  # a column more, where empty outlier slots land
        kv = torch.empty(2, *codes.shape[1:3], end - start + spare, codes.shape[4], dtype=torch.float32,
                         device=codes.device)  # fmt: skip
        coded_start = start + shared
        coded_end = end if view.recent is None else min(max(view.recent_start, coded_start), end)
        if shared:
            kv.narrow(3, 0, shared).copy_(as_held(view.sinks.narrow(3, 0, shared)))
        if coded_end > coded_start:
            HostPositions._decode(view, coded_start, coded_end, kv.narrow(3, shared, coded_end - coded_start), rotated)
        for first, stop, slot in ring_pieces(coded_end, end, view.recent.shape[3]) if view.recent is not None else ():
            kv.narrow(3, first - start, stop - first).copy_(as_held(view.recent.narrow(3, slot, stop - first)))
        if sinks is None:
            HostPositions._lay_sinks(kv, view, as_held)
        if spare:
            t = view.outlier_pos
            lay_outliers(kv, view, torch.where((t >= start) & (t < end), t - start, end - start), as_held)
            kv = kv.narrow(3, 0, end - start)
        return kv

    @staticmethod
    def _decode(view: KVView, first: int, stop: int, out: torch.Tensor | None, rotated: bool = False) -> torch.Tensor:
        """fp32 K/V of the codes of tokens `[first, stop)`, into `out` when given (`rotated`: rotated codes left in
        the rotated space)."""
        slot, scales = first - view.offset, _scale_columns(view)
        codes = view.codes.narrow(3, slot, stop - first)
        values = dequantize_stacked(codes, scales.narrow(3, slot, stop - first) if view.per_token else scales,
                                    view.fmt, view.has_nan, out)  # fmt: skip
        if rotated or not view.rotate:
            return values
        return hadamard(values) if out is None else out.copy_(hadamard(values))

    @staticmethod
    def _lay_sinks(kv: torch.Tensor, view: KVView, as_held: Callable = torch.Tensor.float) -> None:
        """Replace the decoded codes of each row's sink tokens by their full-precision values (`as_held` of them):
        one copy per distinct span of rows."""
        if view.sinks is None:
            return
        for (first, count), rows in view.sink_spans().items():
            index = torch.tensor(rows, device=kv.device) if len(rows) < kv.shape[1] else slice(None)
            column = slice(first - view.start, first - view.start + count)
            kv[:, index, :, column] = as_held(view.sinks[:, index, :, :count])

    @staticmethod
    def mask(query, view: KVView, mask, window, columns: int):
        """The mask's columns of the visible tokens (the mask ends at `end`, or starts at `mask_start`)."""
        if mask is not None:
            first = mask.shape[-1] - columns if view.mask_start is None else view.start - view.mask_start
            mask = mask[..., first : first + columns]
        return mask, window


class DevicePositions:
    """Positions are 0-dim device tensors (static buffers: compiled graphs, CUDA graphs): every index is computed,
    nothing syncs with the host. The buffers have a spare slot at the end, where writes with nowhere to go land."""

    @staticmethod
    def write(states: torch.Tensor, view: KVView, stats: torch.Tensor) -> bool:
        codes, scales, recent, fmt, end = view.codes, view.scales, view.recent, view.fmt, view.end
        n, recent_slots = states.shape[3], recent.shape[3] if recent is not None else 0
        device = states.device

        def quantize_into(rows: torch.Tensor, index: torch.Tensor) -> None:
            if view.rotate:
                rows = hadamard(rows)
            if view.per_token:
                row_scale = token_scale(rows, view)[..., None]
                scales.index_copy_(3, index, row_scale[..., 0].to(scales.dtype))
            else:
                row_scale = scales[..., None]
            row_codes, clipped, nonfinite = quantize(rows, row_scale, fmt, count_per_row=True)
            stats.add_(torch.stack([clipped, nonfinite], dim=1))
            codes.view(torch.uint8).index_copy_(3, index, row_codes.view(torch.uint8))

        if recent_slots:
            # the recent buffer's oldest tokens leave it: at most min(n, recent_slots), those at or after recent_start
            leaving = end - recent_slots + torch.arange(min(n, recent_slots), device=device)
            valid = leaving >= view.recent_start
            quantize_into(recent.index_select(3, leaving % recent_slots), _place(view, leaving, valid, view.slots))
        direct = max(n - recent_slots, 0)
        if direct:
            t = end + torch.arange(direct, device=device)
            quantize_into(states[:, :, :, :direct], _place(view, t, torch.ones_like(t, dtype=torch.bool), view.slots))
        if recent_slots:
            kept = end + torch.arange(direct, n, device=device)
            recent.index_copy_(3, kept % recent_slots, states[:, :, :, direct:].to(recent.dtype))
        return True

    @staticmethod
    def materialize(view: KVView) -> torch.Tensor:
        """Every column (`slot_positions`): the codes of the tokens before `recent_start` laid out on them, the
        full-precision tokens laid over them (a spare column at the end takes what has nowhere to go)."""
        positions, held = slot_positions(view)
        spare = torch.full((1,), view.slots, device=positions.device)
        coded = held & (positions < view.recent_start)
        if view.ring:  # the codes of the last `slots` tokens before `recent_start`
            coded &= positions >= view.recent_start - view.slots
        code_slot = torch.cat((_place(view, positions, coded, view.slots), spare))
        scales = _scale_columns(view)
        kv = dequantize_stacked(view.codes.index_select(3, code_slot),
                                scales.index_select(3, code_slot) if view.per_token else scales, view.fmt, view.has_nan)  # fmt: skip
        if view.rotate:
            kv = hadamard(kv)
        columns = kv.shape[3] - 1
        if view.recent is not None:
            window = view.recent.shape[3]
            t = view.end - window + torch.arange(window, device=kv.device)
            recent_held = (t >= view.recent_start) & (t >= view.start) & (t >= 0)
            kv.index_copy_(3, _place(view, t, recent_held, columns), view.recent.index_select(3, t % window).float())
        if view.sinks is not None:
            s = torch.arange(view.sinks.shape[3], device=kv.device)
            t = view.sink_start[:, None] + s  # [batch, S]
            column = _place(view, t, s < view.sink_count[:, None], columns)
            index = column[None, :, None, :, None].expand(2, -1, kv.shape[2], -1, kv.shape[4])
            kv.scatter_(3, index, view.sinks.float())
        if view.outliers is not None:
            t = view.outlier_pos
            lay_outliers(kv, view, _place(view, t, (t >= view.start) & (t >= 0) & (t < view.end), columns))
        return kv[:, :, :, :columns]

    @staticmethod
    def mask(query, view: KVView, mask, window, columns: int):
        """Which columns each query sees: the mask's columns at the columns' positions (or the causal and window
        rules), among the columns that hold a visible token."""
        positions, held = slot_positions(view)
        if mask is not None:
            return mask.index_select(-1, positions.clamp(0, mask.shape[-1] - 1)) & held, None
        q_pos = view.end - query.shape[2] + torch.arange(query.shape[2], device=query.device)
        visible = (positions <= q_pos[:, None]) & held
        if window is not None:
            visible = visible & (positions > q_pos[:, None] - window)
        return visible, None


def lay_outliers(kv: torch.Tensor, view: KVView, column: torch.Tensor, as_held: Callable = torch.Tensor.float) -> None:
    """Lay each head's outlier tokens (`as_held` of them) over their columns of `kv` (`column` `[batch, kv_heads, N]`;
    empty slots on the spare last column)."""
    index = column[None, :, :, :, None].expand(2, -1, -1, -1, kv.shape[4])
    kv.scatter_(3, index, as_held(view.outliers))


def _place(view: KVView, t: torch.Tensor, held: torch.Tensor, places: int) -> torch.Tensor:
    """Where positions `t` lie among `places` code slots or columns (device positions; a ring's `t % places`):
    the spare one, `places`, where `held` is False."""
    return torch.where(held, t % places if view.ring else t, places)


def slot_positions(view: KVView) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column's token position and whether it holds a visible token (device positions)."""
    columns = view.columns or view.slots
    column = torch.arange(columns, device=view.codes.device)
    if view.ring:  # the latest token of the column's residue before `end`
        positions = view.end - 1 - (view.end - 1 - column) % columns
    else:
        positions = column
    return positions, (positions >= view.start) & (positions >= 0) & (positions < view.end)
