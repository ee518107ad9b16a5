"""The oracle: the slow, obviously right definition of what every kernel computes. Tests hold the CPU path
(`cpu.py`) and the Triton kernels to it; nothing in the cache runs it.

Conventions (vLLM's): a scale is a dequantization multiplier, `stored = saturate(x / scale)`,
`value = stored * scale`. Scales are fp32 and broadcast against `[..., tokens]`: one value per KV head, or (per
token) one per token and KV head.

Policy for values outside the format: +-inf and finite values beyond +-max saturate to +-max; those beyond
`fmt.clip_bound` (where rounding alone would not bring them back to max) are counted as clipped. NaN is written
as the format's NaN code (0 in int8, which has none) and reads back as NaN, on every backend; NaN and +-inf
inputs are counted as non-finite. A per-token scale ignores non-finite values. A token no query row may see (a
padded row's slot, one outside the sliding window) contributes nothing, whatever its slot holds.

`write` and `attend` go token by token over a layer's buffers (`KVView`): which buffer holds token t, and what
it holds, is spelled out in `token_kv`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .formats import FORMATS, TINY_SCALE, StorageFormat
from .rotation import hadamard
from .view import KVView, coded_end, slot_codes

QUERY_BLOCK = 256  # query rows per block of the explicit-softmax path: its memory stays linear in the prompt


# --- values -------------------------------------------------------------------------------------------------------
def dynamic_scale(x: torch.Tensor, fmt: StorageFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row scale over the last dim: `max(amax(|finite x|) / fmt.row_max, TINY_SCALE)`, as a `dtype` buffer
    holds it: rounded up to the next `dtype` value (never down, so that `x / scale` stays within the format's
    range). Returned in fp32."""
    scale = (x.float().abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=-1) / fmt.row_max).clamp_min(TINY_SCALE)
    if dtype == torch.bfloat16:
        return round_up_to_bf16(scale)
    held = scale.to(dtype)
    return torch.where(held.float() < scale, torch.nextafter(held, torch.full_like(held, math.inf)), held).float()


