"""Passkey retrieval: a random 5-digit key hidden at a given depth in filler text of a given length, the model
asked for it (greedy, through the cache under test), scored by exact match. With `keys` > 1 (RULER's multi-key
needles), as many keys are hidden, each under its own label, and one is asked for: the others are distractors,
so a cache that blurs which key sat where answers the wrong one.

Long-context retrieval is where users judge an FP8 KV cache (needle-in-a-haystack, RULER) and where it moves
before perplexity does: the answer depends on a few stored tokens far back. The filler is the sentences of a
text in a seeded random order (every sentence once before any repeats), so each trial reads a different
haystack; the same prompts go to every cache, so a miss can be paired with the reference's answer.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import random
import re
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Mapping, Sequence

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from hf_fp8kv.evaluate import greedy_with_logits

INTRO = "A pass key is hidden in the text below. Find it and remember it.\n\nText:"
NEEDLE = " The pass key is {key}. Remember it: {key} is the pass key."
QUESTION = "\n\nWhat is the pass key?"
ANSWER = "The pass key is"  # the answer's start, given to the model
HAYSTACK = "\x00"  # where the filler goes in the framed prompt
# several keys: each under a label, one asked for
INTRO_KEYS = "Pass keys are hidden in the text below, each for a name. Find them and remember them.\n\nText:"
LABELED_NEEDLE = " The pass key for {label} is {key}. Remember it: {key} is the pass key for {label}."
QUESTION_FOR = "\n\nWhat is the pass key for {label}?"
ANSWER_FOR = "The pass key for {label} is"
LABELS = ("Amber", "Birch", "Cobalt", "Dune", "Ember", "Fjord", "Granite", "Harbor", "Indigo", "Juniper", "Kestrel",
          "Lantern", "Meadow", "Nimbus", "Orchid", "Pebble")  # fmt: skip


@dataclass(frozen=True)
class PasskeyProbe:
    """What to probe: `trials` keys per (length, depth) cell. `lengths`: tokens of context a cell uses, prompt
    and `max_new_tokens` answer tokens together (at most the model's context); `depths`: the fraction of the
    filler before the key asked for (0: first, 1: last, just before the question); `keys`: keys hidden per
    prompt, each under its own label (the others at random places in the filler)."""

    lengths: Sequence[int] = (1024,)
    depths: Sequence[float] = (0.0, 0.5, 1.0)
    trials: int = 2
    max_new_tokens: int = 10
    keys: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.keys, int) or not 1 <= self.keys <= len(LABELS):
            raise ValueError(f"keys={self.keys!r} must be a count of keys from 1 to {len(LABELS)}")
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths {list(self.lengths)} must be positive token counts")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths {list(self.depths)} must be fractions between 0 and 1")
        if self.trials < 1 or self.max_new_tokens < 1:
            raise ValueError(f"trials={self.trials} and max_new_tokens={self.max_new_tokens} must be at least 1")


@dataclass
class PasskeyPrompt:
    """One trial's prompt: `ids` `[1, tokens]`, the key asked for, and where its sentence starts (`needle_at`, a
    token index); `others`: the other keys hidden (distractors)."""

    length: int
    depth: float
    trial: int
    key: str
    ids: torch.Tensor
    needle_at: int
    filler_tokens: int  # filler tokens in the prompt (the keys' sentences not counted)
    others: tuple[str, ...] = ()


@dataclass
class RetrievalTrial:
    """One cache's answer to one prompt."""

    variant: str
    length: int
    depth: float
    trial: int
    key: str
    answer: str
    found: bool
    keys: int = 1  # keys hidden in the prompt


def found(answer: str, key: str) -> bool:
    """Exact match: the answer's first number is the key."""
    number = re.search(r"\d+", answer)
    return number is not None and number.group() == key


