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


def _launched(monkeypatch) -> list[str]:
    """The Triton kernels launched from here on, by name."""
    from hf_fp8kv.kernels import triton_attention, triton_launch, triton_write

    names = []

    def launch_all(launches, device):
        names.extend(launch.kernel.fn.__name__ for launch in launches)
        triton_launch.launch_all(launches, device)

    for module in (triton_attention, triton_write):
        monkeypatch.setattr(module, "launch_all", launch_all)
    return names


@pytest.mark.parametrize("cache_kwargs", [dict(scales="dynamic"), dict(scales="dynamic", max_cache_len=16)],
                         ids=["dynamic", "static"])  # fmt: skip
def test_a_decode_step_is_one_launch_per_layer(model, monkeypatch, cache_kwargs):
    """The attention launch writes a decode step's token (`NewToken`): no write launch of its own, and the layer
    it leaves holds what the torch backend's holds."""
    caches = {backend: QuantizedFP8Cache(model, backend=backend, **cache_kwargs) for backend in ("torch", "triton")}
    for cache in caches.values():
        model(input_ids=PROMPTS[1:, :7], past_key_values=cache)
    launched = _launched(monkeypatch)
    for cache in caches.values():
        model(input_ids=PROMPTS[1:, 7:], past_key_values=cache)
    assert launched == ["_attention_kernel"] * model.config.num_hidden_layers
    # (the first layer's: the later ones' inputs differ by the attention's rounding)
    torch_layer, triton_layer = (cache.layers[0] for cache in caches.values())
    assert all(map(torch.equal, triton_layer.dequantized(), torch_layer.dequantized()))
    assert torch.equal(triton_layer.stats, torch_layer.stats)


def test_an_update_no_attention_reads_is_written_when_the_layer_is_read(model, monkeypatch):
    """A one-token `update` called directly (no attention launch follows to write it): the layer's next read
    writes it first, whichever read it is."""
    caches = {backend: QuantizedFP8Cache(model, backend=backend, scales="dynamic") for backend in ("torch", "triton")}
    for cache in caches.values():
        model(input_ids=PROMPTS, attention_mask=PADDING, past_key_values=cache)
    key, value = torch.randn(2, 2, model.config.num_key_value_heads, 1, model.config.head_dim).unbind()
    reads = [
        lambda layer: layer.key_codes.view(torch.uint8), lambda layer: layer.value_scale, lambda layer: layer.clipped,
        lambda layer: layer.dequantized()[1],
    ]  # fmt: skip
    for read in reads:
        for cache in caches.values():
            cache.layers[0].update(key, value)
        assert caches["triton"].layers[0].pending is not None
        assert torch.equal(read(caches["triton"].layers[0]), read(caches["torch"].layers[0]))
        assert caches["triton"].layers[0].pending is None
    for cache in caches.values():  # a batch operation, then a crop
        cache.layers[0].update(key, value)
        cache.batch_select_indices(torch.tensor([1]))
        cache.layers[0].update(key[1:], value[1:])
        cache.crop(-1)
    assert all(map(torch.equal, caches["triton"].layers[0].dequantized(), caches["torch"].layers[0].dequantized()))
