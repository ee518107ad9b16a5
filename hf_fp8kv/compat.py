"""What differs between the transformers releases hf-fp8kv supports, decided once, here, from what the installed
transformers has (its arguments and attributes), not from its version number.

- `CACHE_ARG`: the name under which `generate` hands the cache to a model's forward ("cache" from 5.24,
  "past_key_values" before). Before 5.24 a model takes `cache=` into its `**kwargs` and ignores it, so every call
  of ours passes the cache through `cache_kwargs` / `forward`, and `forward` raises when the model did not use it.
- `layer_types_and_kwargs`: transformers' `get_layer_types_and_kwargs`, whose kwargs are one dict for every layer
  before 5.19 (with the window of the sliding layers) and one dict per layer after.
- `no_cache_layer`: transformers' own layer for layer types that hold nothing ("dummy" from 5.23, "moe" / "mlp"
  before, which transformers then fills with an empty linear-attention layer).
- `HAS_FP8_QUANTIZED_CACHE`: transformers' `QuantizedCache(backend="fp8")`, compared against, exists from 5.21.
- `CHUNKED_PREFILL_CONTINUES`: whether chunked prefill onto a filled cache continues it (5.24) or restarts.
- `paged_cache_from_kwargs`: before 5.24, continuous batching passes the paged cache to the attention function as
  `cache=` (the model's forward does not take that name), and the attention function writes the new tokens; from
  5.24 the attention module writes them through the forward's `cache` argument.
"""

from __future__ import annotations

import inspect

from transformers import cache_utils
from transformers.generation.utils import GenerationMixin

SLIDING_TYPES = ("sliding_attention", "chunked_attention")

# generate passes the cache to the model under the name that `prepare_inputs_for_generation` takes
CACHE_ARG = (
    "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)  # fmt: skip
# Chunked prefill (`prefill_chunk_size`) onto a filled cache continues from the cached tokens in the generate that
# hands the cache as `cache` (the same rewrite of generate, transformers 5.24); before, it restarts at the first
# token and writes the conversation a second time, into any cache (DynamicCache's too).
CHUNKED_PREFILL_CONTINUES = CACHE_ARG == "cache"


class CacheNotUsedError(RuntimeError):
    """A forward returned without using the cache it was given (it would have measured an empty cache)."""


def cache_kwargs(cache) -> dict:
    """`{name: cache}` for `model(...)` / `model.generate(...)` under the name this transformers reads."""
    return {CACHE_ARG: cache}


def forward(model, cache, **inputs):
    """`model(**inputs)` through `cache` (`use_cache=True`); raises `CacheNotUsedError` when the model returned
    another cache than the one given (it did not use ours: a model that takes the cache under another name)."""
    out = model(**inputs, **cache_kwargs(cache), use_cache=True)
    returned = out.get(CACHE_ARG) if hasattr(out, "get") else None
    if returned is not cache:
        raise CacheNotUsedError(
            f"{type(model).__name__} returned without using the {type(cache).__name__} it was given as {CACHE_ARG}= "
            f"(transformers {_version()}): its forward does not take the cache under that name"
        )
    return out


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """transformers' layer types of `config` and the kwargs of each layer (one dict per layer)."""
    layer_types, kwargs = cache_utils.get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):  # one dict for every layer: only sliding and chunked layers take the window
        window = {"sliding_window": kwargs["sliding_window"]} if "sliding_window" in kwargs else {}
        kwargs = [dict(window) if kind in SLIDING_TYPES else {} for kind in layer_types]
    return layer_types, kwargs


# layer types that cache nothing, as transformers names them in this release
NO_CACHE_TYPES = frozenset(t for t in ("dummy", "moe", "mlp") if t in cache_utils.DYNAMIC_LAYER_TYPE_MAPPING)


def no_cache_layer(layer_type: str):
    """transformers' own (empty) layer for a layer type that caches nothing."""
    return cache_utils.DYNAMIC_LAYER_TYPE_MAPPING[layer_type]()


# transformers' own FP8 cache, `QuantizedCache(backend="fp8")` (from 5.21)
HAS_FP8_QUANTIZED_CACHE = hasattr(cache_utils, "Fp8QuantizedLayer")


def paged_cache_from_kwargs(kwargs: dict):
    """The paged cache that continuous batching handed to the attention function itself (before 5.24), else None.

    Any other cache there was passed as `cache=` to a model that takes it as `past_key_values=`: the model would
    ignore it, so this raises."""
    cache = kwargs.pop("cache", None)
    if cache is None:
        return None
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    if not isinstance(cache, PagedAttentionCache):
        raise CacheNotUsedError(
            f"the model got cache={type(cache).__name__}, which transformers {_version()} ignores: pass it as "
            f"{CACHE_ARG}="
        )
    return cache


def _version() -> str:
    import transformers

    return transformers.__version__
