"""The full-precision window: the newest `recent_tokens` and the first `sink_tokens` real tokens of each row in
the model's dtype, every other token quantized once, when it leaves the window."""

import math

import pytest
import torch
from hf_fp8kv.kernels import reference
from transformers import DynamicCache

from hf_fp8kv import KVScales, QuantizedFP8Cache, calibrate
from hf_fp8kv.compat import cache_kwargs
from tests.models import PURE_FP8, tiny_model

PROMPTS = torch.tensor([[0, 0, 0, 5, 17, 42, 8, 99, 3, 14], [23, 64, 11, 3, 7, 120, 1, 9, 51, 4]])
PADDING = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10])


def generate(model, cache, **kwargs):
    out = model.generate(input_ids=PROMPTS, attention_mask=PADDING, max_new_tokens=6, do_sample=False, **cache_kwargs(cache),
                         output_logits=True, return_dict_in_generate=True, **kwargs)  # fmt: skip
    return out.sequences, torch.stack(out.logits) if out.logits else None


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_a_window_over_every_token_is_the_full_precision_cache(model_type, static, rotate):
    """Nothing leaves a window wider than the whole generation: greedy tokens and logits are DynamicCache's,
    through padding, sinks, sliding layers and static buffers alike, rotated codes or not (there are none)."""
    extra = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"]) if model_type != "llama" else {}
    model = tiny_model(model_type, **extra)
    tokens, logits = generate(model, DynamicCache(config=model.config))
    window = dict(recent_tokens=32, sink_tokens=2, max_cache_len=24 if static else None)
    cache = QuantizedFP8Cache(model, scales="dynamic", rotate=rotate, **window)
    ours, our_logits = generate(model, cache)
    assert torch.equal(ours, tokens)
    torch.testing.assert_close(our_logits, logits, rtol=1e-5, atol=1e-5)
    assert all(int(layer.stats.sum()) == 0 for layer in cache.layers)  # nothing was quantized


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_window_over_every_token_holds_the_models_keys_with_calibrated_key_channels(backend, dtype, static):
    """The window's keys, held divided by the per-channel key scales, come back as DynamicCache holds them, bit
    for bit, through a left-padded prefill and a decode step, in the dynamic and static caches: calibrate rounds the
    channel scales to powers of two. Channel scales off a power of two round them in the model's dtype. (One
    layer: a second's keys would follow the first's attention, which is not sdpa's to the bit.)"""
    model = tiny_model(num_hidden_layers=1).to(dtype)
    channels = calibrate(model, PROMPTS, strategy="token", key_channels=True, progress=False).key_channel
    next_ids = torch.tensor([[7], [9]])

    def keys(cache):
        with torch.no_grad():
            model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache))
            model(input_ids=next_ids, attention_mask=torch.cat((PADDING, torch.ones(2, 1, dtype=PADDING.dtype)), 1),
                  **cache_kwargs(cache))  # fmt: skip
        # (a static cache's layers hold max_cache_len slots: the first are the tokens)
        return [layer.dequantized()[0] if hasattr(layer, "dequantized") else layer.keys for layer in cache.layers]

    def ours(key_channel):
        scales = KVScales(dynamic=True, key_channel=key_channel)
        window = dict(recent_tokens=32, sink_tokens=2, max_cache_len=16 if static else None)
        return keys(QuantizedFP8Cache(model, kv_cache_dtype="int8_per_token_head", scales=scales, backend=backend,
                                      **window))  # fmt: skip

    expected = keys(DynamicCache(config=model.config))
    assert all(torch.equal(a[:, :, : b.shape[2]], b) for a, b in zip(ours(channels), expected, strict=True))
    off = {layer: channel * 0.75 for layer, channel in channels.items()}
    assert not all(torch.equal(a[:, :, : b.shape[2]], b) for a, b in zip(ours(off), expected, strict=True))