def round_up_to_bf16(scale: torch.Tensor) -> torch.Tensor:
    """Positive finite fp32 `scale` rounded up to a bf16 value (in fp32): the bits past bf16's carried up, then
    dropped (a compiled graph would drop a round trip through bf16)."""
    return ((scale.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)


SEARCH_ERROR_BITS = 10  # a searched scale's error terms: |code-unit error| <= half the top code step = 2^10
SEARCH_WEIGHT_MAX = 255  # a channel's error weight: an integer in [0, 255]
MAX_SEARCH_ELEMENTS = 2**22  # elements of a search's candidates at once (16 MiB of fp32)


def searched_scale(
    x: torch.Tensor, fmt: StorageFormat, dtype: torch.dtype, candidates: int, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row scale over the last dim, searched within one octave: of `candidates` scales from `dynamic_scale`'s
    `s0` up (`s0`'s fp32 bits plus `i * 2^23 / candidates`, `i < candidates`: `candidates` evenly spread
    significands of each binade, every one a `dtype` value, all in `[s0, 2 s0)`), the one whose codes have the
    least weighted squared error, ties to the smallest. Returned in fp32; `candidates=1` is `dynamic_scale`.

    The error is integer arithmetic, so that every path finds the same scale whatever the order of its sums:
    each element's error in code units `x / s - code value` (0 for a non-finite `x`), times 2^SEARCH_ERROR_BITS
    over half the format's top code step, truncated (`q`); the row's error is `sum_c weight_c q_c^2` (int64,
    `weight` broadcasting against `x`: integers in [0, SEARCH_WEIGHT_MAX], None: 1) times `m^2 4^b`, `m` the top 8
    bits of the candidate's significand and `b` its binade above `s0`'s (the code-unit error times the scale:
    exact for bf16 scales). `x`: `[..., rows, D]`; all candidates at once, `MAX_SEARCH_ELEMENTS` at a time."""
    if candidates & (candidates - 1) or not 1 <= candidates <= 128:
        raise ValueError(f"candidates={candidates}: expected a power of two from 1 to 128")
    base = dynamic_scale(x, fmt, dtype)
    if candidates == 1:
        return base
    base_bits = base.view(torch.int32)[..., None]
    bits = base_bits + torch.arange(candidates, dtype=torch.int32, device=x.device) * (2**23 // candidates)
    scales = bits.view(torch.float32)  # [..., rows, candidates]
    significand = (((bits >> 16) & 0x7F) | 0x80).long()
    factor = significand * significand << (2 * ((bits >> 23) - (base_bits >> 23))).long()
    x = x.float().where(torch.isfinite(x), 0.0)
    weight = torch.ones((), dtype=torch.int32, device=x.device) if weight is None else weight.to(torch.int32)
    weight = weight.expand(x.shape)
    unit_scale = 2.0**SEARCH_ERROR_BITS / (fmt.clip_bound - fmt.max)  # a power of two
    error = torch.empty(bits.shape, dtype=torch.int64, device=x.device)
    chunk = max(MAX_SEARCH_ELEMENTS // (candidates * x[..., :1, :].numel()), 1)
    for start in range(0, x.shape[-2], chunk):
        rows = slice(start, start + chunk)
        row_x, row_scales = x[..., rows, None, :], scales[..., rows, :, None]  # [..., r, 1, D], [..., r, n, 1]
        scaled = row_x / row_scales  # (in range: no saturation, no count, as `quantize` rounds it)
        rounded = scaled.to(fmt.dtype).float() if fmt.is_float else scaled.round()
        term = ((scaled - rounded) * unit_scale).to(torch.int32)
        error[..., rows, :] = (term * term * weight[..., rows, None, :]).sum(-1, dtype=torch.int64)
    return scales.gather(-1, (error * factor).argmin(-1, keepdim=True))[..., 0]


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


# --- attention ----------------------------------------------------------------------------------------------------
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
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` `[batch, q_heads, q_len, D]` over full-precision `keys`/`values`
    `[batch, kv_heads, kv_len, D]` (GQA: each KV head serves `q_heads / kv_heads` query heads); returns
    `[batch, q_heads, q_len, D]` in fp32.

    `mask` (bool, True = attend) broadcasts against `[batch, q_heads, q_len, kv_len]` and replaces the causal
    rule; without it query i sees key j iff `j <= kv_len - q_len + i` (and, with `window`,
    `j > kv_len - q_len + i - window`). `softcap` caps scores as `softcap * tanh(s / softcap)`; `sink_logits`
    (`[q_heads]`, gpt-oss) add one logit per head to the softmax denominator. A row that sees nothing gives 0; a
    key no row sees contributes nothing. Memory stays linear in `kv_len`: sdpa (a flash kernel on CPU) where it
    applies, else blocks of queries.
    """
    q_heads, q_len = query.shape[1], query.shape[2]
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the cache's {kv_heads} KV heads")
    query, keys, values = query.float(), keys.float(), values.float()
    if mask is None and (window is not None or 1 < q_len < kv_len):
        mask = causal_mask(q_len, kv_len, window, query.device)
    if mask is not None:
        keys, values = without_unseen(keys, values, mask)
    if softcap is None and sink_logits is None:
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
        if sink_logits is not None:
            sink = sink_logits.float().reshape(1, q_heads, 1, 1).expand(*scores.shape[:3], 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a fully masked row attends to nothing
        out[:, :, rows] = probs[..., :kv_len] @ values
    return out


E4M3 = FORMATS["fp8_e4m3"]  # the FP8 dots' operand format


def fp8_terms(x: torch.Tensor, scale: torch.Tensor | float, terms: int = 1) -> torch.Tensor:
    """`x` as an FP8 dot takes it: `x / scale` in e4m3 (3 mantissa bits), times `scale` again; with `terms=2` plus
    a second e4m3 term holding 16x what the first leaves (about 8 bits: what a more precise kernel would pay a
    second dot for)."""
    x = x.float() / scale
    high = x.to(torch.float8_e4m3fn).float()
    if terms == 2:
        high = high + ((x - high) * 16.0).to(torch.float8_e4m3fn).float() / 16.0
    return high * scale


def fp8_dots_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    fp8_pv: bool = True,
    terms: int = 1,
    block: int = 64,
    rotate: bool = False,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention` (causal, or `mask`) with the FP8 prefill's arithmetic (`triton_attention.fp8_dots`), tile by
    tile as the kernel runs it: each query row in e4m3 under a scale mapping its amax to 448, scores from exact
    products; the online softmax over `block`-token tiles and, with `fp8_pv`, each tile's probabilities (relative
    to the running max) times 256 in e4m3 for the values' dot. `terms=2`: both operands as two e4m3 terms
    (`fp8_terms`), an alternative the benchmark measures. `keys`/`values` as given: the cache's e4m3 codes times
    their scales are exact in fp32. `rotate`: query, keys and values times the Hadamard matrix first (rotated
    codes: the query is rounded to e4m3 rotated), the output rotated back. fp32 `[batch, q_heads, q_len, D]`.

    `value_scales` `[batch, kv_heads, kv_len]`: per-token V scales (0: a token held in full precision). The
    e4m3 operand is then the probabilities times the scales, the values' dot runs over `values / scale` (the
    codes), and the running max is that of `score + log(scale / 256)` (as `triton_common.attend_tile`'s). The
    full-precision tokens come after the coded ones, as in the kernels: their scores from the query as it came,
    their probabilities unrounded."""
    if rotate:
        out = fp8_dots_attention(hadamard(query), hadamard(keys), hadamard(values), scaling=scaling, mask=mask,
                                 fp8_pv=fp8_pv, terms=terms, block=block, value_scales=value_scales)  # fmt: skip
        return hadamard(out)
    q_heads, q_len, kv_heads, kv_len = query.shape[1], query.shape[2], keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    exact_query = query.float()
    query = fp8_terms(exact_query, exact_query.abs().amax(-1, keepdim=True).clamp_min(1e-30) / E4M3.max, terms)
    if mask is None:
        mask = causal_mask(q_len, kv_len, device=query.device)
    passes = [(mask, query, None)]  # (the columns read, the query, their V scales)
    if value_scales is not None:  # the coded tokens, then the full-precision ones (as the kernels read them)
        value_scales = value_scales.float().repeat_interleave(group, 1)[:, :, None, :]  # [batch, q_heads, 1, kv_len]
        coded = value_scales > 0
        values = values / torch.where(coded, value_scales, 1.0).transpose(-1, -2)
        passes = [(mask & coded, query, value_scales), (mask & ~coded, exact_query, None)]
    m = torch.full(query.shape[:3], -math.inf, device=query.device)
    l = torch.zeros(query.shape[:3], device=query.device)
    acc = torch.zeros_like(query)
    for seen, pass_query, scales in passes:
        for first in range(0, kv_len, block):
            tile = slice(first, first + block)
            scores = pass_query @ keys[:, :, tile].transpose(-1, -2) * scaling
            scores = scores.masked_fill(~seen[..., tile], -math.inf)
            weighted = scores
            if fp8_pv and scales is not None:
                weighted = scores + torch.log(scales[..., tile].clamp_min(2.0**-64) / 256.0)
            m_new = torch.maximum(m, weighted.amax(-1))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(scores - m_safe[..., None])
            l = l * alpha + p.sum(-1)
            if scales is not None:  # the codes' dot: the probabilities times their tokens' scales
                p = fp8_terms(p * scales[..., tile], 1.0, terms) if fp8_pv else p * scales[..., tile]
            elif fp8_pv and value_scales is None:
                p = fp8_terms(p, 1 / 256.0, terms)
            acc = acc * alpha[..., None] + p @ values[:, :, tile]
            m = m_new
    return torch.where(l[..., None] > 0, acc / l.clamp_min(1e-30)[..., None], 0.0)


def without_unseen(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys`/`values` with zeros in the columns no query row may see (padding, slots outside the window): a
    masked column contributes exactly nothing, where a NaN or inf there would reach every row (0 x NaN)."""
    seen = mask.any(dim=-2)  # [..., columns]
    if seen.dim() == 3 and seen.shape[1] not in (1, keys.shape[1]):  # one row per query head: per KV head
        seen = seen.unflatten(1, (keys.shape[1], -1)).any(dim=2)
    if not torch.compiler.is_compiling() and bool(seen.all()):
        return keys, values
    seen = seen[..., None]
    return keys.where(seen, 0.0), values.where(seen, 0.0)


# --- a layer's buffers, token by token ---------------------------------------------------------------------------
def write(key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor) -> bool:
    """Store the new tokens `[end, end + n)` (`key`/`value` `[batch, kv_heads, n, head_dim]`) in the buffers of
    `view` (as it was before the update), token by token: a token among the newest `R` (the recent buffer's
    slots) goes to the recent buffer; one that leaves them (or never enters them) is quantized into its code
    slot, once (times the Hadamard matrix with `view.rotate`), with a per-token scale computed from it or the view's
    fixed scale. Adds clipped and non-finite counts to `stats` (int64 `[2 (keys, values), 2]`: of the values
    quantized, rotated ones with `view.rotate`); returns whether a quantized token was non-finite."""
    end, recent_start = int(view.end), int(view.recent_start)
    window = view.recent.shape[3] if view.recent is not None else 0
    new = torch.stack((key, value)).float()
    n = new.shape[3]
    new_recent_start = coded_end(end, recent_start, n, window)
    nonfinite = False
    for t in range(recent_start, new_recent_start):  # leaving the recent buffer, or never entering it
        if not view.ring and t < view.offset:  # before the first slot: it left a sliding window, nobody reads it
            continue
        x = view.recent[:, :, :, t % window].float() if t < end else new[:, :, :, t - end]
        nonfinite |= _quantize_token(x, t, view, stats)
    for t in range(max(end, new_recent_start), end + n):
        view.recent[:, :, :, t % window] = new[:, :, :, t - end].to(view.recent.dtype)
    return nonfinite


def _quantize_token(x: torch.Tensor, t: int, view: KVView, stats: torch.Tensor) -> bool:
    """Quantize token t's `x` `[2, batch, kv_heads, head_dim]` (rotated first with `view.rotate`) into its code
    slot."""
    slot = _code_slot(view, t)
    if view.rotate:
        x = hadamard(x)
    if view.per_token:
        scale = token_scale(x[..., None, :], view)[..., 0]
        view.scales[:, :, :, slot] = scale
    else:
        scale = view.scales[..., 0]
    codes, clipped, nonfinite = quantize(x, scale[..., None], view.fmt, count_per_row=True)
    for stored, new in zip(slot_codes(view.codes, slot, view.value_tiled), codes):
        stored.copy_(new)
    stats[:, 0] += clipped.to(stats.device)
    stats[:, 1] += nonfinite.to(stats.device)
    return bool(nonfinite.any())


def token_scale(rows: torch.Tensor, view: KVView) -> torch.Tensor:
    """The per-token scales of stacked K/V `rows` (`[2, batch, kv_heads, tokens, head_dim]`, rotated already) as
    `view` writes them: searched (`view.scale_search`, weighted by `search_weights(view.search_energy)`), else
    `dynamic_scale`."""
    if view.scale_search > 1:
        weight = search_weights(view.search_energy)
        return searched_scale(rows, view.fmt, view.scales.dtype, view.scale_search, weight)
    return dynamic_scale(rows, view.fmt, view.scales.dtype)


def search_weights(energy: torch.Tensor) -> torch.Tensor:
    """A search's integer error weights for stacked K/V rows (int32 `[2, 1, kv_heads, 1, head_dim]`) from the
    queries' energy per KV head and channel (`[kv_heads, head_dim]`, `hf_fp8kv/scale_search.py`): the keys' each
    channel's energy over its head's largest times SEARCH_WEIGHT_MAX, rounded (1 while a head has none); the
    values' 1."""
    largest = energy.amax(-1, keepdim=True)
    keys = torch.where(largest > 0, (energy * (SEARCH_WEIGHT_MAX / largest)).round(), 1.0)
    return torch.stack((keys, torch.ones_like(keys)))[:, None, :, None, :].to(torch.int32)


def query_energy(query: torch.Tensor, kv_heads: int, key_channel_scale: torch.Tensor | None = None,
                 rotate: bool = False) -> torch.Tensor:  # fmt: skip
    """The squares of `query` (`[batch, q_heads, q_len, head_dim]`) summed per KV head and channel, in the space the
    keys are coded in: times the per-channel key scales (`[kv_heads, head_dim]`; `q.k = (q c).(k / c)`), rotated
    with the codes (`q.k = (qH).(kH)`). fp32 `[kv_heads, head_dim]`: a searched write's weights come from their
    running sum (`search_weights`)."""
    query = query.float().unflatten(1, (kv_heads, -1))
    if key_channel_scale is not None:
        query = query * key_channel_scale[:, None, None, :]
    if rotate:
        query = hadamard(query)
    return query.square().sum((0, 2, 3))


def _code_slot(view: KVView, t: int) -> int:
    return t % view.slots if view.ring else t - view.offset


def visible_positions(view: KVView) -> range:
    """The tokens the view serves: `[start, end)`, of a ring from the last `slots` before `recent_start` on."""
    start, end = int(view.start), int(view.end)
    return range(max(start, int(view.recent_start) - view.slots) if view.ring else start, end)


def token_kv(view: KVView, t: int, row: int) -> torch.Tensor:
    """Token t of batch row `row`, `[2, kv_heads, head_dim]` in fp32: from the sinks if it is one of the row's
    sink tokens, from the recent buffer at or after `recent_start`, else its codes times its scale, but for the
    heads that hold it among their outlier tokens (`outlier_pos`), which read it from `outliers`; keys times
    the per-channel key scale, which every stored key was divided by."""
    keys, values = _stored_kv(view, t, row)
    if view.key_channel_scale is not None:
        keys = keys * view.key_channel_scale.float()
    return torch.stack((keys, values))


def _stored_kv(view: KVView, t: int, row: int) -> torch.Tensor:
    kv = _kept_kv(view, t, row)
    if view.outliers is not None:  # a head's outlier token: from the outlier buffer
        kv = kv.clone()
        for head, slots in enumerate(view.outlier_pos[row] == t):
            if slots.any():
                kv[:, head] = view.outliers[:, row, head, int(slots.nonzero()[0])].float()
    return kv


def _is_sink(view: KVView, t: int, row: int) -> bool:
    """Whether token t is one of row `row`'s sink tokens (held in the sink buffer)."""
    if view.sinks is None or view.sink_start is None:
        return False
    first = int(view.sink_start[row])
    return first <= t < first + int(view.sink_count[row])


def _is_recent(view: KVView, t: int) -> bool:
    """Whether token t is held in the recent buffer."""
    return view.recent is not None and t >= int(view.recent_start)


def _kept_kv(view: KVView, t: int, row: int) -> torch.Tensor:
    if _is_sink(view, t, row):
        return view.sinks[:, row, :, t - int(view.sink_start[row])].float()
    if _is_recent(view, t):
        return view.recent[:, row, :, t % view.recent.shape[3]].float()
    slot = _code_slot(view, t)
    scale = view.scales[:, min(row, view.scales.shape[1] - 1), :, slot if view.per_token else 0]
    codes = torch.stack(slot_codes(view.codes, slot, view.value_tiled))[:, row]
    values = dequantize(codes, scale[..., None], view.fmt)
    return hadamard(values) if view.rotate else values


def materialize(view: KVView) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys and values `[batch, kv_heads, tokens, head_dim]` of the visible tokens, in order."""
    positions = visible_positions(view)
    batch, kv_heads, head_dim = view.codes.shape[1], view.codes.shape[2], view.codes.shape[4]
    kv = torch.zeros(2, batch, kv_heads, len(positions), head_dim, device=view.codes.device)
    for column, t in enumerate(positions):
        for row in range(batch):
            kv[:, row, :, column] = token_kv(view, t, row)
    return kv[0], kv[1]


def value_scales(view: KVView) -> torch.Tensor:
    """Per-token V scales `[batch, kv_heads, tokens]` of the visible tokens (`materialize`'s columns) of a view
    with per-token scales; 0 for a token held in full precision (a sink, recent or outlier token)."""
    positions = visible_positions(view)
    scales = torch.zeros(view.codes.shape[1], view.codes.shape[2], len(positions), device=view.codes.device)
    for column, t in enumerate(positions):
        for row in range(scales.shape[0]):
            if _is_sink(view, t, row) or _is_recent(view, t):
                continue
            scales[row, :, column] = view.scales[1, row, :, _code_slot(view, t)].float()
            if view.outliers is not None:
                scales[row, :, column] *= ~(view.outlier_pos[row] == t).any(-1)
    return scales


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
    """Attention of `query` (the last `q_len` tokens of the timeline) over the tokens a layer serves; returns
    `[batch, q_heads, q_len, head_dim]` in the query's dtype.

    `mask` (bool, True = attend) broadcasts against `[batch, q_heads, q_len, columns]`, its columns being the
    positions `[end - columns, end)` (or from `mask_start`), or `[0, max_len)` for static buffers."""
    keys, values = materialize(view)
    positions = torch.tensor(visible_positions(view), device=query.device)
    if mask is not None:
        first = 0 if view.static else view.mask_start if view.mask_start is not None else int(view.end) - mask.shape[-1]
        mask = mask.index_select(-1, positions - first)
    else:
        mask = causal_mask(query.shape[2], int(view.end), window, query.device)[:, positions]
    out = attention(query, keys, values, scaling=scaling, mask=mask, window=None, softcap=softcap,
                    sink_logits=sink_logits)  # fmt: skip
    return out.to(query.dtype)
