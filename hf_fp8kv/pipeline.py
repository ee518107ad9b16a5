"""FP8 caching for pipelines and any other caller of `generate`: a fresh cache per call.

A pipeline forwards its generate kwargs to every call, so a cache object passed to it would be reused for every
prompt (a `QuantizedFP8Cache` built from the model refuses that with `CacheReuseError`). The one way to run a
pipeline with FP8 caching is to switch the model:

    from hf_fp8kv import pipeline as fp8_pipeline
    fp8_pipeline.enable(model, scales="dynamic")      # every generate without a cache gets a fresh one
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    pipe(prompts, max_new_tokens=32, batch_size=8)
    fp8_pipeline.disable(model)                       # back to transformers' default cache
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from hf_fp8kv import compat
from hf_fp8kv.cache import QuantizedFP8Cache


class FreshCacheGenerate:
    """`model.generate` while `enable` is in effect: a plain object (not a closure), so the model still pickles."""

    def __init__(self, model: torch.nn.Module, cache_kwargs: dict[str, Any], inner: Callable | None):
        self.model, self.cache_kwargs, self.inner = model, cache_kwargs, inner  # inner: a generate wrapped before

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.model).generate.__get__(self.model))

    def __call__(self, *args, **kwargs):
        explicit = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        if not explicit and kwargs.get("use_cache", True):
            kwargs[compat.CACHE_ARG] = QuantizedFP8Cache(self.model, **self.cache_kwargs)
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.model).generate(self.model, *args, **kwargs)


def enable(model: torch.nn.Module, **cache_kwargs) -> None:
    """Make every `model.generate` call that passes no cache (neither `cache=` nor `past_key_values=`) and does
    not set `use_cache=False` run with a fresh `QuantizedFP8Cache(model, **cache_kwargs)`. Calling it again
    replaces the kwargs. The kwargs are checked now: a bad one raises here, not at the first prompt."""
    QuantizedFP8Cache(model, **cache_kwargs)
    current = vars(model).get("generate")
    inner = current.inner if isinstance(current, FreshCacheGenerate) else current
    model.generate = FreshCacheGenerate(model, cache_kwargs, inner)


def disable(model: torch.nn.Module) -> None:
    """Undo `enable`: `generate` uses transformers' default cache again (the attention stays "fp8kv", which
    behaves exactly like the previous implementation for any other cache)."""
    current = vars(model).get("generate")
    if isinstance(current, FreshCacheGenerate):
        del model.generate  # the instance attribute set by `enable`; the class's method shows through again
        if current.inner is not None:
            model.generate = current.inner


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether `enable` is in effect on `model`."""
    return isinstance(vars(model).get("generate"), FreshCacheGenerate)
