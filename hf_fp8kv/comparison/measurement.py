"""What `compare` measures on every variant: greedy generations and decode-mode scores against the reference,
and cost points (KV bytes held, a decode step's peak memory and time); the warnings the variants raise meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from hf_fp8kv import compat
from hf_fp8kv.comparison.variants import Variant
from hf_fp8kv.evaluate import TokenScores, decode_mode_logits, greedy_with_logits, topk_rule


@dataclass
class Generation:
    """One variant's greedy output for one prompt, split around the first token that differs from the reference."""

    prompt: int
    variant: str
    before: str
    divergent: str
    after: str
    diverges_at: int | None  # index of the first generated token that differs from the reference
    topk_rule: bool | None  # at that token: is each side's choice in the other's top-k? None when identical

    def marked(self) -> str:
        text = self.before + (f"[[{self.divergent}]]" if self.diverges_at is not None else "") + self.after
        return text.replace("\n", "\\n")


@dataclass
class CostPoint:
    """Memory and decode speed of one variant at one context length (batch 1)."""

    variant: str
    context: int
    tokens: int  # tokens cached when `kv_bytes` was read
    kv_bytes: int
    peak_bytes: int
    step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 / self.step_ms


@dataclass
class RaisedWarning:
    """A warning that variants raised while `compare` ran them: recorded for the report instead of printed."""

    category: str
    message: str
    variants: list[str]

    def line(self) -> str:
        first_sentence = self.message.split(". ")[0].rstrip(".")
        return f"{', '.join(self.variants)} warned ({self.category}): {first_sentence}."


class WarningLog:
    """Records the warnings each variant raises, each distinct one once with the variants that raised it: a
    comparison provokes some on purpose (scale 1.0 without calibration is a variant), and printed they would land
    in the middle of the progress bars."""

    def __init__(self) -> None:
        self.raised: dict[tuple[str, str], RaisedWarning] = {}

    @contextlib.contextmanager
    def running(self, variant: str):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught:
            key = (w.category.__name__, str(w.message))
            entry = self.raised.setdefault(key, RaisedWarning(*key, []))
            if variant not in entry.variants:
                entry.variants.append(variant)


# --- greedy generations and decode-mode scores ----------------------------------------------------------------


def compare_generations(
    model, tokenizer, prompt_ids, variants, max_new_tokens, top_k, progress, log: WarningLog
) -> list[Generation]:
    """Each prompt generated greedily with every variant (a fresh cache each), split at the first token that
    differs from the reference's (the first variant's)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results = []
    bar = tqdm(total=len(prompt_ids) * len(variants), desc="generate", disable=not progress)
    for index, ids in enumerate(prompt_ids):
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        reference = None
        for variant in variants:
            with log.running(variant.name):
                cache = variant.make_cache(model)  # a fresh cache every call: transformers would continue a filled one
                tokens, logits = greedy_with_logits(model, inputs, cache, max_new_tokens, pad_token_id=pad)
            reference = reference or (tokens[0], logits[0])
            results.append(_generation(tokenizer, index, variant.name, *reference, tokens[0], logits[0], top_k))
            bar.update()
    bar.close()
    return results


def _generation(tokenizer, prompt: int, name: str, ref_tokens, ref_logits, tokens, logits, top_k: int) -> Generation:
    at, ok = topk_rule(ref_tokens, ref_logits, tokens, logits, k=top_k)
    ids = tokens.tolist()
    split = len(ids) if at is None else at
    pieces = (ids[:split], ids[split : split + 1], ids[split + 1 :])
    before, divergent, after = (tokenizer.decode(piece, skip_special_tokens=False) for piece in pieces)
    return Generation(prompt, name, before, divergent, after, at, None if at is None else ok)


def decode_mode_scores(
    model, text_ids, prefill, variants, progress, log: WarningLog
) -> tuple[torch.Tensor, dict[str, TokenScores]]:
    """The context length at which each text token after `prefill` was predicted, and every variant's scores
    there against the reference's (the first variant's) logits."""
    per_variant: dict[str, list[TokenScores]] = {v.name: [] for v in variants}
    positions = []
    for ids in text_ids:
        targets = ids[0, prefill:]
        reference = None
        for variant in tqdm(variants, desc="decode-mode", disable=not progress):
            with log.running(variant.name):
                logits = decode_mode_logits(model, ids, prefill, variant.make_cache(model), progress=progress).cpu()
            reference = logits if reference is None else reference
            per_variant[variant.name].append(TokenScores.of(reference, logits, targets.cpu()))
        positions.append(torch.arange(prefill, ids.shape[1]))
    return torch.cat(positions), {name: TokenScores.cat(parts) for name, parts in per_variant.items()}


# --- cost: bytes, peak memory, step time ----------------------------------------------------------------------


def cost_points(model, text, variants, contexts, steps, progress, log: WarningLog) -> list[CostPoint]:
    """Every variant's cost points at `contexts`, in that order (`_grow_and_time`)."""
    points = []
    for variant in tqdm(variants if contexts else [], desc="cost", disable=not progress):
        with log.running(variant.name):
            points += _grow_and_time(model, variant, text, contexts, steps)
    return points


