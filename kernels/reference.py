"""Torch reference of every kernel: the test oracle of the Triton kernels and the CPU path of the cache.

Conventions (vLLM's): a scale is a dequantization multiplier, `stored = saturate(x / scale)`,
`value = stored * scale`. Scales are fp32 and broadcast against `[batch, kv_heads, tokens]`: a static
scale has shape `[1, kv_heads, 1]`, a per-token-head (dynamic) scale `[batch, kv_heads, tokens]`.

Policy for values outside the format: +-inf and finite values beyond +-max saturate to +-max; those beyond
`fmt.clip_bound` (where rounding alone would not bring them back to max) are counted as clipped. NaN is
written as the format's NaN code (0 in int8) and never counted; the attention's exact decode covers finite
codes only, so a NaN code reads back as 480 (e4m3fn) or -0 (e4m3fnuz) on the CPU path and in the Triton
kernels (e5m2 keeps NaN). Only a model that already produced NaN can reach this.
"""

from __future__ import annotations

import math

import torch

from .formats import StorageFormat


def dynamic_scale(x: torch.Tensor, fmt: StorageFormat) -> torch.Tensor:
    """Per-row scale `amax(|x|) / max` over the last dim (non-finite values ignored, 1.0 for an all-zero row)."""
    amax = x.float().abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=-1)
    return torch.where(amax > 0, amax / fmt.max, 1.0)


