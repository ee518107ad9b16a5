"""Outlier tokens (`hf_fp8kv/outliers.py`): per layer and KV head, the coded tokens of smallest key L1 norm over the
running mean kept exact beside the sinks, on the dynamic and static caches, both backends."""

import math

import pytest
import torch
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from tests.models import tiny_model

PROMPTS = torch.tensor([[0, 0, 0, 0, 0, 5, 17, 42, 8, 99, 3, 14, 77, 21, 9, 60, 33, 12, 48, 90, 7, 65, 31, 26],
                        [23, 64, 11, 3, 7, 120, 1, 9, 51, 4, 88, 16, 72, 45, 30, 19, 56, 93, 27, 70, 5, 38, 11, 84]])
PADDING = (PROMPTS != 0).long()
PADDING[1] = 1
WINDOW = dict(scales="dynamic", recent_tokens=4, sink_tokens=2, outlier_tokens=3)


def expected_outliers(keys: torch.Tensor, coded_end: int, first_real: list[int], count: int) -> list[list[set]]:
    """The set the rule keeps, computed from every key at once: for row b and head h, the `count` best scores
    `-|k_t|_1 / mean(|k_i|_1, first_real[b] <= i <= t)` of the coded tokens `[first_real[b], coded_end)` (a running
    top-`count` ends as the top-`count` of all the scores it saw)."""
    norms = keys.float().abs().sum(-1)  # [batch, heads, tokens]
    kept = []
    for row, first in enumerate(first_real):
        row_norms = norms[row, :, first:coded_end]
        mean = row_norms.cumsum(-1) / torch.arange(1, row_norms.shape[-1] + 1)
        score = -row_norms / mean
        best = score.topk(min(count, score.shape[-1]), dim=-1).indices + first
        kept.append([set(head.tolist()) for head in best])
    return kept


def layer_outliers(layer) -> list[list[set]]:
    return [[{t for t in head.tolist() if t >= 0} for head in row] for row in layer.outlier_pos[0]]


@pytest.mark.parametrize("static", [False, True])
def test_the_kept_set_is_the_rule_over_every_coded_token(static):
    """Fed a prefill then decode steps, each layer keeps per row and head the coded tokens of best score (never
    padding, sinks or recent tokens), their exact K/V, and their key scales negated (no other one)."""
    model = tiny_model()
    cache = QuantizedFP8Cache(model, max_cache_len=64 if static else None, **WINDOW)
    captured = {}
    for layer_index, module in enumerate(model.model.layers):  # the keys as the cache receives them
        original = cache.layers[layer_index].update

        def update(key, value, *args, _original=original, _i=layer_index, **kwargs):
            captured[_i] = torch.cat((captured[_i], key), dim=2) if _i in captured else key
            return _original(key, value, *args, **kwargs)

        cache.layers[layer_index].update = update
    ids, mask = PROMPTS, PADDING
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
        for step in range(6):
            mask = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1)
            model(input_ids=torch.tensor([[40 + step], [50 + step]]), attention_mask=mask, **cache_kwargs(cache))
    end = PROMPTS.shape[1] + 6
    for index, layer in enumerate(cache.layers):
        keys = captured[index]
        expected = expected_outliers(keys, end - 4, [5 + 2, 0 + 2], 3)
        assert layer_outliers(layer) == expected
        negative = layer.scale[0][..., : end - 4] < 0
        for row in range(2):
            for head in range(2):
                assert set(negative[row, head].nonzero().flatten().tolist()) == expected[row][head]
                for slot, t in enumerate(layer.outlier_pos[0, row, head].tolist()):
                    assert torch.equal(layer.outlier_kv[0, row, head, slot], keys[row, head, t])


@pytest.mark.parametrize("backend, static, dtype", [("triton", False, torch.float32), ("triton", True, torch.bfloat16),
                                                    ("triton", False, torch.float16), ("torch", True, torch.float32)],
                         ids=str)  # fmt: skip
