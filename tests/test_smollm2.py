"""QuantizedFP8Cache inside `generate` on the real SmolLM2-135M-Instruct: every generation mode, agreement with
DynamicCache under vLLM's top-k rule, and decode-mode quality against transformers' own FP8 cache."""

from contextlib import nullcontext
from importlib.resources import files

import pytest
import torch
from transformers import DynamicCache, QuantizedCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.compat import CACHE_ARG, HAS_FP8_QUANTIZED_CACHE, cache_kwargs
from hf_fp8kv.evaluate import decode_mode_logits, greedy_with_logits, quality, topk_rule
from tests.models import smollm2

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain in one sentence why the sky is blue.",
    "What is 12 times 7?",
]


# the default window on this text (docs/recent.md has the figures), with margin
KL_WINDOW, TOP1_WINDOW, PPL_WINDOW = 1e-3, 0.975, 0.5


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return smollm2()


def chat(tokenizer, prompts, **kwargs):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    return dict(tokenizer(texts, return_tensors="pt", add_special_tokens=False, **kwargs))


def generate(model, inputs, cache, new=16, **kwargs):
    with torch.inference_mode():
        return model.generate(**inputs, **cache_kwargs(cache), max_new_tokens=new, do_sample=False, **kwargs)


def test_greedy_with_both_spellings(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    inputs = chat(tokenizer, PROMPTS[:1])
    with_cache = generate(model, inputs, QuantizedFP8Cache(model, scales="dynamic"))
    # the old spelling: deprecated where transformers takes `cache=` (5.24), the only one before
    legacy_spelling = pytest.warns(FutureWarning, match="past_key_values") if CACHE_ARG == "cache" else nullcontext()
    with legacy_spelling:
        legacy = model.generate(**inputs, past_key_values=QuantizedFP8Cache(model, scales="dynamic"), max_new_tokens=16,
                                do_sample=False)
    assert torch.equal(with_cache, legacy)
    assert "Paris" in tokenizer.decode(with_cache[0])


@pytest.fixture(scope="module")
def alone(model_and_tokenizer):
    """Each prompt alone, greedy through `QuantizedFP8Cache(scales="dynamic")`: its 24 new tokens and their logits,
    computed once for the tests that compare with them (greedy steps do not depend on how many follow: the first
    16 are a 16-token run's)."""
    model, tokenizer = model_and_tokenizer
    runs = {}
    for prompt in PROMPTS:
        tokens, logits = greedy_with_logits(model, chat(tokenizer, [prompt]), QuantizedFP8Cache(model, scales="dynamic"), 24)
        runs[prompt] = tokens[0], logits[0]
    return runs


def test_greedy_agreement_with_dynamic_cache(model_and_tokenizer, alone):
    model, tokenizer = model_and_tokenizer
    for prompt in PROMPTS:
        inputs = chat(tokenizer, [prompt])
        ref_tokens, ref_logits = greedy_with_logits(model, inputs, DynamicCache(config=model.config), 24)
        tokens, logits = alone[prompt]
        at, ok = topk_rule(ref_tokens[0], ref_logits[0], tokens, logits, k=5)
        assert ok, f"{prompt!r}: first divergence at {at} breaks the top-5 rule"


def test_sampling_is_reproducible_with_a_seed(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    inputs = chat(tokenizer, PROMPTS[1:2])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        with torch.inference_mode():
            runs.append(model.generate(**inputs, **cache_kwargs(QuantizedFP8Cache(model, scales="dynamic")), max_new_tokens=16,
                                       do_sample=True, temperature=0.8, top_p=0.95))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape[1] > inputs["input_ids"].shape[1]


def test_left_padded_batch_matches_each_prompt_alone(model_and_tokenizer, alone):
    model, tokenizer = model_and_tokenizer
    prompts = [PROMPTS[0], PROMPTS[2], "Hi"]
    tokenizer.padding_side = "left"
    batch = chat(tokenizer, prompts, padding=True)
    assert (batch["attention_mask"] == 0).any()  # really padded
    tokens, logits = greedy_with_logits(model, batch, QuantizedFP8Cache(model, scales="dynamic"), 16)
    for row, prompt in enumerate(prompts):
        if prompt in alone:  # the shared single-prompt run, its first 16 steps
            alone_tokens, alone_logits = (part[:16] for part in alone[prompt])
        else:
            alone_tokens, alone_logits = (part[0] for part in greedy_with_logits(
                model, chat(tokenizer, [prompt]), QuantizedFP8Cache(model, scales="dynamic"), 16))  # fmt: skip
        at, ok = topk_rule(alone_tokens, alone_logits, tokens[row], logits[row], k=5)
        assert ok, f"row {row}: batch and single diverge at {at} outside the top-5"
        assert at is None or at > 0  # the first token (from the prompt alone) always agrees


def test_beam_search(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    inputs = chat(tokenizer, PROMPTS[:1])
    ours = generate(model, inputs, QuantizedFP8Cache(model, scales="dynamic"), num_beams=3, num_return_sequences=2)
    reference = generate(model, inputs, DynamicCache(config=model.config), num_beams=3, num_return_sequences=2)
    assert ours.shape[0] == 2
    assert torch.equal(ours[0, : inputs["input_ids"].shape[1] + 4], reference[0, : inputs["input_ids"].shape[1] + 4])


def test_prompt_lookup_decoding_uses_crop(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    inputs = chat(tokenizer, ["Repeat exactly: the cat sat on the mat, the cat sat on the mat."])
    plain = generate(model, inputs, QuantizedFP8Cache(model, scales="dynamic"), new=20)
    lookup = generate(model, inputs, QuantizedFP8Cache(model, scales="dynamic"), new=20, prompt_lookup_num_tokens=4)
    assert torch.equal(plain[:, : inputs["input_ids"].shape[1] + 8], lookup[:, : inputs["input_ids"].shape[1] + 8])


def test_multi_turn_continuation_with_the_same_cache(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cache = QuantizedFP8Cache(model, scales="dynamic")
    messages = [{"role": "user", "content": "My name is Ada. Remember it."}]
    first_inputs = dict(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                      return_dict=True))
    first = generate(model, first_inputs, cache, new=12)
    reply = tokenizer.decode(first[0, first_inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "What is my name?"}]
    second_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    if not torch.equal(second_ids[:, : first.shape[1]], first):  # the template re-renders the reply differently
        second_ids = torch.cat([first, second_ids[:, first.shape[1] - 1 :]], dim=1)[:, : max(second_ids.shape[1], first.shape[1] + 1)]
    continued = generate(model, {"input_ids": second_ids}, cache, new=12)
    fresh = generate(model, {"input_ids": second_ids}, QuantizedFP8Cache(model, scales="dynamic"), new=12)
    assert cache.get_seq_length() == continued.shape[1] - 1
    assert torch.equal(continued[:, : second_ids.shape[1] + 3], fresh[:, : second_ids.shape[1] + 3])


def test_return_dict_in_generate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cache = QuantizedFP8Cache(model, scales="dynamic")
    out = generate(model, chat(tokenizer, PROMPTS[:1]), cache, new=6, return_dict_in_generate=True, output_scores=True)
    assert out.past_key_values is cache and len(out.scores) == 6 and cache.get_seq_length() == out.sequences.shape[1] - 1


@pytest.fixture(scope="module")
def decode_text(model_and_tokenizer):
    """640 tokens of the built-in text; the model's own logits after a 64-token prefix, from one forward without a
    cache: DynamicCache's decode mode gives them to within a KL of 5e-8 in fp32 (four orders below the caches'
    under test) in 38 s instead of 1.5 s."""
    model, tokenizer = model_and_tokenizer
    text = files("hf_fp8kv").joinpath("data/sample_text.txt").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :640]
    with torch.inference_mode():
        return ids, model(ids, use_cache=False).logits[0, 63:-1].float()


def decode_quality(model, decode_text, cache):
    ids, reference = decode_text
    return quality(reference, decode_mode_logits(model, ids, 64, cache), ids[0, 64:])


@pytest.fixture(scope="module")
def pure_quality(model_and_tokenizer, decode_text):
    """Pure FP8 (per-token-head e4m3) on the decode text (45 s: computed once for the tests comparing with it)."""
    model, _ = model_and_tokenizer
    return decode_quality(model, decode_text, QuantizedFP8Cache(model, scales="dynamic", recent_tokens=0, sink_tokens=0))


@pytest.mark.skipif(not HAS_FP8_QUANTIZED_CACHE, reason="transformers has no fp8 QuantizedCache (5.21 on)")
def test_decode_mode_quality_beats_transformers_fp8(model_and_tokenizer, decode_text, pure_quality):
    model, _ = model_and_tokenizer
    ours = pure_quality
    theirs = decode_quality(model, decode_text, QuantizedCache(backend="fp8", config=model.config))
    print(f"\ndppl ours {ours.ppl_delta_pct:+.2f}% KL {ours.kl_mean:.2e}; transformers fp8 {theirs.ppl_delta_pct:+.2f}% "
          f"KL {theirs.kl_mean:.2e}")
    # (the perplexity delta of these 576 tokens moves with the order of torch's CPU sums: +0.73% with 2 threads,
    # +1.01% with 1, this suite's workers', KL 3.64e-3 either way, 948acec as now; the bound: no blow-up)
    assert abs(ours.ppl_delta_pct) < 1.5
    # "clearly better" by KL: over a few hundred tokens the perplexity delta is noise-dominated (transformers'
    # swings between +0.3% and +0.9% across windows of this text), KL is not (ours ~3.5e-3 vs ~5.2e-3)
    assert ours.kl_mean < 0.8 * theirs.kl_mean


def test_default_recent_quality(model_and_tokenizer, decode_text, pure_quality):
    """The default cache (newest 128 + first 4 tokens in full precision over per-token-head e4m3) against pure
    FP8 on the same text; thresholds from docs/recent.md's measurements with margin."""
    model, _ = model_and_tokenizer
    window = decode_quality(model, decode_text, QuantizedFP8Cache(model, scales="dynamic"))
    pure = pure_quality
    print(f"\nrecent 128+4: dppl {window.ppl_delta_pct:+.2f}% KL {window.kl_mean:.2e} top-1 {window.top1_agreement:.3f}; "
          f"pure: dppl {pure.ppl_delta_pct:+.2f}% KL {pure.kl_mean:.2e} top-1 {pure.top1_agreement:.3f}")
    assert window.kl_mean < KL_WINDOW and window.kl_mean < 0.3 * pure.kl_mean
    assert window.top1_agreement >= TOP1_WINDOW and abs(window.ppl_delta_pct) < PPL_WINDOW
