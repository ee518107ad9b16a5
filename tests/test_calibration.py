"""`calibrate`: SmolLM2 on the built-in text (keys as the cache sees them, save/reload with vLLM's names,
quality against scale 1.0 on held-out text), and the data forms and options on a tiny random Llama."""

import json
import warnings
from importlib.resources import files

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, DynamicCache

from hf_fp8kv import KVScales, QuantizedFP8Cache, UncalibratedScalesWarning, calibrate
from hf_fp8kv.bundled import smollm2_dir
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.evaluate import decode_mode_logits, quality
from tests.models import PURE_FP8, smollm2, tiny_model

CALIBRATION_TOKENS = 128


@pytest.fixture(scope="module")
def paragraphs():
    text = (files("hf_fp8kv") / "data" / "sample_text.txt").read_text()
    return [p for p in text.split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def smollm2_scales(paragraphs):
    """Per-head scales with key channels from the first three paragraphs (held-out text comes from the end)."""
    model, tokenizer = smollm2()
    texts = paragraphs[:3]
    scales = calibrate(model, texts, tokenizer, strategy="attn_head", key_channels=True,
                       max_length=CALIBRATION_TOKENS, progress=False)  # fmt: skip
    return scales, texts


def test_scales_are_the_amax_of_the_keys_the_cache_sees(smollm2_scales):
    """Independent check: the keys and values a DynamicCache stores (after RoPE) over the same texts."""
    model, tokenizer = smollm2()
    scales, texts = smollm2_scales
    amax = {}
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :CALIBRATION_TOKENS]
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
        last = {}
        for i, layer in enumerate(cache.layers):
            last[i] = (layer.keys.abs().amax(dim=(0, 2, 3)), layer.values.abs().amax(dim=(0, 2, 3)))
            amax[i] = tuple(torch.maximum(a, b) for a, b in zip(amax.get(i, last[i]), last[i]))
    for i in range(len(amax)):
        torch.testing.assert_close(scales.key[i] * 448, amax[i][0], rtol=1e-6, atol=0)
        torch.testing.assert_close(scales.value[i] * 448, amax[i][1], rtol=1e-6, atol=0)
        channel = scales.key_channel[i]
        assert channel.shape == (3, 64) and channel.amax(dim=1).tolist() == [1.0, 1.0, 1.0] and channel.min() > 0
    # min-max over the whole set: the last text alone would give smaller scales somewhere
    assert any((last[i][0] < amax[i][0]).any() for i in last)


