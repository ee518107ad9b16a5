"""The reuse guard on every path that fills a cache (issue: reliability): each either raises `CacheReuseError` or
continues like a fresh cache; and a guarded model still pickles."""

import io
import pickle

import pytest
import torch

from hf_fp8kv import CacheReuseError, QuantizedFP8Cache
from hf_fp8kv.compat import CHUNKED_PREFILL_CONTINUES, cache_kwargs
from tests.models import tiny_model

PROMPT = torch.tensor([[5, 17, 42, 8, 99, 23, 64, 11]])
NEW = torch.tensor([[3, 4, 5]])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def cache_of(model):
    return QuantizedFP8Cache(model, scales="dynamic")


def generate(model, cache, ids, new=4, **kwargs):
    return model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, **cache_kwargs(cache), **kwargs)


def unrelated(cache) -> torch.Tensor:
    """Ids as long as the cached tokens plus three, differing from them everywhere."""
    return (torch.arange(cache.get_seq_length() + 3).unsqueeze(0) * 7 + 101) % 128


def assert_continues_like_a_fresh_cache(model, cache, ids, **kwargs):
    continued = generate(model, cache, ids, **kwargs)
    assert torch.equal(continued, generate(model, cache_of(model), ids, **kwargs))


def test_cache_filled_by_a_direct_forward(model):
    cache = cache_of(model)
    with torch.no_grad():
        model(input_ids=PROMPT, **cache_kwargs(cache))
    with pytest.raises(CacheReuseError, match="do not start with the 8 tokens"):
        generate(model, cache, unrelated(cache))
    assert_continues_like_a_fresh_cache(model, cache, torch.cat([PROMPT, NEW], dim=1))


def test_manual_decode_step_between_generate_calls(model):
    cache = cache_of(model)
    out = generate(model, cache, PROMPT)
    with torch.no_grad():
        model(input_ids=out[:, -1:], **cache_kwargs(cache))  # the last generated token, fed by hand
    changed = out.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 128  # the manually fed token differs
    with pytest.raises(CacheReuseError, match="do not start with"):
        generate(model, cache, torch.cat([changed, NEW], dim=1))
    assert_continues_like_a_fresh_cache(model, cache, torch.cat([out, NEW], dim=1))


def test_prompt_given_as_inputs_embeds(model):
    """Embedded tokens are unknown: a later generate with ids is checked on the known (generated) tokens; a
    continuation that passes the embeddings again is not checked and continues like a fresh cache."""
    embed = model.get_input_embeddings()
    cache = cache_of(model)
    with torch.no_grad():
        out = model.generate(inputs_embeds=embed(PROMPT), max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
    with pytest.raises(CacheReuseError, match="do not start with"):
        generate(model, cache, unrelated(cache))
    with torch.no_grad():
        embeds = embed(torch.cat([PROMPT, out, NEW], dim=1))
        continued = model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
        fresh = model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, **cache_kwargs(cache_of(model)))
    assert torch.equal(continued, fresh)


@pytest.mark.skipif(not CHUNKED_PREFILL_CONTINUES, reason="this transformers restarts chunked prefill (below)")
def test_chunked_prefill(model):
    """Checked before the first decode step (the chunks bypass `prepare_inputs_for_generation`)."""
    cache = cache_of(model)
    out = generate(model, cache, PROMPT, prefill_chunk_size=3)
    with pytest.raises(CacheReuseError, match="do not start with"):
        generate(model, cache, unrelated(cache), prefill_chunk_size=3)
    cache = cache_of(model)
    generate(model, cache, PROMPT, prefill_chunk_size=3)
    assert_continues_like_a_fresh_cache(model, cache, torch.cat([out, NEW], dim=1), prefill_chunk_size=3)


@pytest.mark.skipif(CHUNKED_PREFILL_CONTINUES, reason="this transformers continues chunked prefill (above)")
def test_chunked_prefill_onto_a_filled_cache_is_refused_where_transformers_restarts_it(model):
    """Before transformers 5.24 a chunked prefill restarts at the first token (any cache would hold the
    conversation twice): refused before the model runs, the cache unchanged."""
    cache = cache_of(model)
    generate(model, cache, PROMPT, prefill_chunk_size=3)
    held = cache.get_seq_length()
    with pytest.raises(ValueError, match="restarts a chunked prefill"):
        generate(model, cache, torch.cat([PROMPT, NEW], dim=1), prefill_chunk_size=3)
    assert cache.get_seq_length() == held


def test_continuation_with_only_the_new_ids_keeps_the_guard_on(model):
    """Passing only the new ids with the full attention mask cannot be checked, but the cache stays tracked."""
    cache = cache_of(model)
    out = generate(model, cache, PROMPT)
    full = torch.cat([out, NEW], dim=1)
    new_ids = full[:, cache.get_seq_length() :]
    continued = generate(model, cache, new_ids, attention_mask=torch.ones_like(full))
    fresh = generate(model, cache_of(model), full)
    assert torch.equal(continued[:, new_ids.shape[1] :], fresh[:, full.shape[1] :])
    with pytest.raises(CacheReuseError, match="do not start with"):
        generate(model, cache, unrelated(cache))


def test_guarded_model_pickles_and_saves():
    model = tiny_model()
    cache = cache_of(model)
    expected = generate(model, cache, PROMPT)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for copy in (pickle.loads(pickle.dumps(model)), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
        copy_cache = cache_of(copy)
        assert torch.equal(generate(copy, copy_cache, PROMPT), expected)
        with pytest.raises(CacheReuseError):
            generate(copy, copy_cache, unrelated(copy_cache))