@pytest.mark.parametrize("method", [dict(num_beams=2), dict(prompt_lookup_num_tokens=2)], ids=["beams", "assisted"])
def test_beams_and_assisted_decoding_keep_the_window_in_step(method):
    model = tiny_model()
    prompt = torch.tensor([[5, 17, 42, 8, 99, 5, 17, 42, 8, 3]])
    generated = {}
    for name, cache in [("dynamic", DynamicCache(config=model.config)),
                        ("window", QuantizedFP8Cache(model, scales="dynamic", recent_tokens=40, sink_tokens=2))]:  # fmt: skip
        out = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, **cache_kwargs(cache), **method)
        generated[name] = out
    assert torch.equal(generated["window"], generated["dynamic"])


def test_sinks_are_each_rows_first_real_tokens():
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=2, sink_tokens=3)
    layer = cache.layers[0]
    model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache))
    assert layer.sink_tracker.rows == [3, 0]  # row 0 is padded by 3
    assert layer.sink_count.tolist() == [3, 3] and layer.sink_start.tolist() == [3, 0]
    # the sinks hold the same values as the recent window held for them: compare through a fresh full window
    full = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=64)
    model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(full))
    recent = full.layers[0].recent
    assert torch.equal(layer.sinks[:, 0], recent[:, 0, :, 3:6]) and torch.equal(layer.sinks[:, 1], recent[:, 1, :, :3])


def test_each_token_is_quantized_once_when_it_leaves_and_crop_keeps_full_precision():
    torch.manual_seed(0)
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=4)
    layer = cache.layers[0]
    kv = torch.randn(2, 1, 2, 20, 16)
    layer.update(kv[0, :, :, :10], kv[1, :, :, :10])
    layer.update(kv[0, :, :, 10:11], kv[1, :, :, 10:11])
    assert layer.recent_start == 7 and int(layer.stats.sum()) == 0
    keys, _ = layer.dequantized()
    expected = reference.dequantize(*_quantized(kv[0, :, :, :7]))
    assert torch.equal(keys[:, :, :7], expected) and torch.equal(keys[:, :, 7:11], kv[0, :, :, 7:11])
    layer.crop(-2)  # into the window: tokens 7, 8 stay full precision
    keys, _ = layer.dequantized()
    assert layer.get_seq_length() == 9 and layer.recent_start == 7 and torch.equal(keys[:, :, 7:9], kv[0, :, :, 7:9])
    layer.crop(-5)  # beyond it: the cache holds quantized tokens 0..3 only
    assert layer.get_seq_length() == 4 and layer.recent_start == 4
    layer.update(kv[0, :, :, 4:6], kv[1, :, :, 4:6])  # they come back in full precision
    keys, _ = layer.dequantized()
    assert torch.equal(keys[:, :, :4], expected[:, :, :4]) and torch.equal(keys[:, :, 4:6], kv[0, :, :, 4:6])


def _quantized(x):
    fmt = QuantizedFP8Cache(tiny_model(), scales="dynamic").fmt
    scale = reference.dynamic_scale(x, fmt, torch.bfloat16)[..., None]
    codes, _, _ = reference.quantize(x, scale, fmt)
    return codes, scale, fmt


def test_window_shows_in_summary_and_bytes():
    model = tiny_model(num_hidden_layers=2)
    pure = QuantizedFP8Cache(model, scales="dynamic", **PURE_FP8)
    window = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=8, sink_tokens=2)
    for cache in (pure, window):
        model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache))
    extra = sum(layer.recent.nbytes + layer.sinks.nbytes for layer in window.layers)
    assert extra == 2 * (2 * 2 * 2 * (8 + 2) * 16 * 4) and window.nbytes == pure.nbytes + extra  # 2 layers
    assert all(row["recent+sinks"] == "8+2" for row in window.summary())
    assert "8+2" in str(window)


def test_zero_window_is_pure_fp8():
    """`recent_tokens=0, sink_tokens=0` stores every token as codes at once."""
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", **PURE_FP8)
    model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache))
    layer = cache.layers[0]
    assert layer.recent is None and layer.sinks is None and layer.recent_start == layer.end == 10


