"""The static cache (`max_cache_len`) where its modes cross: sliding rings x crop x the recent window, batches up to
`max_batch_size`, and generate calls it cannot serve refused before the first step."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from tests.models import PURE_FP8, left_padded_mask, tiny_model

WINDOWS = {"pure": PURE_FP8, "recent 4": dict(recent_tokens=4, sink_tokens=0), "default": {}}
IDS = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(0))
LOOKUP_PROMPT = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])


def gemma(sliding_window: int = 8):
    return tiny_model("gemma3_text", num_hidden_layers=2, sliding_window=sliding_window,
                      layer_types=["sliding_attention", "full_attention"])  # fmt: skip


GEMMA_SLIDING_6 = gemma(sliding_window=6)


def chat(model, cache, crop: int = 0) -> torch.Tensor:
    """A prompt past the sliding window, a turn of 4 tokens, an optional crop, then a turn of 2 (several tokens
    at once once the ring is full); the last logits."""
    cache.activate_past_recording()
    with torch.no_grad():
        model(input_ids=IDS[:, :20], **cache_kwargs(cache))
        model(input_ids=IDS[:, 20:24], **cache_kwargs(cache))
        cache.crop(-crop)
        start = 24 - crop
        return model(input_ids=IDS[:, start : start + 2], **cache_kwargs(cache)).logits


@pytest.mark.parametrize("recent_tokens", [0, 4, 7, 8, 9, 32])
def test_several_tokens_into_a_full_ring_with_any_recent_window(recent_tokens):
    """A chat turn once the ring is full, whatever the recent window (as large as the ring or larger: clamped to the
    layer's window) and with a crop that keeps what the next token sees: the dynamic cache's logits."""
    model = gemma()
    window = dict(recent_tokens=recent_tokens, sink_tokens=0)
    for crop in (0, 1):
        expected = chat(model, QuantizedFP8Cache(model, scales="dynamic", **window), crop)
        got = chat(model, QuantizedFP8Cache(model, scales="dynamic", max_cache_len=64, **window), crop)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [PURE_FP8, WINDOWS["recent 4"]], ids=["pure", "recent 4"])
def test_crop_past_what_the_ring_holds_is_refused(window):
    """The ring overwrote tokens the next step would see: `crop` refuses, naming the layer and the way out, and
    the cache says it is not croppable (as transformers' static sliding layer)."""
    model = gemma()
    cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=64, **window)
    assert not cache.is_croppable
    with pytest.raises(RuntimeError, match=r"layer 0: after crop\(-3\).*overwritten.*dynamic cache"):
        chat(model, cache, crop=3)
    assert QuantizedFP8Cache(model, scales="dynamic", max_cache_len=8).is_croppable  # the ring never wraps


def test_a_second_crop_refuses_what_the_ring_overwrote_before_the_first():
    """A crop moves the codes' end back, not what the ring's slots overwrote: after 7 tokens in a ring of 6 code
    slots (token 0's slot holds token 6), crop(-1) is served (the next token sees tokens 1..6) and a second crop(-1)
    is refused (the next one would see token 0). Found by the property test below: the second crop was served, and
    the next logits read token 6's codes as token 0's."""
    cache = QuantizedFP8Cache(GEMMA_SLIDING_6, scales="dynamic", max_cache_len=36, **PURE_FP8)
    with torch.no_grad():
        GEMMA_SLIDING_6(input_ids=IDS[:, :7], **cache_kwargs(cache))
    cache.crop(-1)
    refusal = r"layer 0: after crop\(-1\) the next token sees tokens from 0 on.*overwritten tokens 0..0"
    with pytest.raises(RuntimeError, match=refusal):
        cache.crop(-1)
    assert cache.get_seq_length() == 6  # (nothing lost)
    cache.reset()
    with torch.no_grad():
        GEMMA_SLIDING_6(input_ids=IDS[:, :5], **cache_kwargs(cache))
    cache.crop(-1)  # (a reset cache's ring holds every token again)


def test_crop_of_tokens_the_recent_buffer_still_holds_is_served():
    """With the default window (128 recent tokens, 64 in a cache of 64) every token is still in the recent buffer:
    the same crop is served, as the dynamic cache serves it."""
    model = gemma()
    expected = chat(model, QuantizedFP8Cache(model, scales="dynamic"), crop=3)
    got = chat(model, QuantizedFP8Cache(model, scales="dynamic", max_cache_len=64), crop=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_assisted_decoding_on_a_ring_that_can_wrap_is_refused_before_the_model_runs():
    model = gemma()
    cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=64)
    with pytest.raises(ValueError, match="assisted and prompt-lookup decoding.*layer 0 cannot roll back"):
        model.generate(input_ids=LOOKUP_PROMPT, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                       **cache_kwargs(cache))  # fmt: skip
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
def test_prompt_lookup_on_a_static_ring_that_never_wraps_is_greedy(window):
    """max_cache_len <= sliding_window: the ring never wraps, so prompt lookup rolls back exactly."""
    model = gemma(sliding_window=32)
    tokens = {}
    for lookup in (None, 3):
        cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=32, **window)
        tokens[lookup] = model.generate(input_ids=LOOKUP_PROMPT, max_new_tokens=12, do_sample=False,
                                        prompt_lookup_num_tokens=lookup, **cache_kwargs(cache))  # fmt: skip
    assert torch.equal(tokens[3], tokens[None])


