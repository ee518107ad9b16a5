"""Scale schemes: where each layer's K/V scales come from and at which granularity.

A scheme is one small class. `StaticScales` holds one K and one V scale per KV head (a per-tensor scale is the
same value on every head); `DynamicScales` asks the write kernel for a scale per token and KV head.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import torch

from hf_fp8kv.kernels.formats import StorageFormat

CALIBRATION_WARNING = (
    "QuantizedFP8Cache: the checkpoint has no KV cache scales, so every layer uses scale 1.0 (uncalibrated). "
    "Values beyond the FP8 range saturate and small ones lose precision. Remedy: pass scales='dynamic' "
    "(per-token-head scales, no calibration needed) or calibrate scales for this model."
)


@dataclass
class DynamicScales:
    """Per-token-head scales, computed by the write kernel (`amax / max` of each token's head vector)."""

    granularity: str = "per-token-head"
    source: str = "dynamic"


@dataclass
class StaticScales:
    """Fixed K and V scales of one layer, as `[kv_heads]` fp32 tensors (per-tensor = one value repeated)."""

    key: torch.Tensor
    value: torch.Tensor
    granularity: str
    source: str

    def describe(self, which: str) -> str:
        values = self.key if which == "key" else self.value
        if self.granularity == "per-tensor":
            return f"{values[0].item():.4g}"
        return "[" + ", ".join(f"{v:.3g}" for v in values.tolist()) + "]"


LayerScales = Union[StaticScales, DynamicScales]
ScalesArg = Union[str, float, Mapping[int, Any], Sequence[Any]]


def resolve_scales(
    scales: ScalesArg,
    fmt: StorageFormat,
    quantized_layers: Sequence[int],
    num_layers: int,
    kv_heads: int,
    checkpoint_dir: str | None,
) -> tuple[dict[int, LayerScales], bool]:
    """Each quantized layer's scale scheme, and whether the uncalibrated 1.0 fallback was taken."""
    if fmt.per_token_only and scales not in ("auto", "dynamic"):
        raise ValueError(f"kv_cache_dtype={fmt.name!r} computes its scales per token and head: use scales='dynamic'")
    if isinstance(scales, str):
        if scales == "dynamic" or (scales == "auto" and fmt.per_token_only):
            return {i: DynamicScales() for i in quantized_layers}, False
        if scales != "auto":
            raise ValueError(f"scales={scales!r}: expected 'auto', 'dynamic', a float or per-layer K/V scales")
        found = load_checkpoint_scales(checkpoint_dir) if checkpoint_dir else {}
        if found:
            return _from_per_layer(found, fmt, quantized_layers, num_layers, kv_heads), False
        fallback = {i: _static(1.0, 1.0, fmt, kv_heads, i, "default 1.0") for i in quantized_layers}
        return fallback, True
    if isinstance(scales, (int, float)) and not isinstance(scales, bool):
        return {i: _static(scales, scales, fmt, kv_heads, i, "user float") for i in quantized_layers}, False
    if isinstance(scales, Mapping):
        per_layer = dict(scales)
    elif isinstance(scales, Sequence):
        if len(scales) != num_layers:
            raise ValueError(f"scales has {len(scales)} entries but the model has {num_layers} layers")
        per_layer = dict(enumerate(scales))
    else:
        raise TypeError(f"scales of type {type(scales).__name__} is not supported")
    return _from_per_layer(per_layer, fmt, quantized_layers, num_layers, kv_heads, source="user"), False


def _from_per_layer(
    per_layer: Mapping[int, Any],
    fmt: StorageFormat,
    quantized_layers: Sequence[int],
    num_layers: int,
    kv_heads: int,
    source: str | None = None,
) -> dict[int, LayerScales]:
    unknown = sorted(i for i in per_layer if not (isinstance(i, int) and 0 <= i < num_layers))
    if unknown:
        raise ValueError(f"scales given for layers {unknown}, but the model has layers 0..{num_layers - 1}")
    missing = [i for i in quantized_layers if i not in per_layer]
    if missing:
        raise ValueError(f"scales are missing for layers {missing}: give every quantized layer a K and a V scale")
    resolved = {}
    for i in quantized_layers:
        entry = per_layer[i]
        key, value = entry[0], entry[1]
        entry_source = source or (entry[2] if len(entry) > 2 else "user")
        resolved[i] = _static(key, value, fmt, kv_heads, i, entry_source)
    return resolved


def _static(key: Any, value: Any, fmt: StorageFormat, kv_heads: int, layer: int, source: str) -> StaticScales:
    k, k_granularity = _as_head_vector(key, kv_heads, layer, "k_scale")
    v, v_granularity = _as_head_vector(value, kv_heads, layer, "v_scale")
    granularity = "per-head" if "per-head" in (k_granularity, v_granularity) else "per-tensor"
    return StaticScales(k * fmt.ocp_scale_factor, v * fmt.ocp_scale_factor, granularity, source)


def _as_head_vector(scale: Any, kv_heads: int, layer: int, name: str) -> tuple[torch.Tensor, str]:
    """A scale given as a float or a tensor of 1 or `kv_heads` values, as a validated `[kv_heads]` fp32 tensor."""
    tensor = torch.as_tensor(scale, dtype=torch.float32).detach().cpu()
    if tensor.numel() not in (1, kv_heads):
        raise ValueError(
            f"layer {layer} {name} has shape {tuple(tensor.shape)}: expected one value or one per KV head ({kv_heads})"
        )
    bad = [v for v in tensor.flatten().tolist() if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"layer {layer} {name} must be finite and > 0, got {bad[0]}")
    granularity = "per-tensor" if tensor.numel() == 1 else "per-head"
    return tensor.flatten().expand(kv_heads).clone(), granularity


_LLM_COMPRESSOR_NAME = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.self_attn\.([kv])_scale$")


def load_checkpoint_scales(checkpoint_dir: str) -> dict[int, tuple[torch.Tensor, torch.Tensor, str]]:
    """K/V scales stored in a local checkpoint's safetensors under llm-compressor's names.

    Returns `{layer: (k_scale, v_scale, source)}`; empty when the directory has none. Never unpickles, never
    touches the network. A layer with only one of the two gets the max of the two for both (vLLM's rule).
    """
    from safetensors import safe_open

    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        return {}
    found: dict[int, dict[str, tuple[torch.Tensor, str]]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                match = _LLM_COMPRESSOR_NAME.match(name)
                if match:
                    layer, which = int(match.group(1)), match.group(2)
                    found.setdefault(layer, {})[which] = (handle.get_tensor(name).float(), name)
    result = {}
    for layer, entries in found.items():
        if len(entries) == 2:
            (k, k_name), (v, _) = entries["k"], entries["v"]
            result[layer] = (k, v, k_name.rsplit(".", 1)[0] + ".{k,v}_scale")
        else:
            (only, name) = next(iter(entries.values()))
            warnings.warn(f"{name} has no {'v' if 'k_scale' in name else 'k'} counterpart: using it for K and V")
            result[layer] = (only, only, name)
    return result
