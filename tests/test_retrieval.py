"""The passkey-retrieval probe: prompts (key placement, length, chat frame), exact-match scoring, the tables, and
one real cell on SmolLM2."""

import dataclasses
import functools
import re
import warnings

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.bundled import smollm2_dir
from hf_fp8kv.comparison import builtin_text
from hf_fp8kv.retrieval import (
    LABELED_NEEDLE,
    NEEDLE,
    PasskeyProbe,
    RetrievalTrial,
    against_reference,
    filler_sentences,
    found,
    found_rate,
    missed_where_reference_retrieves,
    passkey_prompt,
    probe_prompts,
    retrieval_rows,
    run_probe,
)
from tests.models import smollm2, tiny_model


@functools.lru_cache(maxsize=None)
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir())


@functools.lru_cache(maxsize=None)
def sentences():
    return filler_sentences(tokenizer(), builtin_text())


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("length", [300, 2048])
def test_key_sits_at_the_asked_depth_of_a_prompt_that_fills_the_length(length, depth):
    prompt = passkey_prompt(tokenizer(), sentences(), length, depth, trial=0, chat=True, max_new_tokens=10)
    ids = prompt.ids[0].tolist()
    needle = tokenizer()(NEEDLE.format(key=prompt.key), add_special_tokens=False).input_ids
    assert ids[prompt.needle_at : prompt.needle_at + len(needle)] == needle
    assert re.fullmatch(r"\d{5}", prompt.key)
    text = tokenizer().decode(ids)
    intro = len(tokenizer()(text[: text.index("Text:") + len("Text:")], add_special_tokens=False).input_ids)
    longest = max(map(len, sentences()))
    assert abs(prompt.needle_at - intro - depth * prompt.filler_tokens) <= longest / 2  # the filler follows "Text:"
    # prompt + answer fit in `length`, short of it by less than one filler sentence
    assert length - 10 - longest < len(ids) <= length - 10
    assert re.findall(r"\d+", text.split("<|im_start|>user")[1]) == [prompt.key, prompt.key]  # the only number


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_several_keys_each_under_its_label_one_asked_for(depth):
    """Multi-key needles (RULER's): 6 distinct keys under 6 distinct labels, the only numbers in the prompt; the
    question names the label of the key asked for, whose sentence starts at `needle_at`, at the asked depth of the
    filler; the same prompt every time."""
    prompt = passkey_prompt(tokenizer(), sentences(), 1500, depth, trial=1, chat=True, max_new_tokens=10, keys=6)
    ids = prompt.ids[0].tolist()
    user = tokenizer().decode(ids).split("<|im_start|>user")[1]
    keys = [prompt.key, *prompt.others]
    hidden = dict(re.findall(r"The pass key for (\w+) is (\d{5})\. Remember it", user))
    assert len(set(keys)) == 6 and sorted(hidden.values()) == sorted(keys) and len(hidden) == 6
    asked = next(label for label, key in hidden.items() if key == prompt.key)
    assert user.endswith(f"for {asked}?<|im_end|>\n<|im_start|>assistant\nThe pass key for {asked} is")
    assert sorted(re.findall(r"\d+", user)) == sorted(keys * 2)
    needle = tokenizer()(LABELED_NEEDLE.format(label=asked, key=prompt.key), add_special_tokens=False).input_ids
    assert ids[prompt.needle_at : prompt.needle_at + len(needle)] == needle
    assert len(ids) <= 1500 - 10
    text = user.split("Text:")[1]
    before = text[: text.index(f"The pass key for {asked} is")]
    needles = r" The pass key for \w+ is \d{5}\. Remember it: \d{5} is the pass key for \w+\."
    share = len(re.sub(needles, "", before)) / len(re.sub(needles, "", text))
    assert abs(share - depth) < 0.05  # (characters of filler: the asked depth, within a sentence or two)
    again = passkey_prompt(tokenizer(), sentences(), 1500, depth, trial=1, chat=True, max_new_tokens=10, keys=6)
    assert torch.equal(again.ids, prompt.ids)


def test_chat_and_plain_frames():
    chat = tokenizer().decode(passkey_prompt(tokenizer(), sentences(), 400, 0.5, 0, True, 10).ids[0])
    assert chat.startswith("<|im_start|>system\n") and "<|im_start|>user\nA pass key is hidden" in chat
    assert chat.endswith("What is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is")
    plain = tokenizer().decode(passkey_prompt(tokenizer(), sentences(), 400, 0.5, 0, False, 10).ids[0])
    assert plain.startswith("A pass key is hidden") and plain.endswith("What is the pass key?\nThe pass key is")


def test_trials_draw_their_own_key_and_filler_the_same_every_time():
    draw = functools.partial(passkey_prompt, tokenizer(), sentences(), 1024, 0.5, chat=True, max_new_tokens=10)
    first, again, second = draw(trial=0), draw(trial=0), draw(trial=1)
    assert torch.equal(first.ids, again.ids) and first.key == again.key
    assert first.key != second.key and first.ids[0, :200].tolist() != second.ids[0, :200].tolist()


def test_exact_match_takes_the_first_number_whole():
    assert found(" 28547.", "28547") and found("28547", "28547") and found(" is 28547, I think", "28547")
    for answer in (" 2854", " 285471", " 128547", " 12345, not 28547", " twenty-eight thousand", ""):
        assert not found(answer, "28547")


def test_filler_leaves_out_sentences_with_digits():
    kept = filler_sentences(tokenizer(), "The sea was calm. It was 1923 then. Gulls cried! Was it late?")
    assert [tokenizer().decode(s) for s in kept] == [" The sea was calm.", " Gulls cried!", " Was it late?"]
    with pytest.raises(ValueError, match="no sentence without digits"):
        filler_sentences(tokenizer(), "Room 101. 42.")