def test_any_batch_up_to_max_batch_size():
    """Buffers sized from max_batch_size: a batch of 2, then (after reset) one of 4, each as a fresh cache gives;
    a batch beyond it is refused naming max_batch_size."""
    model = tiny_model()
    prompts = torch.randint(3, 120, (4, 6), generator=torch.Generator().manual_seed(1))
    cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=16, max_batch_size=4)
    for rows in (2, 4, 1):
        cache.reset()
        got = model.generate(input_ids=prompts[:rows], max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
        fresh = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=16, max_batch_size=4)
        expected = model.generate(input_ids=prompts[:rows], max_new_tokens=4, do_sample=False, **cache_kwargs(fresh))
        assert torch.equal(got, expected)
        assert cache.nbytes == fresh.nbytes  # 4 rows allocated from the first update
    cache.reset()
    with pytest.raises(ValueError, match="max_batch_size=4"):
        model.generate(input_ids=torch.cat([prompts, prompts[:1]]), max_new_tokens=2, **cache_kwargs(cache))
    with pytest.raises(ValueError, match="max_batch_size applies to a static cache"):
        QuantizedFP8Cache(model, max_batch_size=4)


def test_beams_on_the_static_cache_keep_the_buffers_in_place():
    model = tiny_model()
    prompt = torch.tensor([[5, 17, 42, 8, 99, 5, 17, 42]])
    outputs = {}
    for name, kwargs in (("dynamic", {}), ("static", dict(max_cache_len=16, max_batch_size=2))):
        cache = QuantizedFP8Cache(model, scales="dynamic", **kwargs)
        outputs[name] = model.generate(input_ids=prompt, max_new_tokens=6, num_beams=2, do_sample=False, **cache_kwargs(cache))
    assert torch.equal(outputs["static"], outputs["dynamic"])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile_config"])
def test_generate_past_max_cache_len_is_refused_before_the_first_step(compiled):
    """generate knows prompt + max_new_tokens before it runs: refused naming max_cache_len, nothing written (a
    compiled decode step would otherwise fail inside Inductor mid-generation)."""
    from transformers import CompileConfig

    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=12)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # generate compiles on CUDA by itself; on the CPU only when asked
    extra = dict(compile_config=config) if compiled else dict(disable_compile=True)
    with pytest.raises(ValueError, match=r"may hold 14 tokens.*max_cache_len=12"):
        model.generate(input_ids=IDS[:, :6], max_new_tokens=9, do_sample=False, **cache_kwargs(cache), **extra)
    assert cache.get_seq_length() == 0
    model.generate(input_ids=IDS[:, :6], max_new_tokens=7, do_sample=False, **cache_kwargs(cache))  # 12 tokens: fits


