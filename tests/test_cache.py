"""QuantizedFP8Cache on tiny random models: construction, errors, storage, batch operations, attention hooks."""

import math
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_fp8kv import ATTENTION_NAME, CacheReuseError, QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.dynamic import DynamicFP8Layer
from hf_fp8kv.layer import QuantizedKV
from hf_fp8kv.scales import UncalibratedScalesWarning
from hf_fp8kv.settings import check_rotation
from tests.models import PURE_FP8, tiny_model

PROMPT = torch.tensor([[5, 17, 42, 8, 99, 23, 64, 11]])


def greedy(model, cache, ids=PROMPT, new=8, **kwargs):
    return model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, past_key_values=cache, **kwargs)


def decode_logits(model, cache, ids, prefix=4):
    from hf_fp8kv.evaluate import decode_mode_logits

    return decode_mode_logits(model, ids, prefix, cache)


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": None}),
        ("phi3", {"hidden_size": 192, "num_attention_heads": 2, "num_key_value_heads": 2}),  # head_dim 96
    ],
)
def test_tiny_models_stay_close_to_dynamic_cache(model_type, overrides):
    model = tiny_model(model_type, **overrides)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    reference = decode_logits(model, DynamicCache(config=model.config), ids)
    ours = decode_logits(model, QuantizedFP8Cache(model, scales="dynamic"), ids)
    probs_ref, probs = reference.softmax(-1), ours.softmax(-1)
    assert (probs_ref - probs).abs().max() < 0.02
    assert (reference.argmax(-1) == ours.argmax(-1)).float().mean() > 0.9


def test_construction_from_model_or_config_and_switch_is_invisible_to_dynamic_cache():
    model = tiny_model()
    before = greedy(model, DynamicCache(config=model.config))
    with pytest.warns(UserWarning, match="calibrat"):
        QuantizedFP8Cache(config=model.config)
    cache = QuantizedFP8Cache(model, scales=0.05)
    assert model.config._attn_implementation == ATTENTION_NAME
    assert len(cache.layers) == 2 and all(isinstance(layer, DynamicFP8Layer) for layer in cache.layers)
    greedy(model, cache)
    assert torch.equal(greedy(model, DynamicCache(config=model.config)), before)


def test_eager_model_keeps_eager_for_other_caches():
    model = tiny_model(attn_implementation="eager")
    before = greedy(model, DynamicCache(config=model.config))
    fp8 = greedy(model, QuantizedFP8Cache(model, scales="dynamic"))
    assert torch.equal(greedy(model, DynamicCache(config=model.config)), before)
    assert fp8.shape == before.shape


def test_from_pretrained_with_our_attention_name(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTENTION_NAME).eval()
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert torch.equal(greedy(ours, DynamicCache(config=ours.config)), greedy(sdpa, DynamicCache(config=sdpa.config)))
    cache = QuantizedFP8Cache(ours, scales="dynamic")
    assert ours.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=False, **cache_kwargs(cache)).shape == (1, 12)


def test_update_returns_a_view_on_the_fast_path_and_tensors_otherwise():
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic")
    key = torch.randn(1, 2, 3, 16)
    k, v = cache.update(key, key.clone(), 0)
    assert isinstance(k, QuantizedKV) and k.shape == (1, 2, 3, 16)
    model.set_attn_implementation("sdpa")
    with pytest.warns(UserWarning, match="slow path"):
        k, v = cache.update(key, key.clone(), 0)
    assert isinstance(k, torch.Tensor) and k.shape == (1, 2, 6, 16)
    torch.testing.assert_close(k[:, :, 3:], key, rtol=0.07, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.update(key, key.clone(), 0)  # warned once only


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "int8_per_token_head"])
def test_storage_formats(name):
    model = tiny_model()
    cache = QuantizedFP8Cache(model, kv_cache_dtype=name, scales="dynamic")
    greedy(model, cache, new=2)
    assert cache.layers[0].key_codes.element_size() == 1
    assert cache.summary()[0]["storage"] == ("fp8_e4m3" if name == "fp8" else name)


def test_invalid_dtype_lists_valid_names():
    with pytest.raises(ValueError, match="'fp8_e5m2'.*'int8_per_token_head'|valid names"):
        QuantizedFP8Cache(tiny_model(), kv_cache_dtype="fp4")


@pytest.mark.parametrize(
    "scales,match",
    [
        (-1.0, "layer 0 k_scale must be finite and > 0"),
        (0.0, "must be finite and > 0"),
        (math.nan, "must be finite and > 0"),
        ({0: (1.0, 1.0), 1: (1.0, math.inf)}, "layer 1 v_scale must be finite"),
        ({0: (torch.ones(3), 1.0), 1: (1.0, 1.0)}, r"layer 0 k_scale has shape \(3,\).*2\)"),
        ([(1.0, 1.0)], "scales has 1 entries but the model has 2 layers"),
        ({0: (1.0, 1.0), 1: (1.0, 1.0), 5: (1.0, 1.0)}, r"layers \[5\]"),
        ({0: (1.0, 1.0)}, r"missing for layers \[1\]"),
    ],
)
def test_bad_scales_name_the_layer(scales, match):
    with pytest.raises(ValueError, match=match):
        QuantizedFP8Cache(tiny_model(), scales=scales)