@pytest.mark.parametrize(
    "kwargs,message",
    [(dict(lengths=()), "lengths"), (dict(lengths=(0,)), "lengths"), (dict(depths=(1.5,)), "depths"),
     (dict(trials=0), "trials=0"), (dict(keys=0), "keys=0"), (dict(keys=17), "keys=17")],
)
def test_bad_probe_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PasskeyProbe(**kwargs)


def test_lengths_beyond_the_context_or_too_short_are_refused():
    model = tiny_model("llama", vocab_size=len(tokenizer()))  # max_position_embeddings 512
    with pytest.raises(ValueError, match="beyond the model's context"):
        probe_prompts(model, tokenizer(), PasskeyProbe(lengths=(1024,)), builtin_text(), True)
    with pytest.raises(ValueError, match="no room for a filler sentence"):
        probe_prompts(model, tokenizer(), PasskeyProbe(lengths=(64,)), builtin_text(), True)


def trial(variant, length, depth, index, hit):
    return RetrievalTrial(variant, length, depth, index, "12345", "", hit)


SYNTHETIC = [
    trial(v, length, depth, i, hit)
    for (length, depth, i), hits in {
        (1024, 0.0, 0): (True, True), (1024, 0.0, 1): (True, False), (1024, 1.0, 0): (False, True),
        (1024, 1.0, 1): (True, True), (4096, 0.0, 0): (True, False), (4096, 0.0, 1): (False, False),
    }.items()
    for v, hit in zip(("native", "fp8"), hits)
]  # fmt: skip


def test_table_counts_keys_found_per_cell_and_in_all():
    assert retrieval_rows(SYNTHETIC) == [
        {"length": 1024, "depth_%": 0, "trials": 2, "native": "2/2", "fp8": "1/2"},
        {"length": 1024, "depth_%": 100, "trials": 2, "native": "1/2", "fp8": "2/2"},
        {"length": 4096, "depth_%": 0, "trials": 2, "native": "1/2", "fp8": "0/2"},
        {"length": "all", "depth_%": "", "trials": 6, "native": "4/6", "fp8": "3/6"},
    ]
    assert found_rate(SYNTHETIC, "fp8") == 0.5
    assert retrieval_rows(SYNTHETIC, by_depth=False) == [
        {"length": 1024, "trials": 4, "native": "3/4", "fp8": "3/4"},
        {"length": 4096, "trials": 2, "native": "1/2", "fp8": "0/2"},
        {"length": "all", "trials": 6, "native": "4/6", "fp8": "3/6"},
    ]


def test_keys_missed_only_at_lengths_where_the_reference_retrieves_enough():
    assert missed_where_reference_retrieves(SYNTHETIC, "native", "fp8", 0.75) == {1024: [(1024, 0.0, 1)]}
    assert missed_where_reference_retrieves(SYNTHETIC, "native", "fp8", 0.5) == {
        1024: [(1024, 0.0, 1)], 4096: [(4096, 0.0, 0)],
    }  # fmt: skip
    assert missed_where_reference_retrieves(SYNTHETIC, "native", "fp8", 1.0) == {}
    assert missed_where_reference_retrieves(SYNTHETIC, "fp8", "native", 0.75) == {1024: [(1024, 1.0, 0)]}


def test_against_the_reference_pairs_the_prompts():
    assert against_reference(SYNTHETIC, "native", "fp8") == (
        "native found 4 of 6 keys, fp8 3; fp8 missed 2 that native found: 1024 tokens at depth 0% (1), 4096 tokens "
        "at depth 0% (1); it found 1 that native missed"
    )
    native = [t for t in SYNTHETIC if t.variant == "native"]
    copy = [dataclasses.replace(t, variant="copy") for t in native]
    assert against_reference(native + copy, "native", "copy") == (
        "native found 4 of 6 keys, copy 4; copy found every key native found"
    )
    none = [dataclasses.replace(t, found=False) for t in native + copy]
    assert against_reference(none, "native", "copy") == "native found 0 of 6 keys, copy 0"


def test_smollm2_recommended_cache_retrieves_where_native_does():
    """One real cell (SmolLM2, 320 tokens, the key mid-text, far behind the full-precision recent tokens): the
    native cache finds the key, and so do the recommended FP8 configuration and pure FP8; the same with two keys
    under two labels, the asked one mid-text."""
    model, tok = smollm2()
    probe = PasskeyProbe(lengths=(320,), depths=(0.5,), trials=1, max_new_tokens=7)
    prompts = probe_prompts(model, tok, probe, builtin_text(), True)
    assert prompts[0].ids.shape[1] - prompts[0].needle_at > 100
    caches = {
        "native": lambda m: DynamicCache(config=m.config),
        "fp8_recent": lambda m: QuantizedFP8Cache(m, scales="dynamic"),
        "pure": lambda m: QuantizedFP8Cache(m, scales="dynamic", recent_tokens=0, sink_tokens=0),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        answers = run_probe(model, tok, prompts, caches, probe.max_new_tokens)
    assert [(a.variant, a.found) for a in answers] == [("native", True), ("fp8_recent", True), ("pure", True)]
    assert all(a.answer.strip().startswith(prompts[0].key) for a in answers)
    # two keys under two labels (400 tokens, the asked one mid-text): each cache answers the asked one
    probe = PasskeyProbe(lengths=(400,), depths=(0.5,), trials=1, max_new_tokens=7, keys=2)
    prompts = probe_prompts(model, tok, probe, builtin_text(), True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        answers = run_probe(model, tok, prompts, caches, probe.max_new_tokens)
    assert [(a.variant, a.found, a.keys) for a in answers] == [(v, True, 2) for v in caches]
