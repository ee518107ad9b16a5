"""Gemma 3 270M (5 sliding : 1 full, window 512): FP8 on every layer and with sliding layers skipped, on a text
that runs past the window. Sized for CI: a 508-token prefill, then decode mode across the window's edge."""

import copy
import functools
from importlib.resources import files

import pytest
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.dynamic import DynamicFP8SlidingLayer
from hf_fp8kv.evaluate import decode_mode_logits, greedy_with_logits, quality, topk_rule
from tests.models import PURE_FP8

PREFIX, DECODE, WINDOW = 508, 16, 512  # decode mode over positions 508..523: the sliding layers drop tokens
CONFIGURATIONS = {
    "all layers": PURE_FP8,
    "sliding skipped": {"skip_layers": "sliding_window", **PURE_FP8},
    "default window": {},  # newest 32 + first 4 tokens in the model's dtype
}


@functools.lru_cache(maxsize=None)
def gemma3():
    from hf_fp8kv.bundled import load_gemma3

    model, tokenizer = load_gemma3()
    text = files("hf_fp8kv").joinpath("data/sample_text.txt").read_text()
    return model, tokenizer(text, return_tensors="pt").input_ids[:, : PREFIX + DECODE + 1]


@functools.lru_cache(maxsize=None)
def decoded(configuration: str):
    """Decode-mode logits and the filled cache of one configuration ("DynamicCache" is the reference)."""
    model, ids = gemma3()
    if configuration == "DynamicCache":
        cache = DynamicCache(config=model.config)
    else:
        cache = QuantizedFP8Cache(model, scales="dynamic", **CONFIGURATIONS[configuration])
    return decode_mode_logits(model, ids, PREFIX, cache), cache


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_decode_mode_quality_past_the_window(configuration):
    model, ids = gemma3()
    assert model.config.sliding_window == WINDOW and ids.shape[1] > WINDOW
    logits, cache = decoded(configuration)
    q = quality(decoded("DynamicCache")[0], logits, ids[0, PREFIX:])
    # KL, not perplexity: over 17 predicted tokens a perplexity delta of a few percent is noise either way
    assert q.top1_agreement >= 0.9 and q.kl_mean < 0.02 and q.kl_p99 < 0.1, q
    if configuration == "default window":  # closer to the reference than pure FP8 on the same tokens
        assert q.kl_mean < 0.5 * quality(decoded("DynamicCache")[0], decoded("all layers")[0], ids[0, PREFIX:]).kl_mean
    sliding = [layer for layer in cache.layers if isinstance(layer, DynamicFP8SlidingLayer)]
    assert len(sliding) == (0 if configuration == "sliding skipped" else 15)
    for layer in sliding:  # one window of FP8 codes and scales, not the whole text
        assert layer.length == WINDOW - 1 and layer.capacity <= WINDOW + 2 * layer.block_size


def test_bytes_per_configuration():
    reference = decoded("DynamicCache")[1]
    held = {name: decoded(name)[1].nbytes for name in ("all layers", "sliding skipped")}
    fp32 = sum(layer.keys.nbytes + layer.values.nbytes for layer in reference.layers)
    # fp32 DynamicCache > FP8 with the sliding layers kept in fp32 > FP8 everywhere (about a quarter of fp32)
    assert fp32 > held["sliding skipped"] > held["all layers"] and held["all layers"] < 0.3 * fp32


def test_greedy_agreement_after_the_window_is_full():
    """Greedy continuation of the text from the decode-mode caches (524 tokens in, so no second long prefill)."""
    model, ids = gemma3()

    def run(configuration):
        tokens, logits = greedy_with_logits(model, {"input_ids": ids}, copy.deepcopy(decoded(configuration)[1]), 8)
        return tokens[0], logits[0]

    assert topk_rule(*run("DynamicCache"), *run("all layers"))[1]  # vLLM's rule, top 5