def test_per_head_scales_and_skip_layers():
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales={1: (torch.tensor([0.5, 0.25]), 0.1)}, skip_layers=[0])
    greedy(model, cache, new=2)
    rows = cache.summary()
    assert rows[0]["storage"] == "skipped" and rows[1]["granularity"] == "per-head"
    assert rows[1]["k_scale"] == "[0.5, 0.25]" and rows[1]["v_scale"] == "[0.1, 0.1]"
    assert "skipped" in str(cache) and cache.nbytes == sum(r["bytes"] for r in rows)
    with pytest.raises(ValueError, match=r"skip_layers \[7\]"):
        QuantizedFP8Cache(model, skip_layers=[7])


def test_values_beyond_the_range_saturate_and_are_counted():
    cache = QuantizedFP8Cache(tiny_model(), scales=1.0, **PURE_FP8)
    key = torch.randn(1, 2, 4, 16)
    key[0, 0, 0, :3] = torch.tensor([math.inf, -math.inf, 1e6])
    k, _ = cache.layers[0].update(key, torch.zeros_like(key))
    keys, _ = cache.layers[0].dequantized()
    assert torch.isfinite(keys).all() and keys[0, 0, 0, 0] == 448 and keys[0, 0, 0, 1] == -448
    assert cache.summary()[0]["clipped"] == 3


def test_buffers_grow_one_block_at_a_time():
    cache = QuantizedFP8Cache(tiny_model(), scales="dynamic", block_size=16, **PURE_FP8)
    layer = cache.layers[0]
    for step, new in enumerate([5, 11, 1, 20]):
        layer.update(torch.randn(1, 2, new, 16), torch.randn(1, 2, new, 16))
        assert layer.capacity == math.ceil(layer.length / 16) * 16
    # bytes held: codes (1 byte) plus bf16 scales per token and head, capacity included
    assert layer.nbytes == 2 * layer.capacity * 2 * (16 + 2)


def test_kv_bytes_at_2k_context_in_bf16():
    model = tiny_model(num_hidden_layers=1, max_position_embeddings=4096).to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 2048))
    dynamic = DynamicCache(config=model.config)
    ours = QuantizedFP8Cache(model, scales=1.0)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=dynamic)
        model(input_ids=ids, past_key_values=ours)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    per_token = held // 2048 // 2  # keys and values of a token as FP8 codes (one byte each)
    # each token stored once: the newest 128 in bf16 only, the first 4 in bf16 beside their codes
    assert ours.nbytes == (2048 - 128) * per_token + (128 + 4) * 2 * per_token
    assert ours.nbytes <= 0.54 * held


def test_layer_batch_operations_match_dynamic_cache():
    torch.manual_seed(0)
    model = tiny_model()
    ours, reference = QuantizedFP8Cache(model, scales="dynamic"), DynamicCache(config=model.config)
    k, v = torch.randn(2, 3, 2, 6, 16)
    ours.layers[0].update(k, v)
    deq_k, deq_v = ours.layers[0].dequantized()
    reference.layers[0].update(deq_k, deq_v)
    steps = [
        lambda c: c.layers[0].reorder_cache(torch.tensor([2, 0, 0])),
        lambda c: c.layers[0].crop(-2),
        lambda c: c.layers[0].batch_repeat_interleave(2),
        lambda c: c.layers[0].batch_select_indices(torch.tensor([0, 3, 5])),
    ]
    for step in steps:
        step(ours)
        step(reference)
        k_ours, v_ours = ours.layers[0].dequantized()
        assert torch.equal(k_ours, reference.layers[0].keys) and torch.equal(v_ours, reference.layers[0].values)
    assert ours.get_seq_length() == reference.get_seq_length() == 4
    ours.reset()
    assert ours.get_seq_length() == 0 and ours.nbytes == 0


