"""Torch reference of every kernel: the test oracle of the Triton kernels and the CPU path of the cache.

Conventions (vLLM's): a scale is a dequantization multiplier, `stored = saturate(x / scale)`,
`value = stored * scale`. Scales are fp32 and broadcast against `[..., tokens]`: a static scale is one value
per KV head, a dynamic (per-token-head) scale one value per token and head.

Policy for values outside the format: +-inf and finite values beyond +-max saturate to +-max; those beyond
`fmt.clip_bound` (where rounding alone would not bring them back to max) are counted as clipped. NaN is written
as the format's NaN code (0 in int8, which has none) and reads back as NaN, on every backend; NaN and +-inf
inputs are counted as non-finite. A dynamic scale ignores non-finite values.

The functions come in two kinds: the obviously right oracle (`dynamic_scale`, `quantize`, `decode`,
`attention`), and the CPU path the cache runs (`write_stacked`, `dequantize_stacked`), which produces the same
bits with the fewest torch ops (a decode step on CPU is op-dispatch bound: docs/benchmarks.md); tests hold the
two equal.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .formats import StorageFormat, get_format

TINY_SCALE = 2.0**-126  # the smallest dynamic scale: an all-zero row gets it (its codes are 0 whatever it is)
QUERY_BLOCK = 256  # query rows per block of the explicit-softmax path: its memory stays linear in the prompt
# codes up to which the decode multiplies its fp16 (or int8) values by the fp32 scales in one mixed-dtype op; on
# more, a conversion then an fp32 multiply is faster (1 thread, 4096 tokens of SmolLM2's shapes, 1.6 M codes:
# 313 -> 208 us; a layer-step 1.74 -> 1.14 ms at 4k, 11.6 -> 8.2 ms at 16k), where a decode step's small tensors
# are op-dispatch bound (12.7 k codes: as fast either way)
MIXED_MULTIPLY_MAX = 1 << 14


# --- the oracle ------------------------------------------------------------------------------------------------
def dynamic_scale(x: torch.Tensor, fmt: StorageFormat) -> torch.Tensor:
    """Per-row scale over the last dim: `max(amax(|finite x|) / fmt.row_max, TINY_SCALE)`."""
    amax = x.float().abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=-1)
    return (amax / fmt.row_max).clamp_min(TINY_SCALE)


def quantize(
    x: torch.Tensor, scale: torch.Tensor, fmt: StorageFormat, count_per_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of `x / scale` in `fmt` (saturated, round to nearest even), the number of clipped values and the
    number of non-finite inputs (one count per index of `x`'s first dim with `count_per_row`).

    `scale` broadcasts against `x[..., :1]`, i.e. it has the shape of `x` without its last dim plus a trailing 1.
    """
    scaled = x.float() / scale
    beyond = scaled.abs() > fmt.clip_bound
    nonfinite = ~torch.isfinite(x)
    if count_per_row:
        clipped, nonfinite = beyond.flatten(1).sum(1), nonfinite.flatten(1).sum(1)
    else:
        clipped, nonfinite = beyond.sum(), nonfinite.sum()
    scaled = scaled.clamp(-fmt.max, fmt.max)
    if fmt.is_float:
        return scaled.to(fmt.dtype), clipped, nonfinite
    return torch.round(torch.nan_to_num(scaled, nan=0.0)).to(fmt.dtype), clipped, nonfinite


def decode(codes: torch.Tensor, fmt: StorageFormat) -> torch.Tensor:
    """The fp32 values of `codes` (torch's own conversion: NaN codes are NaN)."""
    return codes.float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: StorageFormat) -> torch.Tensor:
    """`codes * scale` in fp32, `scale` broadcasting against `codes[..., :1]`."""
    return decode(codes, fmt) * scale


