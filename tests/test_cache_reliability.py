"""Defects a hostile user found in the cache's storage and kernels (issue: reliability), each with the test that
would have caught it: no state shared between caches, prefill memory linear in the prompt, bf16 on the Triton
interpreter, buffers that shrink after a crop, NaN inputs alike on both backends and counted, sliding crops as
transformers counts them."""

import math
import threading

import pytest
import torch
from hf_fp8kv.kernels.formats import get_format

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.comparison import LiveTensorBytes
from hf_fp8kv.compat import cache_kwargs
from tests.models import PURE_FP8, tiny_model

PROMPT = torch.tensor([[5, 17, 42, 8, 99, 3, 64, 11, 23, 7, 120, 1]])


def test_two_threads_with_two_caches_get_the_sequential_logits():
    """Each cache owns its buffers (no process-wide scratch): concurrent CPU decodes equal sequential ones."""
    models = [tiny_model(seed=seed, num_hidden_layers=2) for seed in (0, 1)]

    def run(model) -> torch.Tensor:
        cache = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=2)
        with torch.no_grad():
            logits = [model(input_ids=PROMPT, **cache_kwargs(cache)).logits[:, -1]]
            for step in range(30):
                logits.append(model(input_ids=PROMPT[:, step % 12 : step % 12 + 1], **cache_kwargs(cache)).logits[:, -1])
        return torch.cat(logits)

    sequential = [run(model) for model in models]
    results = [None, None]

    def worker(i: int) -> None:
        results[i] = run(models[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got, expected in zip(results, sequential):
        assert torch.equal(got, expected)


def _peak_prefill_bytes(model, tokens: int, cache) -> int:
    ids = torch.randint(3, 120, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad(), LiveTensorBytes([]) as live:
        model(input_ids=ids, **cache_kwargs(cache), logits_to_keep=1)
    return live.peak


def test_prefill_memory_is_linear_in_the_prompt():
    from transformers import DynamicCache

    model = tiny_model(num_hidden_layers=2, max_position_embeddings=8192)
    ours = {n: _peak_prefill_bytes(model, n, QuantizedFP8Cache(model, scales="dynamic")) for n in (1024, 4096)}
    native = _peak_prefill_bytes(model, 4096, DynamicCache(config=model.config))
    assert ours[4096] < 5 * ours[1024]  # linear: ~4x (a quadratic score matrix would be 16x)
    assert ours[4096] < 3 * native


def test_bf16_on_the_triton_interpreter_generates_what_torch_does():
    """The interpreter's bf16 dot is broken; the kernels' dots run in fp16, so bf16 models work there too."""
    model = tiny_model().to(torch.bfloat16)
    outputs = {}
    for backend in ("torch", "triton"):
        cache = QuantizedFP8Cache(model, scales="dynamic", backend=backend, recent_tokens=3)
        out = model.generate(input_ids=PROMPT, max_new_tokens=5, do_sample=False, **cache_kwargs(cache),
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        outputs[backend] = (out.sequences, torch.stack(out.logits).float())
    assert torch.equal(outputs["triton"][0], outputs["torch"][0])
    torch.testing.assert_close(outputs["triton"][1], outputs["torch"][1], rtol=0.05, atol=0.05)


def test_crop_releases_buffers():
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", block_size=16, **PURE_FP8)
    layer = cache.layers[0]
    kv = torch.randn(2, 1, 2, 400, 16)
    layer.update(kv[0], kv[1])
    layer.crop(-370)
    assert layer.get_seq_length() == 30 and layer.capacity <= 30 + 16  # within one block of the tokens held
    assert layer.nbytes == 2 * layer.capacity * 2 * (16 + 2)  # codes and a bf16 scale per token and head


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "int8_per_token_head"])
def test_nan_keys_read_alike_on_both_backends_and_are_counted(fmt):
    model = tiny_model(num_hidden_layers=1)
    kv = torch.randn(2, 1, 2, 6, 16, generator=torch.Generator().manual_seed(0))
    kv[0, 0, 1, 2, 5] = math.nan
    kv[1, 0, 0, 4, 0] = math.inf
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    outputs = {}
    for backend in ("torch", "triton"):
        cache = QuantizedFP8Cache(model, kv_cache_dtype=fmt, scales="dynamic", backend=backend, **PURE_FP8)
        layer = cache.layers[0]
        layer.update(kv[0], kv[1])
        keys, _ = layer.update(kv[0, :, :, :1], kv[1, :, :, :1])
        outputs[backend] = keys.attend(query, scaling=0.25)
        assert layer.nonfinite.tolist() == [1, 1]
        assert cache.summary()[0]["non-finite"] == 2
    nan = {b: out.isnan() for b, out in outputs.items()}
    assert torch.equal(nan["torch"], nan["triton"])
    assert nan["torch"][0, 2:].all() == get_format(fmt).is_float  # KV head 1 read a NaN key (int8: read as 0)
    finite = ~nan["torch"]
    torch.testing.assert_close(outputs["triton"][finite], outputs["torch"][finite], rtol=1e-5, atol=1e-5)


ARGUMENT_ERRORS = [
    (dict(block_size=0), r"block_size=0 must be an int >= 1"),
    (dict(block_size=-1), r"block_size=-1 must be an int >= 1"),
    (dict(block_size=2.5), r"block_size=2.5 must be an int >= 1"),
    (dict(block_size="64"), r"block_size='64' must be an int >= 1"),
    (dict(backend="cuda"), r"backend='cuda' is not one of"),
    (dict(scales={0: 0.1, 1: 0.1}), r"scales\[0\] = 0.1: each layer takes a \(k_scale, v_scale\) pair"),
    (dict(scales=[0.1, 0.2]), r"scales\[0\] = 0.1: each layer takes"),
    (dict(skip_layers=1), r"skip_layers=1: pass a list of layer indices.*skip_layers=\[1\]"),
]


@pytest.mark.parametrize("kwargs,match", ARGUMENT_ERRORS)
def test_bad_arguments_raise_at_construction_and_enable(kwargs, match):
    """Checked when the cache is built (and by `pipeline.enable`), not at the first generate."""
    from hf_fp8kv import pipeline

    model = tiny_model()
    with pytest.raises(ValueError, match=match):
        QuantizedFP8Cache(model, **kwargs)
    with pytest.raises(ValueError, match=match):
        pipeline.enable(model, **kwargs)
    assert not pipeline.is_enabled(model)


def test_each_model_keeps_its_own_previous_attention():
    """A user's switch to eager is respected by the next cache; a deep copy of a switched Gemma 2 (softcap: eager
    only) keeps eager for other caches; another model switched meanwhile keeps sdpa."""
    import copy

    from transformers import DynamicCache

    from hf_fp8kv.attention import fallback_implementation

    model, other = tiny_model(), tiny_model(seed=1)
    QuantizedFP8Cache(model, scales="dynamic")
    QuantizedFP8Cache(other, scales="dynamic")
    model.set_attn_implementation("eager")
    QuantizedFP8Cache(model, scales="dynamic")
    assert fallback_implementation(model.config) == "eager" and fallback_implementation(other.config) == "sdpa"

    gemma = tiny_model("gemma2", attn_implementation="eager", num_hidden_layers=2, sliding_window=4)
    with torch.no_grad():
        expected = gemma(input_ids=PROMPT, **cache_kwargs(DynamicCache(config=gemma.config))).logits
    QuantizedFP8Cache(gemma, scales="dynamic")
    twin = copy.deepcopy(gemma)
    with torch.no_grad():
        got = twin(input_ids=PROMPT, **cache_kwargs(DynamicCache(config=twin.config))).logits
    assert torch.equal(got, expected)
    assert fallback_implementation(twin.model.layers[0].self_attn.config) == "eager"


def test_output_attentions_with_fp8_attention_warns():
    """Like transformers' sdpa, instead of silently giving no attention weights."""
    model = tiny_model(attn_implementation="eager")
    cache = QuantizedFP8Cache(model, scales="dynamic")
    with torch.no_grad(), pytest.warns(UserWarning, match="does not return attention weights"):
        model(input_ids=PROMPT, **cache_kwargs(cache), output_attentions=True)


def test_cache_of_another_config_or_model_takes_the_warned_slow_path():
    """A cache built from a config that is not the running model's, or one model's cache used with another, hands
    real tensors to the sdpa modules (warned slow path) instead of failing inside sdpa."""
    import copy

    model = tiny_model()
    reference = tiny_model()
    with torch.no_grad():
        expected = reference(input_ids=PROMPT, **cache_kwargs(QuantizedFP8Cache(reference, scales="dynamic"))).logits
    for cache in (QuantizedFP8Cache(config=copy.deepcopy(model.config), scales="dynamic"),
                  QuantizedFP8Cache(tiny_model(), scales="dynamic")):  # fmt: skip
        with torch.no_grad(), pytest.warns(UserWarning, match="built for another model or config"):
            got = model(input_ids=PROMPT, **cache_kwargs(cache)).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert model.config._attn_implementation == "sdpa"


def test_integral_lengths_of_any_type_are_accepted():
    """numpy integers (a length read from an array) are lengths as transformers takes them; floats are not."""
    import numpy as np

    model = tiny_model()
    lengths = dict(recent_tokens=np.int64(4), sink_tokens=np.int32(2), block_size=np.int16(16))
    expected = model.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=False,
                              **cache_kwargs(QuantizedFP8Cache(model, scales="dynamic", recent_tokens=4, sink_tokens=2)))  # fmt: skip
    for static in ({}, dict(max_cache_len=np.int64(32), max_batch_size=np.int64(1))):
        cache = QuantizedFP8Cache(model, scales="dynamic", **lengths, **static)
        assert type(cache.layers[0].recent_tokens) is int
        got = model.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="max_cache_len=32.0 must be an int"):
        QuantizedFP8Cache(model, max_cache_len=32.0)


@pytest.mark.parametrize("static", [False, True])
def test_a_filled_cache_pickles_and_continues_where_it_was(static):
    import pickle

    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=3, max_cache_len=40 if static else None)
    with torch.no_grad():
        model(input_ids=PROMPT, **cache_kwargs(cache))
        restored = pickle.loads(pickle.dumps(cache))
        step = PROMPT[:, :1]
        assert torch.equal(model(input_ids=step, **cache_kwargs(restored)).logits, model(input_ids=step, **cache_kwargs(cache)).logits)
