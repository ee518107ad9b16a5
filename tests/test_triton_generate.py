"""End to end: generate through the Triton kernels (the interpreter on CPU) equals the torch backend."""

import pytest
import torch

from hf_fp8kv import QuantizedFP8Cache
from tests.models import tiny_model

PROMPTS = torch.tensor([[0, 0, 0, 5, 17, 42, 8, 99], [23, 64, 11, 3, 7, 120, 1, 9]])
PADDING = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def generate(model, backend, batch, **cache_kwargs):
    cache = QuantizedFP8Cache(model, backend=backend, **cache_kwargs)
    out = model.generate(
        input_ids=PROMPTS[-batch:],
        attention_mask=PADDING[-batch:],
        max_new_tokens=4,
        do_sample=False,
        past_key_values=cache,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert {layer.backend.name for layer in cache.layers} == {backend}
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize(
    "batch,cache_kwargs",
    [
        (2, dict(scales="dynamic")), (1, dict(scales=0.05)), (1, dict(kv_cache_dtype="int8_per_token_head")),
        (2, dict(scales="dynamic", rotate=True, recent_tokens=3, sink_tokens=1)),
        (1, dict(kv_cache_dtype="fp8_e5m2", scales="dynamic", rotate=True, recent_tokens=0, sink_tokens=0)),
        (2, dict(scales="dynamic", rotate=True, recent_tokens=2, sink_tokens=1, max_cache_len=16)),
    ],
    ids=["fp8-dynamic-left-padded", "fp8-static", "int8", "rotated-left-padded", "rotated-e5m2", "rotated-static"],
)  # fmt: skip
def test_triton_backend_generates_what_torch_generates(model, batch, cache_kwargs):
    tokens, logits = generate(model, "torch", batch, **cache_kwargs)
    triton_tokens, triton_logits = generate(model, "triton", batch, **cache_kwargs)
    assert torch.equal(triton_tokens, tokens)
    torch.testing.assert_close(triton_logits, logits, rtol=1e-4, atol=1e-4)


def test_environment_variable_selects_the_backend(model, monkeypatch):
    monkeypatch.setenv("HF_FP8KV_BACKEND", "triton")
    cache = QuantizedFP8Cache(model, scales="dynamic")
    model(input_ids=PROMPTS[1:, :3], past_key_values=cache)
    assert {layer.backend.name for layer in cache.layers} == {"triton"}


def test_fp8_prefill_reaches_the_kernels_and_keeps_the_logits_close():
    """`QuantizedFP8Cache(fp8_prefill=True)`: an fp16 model's prefill of 72 tokens (128-row tiles: 2 query heads per
    KV head) runs its dots on e4m3 operands; its logits move, by about what the query's rounding costs."""
    model = tiny_model().half()
    prompt = torch.randint(1, 120, (1, 72), generator=torch.Generator().manual_seed(0))

    def prefill_logits(**cache_kwargs):
        cache = QuantizedFP8Cache(model, backend="triton", scales=0.05, recent_tokens=0, sink_tokens=0, **cache_kwargs)
        logits = model(input_ids=prompt, past_key_values=cache).logits.float()
        assert {layer.kernels.fp8_prefill for layer in cache.layers} == {bool(cache_kwargs)}
        return logits

    fp16, fp8 = prefill_logits(), prefill_logits(fp8_prefill=True)
    difference = ((fp8 - fp16).abs().mean() / fp16.abs().mean()).item()
    assert 0 < difference < 0.05
