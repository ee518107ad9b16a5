"""`layer_sensitivity` on a tiny random Llama with one layer made to saturate at scale 1.0."""

import pytest
import torch
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache, UncalibratedScalesWarning, layer_sensitivity
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.evaluate import decode_mode_logits
from tests.models import PURE_FP8, tiny_model

IDS = [torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]


@pytest.fixture(scope="module")
def model():
    model = tiny_model(num_hidden_layers=4)
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight.mul_(1e4)  # values far beyond 448: saturate at scale 1.0
    return model


def test_the_saturating_layer_ranks_first_and_is_skipped(model):
    with pytest.warns(UncalibratedScalesWarning) as caught:
        report = layer_sensitivity(model, IDS, scales="auto", progress=False)
    assert len([w for w in caught if w.category is UncalibratedScalesWarning]) == 1
    by_layer = {row["layer"]: row for row in report.rows}
    assert sorted(by_layer) == [0, 1, 2, 3]
    assert max(by_layer, key=lambda i: by_layer[i]["kl_mean"]) == 2
    assert by_layer[2]["kl_mean"] > 10 * max(by_layer[i]["kl_mean"] for i in (0, 1, 3))
    assert report.skip_layers == [2] and report.kl_with_skip <= report.target_kl == report.kl_all / 2
    text = str(report)
    assert text.splitlines()[2].split()[0] == "2" and "suggested skip_layers=[2]" in text


def test_one_pass_through_the_cache_is_decode_mode(model):
    """The measurement's premise: our cache quantizes new tokens before attention reads them, so one forward
    pass gives the decode-mode logits (up to batched-vs-single float noise)."""
    ids = IDS[0]
    with torch.inference_mode():
        one_pass = model(input_ids=ids, **cache_kwargs(QuantizedFP8Cache(model, scales=0.01, **PURE_FP8))).logits[0, 7:-1]
    decode = decode_mode_logits(model, ids, 8, QuantizedFP8Cache(model, scales=0.01, **PURE_FP8))
    with torch.inference_mode():
        plain = model(input_ids=ids, **cache_kwargs(DynamicCache(config=model.config))).logits[0, 7:-1]
    error = (one_pass - decode).abs().max()
    assert error < 0.01 * (plain - decode).abs().max()
