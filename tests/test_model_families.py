"""Every decoder family on tiny random weights: sliding/hybrid layers, softcap, sinks, chunked attention;
and the models the cache refuses, each with an error naming the model type and layer."""

import pytest
import torch
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.dynamic import DynamicFP8Layer, DynamicFP8SlidingLayer
from hf_fp8kv.evaluate import decode_mode_logits, greedy_with_logits, topk_rule
from tests.models import tiny_model

HYBRID = dict(sliding_window=8, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
IDS = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))  # 3x the window of 8


def max_logit_gap(model, cache_a, cache_b, model_b=None) -> float:
    a = decode_mode_logits(model, IDS, 8, cache_a)
    b = decode_mode_logits(model_b or model, IDS, 8, cache_b)
    return (a - b).abs().max().item()


def fp8(model, **kwargs):
    return QuantizedFP8Cache(model, scales="dynamic", **kwargs)


def without_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-float("inf"))
    return model


# (model type, attention, config overrides, the same weights without the feature under test). The FP8 cache must
# stay much closer to DynamicCache than dropping the feature moves it, so a cache that ignored the window, the
# softcap or the sinks would fail. gpt-oss stays at the default init: larger weights flip its MoE routing.
FAMILIES = {
    "gemma3 window": ("gemma3_text", "sdpa", HYBRID, lambda: tiny_model("gemma3_text", **{**HYBRID, "sliding_window": 99})),
    "gemma2 softcap": (
        "gemma2", "eager", {**HYBRID, "attn_logit_softcapping": 2.0, "initializer_range": 0.3},
        lambda: tiny_model("gemma2", attn_implementation="eager", **HYBRID, initializer_range=0.3),
    ),
    "gpt-oss sinks": (
        "gpt_oss", "eager", {**HYBRID, "num_local_experts": 4, "num_experts_per_tok": 2},
        lambda: without_sinks(tiny_model("gpt_oss", attn_implementation="eager", **HYBRID, num_local_experts=4,
                                         num_experts_per_tok=2)),
    ),
    "mistral window": ("mistral", "sdpa", {"sliding_window": 8}, lambda: tiny_model("mistral", sliding_window=99)),
    "qwen3 window": (
        "qwen3", "sdpa", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        lambda: tiny_model("qwen3", use_sliding_window=True, sliding_window=99, max_window_layers=1),
    ),
    "llama4 chunked": (
        "llama4_text", "sdpa",
        {"attention_chunk_size": 8, "num_local_experts": 2, "intermediate_size_mlp": 128, "no_rope_layers": [1, 1],
         "layer_types": ["chunked_attention", "full_attention"]},
        lambda: tiny_model("llama4_text", attention_chunk_size=99, num_local_experts=2, intermediate_size_mlp=128,
                           no_rope_layers=[1, 1], layer_types=["chunked_attention", "full_attention"]),
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_stays_close_to_dynamic_cache_and_honours_the_feature(family):
    model_type, attention, overrides, without_feature = FAMILIES[family]
    model = tiny_model(model_type, attn_implementation=attention, **overrides)
    cache = fp8(model)
    sliding = [isinstance(layer, DynamicFP8SlidingLayer) for layer in cache.layers]
    layer_types, _ = get_layer_types_and_kwargs(model.config)
    assert sliding == [kind in ("sliding_attention", "chunked_attention") for kind in layer_types]
    assert any(sliding) and not all(sliding) or model_type == "mistral"
    fp8_gap = max_logit_gap(model, DynamicCache(config=model.config), cache)
    feature_gap = max_logit_gap(model, DynamicCache(config=model.config), DynamicCache(), without_feature())
    assert fp8_gap < feature_gap / 8, (fp8_gap, feature_gap)
    # sliding layers hold one window (plus buffer slack), full layers every token
    for layer in cache.layers:
        assert layer.capacity <= (16 + 2 * 64 if layer.is_sliding else IDS.shape[1] + 64)


@pytest.mark.parametrize("family", ["gemma3 window", "gpt-oss sinks"])
def test_greedy_prompt_longer_than_window_agrees_by_top_k_rule(family):
    model_type, attention, overrides, _ = FAMILIES[family]
    model = tiny_model(model_type, attn_implementation=attention, **overrides)
    inputs = {"input_ids": IDS[:, :20]}
    ref_tokens, ref_logits = greedy_with_logits(model, inputs, DynamicCache(config=model.config), 12)
    tokens, logits = greedy_with_logits(model, inputs, fp8(model), 12)
    assert topk_rule(ref_tokens[0], ref_logits[0], tokens[0], logits[0])[1]


def test_left_padded_batch_on_hybrid_model_matches_the_prompt_alone():
    model = tiny_model("gemma3_text", **HYBRID)
    long, short = IDS[:, :20], IDS[:, 12:24]
    batch = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :8] = 0

    def last_logits(cache, ids, attention_mask):
        out = model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False,
                             past_key_values=cache, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        return torch.stack(out.scores, dim=1)

    alone = last_logits(fp8(model), short, torch.ones_like(short))[0]
    padded_gap = (last_logits(fp8(model), batch, mask)[1] - alone).abs().max().item()
    unmasked_gap = (last_logits(fp8(model), batch, torch.ones_like(mask))[1] - alone).abs().max().item()
    # the padded row reads the same tokens as the prompt alone (the gap is rounding noise); attending to the
    # padding, as a cache that lost the mask would, moves it far more
    assert padded_gap < unmasked_gap / 100, (padded_gap, unmasked_gap)


@pytest.mark.parametrize(
    "skip_layers,expected",
    [
        ("sliding_window", [DynamicSlidingWindowLayer, DynamicFP8Layer, DynamicSlidingWindowLayer, DynamicFP8Layer]),
        (["sliding_window", 1], [DynamicSlidingWindowLayer, DynamicLayer, DynamicSlidingWindowLayer, DynamicFP8Layer]),
        ("sliding_window,3", [DynamicSlidingWindowLayer, DynamicFP8Layer, DynamicSlidingWindowLayer, DynamicLayer]),
        ([3], [DynamicFP8SlidingLayer, DynamicFP8Layer, DynamicFP8SlidingLayer, DynamicLayer]),
        ("", [DynamicFP8SlidingLayer, DynamicFP8Layer, DynamicFP8SlidingLayer, DynamicFP8Layer]),  # a flag's default
    ],
)
def test_skip_layers_spellings(skip_layers, expected):
    config = AutoConfig.for_model(
        "gemma3_text", num_hidden_layers=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2
    )
    cache = QuantizedFP8Cache(config=config, scales="dynamic", skip_layers=skip_layers)
    assert [type(layer) for layer in cache.layers] == expected
    with pytest.raises(ValueError, match=r"skip_layers \['sliding', 7\]"):
        QuantizedFP8Cache(config=config, scales="dynamic", skip_layers=["sliding", 7])


def test_skipped_sliding_layers_are_bit_identical_to_dynamic_cache():
    model = tiny_model("gemma3_text", **HYBRID)
    cache = fp8(model, skip_layers=[0, 1])
    assert max_logit_gap(model, DynamicCache(config=model.config), cache) == 0.0


@pytest.mark.parametrize(
    "model_type,overrides,message",
    [
        ("deepseek_v3", {"kv_lora_rank": 16}, "model type 'deepseek_v3' caches MLA latents"),
        ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2},
         "layer 0 of model type 'qwen3_next' is a 'linear_attention' layer"),
        ("jamba", {"num_hidden_layers": 2}, "layer 0 of model type 'jamba' is a 'linear_attention' layer"),
        ("t5", {}, "model type 't5' is encoder-decoder"),
    ],
)
def test_refused_models_name_the_model_type_and_layer(model_type, overrides, message):
    config = AutoConfig.for_model(model_type, **overrides)
    with pytest.raises(ValueError, match=message):
        QuantizedFP8Cache(config=config, scales="dynamic")