def test_generate_with_outliers_on_both_backends(backend, static, dtype):
    """Left-padded greedy generation over dynamic and static caches in each dtype: the tokens kept are exact and
    change the logits (fp32), and the Triton kernels give the torch path's logits."""
    model = tiny_model().to(dtype)

    def logits(backend: str, outliers: int) -> torch.Tensor:
        cache = QuantizedFP8Cache(model, backend=backend, max_cache_len=64 if static else None,
                                  **{**WINDOW, "outlier_tokens": outliers})  # fmt: skip
        out = model.generate(input_ids=PROMPTS, attention_mask=PADDING, max_new_tokens=5, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **cache_kwargs(cache))  # fmt: skip
        assert not outliers or (cache.layers[0].outlier_pos >= 0).all()
        return torch.stack(out.logits).float()

    ours = logits(backend, 3)
    if dtype == torch.float32:
        assert not torch.equal(ours, logits(backend, 0))
    if backend == "triton":
        tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
        torch.testing.assert_close(ours, logits("torch", 3), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("static", [False, True])
def test_sliding_layers_keep_outliers_within_their_window(static):
    """A hybrid model: sliding layers keep outlier tokens too, only ones their window still shows (a kept token a
    window behind leaves the set), also in a static layer's ring once it wraps; both backends agree."""
    model = tiny_model("gemma3_text", sliding_window=12, layer_types=["sliding_attention", "full_attention"])
    logits = []
    for backend in ("torch", "triton"):
        cache = QuantizedFP8Cache(model, backend=backend, max_cache_len=40 if static else None, **WINDOW)
        out = model.generate(input_ids=PROMPTS, attention_mask=PADDING, max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **cache_kwargs(cache))  # fmt: skip
        logits.append(torch.stack(out.logits))
        sliding, full = cache.layers
        end = PROMPTS.shape[1] + 6 - 1  # (the last token's K/V are not written)
        kept = sliding.outlier_pos[0][sliding.outlier_pos[0] >= 0]
        assert len(kept) and (kept >= end - 12).all()
        assert (full.outlier_pos >= 0).all() and (full.outlier_pos < end - 12).any()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_a_window_over_every_token_keeps_no_outlier(static):
    """No token gets codes, so none enters: the logits are DynamicCache's."""
    model = tiny_model()
    out = model.generate(input_ids=PROMPTS, attention_mask=PADDING, max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **cache_kwargs(DynamicCache(config=model.config)))  # fmt: skip
    cache = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=40, sink_tokens=2, outlier_tokens=4,
                              max_cache_len=40 if static else None)  # fmt: skip
    ours = model.generate(input_ids=PROMPTS, attention_mask=PADDING, max_new_tokens=4, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, **cache_kwargs(cache))  # fmt: skip
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(out.logits), rtol=1e-5, atol=1e-5)
    assert all((layer.outlier_pos < 0).all() for layer in cache.layers)


@pytest.mark.parametrize("static", [False, True])
def test_crop_and_reset_forget_outliers_and_restore_their_scales(static):
    model = tiny_model()
    cache = QuantizedFP8Cache(model, max_cache_len=64 if static else None, **WINDOW)
    with torch.no_grad():
        model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache))
    layer = cache.layers[0]
    kept = layer.outlier_pos[0].clone()
    cut = int(kept[kept >= 0].float().median())
    cache.crop(cut - PROMPTS.shape[1])  # to `cut` tokens
    assert ((layer.outlier_pos[0] >= 0) == ((kept >= 0) & (kept < cut))).all()
    assert (layer.outlier_score[0][layer.outlier_pos[0] < 0] == -math.inf).all()
    negative = (layer.scale[0][..., :cut] < 0).nonzero().tolist()
    assert sorted(negative) == sorted([b, h, t] for b, h, t in zip(*torch.where(layer.outlier_pos[0] >= 0)[:2],
                                                                   layer.outlier_pos[0][layer.outlier_pos[0] >= 0].tolist()))  # noqa
    if static:  # the dropped ones' slots made positive (a dynamic layer releases them)
        assert (layer.scale[0][..., cut : PROMPTS.shape[1] - 4] > 0).all()
    cache.reset()
    if static:
        assert (layer.outlier_pos < 0).all() and (layer.outlier_norms == 0).all()
    with torch.no_grad():  # a fresh start: the rule over the new tokens only
        model(input_ids=PROMPTS[:, :10], attention_mask=PADDING[:, :10], **cache_kwargs(cache))
    assert layer.outlier_norms[1].tolist() == [[0.0, 0.0], [4.0, 4.0]]  # row 0: 5 padding + 2 sinks of 6 coded