def test_bad_window_arguments_are_named():
    model = tiny_model()
    for name in ("recent_tokens", "sink_tokens"):
        for bad in (-1, 2.5, "4"):
            with pytest.raises(ValueError, match=name):
                QuantizedFP8Cache(model, **{name: bad})


WINDOW_SETTINGS = [dict(recent_tokens=r, sink_tokens=s) for r, s in ((0, 0), (0, 4), (32, 4), (500, 0), (100, 100))]


def used_bytes(layer) -> int:
    """What the tokens a dynamic layer holds need: a code slot (codes and per-token scales) for each stored token
    that is not among the recent ones (those are stored once, in the model's dtype), plus the model-dtype copies
    of the recent and the sink tokens."""
    batch, heads, head_dim = layer.codes.shape[1], layer.codes.shape[2], layer.codes.shape[4]
    per_code = 2 * batch * heads * (head_dim + layer.scale.element_size())  # keys and values: codes + a scale
    per_fp = 2 * batch * heads * head_dim * layer.dtype.itemsize
    window = min(layer.end - layer.recent_start, layer.recent_tokens)
    sinks = min(layer.end, layer.sink_tokens)
    return (layer.length - window) * per_code + (window + sinks) * per_fp, per_code, per_fp


@pytest.mark.parametrize("window", WINDOW_SETTINGS, ids=lambda w: f"{w['recent_tokens']}+{w['sink_tokens']}")
def test_bytes_held_stay_within_one_block_of_bytes_used(window):
    """Every buffer (codes, recent window, sinks) grows with the context a block at a time and shrinks after a
    crop: a short prompt holds no full-size window, and 400 tokens cropped to 10 release their buffers at the
    next update."""
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", block_size=16, **window)
    layer = cache.layers[0]
    ids = torch.randint(3, 120, (1, 400), generator=torch.Generator().manual_seed(0))

    def assert_within_a_block():
        used, per_code, per_fp = used_bytes(layer)
        slack = 16 * (per_code + per_fp * ((layer.recent is not None) + (layer.sinks is not None)))
        assert used <= layer.nbytes <= used + slack, (layer.end, layer.nbytes, used, slack)

    with torch.no_grad():
        model(input_ids=ids[:, :14], **cache_kwargs(cache))
        assert_within_a_block()
        model(input_ids=ids[:, 14:], **cache_kwargs(cache))
        assert_within_a_block()
        assert layer.capacity == math.ceil(max(400 - window["recent_tokens"], 0) / 16) * 16  # none for a recent token
        cache.crop(-390)
        for step in range(20):
            model(input_ids=ids[:, 10 + step : 11 + step], **cache_kwargs(cache))
            assert_within_a_block()


def test_a_window_beyond_the_models_context_is_refused():
    model = tiny_model()  # max_position_embeddings 512
    for name in ("recent_tokens", "sink_tokens"):
        with pytest.raises(ValueError, match=rf"{name}=1000000 exceeds the model's context.*512"):
            QuantizedFP8Cache(model, **{name: 1_000_000})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_growing_and_cropping_the_window_keeps_its_tokens(backend):
    """Across the window buffers' growth (a block at a time) and a crop that shrinks them: the logits of a window
    wider than the whole text are DynamicCache's."""
    model = tiny_model()
    ids = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(2))
    caches = [DynamicCache(config=model.config),
              QuantizedFP8Cache(model, scales="dynamic", block_size=8, recent_tokens=100, sink_tokens=2,
                                backend=backend)]  # fmt: skip
    logits = []
    for cache in caches:
        with torch.no_grad():
            model(input_ids=ids[:, :5], **cache_kwargs(cache))
            for t in range(5, 20):
                model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache))
            cache.crop(-11)
            logits.append(torch.cat([model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(9, 14)]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