def causal_mask(
    q_len: int, kv_len: int, window: int | None = None, device: torch.device | str = "cpu", q_end: int | None = None
) -> torch.Tensor:
    """Causal (and sliding-window) mask `[q_len, kv_len]`, True = attend, the queries being keys
    `[q_end - q_len, q_end)` (bottom-right aligned by default: `q_end = kv_len`)."""
    q_end = kv_len if q_end is None else q_end
    q_pos = torch.arange(q_end - q_len, q_end, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` `[batch, q_heads, q_len, D]` over full-precision `keys`/`values`
    `[batch, kv_heads, kv_len, D]` (GQA: each KV head serves `q_heads / kv_heads` query heads); returns
    `[batch, q_heads, q_len, D]` in fp32.

    `mask` (bool, True = attend) broadcasts against `[batch, q_heads, q_len, kv_len]` and replaces the causal
    rule; without it query i sees key j iff `j <= kv_len - q_len + i` (and, with `window`,
    `j > kv_len - q_len + i - window`). `softcap` caps scores as `softcap * tanh(s / softcap)`; `sinks`
    (`[q_heads]`, gpt-oss) add one logit per head to the softmax denominator. A row that sees nothing gives 0.
    Memory stays linear in `kv_len`: sdpa (a flash kernel on CPU) where it applies, else blocks of queries.
    """
    q_heads, q_len = query.shape[1], query.shape[2]
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the cache's {kv_heads} KV heads")
    query, keys, values = query.float(), keys.float(), values.float()
    if mask is None and (window is not None or 1 < q_len < kv_len):
        mask = causal_mask(q_len, kv_len, window, query.device)
    if mask is not None:
        keys, values = _without_unseen(keys, values, mask)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scaling,
            enable_gqa=q_heads != kv_heads,
        )  # fmt: skip
    if mask is None:
        mask = causal_mask(q_len, kv_len, device=query.device)
    group = q_heads // kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    out = torch.empty_like(query)
    for first in range(0, q_len, QUERY_BLOCK):
        rows = slice(first, first + QUERY_BLOCK)
        scores = query[:, :, rows] @ keys.transpose(-1, -2) * scaling
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask[..., rows, :], -math.inf)
        if sinks is not None:
            sink = sinks.float().reshape(1, q_heads, 1, 1).expand(*scores.shape[:3], 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a fully masked row attends to nothing
        out[:, :, rows] = probs[..., :kv_len] @ values
    return out


def _without_unseen(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys`/`values` with zeros in the columns no query row may see (padding, slots outside the window): a
    masked column contributes exactly nothing, where a NaN or inf there would reach every row (0 x NaN)."""
    seen = mask.any(dim=-2)  # [..., columns]
    if seen.dim() == 3 and seen.shape[1] not in (1, keys.shape[1]):  # one row per query head: per KV head
        seen = seen.unflatten(1, (keys.shape[1], -1)).any(dim=2)
    if not torch.compiler.is_compiling() and bool(seen.all()):
        return keys, values
    seen = seen[..., None]
    return keys.where(seen, 0.0), values.where(seen, 0.0)


# --- the CPU path: the same bits in few ops ------------------------------------------------------------------
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
    dynamic: bool,
    stats: torch.Tensor,
) -> bool:
    """Quantize `states` (`[2, ...rows, D]`: keys then values) into `codes` (a view of the same shape); with
    `dynamic`, store each row's scale into `scale` (`[2, ...rows, 1]`), else read it from there. Adds clipped and
    non-finite counts to `stats` (int64 `[2, 2]`: keys/values x clipped/non-finite). Returns whether any input was
    non-finite (so the reader knows NaN codes may exist).

    Bit-identical to `dynamic_scale` + `quantize`; the common case (finite inputs, nothing clipped) is found by
    one reduction and takes no counting ops.
    """
    if dynamic:
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
        row_scale = torch.div(amax, numbers.row_max, out=scale)  # into the buffer
        if tiny_rows or not finite:
            row_scale.clamp_min_(numbers.tiny_scale)
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
    """`codes * scale` in fp32 (exactly `dequantize`), for codes `[2, ...]` and a broadcasting `scale` (into
    `out` when given).

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
    if codes.numel() < MIXED_MULTIPLY_MAX:
        values = torch.mul(values, scale, out=out)
    else:
        values = (values.float() if out is None else out.copy_(values)).mul_(scale)
    if has_nan and fmt.nan_code >= 0:
        code_bits = codes.view(torch.uint8) & fmt.nan_code_mask
        values = values.masked_fill_(code_bits == fmt.nan_code, math.nan)
    return values


# --- the cache's two operations over its buffers ---------------------------------------------------------------
def _pieces(first: int, stop: int, modulus: int):
    """`(timeline start, timeline stop, slot)` runs of tokens `[first, stop)` in a ring of `modulus` slots."""
    while first < stop:
        slot = first % modulus
        run = min(stop - first, modulus - slot)
        yield first, first + run, slot
        first += run


def write(key: torch.Tensor, value: torch.Tensor, view, dynamic: bool, stats: torch.Tensor) -> bool:
    """Store the new tokens `[view.end, view.end + n)` (`key`/`value` `[batch, kv_heads, n, head_dim]`) in the
    buffers of `view` (a `KVView` before the update): each token that leaves the recent window (R slots; all of
    them without one) is quantized into the codes, once. Static buffers (positions are 0-dim device tensors; one
    slot more than they hold, the last one taking the writes that have nowhere to go) are written without a host
    sync. Returns whether a non-finite input was seen (always True for static buffers, which cannot check
    without a sync).
    """
    states = torch.stack((key, value))
    if view.static:
        _write_static(states, view, dynamic, stats)
        return True
    end, recent = view.end, view.recent
    if recent is None:  # pure FP8: every new token goes straight to the codes
        return _quantize_tokens(states, end, view, dynamic, stats)
    window, n = recent.shape[3], states.shape[3]
    new_fp_start = max(view.fp_start, end + n - window)
    nonfinite = False
    for first, stop, slot in _pieces(view.fp_start, min(new_fp_start, end), window):  # leaving the window
        nonfinite |= _quantize_tokens(recent.narrow(3, slot, stop - first), first, view, dynamic, stats)
    if new_fp_start > end:  # new tokens that are not among the newest `window`
        nonfinite |= _quantize_tokens(states.narrow(3, 0, new_fp_start - end), end, view, dynamic, stats)
    for first, stop, slot in _pieces(max(end, new_fp_start), end + n, window):
        recent.narrow(3, slot, stop - first).copy_(states.narrow(3, first - end, stop - first))
    return nonfinite


def _quantize_tokens(rows: torch.Tensor, first: int, view, dynamic: bool, stats: torch.Tensor) -> bool:
    """`write_stacked` of tokens `[first, first + n)` (`rows`, `[2, batch, kv_heads, n, head_dim]`)."""
    n, slot = rows.shape[3], first - view.offset
    scale = _scale_columns(view)
    return write_stacked(rows, view.codes.narrow(3, slot, n), scale.narrow(3, slot, n) if dynamic else scale,
                         view.fmt, dynamic, stats)  # fmt: skip


def _scale_columns(view) -> torch.Tensor:
    """`view.scales` with a trailing dim, to broadcast against the codes' rows (a view kept in the view's memo:
    making it costs as much as a small op; a compiled graph makes its own)."""
    if torch.compiler.is_compiling():
        return _unsqueezed_scales(view)
    return view.derived(_scale_columns, _unsqueezed_scales)


def _unsqueezed_scales(view) -> torch.Tensor:
    return view.scales.unsqueeze(-1)


def _write_static(states: torch.Tensor, view, dynamic: bool, stats: torch.Tensor) -> None:
    """`write` for static buffers: positions are device tensors, every index is computed, nothing syncs."""
    codes, scales, recent, fmt, end, ring = view.codes, view.scales, view.recent, view.fmt, view.end, view.ring
    n, slots, window = states.shape[3], codes.shape[3] - 1, recent.shape[3] if recent is not None else 0
    device = states.device

    def slot_of(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, t % slots if ring else t, slots)

    def quantize_into(rows: torch.Tensor, index: torch.Tensor) -> None:
        if dynamic:
            row_scale = dynamic_scale(rows, fmt)[..., None]
            scales.index_copy_(3, index, row_scale[..., 0])
        else:
            row_scale = scales[..., None]
        row_codes, clipped, nonfinite = quantize(rows, row_scale, fmt, count_per_row=True)
        stats.add_(torch.stack([clipped, nonfinite], dim=1))
        codes.view(torch.uint8).index_copy_(3, index, row_codes.view(torch.uint8))

    if window:
        # the window's oldest tokens leave it: at most min(n, window) of them, those at or after fp_start
        leaving = end - window + torch.arange(min(n, window), device=device)
        valid = leaving >= view.fp_start
        quantize_into(recent.index_select(3, leaving % window), slot_of(leaving, valid))
    direct = max(n - window, 0)
    if direct:
        t = end + torch.arange(direct, device=device)
        quantize_into(states[:, :, :, :direct], slot_of(t, torch.ones_like(t, dtype=torch.bool)))
    if window:
        kept = end + torch.arange(direct, n, device=device)
        recent.index_copy_(3, kept % window, states[:, :, :, direct:].to(recent.dtype))


def attend(
    query: torch.Tensor,
    view,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` (the last `q_len` tokens of the timeline) over a layer's tokens (`KVView`):
    the visible tokens are decoded, the full-precision ones laid over them, then `attention` runs; returns
    `[batch, q_heads, q_len, head_dim]` in the query's dtype.

    `mask` (bool, True = attend) broadcasts against `[batch, q_heads, q_len, columns]`, its columns being the
    tokens `[end - columns, end)`, or `[0, max_len)` for static buffers.
    """
    keys, values = materialize(view)
    if view.static:
        positions, held = _static_positions(view)
        q_pos = view.end - query.shape[2] + torch.arange(query.shape[2], device=query.device)
        if mask is not None:
            visible = mask.index_select(-1, positions.clamp(0, mask.shape[-1] - 1)) & held
        else:
            visible = (positions <= q_pos[:, None]) & held
            if window is not None:
                visible = visible & (positions > q_pos[:, None] - window)
        mask, window = visible, None
    elif mask is not None:
        first = mask.shape[-1] - keys.shape[2] if view.mask_start is None else view.start - view.mask_start
        mask = mask[..., first : first + keys.shape[2]]
    out = attention(query, keys, values, scaling=scaling, mask=mask, window=window, softcap=softcap, sinks=sinks)
    return out if out.dtype == query.dtype else out.to(query.dtype)  # `to` costs 2 us even when it is a no-op


def materialize(view) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 keys and values `[batch, kv_heads, tokens, head_dim]` of the visible tokens (`[start, end)` in
    order), or of every slot for static buffers (their positions: `_static_positions`)."""
    if view.static:  # every slot, the spare one included: it takes the writes that have nowhere to go
        kv = dequantize_stacked(view.codes, _scale_columns(view), view.fmt, view.has_nan)
        _lay_full_precision(kv, view)
        kv = kv[:, :, :, : view.slots]
    else:
        kv = _timeline(view)
    if view.key_channel_scale is not None:
        kv[0] *= view.key_channel_scale[None, :, None, :]
    keys, values = kv.unbind()
    return keys, values


def _timeline(view) -> torch.Tensor:
    """The fp32 K/V of dynamic buffers' tokens `[start, end)`. When the rows share their sinks (no sinks, or all
    from `start`: no padding), the codes between the sinks and the recent window are decoded straight into the
    result and the full-precision tokens copied beside them; else every code is decoded and the full-precision
    tokens laid over them. Decoding only the codes it needs took a window layer-step from 108 to 103-105 us at
    the tiny Llama's shapes (`benchmarks/host_overhead.py`), from 2.7 to 1.7-2.0 ms at SmolLM2's at 4k tokens;
    a `cat` of the pieces was 98 us at the first but 5.0 ms at the second (one more pass over the result)."""
    start, end = view.start, view.end
    sinks = view.shared_sink_count()
    if sinks is None or not sinks and view.recent is None:
        kv = _decode(view, start, end)
        _lay_full_precision(kv, view)
        return kv
    codes = view.codes
    kv = torch.empty(2, *codes.shape[1:3], end - start, codes.shape[4], dtype=torch.float32, device=codes.device)
    coded_start = start + sinks
    coded_end = end if view.recent is None else min(max(view.fp_start, coded_start), end)
    if sinks:
        kv.narrow(3, 0, sinks).copy_(view.sinks.narrow(3, 0, sinks))
    if coded_end > coded_start:
        _decode(view, coded_start, coded_end, out=kv.narrow(3, sinks, coded_end - coded_start))
    for first, stop, slot in _pieces(coded_end, end, view.recent.shape[3]) if view.recent is not None else ():
        kv.narrow(3, first - start, stop - first).copy_(view.recent.narrow(3, slot, stop - first))
    return kv


def _decode(view, first: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 K/V of the codes of tokens `[first, stop)` (dynamic buffers), into `out` when given."""
    slot, scales = first - view.offset, _scale_columns(view)
    codes = view.codes.narrow(3, slot, stop - first)
    return dequantize_stacked(codes, scales.narrow(3, slot, stop - first) if view.dynamic else scales, view.fmt,
                              view.has_nan, out)  # fmt: skip


def _lay_full_precision(kv: torch.Tensor, view) -> None:
    if view.recent is not None:
        _lay_recent(kv, view)
    if view.sinks is not None:
        _lay_sinks(kv, view)


def _static_positions(view) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's token position and whether it holds a visible token (static buffers)."""
    slot = torch.arange(view.slots, device=view.codes.device)
    if view.ring:  # the latest token of the slot's residue before `end`
        positions = view.end - 1 - (view.end - 1 - slot) % view.slots
    else:
        positions = slot
    return positions, (positions >= view.start) & (positions >= 0) & (positions < view.end)


def _slot(view, t: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The materialized column of static positions `t`: the spare column where `held` is False."""
    return torch.where(held, t % view.slots if view.ring else t, view.slots)


def _lay_recent(kv: torch.Tensor, view) -> None:
    """Replace the decoded codes of the recent window's tokens by their full-precision values."""
    window = view.recent.shape[3]
    if not view.static:
        for lo, hi, slot in _pieces(max(view.fp_start, view.start), view.end, window):
            kv[:, :, :, lo - view.start : hi - view.start] = view.recent[:, :, :, slot : slot + hi - lo]
        return
    t = view.end - window + torch.arange(window, device=kv.device)
    column = _slot(view, t, (t >= view.fp_start) & (t >= view.start) & (t >= 0))
    kv.index_copy_(3, column, view.recent.index_select(3, t % window).float())


def _lay_sinks(kv: torch.Tensor, view) -> None:
    """Replace the decoded codes of each row's sink tokens by their full-precision values."""
    if not view.static:  # the rows' spans are known on the host: one copy per distinct span
        for (first, count), rows in view.sink_spans().items():
            index = torch.tensor(rows, device=kv.device) if len(rows) < kv.shape[1] else slice(None)
            column = slice(first - view.start, first - view.start + count)
            kv[:, index, :, column] = view.sinks[:, index, :, :count].float()
        return
    s = torch.arange(view.sinks.shape[3], device=kv.device)
    t = view.sink_start[:, None] + s  # [batch, S]
    column = _slot(view, t, s < view.sink_count[:, None])
    index = column[None, :, None, :, None].expand(2, -1, kv.shape[2], -1, kv.shape[4])
    kv.scatter_(3, index, view.sinks.float())