def quantize(
    x: torch.Tensor, scale: torch.Tensor, fmt: StorageFormat, count_per_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of `x / scale` in `fmt` (saturated, round to nearest even) and the number of clipped values
    (one count per index of `x`'s first dim with `count_per_row`).

    `scale` broadcasts against `x[..., :1]`, i.e. it has the shape of `x` without its last dim plus a trailing 1.
    """
    scaled = x.float() / scale
    beyond = scaled.abs() > fmt.clip_bound
    clipped = beyond.flatten(1).sum(1) if count_per_row else beyond.sum()
    scaled = scaled.clamp(-fmt.max, fmt.max)
    if fmt.is_float:
        return scaled.to(fmt.dtype), clipped
    return torch.round(torch.nan_to_num(scaled, nan=0.0)).to(fmt.dtype), clipped


def codes_to_float(codes: torch.Tensor, fmt: StorageFormat, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of `codes`: exactly `codes.float()` for every finite code."""
    values = codes_to_scaled_float(codes, fmt, out)
    return values.mul_(fmt.fp16_factor) if fmt.fp16_factor != 1.0 else values


def codes_to_scaled_float(codes: torch.Tensor, fmt: StorageFormat, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of `codes` divided by `fmt.fp16_factor` (exact), for callers that fold the factor into
    a scale. Float formats are decoded through int16 bit operations and an fp16 view (see `StorageFormat`)."""
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if not fmt.is_float:
        return out.copy_(codes)
    bits = _scratch(codes.shape, torch.int16, codes.device).copy_(codes.view(torch.int8))
    bits.bitwise_left_shift_(fmt.fp16_shift)
    if fmt.fp16_shift == 7:  # e4m3: the sign landed on bit 14 too (sign extension); keep it on bit 15 only
        bits.bitwise_and_(~0x4000)
    return out.copy_(bits.view(torch.float16))


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(shape: torch.Size, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """A reused buffer: fresh multi-MB allocations cost page faults that took longer than the decode itself
    (35 MB: 17 ms to allocate and fill vs 2 ms into a reused buffer, on this project's 2-core CPU)."""
    key = (dtype, torch.device(device), slot)
    numel = math.prod(shape)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        # grown by a quarter at least, so a cache that grows a token per step reallocates rarely;
        # a normal (not inference) tensor can be written both inside and outside inference mode
        numel_held = max(numel, buffer.numel() * 5 // 4) if buffer is not None else numel
        with torch.inference_mode(False):
            buffer = _SCRATCH[key] = torch.empty(numel_held, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: StorageFormat) -> torch.Tensor:
    """`codes * scale` in fp32, `scale` broadcasting against `codes[..., :1]`."""
    return codes_to_float(codes, fmt) * scale


def _per_token(scale: torch.Tensor) -> bool:
    return scale.dim() == 3 and scale.shape[-1] > 1


def attention(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    fmt: StorageFormat,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_channel_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` over quantized keys and values; returns `[batch, q_heads, q_len, head_dim]`.

    query: `[batch, q_heads, q_len, head_dim]`; key/value codes: `[batch, kv_heads, kv_len, head_dim]`, the
    last `q_len` of which are the query tokens' own (bottom-right alignment); scales broadcast against
    `[batch, kv_heads, kv_len]`. `mask` (bool, True = attend) broadcasts against `[batch, 1, q_len, kv_len]`
    and replaces the causal/window rule; without it query i sees key j iff `j <= kv_len - q_len + i` and,
    with `window`, `j > kv_len - q_len + i - window`. `softcap` caps scores as `softcap * tanh(s / softcap)`;
    `sinks` (`[q_heads]`, gpt-oss) add one logit per head to the softmax denominator. `key_channel_scale`
    (`[kv_heads, head_dim]`) is a static per-channel key scale, folded into the query.
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key_codes.shape[1], key_codes.shape[2]
    group = q_heads // kv_heads
    if q_heads != group * kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the cache's {kv_heads} KV heads")
    # GQA: every KV head serves its `group` query heads as one batch of rows, with no copy of the keys
    q = query.float().reshape(batch, kv_heads, group * q_len, head_dim) * (scaling * fmt.fp16_factor)
    if key_channel_scale is not None:
        q = q * key_channel_scale.float()[None, :, None, :]
    if not _per_token(key_scale):
        q = q * key_scale.float().reshape(-1, kv_heads, 1, 1)
    keys = codes_to_scaled_float(key_codes, fmt, _scratch(key_codes.shape, torch.float32, key_codes.device, 1))
    scores = torch.matmul(q, keys.transpose(-1, -2))
    if _per_token(key_scale):
        scores = scores * key_scale.float()[:, :, None, :]
    scores = scores.reshape(batch, kv_heads, group, q_len, kv_len)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None and (q_len > 1 or window is not None):
        mask = causal_mask(q_len, kv_len, window, causal, device=query.device)
    if mask is not None:
        scores = scores.masked_fill(~_mask_5d(mask, kv_heads), -math.inf)
    if sinks is not None:
        sink = sinks.float().reshape(1, kv_heads, group, 1, 1).expand(batch, -1, -1, q_len, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.nan_to_num_(0.0)  # a fully masked row (left padding) attends to nothing
    if sinks is not None:
        probs = probs[..., :kv_len]
    probs = probs.reshape(batch, kv_heads, group * q_len, kv_len)
    if _per_token(value_scale):
        probs = probs * value_scale.float()[:, :, None, :]
    values = codes_to_scaled_float(value_codes, fmt, _scratch(value_codes.shape, torch.float32, value_codes.device, 1))
    out = torch.matmul(probs, values) * fmt.fp16_factor
    if not _per_token(value_scale):
        out = out * value_scale.float().reshape(-1, kv_heads, 1, 1)
    return out.reshape(batch, q_heads, q_len, head_dim).to(query.dtype)


def causal_mask(
    q_len: int, kv_len: int, window: int | None = None, causal: bool = True, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Bottom-right aligned causal (and sliding-window) mask `[q_len, kv_len]`, True = attend."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos if causal else torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def _mask_5d(mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A `[.., q_len, kv_len]` mask broadcastable over `[batch, kv_heads, group, q_len, kv_len]`."""
    if mask.dim() == 2:
        return mask
    if mask.shape[1] == 1:  # [batch, 1, q, kv]: the same for every head
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, -1, *mask.shape[-2:])
