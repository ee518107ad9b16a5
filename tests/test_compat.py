"""The transformers differences `hf_fp8kv.compat` decides once: the cache argument's name (a cache a model would
ignore is an error, never an empty measurement), per-layer kwargs, and a crop by a 0-dim tensor (5.17's assisted
decoding)."""

import inspect

import pytest
import torch
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache, compat
from tests.models import tiny_model


def test_the_cache_argument_is_the_one_the_models_take():
    model = tiny_model()
    assert compat.CACHE_ARG in inspect.signature(type(model).forward).parameters
    cache = DynamicCache(config=model.config)
    out = compat.forward(model, cache, input_ids=torch.tensor([[5, 6, 7]]))
    assert cache.get_seq_length() == 3 and out.logits.shape == (1, 3, 128)


def test_a_forward_that_ignores_the_cache_is_an_error(monkeypatch):
    model = tiny_model()
    # a name the model does not take: before 5.24 `cache`, the spelling the issue measured as silently ignored
    monkeypatch.setattr(compat, "CACHE_ARG", "cache" if compat.CACHE_ARG != "cache" else "kv_cache")
    cache = DynamicCache(config=model.config)
    with pytest.raises(compat.CacheNotUsedError, match="returned without using the DynamicCache"):
        compat.forward(model, cache, input_ids=torch.tensor([[5, 6, 7]]))
    assert cache.get_seq_length() == 0


@pytest.mark.skipif(compat.CACHE_ARG == "cache", reason="transformers takes cache= itself")
def test_cache_spelling_the_model_ignores_is_refused_by_our_attention():
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic")
    with pytest.raises(compat.CacheNotUsedError, match="pass it as past_key_values="):
        model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache)


def test_crop_by_a_tensor_keeps_host_positions():
    model = tiny_model()
    prompt = torch.tensor([[5, 17, 42, 8, 99, 5, 17, 42, 8, 3]])
    cache = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=40, sink_tokens=2)
    compat.forward(model, cache, input_ids=prompt)
    cache.crop(torch.tensor(0))  # what transformers 5.17's assisted decoding passes
    compat.forward(model, cache, input_ids=torch.tensor([[7]]))
    assert cache.get_seq_length() == 11 and all(type(layer.end) is int for layer in cache.layers)


def test_layer_kwargs_are_per_layer():
    model = tiny_model("gemma3_text", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    layer_types, kwargs = compat.layer_types_and_kwargs(model.config)
    assert layer_types == ["sliding_attention", "full_attention"] and kwargs == [{"sliding_window": 8}, {}]


def test_continuous_batching_imports_or_names_the_version_it_needs():
    try:
        from hf_fp8kv import continuous_batching as cb
    except ImportError as error:  # an import that moved: the allocators package
        assert "needs transformers 5.20 or later" in str(error)
    else:
        cb.check_transformers_version()