@torch.inference_mode()
def _grow_and_time(model, variant: Variant, text: torch.Tensor, contexts: list[int], steps: int) -> list[CostPoint]:
    """Grow one cache through `contexts` (a prefill chunk up to each), timing `steps` decode steps at each; the
    tokens are `text`'s, repeated as needed."""
    needed = contexts[-1] + (steps + 1) * len(contexts)
    ids = text.repeat(math.ceil(needed / len(text)))
    cache = variant.make_cache(model)
    length, points = 0, []

    def forward(end: int) -> None:
        compat.forward(model, cache, input_ids=ids[None, length:end])

    for context in contexts:
        if context > length:
            forward(context)
            length = context
        start = length
        peak = _step_peak_bytes(model, cache, lambda: forward(length + 1))  # also the warm-up step
        length += 1
        _synchronize(ids.device)
        began = time.perf_counter()
        for _ in range(steps):
            forward(length + 1)
            length += 1
        _synchronize(ids.device)
        elapsed_ms = 1000.0 * (time.perf_counter() - began) / steps
        points.append(CostPoint(variant.name, start, length, kv_bytes(cache), peak, elapsed_ms))
    return points


def kv_bytes(cache: Cache) -> int:
    """Bytes of the tensors a cache holds: `cache.nbytes` when it reports it, else its layers' tensors."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _cache_tensors(cache)}
    return sum(storages.values())


def _cache_tensors(cache: Cache) -> list[torch.Tensor]:
    """Every tensor attribute of the cache's layers (also inside tuples, lists and dicts)."""
    return [leaf for layer in cache.layers for leaf in tree_leaves(vars(layer)) if isinstance(leaf, torch.Tensor)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


def _step_peak_bytes(model, cache: Cache, step: Callable[[], None]) -> int:
    """Peak bytes allocated during one step: CUDA's counter on GPU; on CPU, the weights plus the peak of the
    live tensors (the cache's and every op output) counted by `LiveTensorBytes`."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device)
    with LiveTensorBytes(_cache_tensors(cache)) as live:
        step()
    return weight_bytes(model) + live.peak


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live storages: the given tensors plus every op output, each storage once, until the
    last tensor seen on it is freed. Kernel-internal scratch buffers are not seen."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.refs: collections.Counter[int] = collections.Counter()
        self.current = self.peak = 0
        self.finalizers: list[weakref.finalize] = []
        for tensor in tensors:
            self._track(tensor)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if self.refs[key] == 0:
            self.current += size
            self.peak = max(self.peak, self.current)
        self.refs[key] += 1
        self.finalizers.append(weakref.finalize(tensor, self._release, key, size))

    def _release(self, key: int, size: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for finalizer in self.finalizers:
            finalizer.detach()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