def test_save_and_reload_with_vllm_names(smollm2_scales, tmp_path):
    scales, _ = smollm2_scales
    path = scales.save(tmp_path / "smollm2_kv.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())
        scheme = json.loads(handle.metadata()["kv_cache_scheme"])
        assert handle.get_tensor("model.layers.29.self_attn.v_scale").shape == (3, 1, 1)
    assert {f"model.layers.{i}.self_attn.{w}_scale" for i in range(30) for w in "kv"} <= names
    assert scheme == {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}
    reloaded = KVScales.load(path)
    for i in range(30):
        assert torch.equal(reloaded.key[i].flatten(), scales.key[i])
        assert torch.equal(reloaded.value[i].flatten(), scales.value[i])
        assert torch.equal(reloaded.key_channel[i], scales.key_channel[i])


def test_export_for_vllm_of_the_smollm2_directory(smollm2_scales, tmp_path):
    from hf_fp8kv.bundled import smollm2_dir

    scales, _ = smollm2_scales
    with pytest.warns(UserWarning, match="no per-channel key scales"):
        out = scales.export_for_vllm(smollm2_dir(), tmp_path / "smollm2-fp8kv")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    weights = out / "model.safetensors"
    assert weights.is_file() and not weights.is_symlink() and (out / "tokenizer_config.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors", "kv_cache_scales.safetensors"}
    reloaded = KVScales.from_pretrained(out)
    assert all(torch.equal(reloaded.key[i].flatten(), scales.key[i]) for i in range(30))
    assert not reloaded.key_channel


def test_calibrated_static_holds_its_own_against_scale_one_in_decode_mode(smollm2_scales, paragraphs):
    """SmolLM2's K/V stay far below 448 (|k| <= 20), so scale 1.0 does not saturate and e4m3's relative
    precision does not depend on the scale: on 831 held-out tokens calibrated per-tensor and 1.0 are within 5%
    in mean KL (docs/scales.md), and on this 120-token text calibrated is ahead. A broken calibration (wrong
    keys, saturating scales) would be far behind."""
    model, tokenizer = smollm2()
    scales, _ = smollm2_scales
    per_tensor = KVScales(key={i: k.amax().reshape(1) for i, k in scales.key.items()},
                          value={i: v.amax().reshape(1) for i, v in scales.value.items()})  # fmt: skip
    ids = tokenizer(paragraphs[-2], return_tensors="pt").input_ids[:, :150]
    prefix = 30
    with torch.inference_mode():  # an unquantized cache: one pass gives the decode-mode logits
        reference = model(input_ids=ids, **cache_kwargs(DynamicCache(config=model.config))).logits[0, prefix - 1 : -1].float()
    results = {}
    for name, given in (("1.0", 1.0), ("calibrated", per_tensor)):
        logits = decode_mode_logits(model, ids, prefix, QuantizedFP8Cache(model, scales=given, **PURE_FP8))
        results[name] = quality(reference, logits, ids[0, prefix:])
    assert results["calibrated"].kl_mean < 1.1 * results["1.0"].kl_mean, results


def test_calibrated_static_beats_scale_one_on_an_outlier_model():
    """Values far beyond 448 in one layer (outlier-heavy models): scale 1.0 saturates them, calibration does not."""
    model = tiny_model(num_hidden_layers=3)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.mul_(1e4)
    generator = torch.Generator().manual_seed(3)
    calibration = torch.randint(0, 128, (4, 32), generator=generator)
    held_out = torch.randint(0, 128, (1, 40), generator=generator)
    scales = calibrate(model, calibration, progress=False)
    reference = decode_mode_logits(model, held_out, 8, DynamicCache(config=model.config))
    results, clipped = {}, {}
    for name, given in (("1.0", 1.0), ("calibrated", scales)):
        cache = QuantizedFP8Cache(model, scales=given, **PURE_FP8)
        results[name] = quality(reference, decode_mode_logits(model, held_out, 8, cache), held_out[0, 8:])
        clipped[name] = cache.summary()[1]["clipped"]
    assert clipped["1.0"] > 500 and results["calibrated"].kl_mean < 0.05 * results["1.0"].kl_mean, results


# --- data forms and options on a tiny model ------------------------------------------------------------------
def test_padded_dataloader_equals_the_samples_one_by_one():
    model = tiny_model()
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 128, (n,), generator=generator) for n in (9, 16, 5)]
    alone = calibrate(model, samples, strategy="attn_head", percentile=99.0, progress=False)
    batch = {"input_ids": torch.zeros(3, 16, dtype=torch.long), "attention_mask": torch.zeros(3, 16, dtype=torch.long)}
    for row, sample in enumerate(samples):  # right padding with token 0, which is never attended nor counted
        batch["input_ids"][row, : len(sample)] = sample
        batch["attention_mask"][row, : len(sample)] = 1
    loader = torch.utils.data.DataLoader([{k: v[i] for k, v in batch.items()} for i in range(3)], batch_size=3)
    padded = calibrate(model, loader, strategy="attn_head", percentile=99.0, progress=False)
    for i in (0, 1):
        torch.testing.assert_close(padded.key[i], alone.key[i], rtol=1e-5, atol=0)
        torch.testing.assert_close(padded.value[i], alone.value[i], rtol=1e-5, atol=0)
    assert padded.sources[0] == "calibrated (30 tokens, attn_head)"


def test_strategies_and_percentile_clipping():
    model = tiny_model()
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    per_tensor = calibrate(model, ids, progress=False)
    per_head = calibrate(model, ids, strategy="attn_head", progress=False)
    clipped = calibrate(model, ids, percentile=50.0, progress=False)
    for i in (0, 1):
        assert per_tensor.key[i].shape == (1,) and per_head.key[i].shape == (2,)
        assert per_tensor.key[i] == per_head.key[i].amax() and per_tensor.value[i] == per_head.value[i].amax()
        assert clipped.key[i] < per_tensor.key[i] and clipped.value[i] < per_tensor.value[i]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedScalesWarning)
        min_max, median = (QuantizedFP8Cache(model, scales=s, **PURE_FP8) for s in (per_tensor, clipped))
    for cache in (min_max, median):
        model(input_ids=ids[:1], **cache_kwargs(cache))
    assert sum(r["clipped"] for r in min_max.summary()) == 0 < sum(r["clipped"] for r in median.summary())