@pytest.mark.parametrize("method", [dict(num_beams=2), dict(prompt_lookup_num_tokens=2)], ids=["beams", "assisted"])
def test_beams_and_assisted_decoding_with_outliers(method):
    """Beam reordering moves each row's outliers with it, and assisted decoding's crops drop those of rejected
    tokens, on both backends: the Triton backend's tokens are the torch path's. (Each backend runs once: a torch
    case beside this one generated twice with the torch path and compared it with itself.)"""
    model = tiny_model()
    prompt = torch.tensor([[5, 17, 42, 8, 99, 5, 17, 42, 8, 3, 5, 17, 42, 8, 99, 21]])
    out = {}
    for name in ("torch", "triton"):
        cache = QuantizedFP8Cache(model, **WINDOW, backend=name)
        out[name] = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, **cache_kwargs(cache), **method)
        assert (cache.layers[0].outlier_pos >= 0).all()
    assert torch.equal(out["triton"], out["torch"])


def test_outliers_need_per_token_scales_and_a_count():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"outlier_tokens=4 needs per-token scales \(scales='dynamic'\)"):
        QuantizedFP8Cache(model, scales=0.5, outlier_tokens=4)
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="outlier_tokens"):
            QuantizedFP8Cache(model, scales="dynamic", outlier_tokens=bad)


def test_outlier_buffers_count_in_the_bytes_held():
    model = tiny_model()
    caches = [QuantizedFP8Cache(model, **{**WINDOW, "outlier_tokens": n}) for n in (0, 3)]
    for cache in caches:
        with torch.no_grad():
            model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache))
    per_layer = 2 * 2 * 2 * 3 * 16 * 4 + 2 * 2 * 3 * (8 + 4) + 2 * 2 * 2 * 4  # K/V, positions + scores, norms
    assert caches[1].nbytes == caches[0].nbytes + 2 * per_layer
    assert [row["recent+sinks"] for row in caches[1].summary()] == ["4+2 +3 outliers"] * 2


@pytest.mark.parametrize("settings", [dict(kv_cache_dtype="fp8_e5m2"), dict(kv_cache_dtype="int8_per_token_head"),
                                      dict(kv_cache_dtype="fp8_e4m3fnuz", rotate=True)], ids=str)  # fmt: skip
def test_every_format_and_rotated_codes(settings):
    """Outliers over the other storage formats and over rotated codes (kept as they came, like the sinks): the
    Triton backend's logits are the torch path's."""
    model = tiny_model()
    logits = []
    for backend in ("torch", "triton"):
        cache = QuantizedFP8Cache(model, backend=backend, **WINDOW, **settings)
        out = model.generate(input_ids=PROMPTS, attention_mask=PADDING, max_new_tokens=4, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **cache_kwargs(cache))  # fmt: skip
        logits.append(torch.stack(out.logits))
        assert (cache.layers[0].outlier_pos >= 0).all()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_a_pickled_cache_continues_with_its_outliers():
    import pickle

    model = tiny_model()
    cache = QuantizedFP8Cache(model, **WINDOW)
    with torch.no_grad():
        model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache))
        copy = pickle.loads(pickle.dumps(cache))
        mask = torch.cat((PADDING, torch.ones(2, 1, dtype=PADDING.dtype)), dim=1)
        step = torch.tensor([[40], [50]])
        logits = [model(input_ids=step, attention_mask=mask, **cache_kwargs(c)).logits for c in (cache, copy)]
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(copy.layers[0].outlier_pos, cache.layers[0].outlier_pos)
