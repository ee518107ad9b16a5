"""Scale schemes: where each layer's K/V scales come from and at which granularity.

A scheme is one small class: `PerHeadScales` holds one K and one V scale per KV head (a per-tensor scale is the
same value on every head) and optionally a per-channel key scale; `PerTokenScales` asks the write for a scale per
token and KV head. `resolve_scales` turns any `scales=` argument into one scheme per layer; a whole model's
per-head scales, as a checkpoint stores them or `calibrate` makes them, are a `KVScales` (`checkpoint.py`).
`MeasuredKeyChannels` (`scales="dynamic_key_channels"`) is per-token scales whose per-channel key scales the layer
measures itself, from the keys it holds when its first token is coded.

All scales follow the OCP e4m3 convention of checkpoints and vLLM: a dequantization multiplier,
`scale = amax / 448`. Formats with another range (e4m3fnuz) convert them with `StorageFormat.ocp_scale_factor`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import torch

from hf_fp8kv.checkpoint import KVScales, check_scale_values, load_checkpoint_scales
from hf_fp8kv.kernels.formats import StorageFormat


MIN_CHANNEL_RATIO = 1 / 256  # floor of a per-channel key scale relative to its head's scale
# scales="dynamic_key_channels" measures a layer's key channels over at least this many tokens (its recent tokens
# and the first update that codes any). Gemma 3 270M's code text, int8, channels from the first N tokens, mean KL
# (benchmarks/recent_quality.py decode mode): N=1 3.9e-2, 16 7.0e-4 (plain int8 7.3e-4), 64 1.0e-4; measured by the
# cache at its default window (129) 7.95e-5 (docs/recent.md)
MIN_MEASURED_TOKENS = 64
# where scales="dynamic_key_channels" is refused, the way to per-channel key scales all the same
CALIBRATE_KEY_CHANNELS = ("calibrate them instead: scales=hf_fp8kv.calibrate(model, texts, tokenizer, "
                          "strategy='token', key_channels=True)")  # fmt: skip


class UncalibratedScalesWarning(UserWarning):
    """The cache fell back to scale 1.0 because no scales were found."""


CALIBRATION_WARNING = (
    "QuantizedFP8Cache: the checkpoint has no KV cache scales, so every layer uses scale 1.0 (uncalibrated). "
    "Values beyond the FP8 range saturate and small ones lose precision. Remedy: pass scales='dynamic' "
    "(per-token-head scales, no calibration needed) or calibrate scales for this model "
    "(scales=hf_fp8kv.calibrate(model, texts, tokenizer))."
)


@dataclass
class PerTokenScales:
    """A scale per token and KV head, computed by the write (`amax / max` of each token's head vector).

    `key_channel` (`[kv_heads, head_dim]`, optional, `calibrate(strategy="token", key_channels=True)`): keys are
    divided by it before their scale is computed, which evens out the channels (int8's step is the row's amax /
    127); attention folds it into the query, as with `PerHeadScales`.
    """

    per_token = True
    granularity: str = "per-token-head"
    source: str = "dynamic"
    key_channel: torch.Tensor | None = None

    def describe(self, which: str) -> str:
        return "per token" + (" x channel" if which == "key" and self.key_channel is not None else "")


@dataclass
class MeasuredKeyChannels(PerTokenScales):
    """Per-token scales with per-channel key scales that the layer measures itself (`scales="dynamic_key_channels"`,
    no calibration pass): when the first of its tokens is coded, from every key it holds then (its recent tokens
    and the update's), as `calibrate(strategy="token", key_channels=True)` computes them from a data set
    (`key_channel_ratios`). They hold until `reset`."""

    granularity: str = "per-token-head + key channels"
    source: str = "dynamic, key channels measured from the first coded keys"

    def describe(self, which: str, channels_measured: bool = True) -> str:
        if which != "key":
            return "per token"
        return "per token x " + ("measured channel" if channels_measured else "channel (not measured yet)")


@dataclass
class PerHeadScales:
    """Fixed K and V scales of one layer, as `[kv_heads]` fp32 tensors (per-tensor = one value repeated).

    `key_channel` (`[kv_heads, head_dim]`, optional) refines the key scale per channel: channel d of head h is
    stored as `k / (key[h] * key_channel[h, d])`; attention folds it into the query at no cost.
    """

    per_token = False
    key: torch.Tensor
    value: torch.Tensor
    granularity: str
    source: str
    key_channel: torch.Tensor | None = None

    def describe(self, which: str) -> str:
        values = self.key if which == "key" else self.value
        text = f"{values[0].item():.4g}" if self.granularity.startswith("per-tensor") else (
            "[" + ", ".join(f"{v:.3g}" for v in values.tolist()) + "]"
        )
        return text + (" x channel" if which == "key" and self.key_channel is not None else "")


LayerScales = Union[PerHeadScales, PerTokenScales]
ScalesArg = Union[str, os.PathLike, float, KVScales, Mapping[int, Any], Sequence[Any]]


def resolve_scales(
    scales: ScalesArg,
    fmt: StorageFormat,
    quantized_layers: Sequence[int],
    num_layers: int,
    kv_heads: int,
    checkpoint: str | None,
) -> tuple[dict[int, LayerScales], bool]:
    """Each quantized layer's scale scheme, and whether the uncalibrated 1.0 fallback was taken.

    `checkpoint`: the model's local directory or Hub name, searched for scales when `scales="auto"`.
    """
    named = isinstance(scales, (str, os.PathLike))
    if named and scales not in ("auto", "dynamic", "dynamic_key_channels"):
        if not os.path.exists(scales):
            raise ValueError(
                f"scales={str(scales)!r}: expected 'auto', 'dynamic', 'dynamic_key_channels', a float, per-layer K/V "
                "scales, KVScales or the path of a scales file"
            )
        scales, named = KVScales.load(scales), False
    if named and scales == "dynamic_key_channels":
        return {i: MeasuredKeyChannels() for i in quantized_layers}, False
    per_token = (named and scales in ("auto", "dynamic")) or (isinstance(scales, KVScales) and scales.dynamic)
    if fmt.per_token_only and not per_token:
        raise ValueError(
            f"kv_cache_dtype={fmt.name!r} computes its scales per token and head: use scales='dynamic' (or "
            "calibrate(..., strategy='token', key_channels=True) for per-channel key scales)"
        )
    if named and (scales == "dynamic" or (scales == "auto" and fmt.per_token_only)):
        return {i: PerTokenScales() for i in quantized_layers}, False
    if scales == "auto":
        found = load_checkpoint_scales(checkpoint) if checkpoint else None
        if found is None:
            return {i: _static(1.0, 1.0, fmt, kv_heads, i, "default 1.0") for i in quantized_layers}, True
        scales = found
    if isinstance(scales, KVScales):
        if scales.dynamic:
            unknown = sorted(i for i in scales.key_channel if not (isinstance(i, int) and 0 <= i < num_layers))
            if unknown:
                raise ValueError(f"key channel scales given for layers {unknown}, but the model has layers "
                                 f"0..{num_layers - 1}")  # fmt: skip
            return {i: _per_token(scales, i, kv_heads) for i in quantized_layers}, False
        return _from_kv_scales(scales, fmt, quantized_layers, num_layers, kv_heads), False
    if isinstance(scales, (int, float)) and not isinstance(scales, bool):
        return {i: _static(scales, scales, fmt, kv_heads, i, "user float") for i in quantized_layers}, False
    return _from_kv_scales(_user_scales(scales, num_layers), fmt, quantized_layers, num_layers, kv_heads), False


def _user_scales(scales: Mapping[int, Any] | Sequence[Any], num_layers: int) -> KVScales:
    """`{layer: (k, v[, source])}` or a list with one `(k, v)` per layer, as `KVScales`."""
    if isinstance(scales, Mapping):
        per_layer = dict(scales)
    elif isinstance(scales, Sequence):
        if len(scales) != num_layers:
            raise ValueError(f"scales has {len(scales)} entries but the model has {num_layers} layers")
        per_layer = dict(enumerate(scales))
    else:
        raise TypeError(f"scales of type {type(scales).__name__} is not supported")
    result = KVScales()
    for i, entry in per_layer.items():
        pair = isinstance(entry, (tuple, list)) or (isinstance(entry, torch.Tensor) and entry.dim() > 0)
        if not pair or len(entry) not in (2, 3):
            raise ValueError(
                f"scales[{i!r}] = {entry!r}: each layer takes a (k_scale, v_scale) pair (each a float or one value "
                "per KV head); for one scale on every layer pass scales=<float>"
            )
        result.key[i], result.value[i] = entry[0], entry[1]
        result.sources[i] = entry[2] if len(entry) > 2 else "user"
    return result


def _from_kv_scales(
    scales: KVScales, fmt: StorageFormat, quantized_layers: Sequence[int], num_layers: int, kv_heads: int
) -> dict[int, PerHeadScales]:
    unknown = sorted(i for i in scales.key if not (isinstance(i, int) and 0 <= i < num_layers))
    if unknown:
        names = ", ".join(scales.names[i][0] for i in unknown if i in scales.names)
        raise ValueError(
            f"scales given for layers {unknown}{f' ({names})' if names else ''}, but the model has layers "
            f"0..{num_layers - 1}"
        )
    missing = [i for i in quantized_layers if i not in scales.key]
    if missing:
        raise ValueError(
            f"scales are missing for layers {missing} (scales found for layers {scales.layers}): give every "
            f"quantized layer a K and a V scale, keep these layers in full precision with skip_layers={missing}, "
            "or use scales='dynamic'"
        )
    resolved = {}
    for i in quantized_layers:
        k_name, v_name = scales.names.get(i, ("k_scale", "v_scale"))
        resolved[i] = _static(
            scales.key[i], scales.value[i], fmt, kv_heads, i, scales.sources.get(i, "user"), (k_name, v_name),
            scales.key_channel.get(i),
        )
    return resolved


def _per_token(scales: KVScales, layer: int, kv_heads: int) -> PerTokenScales:
    """Per-token scales, with the layer's per-channel key scales where `scales` has them."""
    channel = scales.key_channel.get(layer)
    if channel is None:
        return PerTokenScales(source=scales.sources.get(layer, "dynamic (checkpoint kv_cache_scheme)"))
    return PerTokenScales("per-token-head + key channels", scales.sources.get(layer, "user"),
                          _key_channel(channel, layer, kv_heads))  # fmt: skip


def key_channel_ratios(channel_amax: torch.Tensor, reference: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """Per-channel key scales from each channel's max |k| (`[kv_heads, head_dim]`) over `reference` (its head's or
    its layer's max, broadcast): `headroom` x the ratio, within [MIN_CHANNEL_RATIO, 1], rounded up to a power of
    two."""
    ratio = headroom * channel_amax / reference.clamp_min(1e-30)
    return _power_of_two_at_least(ratio.clamp(MIN_CHANNEL_RATIO, 1.0))


def _power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    """The least power of two >= each (positive, finite) element of `x`. Keys divided by a power of two and
    multiplied back are the same bits in any float dtype: the recent and sink tokens, which the dense layers hold
    divided, stay exactly the model's, as the pages hold them (other scales round them in bf16)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype))


def _key_channel(key_channel: Any, layer: int, kv_heads: int) -> torch.Tensor:
    """A validated `[kv_heads, head_dim]` fp32 per-channel key scale."""
    key_channel = check_scale_values(torch.as_tensor(key_channel, dtype=torch.float32), layer, "key channel scale")
    if key_channel.dim() != 2 or key_channel.shape[0] != kv_heads:
        raise ValueError(
            f"layer {layer} key channel scale has shape {tuple(key_channel.shape)}: expected [kv_heads={kv_heads}, "
            "head_dim]"
        )
    return key_channel


def _static(
    key: Any,
    value: Any,
    fmt: StorageFormat,
    kv_heads: int,
    layer: int,
    source: str,
    names: tuple[str, str] = ("k_scale", "v_scale"),
    key_channel: torch.Tensor | None = None,
) -> PerHeadScales:
    k, k_granularity = _as_head_vector(key, kv_heads, layer, names[0])
    v, v_granularity = _as_head_vector(value, kv_heads, layer, names[1])
    granularity = "per-head" if "per-head" in (k_granularity, v_granularity) else "per-tensor"
    if key_channel is not None:
        key_channel = _key_channel(key_channel, layer, kv_heads)
        granularity += " + key channels"
    if fmt.ocp_scale_factor != 1.0:  # the adjusted scales must still be usable (2e38 doubled is inf)
        adjusted = f" x{fmt.ocp_scale_factor:g} ({fmt.name} doubles OCP-calibrated scales)"
        k = check_scale_values(k * fmt.ocp_scale_factor, layer, names[0] + adjusted)
        v = check_scale_values(v * fmt.ocp_scale_factor, layer, names[1] + adjusted)
    return PerHeadScales(k, v, granularity, source, key_channel)


def _as_head_vector(scale: Any, kv_heads: int, layer: int, name: str) -> tuple[torch.Tensor, str]:
    """A scale given as a float or a tensor of 1 or `kv_heads` values (shape `[]`, `[1]`, `[kv_heads]`,
    `[kv_heads, 1, 1]`...), as a validated `[kv_heads]` fp32 tensor."""
    tensor = torch.as_tensor(scale, dtype=torch.float32).detach().cpu()
    heads_only = [n for n in tensor.shape if n != 1] in ([], [kv_heads])
    if tensor.numel() not in (1, kv_heads) or not heads_only:
        raise ValueError(
            f"layer {layer} {name} has shape {tuple(tensor.shape)}: expected one value or one per KV head ({kv_heads})"
        )
    check_scale_values(tensor, layer, name)
    granularity = "per-tensor" if tensor.numel() == 1 else "per-head"
    return tensor.flatten().expand(kv_heads).clone(), granularity