def test_reused_cache_with_unrelated_prompt_raises_and_continuation_works():
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic")
    first = greedy(model, cache, new=4)
    follow_up = torch.cat([first, torch.tensor([[3, 4, 5]])], dim=1)
    continued = greedy(model, cache, ids=follow_up, new=4)
    fresh = greedy(model, QuantizedFP8Cache(model, scales="dynamic"), ids=follow_up, new=4)
    assert continued.shape == fresh.shape and torch.equal(continued[:, : follow_up.shape[1]], follow_up)
    with pytest.raises(CacheReuseError, match="fresh QuantizedFP8Cache"):
        greedy(model, cache, ids=torch.tensor([[7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]))
    with pytest.raises(CacheReuseError, match="fewer than"):
        greedy(model, cache, ids=PROMPT)
    cache.reset()
    assert torch.equal(greedy(model, cache, new=4), first)


HALF_WINDOWS = {
    "pure": dict(scales="dynamic", **PURE_FP8),
    "sinks only": dict(scales="dynamic", recent_tokens=0, sink_tokens=4),
    "recent only": dict(scales="dynamic", recent_tokens=4, sink_tokens=0),
    "default": {},  # QuantizedFP8Cache(model): scale 1.0 (warned), recent 128 + sinks 4
}


# every window setting on the torch path; the interpreted Triton kernels (slow) with and without sinks
HALF_CASES = [(name, "torch") for name in HALF_WINDOWS] + [("default", "triton"), ("recent only", "triton")]


@pytest.mark.parametrize("window,backend", HALF_CASES, ids=[f"{w}-{b}" for w, b in HALF_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_left_padded_half_precision_batch_reads_each_prompt_alone(dtype, window, backend):
    """A batch of two prompts, one left-padded, on a bf16 / fp16 model (the README's first usage line): the padded
    row's logits are the prompt's alone up to rounding, far from what attending to the padding would give."""
    model = tiny_model().to(dtype)
    long, short = PROMPT, PROMPT[:, 3:]
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0

    def scores(ids, attention_mask):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the default's calibration warning
            cache = QuantizedFP8Cache(model, backend=backend, **HALF_WINDOWS[window])
        out = model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False,
                             **cache_kwargs(cache), output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
        return torch.stack(out.scores, dim=1).float()

    alone = scores(short, torch.ones_like(short))[0]
    padded_gap = (scores(batch, mask)[1] - alone).abs().max().item()
    unmasked_gap = (scores(batch, torch.ones_like(mask))[1] - alone).abs().max().item()
    assert padded_gap < unmasked_gap / 10, (padded_gap, unmasked_gap)


WINDOW = dict(recent_tokens=8, sink_tokens=2)
SLIDING = dict(model_type="gemma3_text", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
GRAD_CASES = {  # (tiny model, its dtype, cache settings)
    "window, torch": ({}, torch.float32, dict(scales="dynamic", backend="torch", **WINDOW)),
    "pure, searched, torch": ({}, torch.float32, dict(scales="dynamic", scale_search=16, backend="torch", **PURE_FP8)),
    "static cache, torch": ({}, torch.float32, dict(scales="dynamic", max_cache_len=64, backend="torch", **WINDOW)),
    "window, searched, triton": (
        {}, torch.float32, dict(scales="dynamic", scale_search=16, backend="triton", **WINDOW)
    ),
    "sliding model, bf16, torch": (SLIDING, torch.bfloat16, dict(scales="dynamic", backend="torch", **WINDOW)),
}


@pytest.mark.parametrize("model_args,dtype,settings", GRAD_CASES.values(), ids=GRAD_CASES)
def test_a_forward_pass_with_gradients_on_gives_no_grads_outputs_and_keeps_no_graph(model_args, dtype, settings):
    """`model(...)` outside no_grad (a notebook's perplexity loop) on a left-padded batch: the prompt and a decode
    step give the logits they give under no_grad, bit for bit, and no buffer of the cache holds an autograd graph."""
    model = tiny_model(**model_args).to(dtype)
    ids = torch.randint(3, model.config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded

    def run(cache):
        ends = (40, 41)  # a prompt past the recent tokens, then a decode step
        return [model(input_ids=ids[:, end - n : end], attention_mask=mask[:, :end], **cache_kwargs(cache),
                      use_cache=True).logits for end, n in zip(ends, (40, 1))]  # fmt: skip

    with torch.no_grad():
        expected = run(QuantizedFP8Cache(model, **settings))
    cache = QuantizedFP8Cache(model, **settings)
    assert all(torch.equal(a, b) for a, b in zip(run(cache), expected))
    held = [getattr(layer, name) for layer in cache.layers for name in layer._buffers()]
    held += [layer.scale_search.energy for layer in cache.layers if layer.scale_search.candidates]
    assert held and not any(tensor.requires_grad for tensor in held)


def test_rotation_refuses_an_odd_head_dim_and_static_scales():
    with pytest.raises(ValueError, match="even head_dim.*this model's is 15"):  # (no RoPE model has one)
        check_rotation(15, {}, uncalibrated=False)
    with pytest.raises(ValueError, match=r"rotate=True with static scales \(.+\).*scales='dynamic'"):
        QuantizedFP8Cache(tiny_model(), scales=0.5, rotate=True)
    with pytest.raises(ValueError, match="rotate='yes' must be True or False"):
        QuantizedFP8Cache(tiny_model(), scales="dynamic", rotate="yes")
    with pytest.warns(UncalibratedScalesWarning):  # the 1.0 fallback: nothing measured on unrotated K/V to clip
        assert QuantizedFP8Cache(tiny_model(), rotate=True).layers[0].rotate
