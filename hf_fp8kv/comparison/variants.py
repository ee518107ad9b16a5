"""What a comparison runs: variants (a name, a cache factory, a description), the built-in ones, and how names,
factories and `QuantizedFP8Cache` arguments resolve to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import Cache

from hf_fp8kv import compat
from hf_fp8kv.cache import QuantizedFP8Cache

CacheFactory = Callable[[torch.nn.Module], Cache]
VariantSpec = Union[str, CacheFactory, Mapping[str, Any]]
REFERENCE = "native"
HF_FP8 = "hf_quantized_fp8"
# The configuration the report recommends: its first lines say what it gains against REFERENCE and HF_FP8.
RECOMMENDED = "fp8_recent"


@dataclass(frozen=True)
class Variant:
    """A named way to build a fresh cache for a model."""

    name: str
    make_cache: CacheFactory
    description: str


def _ours(name: str, note: str = "", /, **kwargs: Any) -> Variant:
    """A `QuantizedFP8Cache(model, **kwargs)` variant, described by that call (and `note`)."""
    call = "QuantizedFP8Cache(" + ", ".join(["model", *(f"{k}={v!r}" for k, v in kwargs.items())]) + ")"
    return Variant(name, lambda model: QuantizedFP8Cache(model, **kwargs), f"{call}: {note}" if note else call)


BUILTIN_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(REFERENCE, lambda model: DynamicCache(config=model.config), "transformers DynamicCache, model dtype"),
        _ours(RECOMMENDED, "e4m3, a scale per token and KV head, the newest 128 and first 4 tokens in the model's "
              "dtype, the defaults; no calibration", scales="dynamic"),
        _ours("fp8_per_token_head", "e4m3, a scale per token and KV head on every token (vLLM's), no calibration",
              scales="dynamic", recent_tokens=0, sink_tokens=0),
        _ours("int8_per_token_head", "int8, a scale per token and KV head", kv_cache_dtype="int8_per_token_head"),
        _ours("fp8_recent_searched", "the recommended configuration with each coded token's scale searched among 16 "
              "(docs/recent.md); the same bytes", scales="dynamic", scale_search=16),
        _ours("int8_key_channels", "int8, a scale per token and KV head, keys divided first by per-channel scales "
              "each layer measures from its own keys (docs/recent.md: mean KL 3-8e-5 on both bundled models' "
              "held-out texts); no calibration", kv_cache_dtype="int8_per_token_head", scales="dynamic_key_channels"),
        _ours("fp8_e4m3", "e4m3, the checkpoint's scales, else 1.0 with a warning", kv_cache_dtype="fp8_e4m3"),
        _ours("fp8_e5m2", "e5m2, the checkpoint's scales, else 1.0 with a warning", kv_cache_dtype="fp8_e5m2"),
        Variant(
            HF_FP8,
            lambda model: QuantizedCache(backend="fp8", config=model.config),
            "transformers QuantizedCache(backend='fp8'): per-tensor scale frozen at prefill",
        ),
    )
    if v.name != HF_FP8 or compat.HAS_FP8_QUANTIZED_CACHE  # transformers' fp8 cache: from transformers 5.21
}


def resolve_variants(variants: Sequence[str] | Mapping[str, VariantSpec] | None) -> list[Variant]:
    """Variants by built-in name, or `{name: built-in name | factory(model) -> Cache | QuantizedFP8Cache kwargs}`.

    The variant named "native" is the reference; the built-in one is added first when it is missing.
    """
    if variants is None:
        specs: dict[str, VariantSpec] = {name: name for name in BUILTIN_VARIANTS}
    elif isinstance(variants, Mapping):
        specs = dict(variants)
    else:
        names = [variants] if isinstance(variants, str) else list(variants)
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"variants {bad!r}: a list holds built-in names; pass {{name: factory or kwargs}} instead")
        specs = {name: name for name in names}
    if not specs:
        raise ValueError("variants is empty: pass at least one variant to compare with the reference")
    resolved = {name: _variant(name, spec) for name, spec in specs.items()}
    reference = resolved.pop(REFERENCE, BUILTIN_VARIANTS[REFERENCE])
    return [reference, *resolved.values()]


def _variant(name: str, spec: VariantSpec) -> Variant:
    if isinstance(spec, str):
        if spec not in BUILTIN_VARIANTS:
            raise ValueError(
                f"unknown variant {spec!r}; valid names: {', '.join(BUILTIN_VARIANTS)} (or pass a cache factory "
                "or a dict of QuantizedFP8Cache arguments under a name of your choice)"
            )
        builtin = BUILTIN_VARIANTS[spec]
        return Variant(name, builtin.make_cache, builtin.description)
    if isinstance(spec, Mapping):
        return _ours(name, **spec)
    if callable(spec):
        return Variant(name, spec, f"user factory {getattr(spec, '__qualname__', type(spec).__name__)}")
    raise TypeError(f"variant {name!r}: expected a built-in name, a factory model -> Cache or a dict, got {spec!r}")