def filler_sentences(tokenizer, text: str) -> list[list[int]]:
    """The token ids of each sentence of `text` (with its leading space); sentences holding a digit are left out,
    so the key is the only number in a prompt."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s.strip() and not re.search(r"\d", s)]
    if not sentences:
        raise ValueError("the filler text has no sentence without digits")
    return [tokenizer(" " + s.strip(), add_special_tokens=False).input_ids for s in sentences]


def passkey_prompt(
    tokenizer, sentences: list[list[int]], length: int, depth: float, trial: int, chat: bool, max_new_tokens: int,
    keys: int = 1,
) -> PasskeyPrompt:
    """The prompt of one trial: the keys, their labels and places and the filler's order drawn from a seed of
    (length, depth, trial, keys); as many whole filler sentences as fit in `length` tokens beside the frame and the
    answer, the asked key's sentence at the sentence boundary nearest to `depth` of the filler, the others' at
    random boundaries."""
    rng = random.Random(f"passkey {length} {depth} {trial}" + (f" {keys}" if keys > 1 else ""))
    drawn = rng.sample(range(10_000, 100_000), keys) if keys > 1 else [rng.randrange(10_000, 100_000)]
    hidden = [str(key) for key in drawn]
    if keys > 1:
        labels = rng.sample(LABELS, keys)
        intro, question = INTRO_KEYS, QUESTION_FOR.format(label=labels[0]) + "\n"
        answer = ANSWER_FOR.format(label=labels[0])
        needles = [LABELED_NEEDLE.format(label=label, key=key) for label, key in zip(labels, hidden)]
    else:
        intro, question, answer, needles = INTRO, QUESTION + "\n", ANSWER, [NEEDLE.format(key=hidden[0])]
    if chat:
        framed = tokenizer.apply_chat_template(
            [{"role": "user", "content": intro + HAYSTACK + question.rstrip("\n")}], tokenize=False,
            add_generation_prompt=True,
        ) + answer  # fmt: skip
    else:
        framed = intro + HAYSTACK + question + answer
    before, after = framed.split(HAYSTACK)
    head = tokenizer(before, add_special_tokens=not chat).input_ids
    tail = tokenizer(after, add_special_tokens=False).input_ids
    needle_ids = [tokenizer(needle, add_special_tokens=False).input_ids for needle in needles]
    budget = length - max_new_tokens - len(head) - sum(map(len, needle_ids)) - len(tail)
    filler: list[list[int]] = []
    for sentence in _shuffled_passes(sentences, rng):  # whole sentences until the next one would not fit
        if sum(map(len, filler)) + len(sentence) > budget:
            break
        filler.append(sentence)
    if not filler:
        raise ValueError(f"length {length} leaves no room for a filler sentence beside the question and answer")
    bounds = [0, *itertools.accumulate(map(len, filler))]
    cut = min(range(len(bounds)), key=lambda i: abs(bounds[i] - depth * bounds[-1]))
    places = [cut] + [rng.randrange(len(bounds)) for _ in needle_ids[1:]]  # sentence boundaries of the needles
    body: list[int] = []
    needle_at = 0
    for i, sentence in enumerate([*filler, []]):
        for j in (j for j, place in enumerate(places) if place == i):
            if j == 0:  # the key asked for
                needle_at = len(head) + len(body)
            body += needle_ids[j]
        body += sentence
    ids = torch.tensor([head + body + tail])
    return PasskeyPrompt(length, depth, trial, hidden[0], ids, needle_at, bounds[-1], tuple(hidden[1:]))


def _shuffled_passes(sentences: list[list[int]], rng: random.Random) -> Iterator[list[int]]:
    """The sentences in a random order, again and again (each pass in a new order)."""
    while True:
        order = list(sentences)
        rng.shuffle(order)
        yield from order


def probe_prompts(model: torch.nn.Module, tokenizer, probe: PasskeyProbe, filler: str, chat: bool) -> list[PasskeyPrompt]:
    """Every trial's prompt, cell by cell (lengths, then depths); `chat`: in the tokenizer's chat template."""
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if context is not None and max(probe.lengths) > context:
        raise ValueError(f"retrieval length {max(probe.lengths)} is beyond the model's context ({context} tokens)")
    sentences = filler_sentences(tokenizer, filler)
    return [
        passkey_prompt(tokenizer, sentences, length, depth, trial, chat, probe.max_new_tokens, probe.keys)
        for length in probe.lengths
        for depth in probe.depths
        for trial in range(probe.trials)
    ]


def run_probe(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[PasskeyPrompt],
    caches: Mapping[str, Callable[[torch.nn.Module], Cache]],
    max_new_tokens: int,
    progress: bool = False,
    running: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext(),
) -> list[RetrievalTrial]:
    """Every prompt answered greedily (`max_new_tokens`) through a fresh cache of each of `caches` (name ->
    factory), each under `running(name)`."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    trials = []
    bar = tqdm(total=len(prompts) * len(caches), desc="retrieval", disable=not progress)
    for prompt in prompts:
        ids = prompt.ids.to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for name, make_cache in caches.items():
            with running(name):
                tokens, _ = greedy_with_logits(model, inputs, make_cache(model), max_new_tokens, pad_token_id=pad)
            answer = tokenizer.decode(tokens[0], skip_special_tokens=True)
            trials.append(RetrievalTrial(name, prompt.length, prompt.depth, prompt.trial, prompt.key, answer,
                                         found(answer, prompt.key), 1 + len(prompt.others)))  # fmt: skip
            bar.update()
    bar.close()
    return trials


