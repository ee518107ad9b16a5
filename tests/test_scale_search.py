"""Per-token scales searched within an octave (`hf_fp8kv/scale_search.py`): each coded token's scale is the
oracle's (`reference.searched_scale`) under the weights of the queries its layer read before it was coded, on
the dynamic and static caches; generation across dtypes, padding, sliding layers, rotated codes, per-channel key
scales, outliers, beams, crop and reset."""

import pickle

import pytest
import torch

from hf_fp8kv import KVScales, QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.rotation import hadamard
from hf_fp8kv.layer import QuantizedKV
from tests.models import tiny_model

PROMPTS = torch.tensor([[0, 0, 0, 0, 0, 5, 17, 42, 8, 99, 3, 14, 77, 21, 9, 60, 33, 12, 48, 90, 7, 65, 31, 26],
                        [23, 64, 11, 3, 7, 120, 1, 9, 51, 4, 88, 16, 72, 45, 30, 19, 56, 93, 27, 70, 5, 38, 11, 84]])
PADDING = (PROMPTS != 0).long()
PADDING[1] = 1
SEARCH = dict(scales="dynamic", backend="torch", recent_tokens=4, sink_tokens=2, scale_search=16)
STEPS = 6


def key_channels(model) -> KVScales:
    """Per-token scales with per-channel key scales (2 KV heads x 16 channels per layer)."""
    generator = torch.Generator().manual_seed(5)
    layers = model.config.num_hidden_layers
    return KVScales(dynamic=True, key_channel={i: torch.rand(2, 16, generator=generator) + 0.5 for i in range(layers)})


def feed(model, cache, keys: dict | None = None) -> None:
    """A left-padded prefill of PROMPTS then STEPS decode steps of fixed tokens through `cache`; `keys`: filled with
    each layer's keys and values as the cache received them (layer -> `[2, batch, kv_heads, tokens, head_dim]`)."""
    if keys is not None:
        for index, layer in enumerate(cache.layers):
            update = layer.update

            def recording_update(key, value, *args, _update=update, _i=index, **kwargs):
                new = torch.stack((key, value))
                keys[_i] = torch.cat((keys[_i], new), 3) if _i in keys else new
                return _update(key, value, *args, **kwargs)

            layer.update = recording_update
    mask = PADDING
    with torch.no_grad():
        model(input_ids=PROMPTS, attention_mask=mask, **cache_kwargs(cache))
        for step in range(STEPS):
            mask = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1)
            model(input_ids=torch.tensor([[40 + step], [50 + step]]), attention_mask=mask, **cache_kwargs(cache))


CODED = PROMPTS.shape[1] + STEPS - 4  # tokens with codes at the end (all but the newest 4)