def test_tiled_buffers_on_the_triton_backend_serve_the_slow_path_at_max_cache_len():
    """On the Triton backend a static full-attention layer holds whole blocks of tiled values (max_cache_len 70:
    128 slots); `dequantized` (what the slow path hands an sdpa module) still gives max_cache_len keys and values,
    the torch backend's, and a chat turn once a sliding ring (window 8) is full reads the same tokens."""
    model = gemma()
    caches = {backend: QuantizedFP8Cache(model, scales="dynamic", max_cache_len=70, backend=backend, **PURE_FP8)
              for backend in ("torch", "triton")}  # fmt: skip
    logits = {backend: chat(model, cache) for backend, cache in caches.items()}
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    full = {backend: cache.layers[1] for backend, cache in caches.items()}
    assert full["triton"].codes.shape[3] == 129 and full["torch"].codes.shape[3] == 71  # (+ the spare slot)
    for a, b in zip(full["triton"].dequantized(), full["torch"].dequantized()):
        assert a.shape[2] == 70
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend, dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                            ("torch", torch.float16), ("triton", torch.float32)])  # fmt: skip
def test_each_token_stored_once_up_to_max_cache_len(backend, dtype):
    """The codes have no slots for the recent tokens (a full layer: max_cache_len - recent; a sliding ring:
    window - recent), and a left-padded batch generated to exactly max_cache_len gets the dynamic cache's
    scores at every step, its sinks, recent tokens and codes each read from their one place."""
    model = gemma().to(dtype)
    window, length = dict(recent_tokens=4, sink_tokens=2), 26  # (the ring's 4 code slots wrap 5 times)
    prompts = torch.randint(3, 120, (2, 14), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompts)
    mask[1, :5] = 0
    scores = {}
    for name, static in (("dynamic", {}), ("static", dict(max_cache_len=length))):
        cache = QuantizedFP8Cache(model, scales="dynamic", backend=backend, **window, **static)
        out = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=length - 14, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, **cache_kwargs(cache))  # fmt: skip
        scores[name] = torch.stack(out.scores)
    sliding, full = cache.layers
    tiled = -(length - 4) % 64 if backend == "triton" else 0  # whole blocks of tiled values
    assert full.codes.shape[3] == length - 4 + tiled + 1 and sliding.codes.shape[3] == 8 - 4 + 1  # (+ the spare)
    # a column more or fewer in the attention flips an fp16 output's last bit now and then: on a CPU with fp16
    # arithmetic (AVX512-FP16) the logits moved by up to 2.4e-4, an fp16 ulp at 0.25
    tolerance = 1e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(scores["static"], scores["dynamic"], rtol=tolerance, atol=tolerance)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_sequence_of_updates_reorders_crops_and_resets_gets_the_dynamic_caches_logits(data):
    """Property-based (hypothesis): random updates of 1 to 12 tokens (left-padded rows at the first), beam
    reorders, crops and resets on a model with a sliding layer whose ring wraps, any recent and sink window and
    format, both backends: the static cache's logits are the dynamic cache's at every update. A crop either cache
    refuses (the static ring overwrote, or the dynamic layer's earlier crop dropped, what the next step would see)
    must say so; both then start again."""
    draw = data.draw
    backend = draw(st.sampled_from(["torch", "torch", "torch", "triton"]), label="backend")
    window = dict(recent_tokens=draw(st.integers(0, 10), label="recent"),
                  sink_tokens=draw(st.integers(0, 3), label="sinks"),
                  kv_cache_dtype=draw(st.sampled_from(["fp8_e4m3", "fp8_e5m2", "int8_per_token_head"]), label="format"))
    rows, length = draw(st.integers(1, 2), label="rows"), 36
    model = GEMMA_SLIDING_6
    caches = [QuantizedFP8Cache(model, scales="dynamic", backend=backend, **window),
              QuantizedFP8Cache(model, scales="dynamic", backend=backend, max_cache_len=length, max_batch_size=rows,
                                **window)]  # fmt: skip
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16), label="seed"))
    first, end = [0] * rows, 0
    for cache in caches:
        cache.activate_past_recording()  # (what assisted decoding does before the steps it may crop)
    for _ in range(draw(st.integers(2, 8), label="steps")):
        op = "update" if not end else draw(st.sampled_from(["update", "update", "crop", "crop", "reorder", "reset"]))
        if op == "update" and end < length:
            ids = torch.randint(3, 120, (rows, draw(st.integers(1, min(12, length - end)), label="new")),
                                generator=generator)  # fmt: skip
            if not end:
                first = draw(st.lists(st.integers(0, ids.shape[1] - 1), min_size=rows, max_size=rows), label="padding")
            mask = left_padded_mask(first, end + ids.shape[1])
            with torch.no_grad():
                dynamic, static = (model(input_ids=ids, attention_mask=mask, **cache_kwargs(c)).logits for c in caches)
            torch.testing.assert_close(static, dynamic, rtol=1e-5, atol=1e-5)
            end += ids.shape[1]
        elif op == "reorder" and end:
            picked = draw(st.lists(st.integers(0, rows - 1), min_size=rows, max_size=rows), label="rows picked")
            for cache in caches:
                cache.reorder_cache(torch.tensor(picked))
            first = [first[row] for row in picked]
        elif op == "crop" and end > max(first) + 1:
            removed = draw(st.integers(1, end - max(first) - 1), label="removed")
            refusals = []
            for cache in caches:
                try:
                    cache.crop(-removed)
                except RuntimeError as refusal:  # (the dynamic cache: after an earlier crop that dropped them)
                    refusals.append(str(refusal))
            assert all(re.search(r"after crop\(-\d+\).*(overwritten|holds tokens from)", r) for r in refusals)
            end = 0 if refusals else end - removed
            for cache in caches:
                if refusals:  # (the other cache may have cropped: both start again)
                    cache.reset()
                cache.activate_past_recording()
        elif op == "reset":
            for cache in caches:
                cache.reset()
                cache.activate_past_recording()
            end = 0
        assert [int(cache.get_seq_length()) for cache in caches] == [end, end]