def test_token_strategy_calibrates_key_channels_for_per_token_scales(tmp_path):
    """strategy="token": per-token scales at run time with per-channel key scales (each channel's max over its
    head's, no headroom, rounded up to a power of two); the cache reports them, a file keeps them, vLLM's export
    refuses them."""
    model = tiny_model()
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    token = calibrate(model, ids, strategy="token", key_channels=True, progress=False)
    per_head = calibrate(model, ids, strategy="attn_head", key_channels=True, progress=False)
    assert token.dynamic and token.key == {} and token.value == {} and sorted(token.key_channel) == [0, 1]
    for i in (0, 1):  # the same channel maxima, without per_head's 4x headroom (capped at 1)
        torch.testing.assert_close(per_head.key_channel[i], (4 * token.key_channel[i]).clamp_max(1.0))
        assert token.key_channel[i].amax(dim=1).tolist() == [1.0, 1.0]
        exponents = torch.log2(token.key_channel[i])  # powers of two (the recent keys stay exact)
        assert torch.equal(exponents, exponents.round())
    path = token.save(tmp_path / "token.safetensors")
    loaded = KVScales.load(path)
    assert loaded.dynamic and all(torch.equal(loaded.key_channel[i], token.key_channel[i]) for i in (0, 1))
    for scales in (token, path):
        rows = QuantizedFP8Cache(model, kv_cache_dtype="int8_per_token_head", scales=scales).summary()
        assert {(r["granularity"], r["k_scale"], r["v_scale"]) for r in rows} == {
            ("per-token-head + key channels", "per token x channel", "per token")
        }
    with pytest.raises(ValueError, match="dynamic scales have no tensors for vLLM"):
        token.export_for_vllm(smollm2_dir(), tmp_path / "export")
    with pytest.raises(ValueError, match="strategy='token' calibrates only per-channel key scales"):
        calibrate(model, ids, strategy="token", progress=False)


@pytest.mark.parametrize(
    "data,kwargs,error,match",
    [
        (["some text"], {}, ValueError, "pass tokenizer="),
        ([3.5], {}, TypeError, "data item of type float"),
        ([], {}, ValueError, "calibration saw no keys"),
        ([torch.tensor([1, 2])], {"strategy": "channel"}, ValueError, "strategy='channel'"),
        ([torch.tensor([1, 2])], {"percentile": 0}, ValueError, r"percentile=0 must be in \(0, 100\]"),
        ([torch.tensor([1, 2])], {"max_length": 0}, ValueError, r"max_length=0 must be an int >= 1"),
    ],
)
def test_bad_calibration_input(data, kwargs, error, match):
    with pytest.raises(error, match=match):
        calibrate(tiny_model(), data, progress=False, **kwargs)


def test_a_sample_of_zero_tokens_is_skipped_with_a_warning_naming_it():
    """An empty text (a blank line of a data set) has no tokens to observe (the forward fails on it): skipped,
    named in a warning; the scales are those of the other samples. Nothing but empty samples is an error."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = tiny_model(vocab_size=len(tokenizer))
    texts = ["The keeper wrote the weather down.", "", "Six every morning and six every evening."]
    with pytest.warns(UserWarning, match=r"calibrate skipped 1 sample\(s\) of zero tokens: data\[1\]$"):
        skipping = calibrate(model, texts, tokenizer, progress=False)
    kept = calibrate(model, texts[::2], tokenizer, progress=False)
    assert skipping.sources == kept.sources
    for i in (0, 1):
        assert torch.equal(skipping.key[i], kept.key[i]) and torch.equal(skipping.value[i], kept.value[i])
    with pytest.warns(UserWarning, match=r"data\[0\], data\[1\]$"), pytest.raises(ValueError, match="zero tokens"):
        calibrate(model, ["", ""], tokenizer, progress=False)