@pytest.mark.parametrize("kind, static, backend", [
    *[(kind, static, "torch") for kind in ("plain", "rotated", "key channels") for static in (False, True)],
    ("key channels", False, "triton"), ("rotated", True, "triton"),  # (the Triton kernels under the interpreter)
], ids=str)  # fmt: skip
def test_each_token_is_coded_under_the_weights_of_the_queries_before_it(static, kind, backend, monkeypatch):
    """A left-padded prefill then decode steps: each layer's query energy is the sum of the squared queries it
    read (per KV head and channel, in the space the keys are coded in), its weights that energy over each head's
    largest times 255; and every coded token's K and V scales are the oracle's searched scales under the weights
    of the queries read before the update that coded it (none for the prompt's own: weights 1). On both backends
    (Triton: its write kernels, under the interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model()
    extra = {"plain": {}, "rotated": dict(rotate=True), "key channels": dict(scales=key_channels(model))}[kind]
    cache = QuantizedFP8Cache(model, **{**SEARCH, **extra, "backend": backend}, max_cache_len=64 if static else None)
    queries, weights = {}, {}  # layer -> the queries its attention read, its keys' weights after each
    attend = QuantizedKV.attend

    def recording_attend(kv, query, **kwargs):
        out = attend(kv, query, **kwargs)
        queries.setdefault(kv.layer.layer_idx, []).append(query.float())
        weights.setdefault(kv.layer.layer_idx, []).append(reference.search_weights(kv.layer.scale_search.energy))
        return out

    monkeypatch.setattr(QuantizedKV, "attend", recording_attend)
    kv = {}
    feed(model, cache, kv)
    prompt = PROMPTS.shape[1]
    for index, layer in enumerate(cache.layers):
        channel = layer.key_channel_scale
        coded_queries = [q.unflatten(1, (2, -1)) * (1 if channel is None else channel[:, None, None, :])
                         for q in queries[index]]  # fmt: skip
        coded_queries = [hadamard(q) if layer.rotate else q for q in coded_queries]
        energy = sum(q.double().square().sum((0, 2, 3)) for q in coded_queries)
        torch.testing.assert_close(layer.scale_search.energy.double(), energy, rtol=1e-5, atol=0)
        expected_weight = (energy / energy.amax(-1, keepdim=True) * 255).round()
        weight = reference.search_weights(layer.scale_search.energy)
        assert (weight[0, 0, :, 0].double() - expected_weight).abs().max() <= 1  # (fp32 sums)

        stored = kv[index].float()
        stored[0] /= 1 if channel is None else channel[:, None, :]
        stored = hadamard(stored) if layer.rotate else stored
        for t in range(CODED):
            update = max(t + 4 - prompt + 1, 0)  # 0: the prefill; k: decode step k (the one that coded it)
            weight = torch.ones_like(weights[index][0]) if update == 0 else weights[index][update - 1]
            expected = reference.searched_scale(stored[:, :, :, t : t + 1], layer.fmt, torch.bfloat16, 16, weight)
            assert torch.equal(layer.scale[:, :, :, t].float(), expected[..., 0]), (index, t)


@pytest.mark.parametrize("dtype, static", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)],
                         ids=str)  # fmt: skip
def test_searched_scales_lower_the_weighted_key_error(dtype, static):
    """The same tokens in each dtype, on the dynamic and static caches: every coded token's scale lies within the
    octave above its amax scale and most moved; the keys read back have less error weighted by the queries'
    energy than under the amax scales (summed over the layers' coded tokens)."""
    model = tiny_model().to(dtype)
    caches, kv = {}, {}
    for candidates in (0, 16):
        cache = QuantizedFP8Cache(model, **{**SEARCH, "scale_search": candidates}, max_cache_len=64 if static else None)
        kv[candidates] = {}
        feed(model, cache, kv[candidates])
        caches[candidates] = cache
    errors = []
    for candidates, cache in caches.items():
        error = 0.0
        for index, layer in enumerate(cache.layers):
            energy = caches[16].layers[index].scale_search.energy.double()[None, :, None, :]
            keys = kv[candidates][index][0, :, :, :CODED].double()
            read = layer.key_codes[:, :, :CODED].double() * layer.scale[0][..., :CODED, None].double()
            error += float(((keys - read) ** 2 * energy).sum())
        errors.append(error)
    for index, layer in enumerate(caches[16].layers):
        base = reference.dynamic_scale(kv[16][index][:, :, :, :CODED].float(), layer.fmt, torch.bfloat16)
        chosen = layer.scale[..., :CODED].float()
        assert (chosen >= base).all() and (chosen < 2 * base).all() and (chosen > base).float().mean() > 0.5
    assert errors[1] < 0.9 * errors[0], errors


def generated(model, cache, rows: slice = slice(None), **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(input_ids=PROMPTS[rows], attention_mask=PADDING[rows], max_new_tokens=5, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **cache_kwargs(cache), **kwargs)  # fmt: skip
    return out.sequences, torch.stack(out.logits).float()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sliding_layers_on_the_dynamic_and_static_caches(backend, monkeypatch):
    """A hybrid model (a sliding layer whose window the prompt outgrows): both caches code the same tokens under
    the same weights, so their logits agree; both layers read queries. On both backends (Triton: the
    interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model("gemma3_text", sliding_window=12, layer_types=["sliding_attention", "full_attention"])
    results = []
    for static in (False, True):
        cache = QuantizedFP8Cache(model, **{**SEARCH, "backend": backend}, max_cache_len=40 if static else None)
        results.append(generated(model, cache))
        assert all((layer.scale_search.energy > 0).all() for layer in cache.layers)
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", [dict(num_beams=2), dict(prompt_lookup_num_tokens=2, rows=slice(1, 2)), dict()],
                         ids=["beams", "assisted", "greedy"])  # fmt: skip
def test_a_reset_or_pickled_cache_generates_what_a_fresh_one_does(method):
    """Beams, assisted decoding (one row; its crops) and outlier tokens with searched scales: a reset cache forgets
    its layers' queries (energy 0, weights 1) and generates what a fresh cache generates; a pickled copy of a
    filled cache continues as the cache itself does."""
    model = tiny_model()
    settings = {**SEARCH, "outlier_tokens": 3}
    fresh = generated(model, QuantizedFP8Cache(model, **settings), **method)
    cache = QuantizedFP8Cache(model, **settings)
    generated(model, cache, **method)
    cache.reset()
    layer = cache.layers[0]
    assert not layer.scale_search.energy.any()
    again = generated(model, cache, **method)
    assert torch.equal(again[0], fresh[0]) and torch.equal(again[1], fresh[1])
    assert cache.summary()[0]["granularity"] == "per-token-head, searched (16)"

    with torch.no_grad():
        model(input_ids=PROMPTS, attention_mask=PADDING, **cache_kwargs(cache := QuantizedFP8Cache(model, **settings)))
        copy = pickle.loads(pickle.dumps(cache))
        assert torch.equal(copy.layers[1].scale_search.energy, cache.layers[1].scale_search.energy)
        mask = torch.cat((PADDING, torch.ones(2, 1, dtype=PADDING.dtype)), dim=1)
        step = dict(input_ids=torch.tensor([[7], [9]]), attention_mask=mask)
        assert torch.equal(model(**step, **cache_kwargs(copy)).logits, model(**step, **cache_kwargs(cache)).logits)


def test_scale_search_needs_per_token_scales():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"scale_search=16 needs per-token scales \(scales='dynamic'\)"):
        QuantizedFP8Cache(model, scales=0.5, scale_search=16)
    for bad in (3, -1, 256, True, 1.5):
        with pytest.raises(ValueError, match="scale_search"):
            QuantizedFP8Cache(model, scales="dynamic", scale_search=bad)