# --- reading the answers -------------------------------------------------------------------------------------


def cells(
    trials: Sequence[RetrievalTrial], by_depth: bool = True
) -> dict[tuple[int, float | None], dict[str, list[bool]]]:
    """Each (length, depth) cell in probe order, or each length (depth None) with `by_depth=False`: every
    variant's outcomes there, trial by trial."""
    table: dict[tuple[int, float | None], dict[str, list[bool]]] = {}
    for t in trials:
        table.setdefault((t.length, t.depth if by_depth else None), {}).setdefault(t.variant, []).append(t.found)
    return table


def retrieval_rows(trials: Sequence[RetrievalTrial], by_depth: bool = True) -> list[dict]:
    """One row per cell (a length and key depth; a length with `by_depth=False`), then one for all: the trials
    and each variant's keys found ("found/trials")."""
    rows = []
    totals: dict[str, list[bool]] = {}
    for (length, depth), outcomes in cells(trials, by_depth).items():
        where = {"length": length, "depth_%": round(100 * depth)} if by_depth else {"length": length}
        rows.append({**where, **_counts(outcomes)})
        for variant, found_there in outcomes.items():
            totals.setdefault(variant, []).extend(found_there)
    return [*rows, {"length": "all", **({"depth_%": ""} if by_depth else {}), **_counts(totals)}]


def _counts(outcomes: dict[str, list[bool]]) -> dict[str, str | int]:
    return {"trials": len(next(iter(outcomes.values()))), **{v: f"{sum(f)}/{len(f)}" for v, f in outcomes.items()}}


def found_rate(trials: Sequence[RetrievalTrial], variant: str) -> float:
    """The share of its prompts in which `variant` found the key."""
    outcomes = [t.found for t in trials if t.variant == variant]
    return sum(outcomes) / len(outcomes)


def against_reference(trials: Sequence[RetrievalTrial], reference: str, variant: str) -> str:
    """One sentence on `variant` against `reference`, prompt by prompt: the keys each found, those the reference
    found that the variant missed (and where), those the variant found that the reference missed."""
    ours, theirs = _outcomes(trials, variant), _outcomes(trials, reference)
    lost = missed(trials, reference, variant)
    gained = len(missed(trials, variant, reference))
    text = f"{reference} found {sum(theirs.values())} of {len(theirs)} keys, {variant} {sum(ours.values())}"
    if lost:
        where = collections.Counter((length, depth) for length, depth, _ in lost)
        text += f"; {variant} missed {len(lost)} that {reference} found: " + ", ".join(
            f"{length} tokens at depth {100 * depth:.0f}% ({count})" for (length, depth), count in where.items()
        )
    elif any(theirs.values()):
        text += f"; {variant} found every key {reference} found"
    return text + (f"; it found {gained} that {reference} missed" if gained else "")


def missed(trials: Sequence[RetrievalTrial], reference: str, variant: str) -> list[tuple[int, float, int]]:
    """The prompts (length, depth, trial) whose key `reference` found and `variant` missed."""
    ours, theirs = _outcomes(trials, variant), _outcomes(trials, reference)
    return [prompt for prompt, hit in ours.items() if theirs[prompt] and not hit]


def missed_where_reference_retrieves(
    trials: Sequence[RetrievalTrial], reference: str, variant: str, share: float
) -> dict[int, list[tuple[int, float, int]]]:
    """Per length at which `reference` found at least `share` of its keys (RULER-style cells: a length, every
    depth): the prompts whose key it found and `variant` missed (empty lists where the variant kept them all)."""
    lost = missed(trials, reference, variant)
    return {
        length: [prompt for prompt in lost if prompt[0] == length]
        for (length, _), outcomes in cells(trials, by_depth=False).items()
        if sum(outcomes[reference]) >= share * len(outcomes[reference])
    }


def _outcomes(trials: Sequence[RetrievalTrial], variant: str) -> dict[tuple[int, float, int], bool]:
    return {(t.length, t.depth, t.trial): t.found for t in trials if t.variant == variant}
