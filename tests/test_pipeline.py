"""The text-generation pipeline with FP8 caching: a fresh cache per call, outputs equal to `model.generate`."""

import pytest
import torch
from transformers import pipeline

from hf_fp8kv import CacheReuseError, QuantizedFP8Cache
from hf_fp8kv import pipeline as fp8_pipeline
from hf_fp8kv.compat import cache_kwargs
from tests.models import smollm2

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,", "Hi"]
NEW = 4


@pytest.fixture(scope="module")
def pipe():
    model, tokenizer = smollm2()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    yield generator
    fp8_pipeline.disable(model)


def pipeline_tokens(pipe, batch_size: int, **kwargs) -> list[list[int]]:
    """Each prompt's token ids as the pipeline returns them: its (padded) batch row, prompt and new tokens."""
    outputs = pipe(PROMPTS, max_new_tokens=NEW, do_sample=False, batch_size=batch_size, return_tensors=True, **kwargs)
    return [out[0]["generated_token_ids"] for out in outputs]


def generate_tokens(model, input_ids, attention_mask) -> torch.Tensor:
    cache = QuantizedFP8Cache(model, scales="dynamic")
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW, do_sample=False,
                          **cache_kwargs(cache))


def test_enabled_pipeline_equals_generate_prompt_by_prompt(pipe):
    model, tokenizer = pipe.model, pipe.tokenizer
    fp8_pipeline.enable(model, scales="dynamic")
    assert fp8_pipeline.is_enabled(model)
    created = []
    original_init = QuantizedFP8Cache.__init__

    def counting_init(self, *args, **kwargs):
        created.append(self)
        original_init(self, *args, **kwargs)

    QuantizedFP8Cache.__init__ = counting_init
    try:
        single = pipeline_tokens(pipe, batch_size=1)
    finally:
        QuantizedFP8Cache.__init__ = original_init
    assert len(created) == len(PROMPTS) and all(cache.get_seq_length() > 0 for cache in created)
    for prompt, tokens in zip(PROMPTS, single):
        encoded = tokenizer(prompt, return_tensors="pt")
        assert tokens == generate_tokens(model, encoded.input_ids, encoded.attention_mask)[0].tolist()

    batched = pipeline_tokens(pipe, batch_size=2)
    for start in range(0, len(PROMPTS), 2):
        encoded = tokenizer(PROMPTS[start : start + 2], return_tensors="pt", padding=True)  # left padding, as the pipeline
        expected = generate_tokens(model, encoded.input_ids, encoded.attention_mask)
        for row, tokens in enumerate(batched[start : start + 2]):
            assert tokens == expected[row].tolist()  # the pipeline returns the padded row, prompt included


def test_disable_restores_the_default_cache(pipe):
    model = pipe.model
    fp8_pipeline.enable(model, scales="dynamic")
    fp8_pipeline.disable(model)
    assert not fp8_pipeline.is_enabled(model) and "generate" not in vars(model)
    out = model.generate(**pipe.tokenizer("Hello", return_tensors="pt"), max_new_tokens=2, do_sample=False,
                         return_dict_in_generate=True)
    assert not isinstance(out.past_key_values, QuantizedFP8Cache)


def test_enable_checks_its_arguments_at_once(pipe):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp7'"):
        fp8_pipeline.enable(pipe.model, kv_cache_dtype="fp7")
    assert not fp8_pipeline.is_enabled(pipe.model)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_one_cache_object_for_many_prompts_is_an_error(pipe, batch_size):
    cache = QuantizedFP8Cache(pipe.model, scales="dynamic")
    with pytest.raises(CacheReuseError, match="already holds another sequence"):
        pipeline_tokens(pipe, batch_size=batch_size, past_key_values=cache)


def test_enabled_model_pickles():
    """`enable` installs no closure: the model pickles, and the copy still makes a fresh cache per call."""
    import pickle

    from tests.models import tiny_model

    model = tiny_model()
    fp8_pipeline.enable(model, scales="dynamic")
    copy = pickle.loads(pickle.dumps(model))
    assert fp8_pipeline.is_enabled(copy)
    out = copy.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, QuantizedFP8Cache)
    fp8_pipeline.disable(copy)
    assert not fp8_pipeline.is_enabled(copy) and "generate" not in vars(copy)
