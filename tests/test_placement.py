"""Placement on CPU: each layer's FP8 buffers live where its keys arrive, and offloading moves FP8 codes.

There is one real device here, so the second device is `meta` (shapes and dtypes without data): the first
layer runs on the CPU, the second on `meta`, as a `device_map` would split them over two accelerators.
"""

import pytest
import torch

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.dynamic import DynamicFP8Layer, DynamicFP8SlidingLayer
from tests.models import PURE_FP8, tiny_model

HYBRID = dict(sliding_window=8, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])


def to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, tuple):
        return tuple(to_meta(v) for v in value)
    return value


def split_over_cpu_and_meta(model):
    """Layer 0 (and the embeddings) stay on the CPU; layer 1, the final norm and the head move to `meta`, with a hook
    that moves their inputs there (what accelerate's device_map hooks do between devices)."""
    for module in (model.model.layers[1], model.model.norm, model.lm_head):
        module.to("meta")
    model.model.layers[1].register_forward_pre_hook(
        lambda _, args, kwargs: (to_meta(args), {k: to_meta(v) for k, v in kwargs.items()}), with_kwargs=True
    )
    return model


@pytest.mark.parametrize("skip_layers", [(), "sliding_window"])
def test_each_layer_buffers_live_where_its_keys_arrive(skip_layers):
    model = split_over_cpu_and_meta(tiny_model("gemma3_text", **HYBRID))
    cache = QuantizedFP8Cache(model, scales="dynamic", skip_layers=skip_layers)
    ids = torch.randint(0, 128, (2, 12))
    logits = model(input_ids=ids, **cache_kwargs(cache)).logits
    logits = model(input_ids=ids[:, :1], **cache_kwargs(cache)).logits  # one decode step past the window
    assert logits.device.type == "meta" and logits.shape == (2, 1, 128)
    sliding, full = cache.layers
    assert isinstance(full, DynamicFP8Layer) and full.key_codes.device.type == "meta"
    assert full.key_codes.dtype == torch.float8_e4m3fn and full.key_scale.device.type == "meta"
    if skip_layers:
        assert sliding.keys.device.type == "cpu" and sliding.keys.dtype == torch.float32
    else:
        assert isinstance(sliding, DynamicFP8SlidingLayer)
        assert {sliding.key_codes.device.type, sliding.value_codes.device.type, sliding.clipped.device.type} == {"cpu"}
        assert full.get_seq_length() == sliding.get_seq_length() == 13 and sliding.length == 7


def filled_cache() -> QuantizedFP8Cache:
    model = tiny_model("gemma3_text", num_hidden_layers=4, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    cache = QuantizedFP8Cache(model, scales=0.05, offloading=True, **PURE_FP8)
    cache.offloading = False  # Cache.update's offloading path needs CUDA streams: fill the layers without it
    model(input_ids=torch.randint(0, 128, (1, 20)), **cache_kwargs(cache))
    cache.offloading = True
    return cache


def test_prefetch_moves_fp8_codes_to_the_layer_device():
    cache = filled_cache()
    full = cache.layers[1]
    full.device = torch.device("meta")  # pretend its keys arrived on an accelerator, then it was offloaded to CPU
    cache.prefetch(0, only_non_sliding=True)  # the next offloaded layer from 0 is the full layer 1
    assert full.key_codes.device.type == "meta" and full.key_codes.dtype == torch.float8_e4m3fn
    assert cache.layers[0].key_codes.device.type == "cpu"  # sliding layers stay resident
    # the bytes moved are the FP8 codes: half of what the same tokens hold in bf16
    codes = full.capacity * full.key_codes.shape[1] * full.key_codes.shape[3]
    assert full.nbytes == 2 * codes  # K and V at one byte per value, static scales (bf16 would be 4 * codes)


def test_offload_moves_only_full_layers_and_keeps_codes():
    cache = filled_cache()
    calls = []
    for i, layer in enumerate(cache.layers):
        original = layer.offload
        layer.offload = lambda i=i, original=original: (calls.append(i), original())
    codes_before = [layer.key_codes.clone() for layer in cache.layers]
    for i in range(len(cache.layers)):
        cache.offload(i, only_non_sliding=True)
    assert calls == [1, 3]  # transformers' rule: sliding layers are small and stay on their device
    for layer, before in zip(cache.layers, codes_before):
        assert layer.key_codes.dtype == torch.float8_e4m3fn and torch.equal(
            layer.key_codes.view(torch.uint8), before.view(torch.uint8)
        )
