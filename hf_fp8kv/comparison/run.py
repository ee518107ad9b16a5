"""`compare`: checks its inputs (the built-in prompts and text by default), runs every measurement on every variant
and returns the `Comparison`."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Mapping, Sequence

import torch

from hf_fp8kv.comparison.measurement import (
    WarningLog,
    compare_generations,
    cost_points,
    decode_mode_scores,
    machine,
    weight_bytes,
)
from hf_fp8kv.comparison.report import Comparison
from hf_fp8kv.comparison.variants import VariantSpec, resolve_variants
from hf_fp8kv.retrieval import PasskeyProbe, probe_prompts, run_probe


def compare(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str] | None = None,
    texts: Sequence[str] | None = None,
    variants: Sequence[str] | Mapping[str, VariantSpec] | None = None,
    *,
    max_new_tokens: int = 32,
    prefill: int = 64,
    eval_tokens: int | None = 256,
    buckets: Sequence[int] | None = None,
    contexts: Sequence[int] = (128, 256, 512, 1024),
    decode_steps: int = 8,
    top_k: int = 5,
    memory_budget_gib: float | None = None,
    chat_template: bool | None = None,
    retrieval: PasskeyProbe | None = None,
    progress: bool = True,
) -> Comparison:
    """Compare KV cache variants on `model` against the native `DynamicCache`.

    Args:
        prompts: greedy generation prompts (default: the built-in ones), `max_new_tokens` each.
        texts: decode-mode texts (default: the built-in one): `prefill` tokens prefilled, then up to
            `eval_tokens` more fed one at a time (None: the whole text); scores bucketed at the context lengths
            `buckets` (default: powers of two).
        variants: built-in names (`BUILTIN_VARIANTS`) or `{name: name | factory(model) -> Cache | kwargs of
            QuantizedFP8Cache}`; "native" (the reference) is added when missing.
        contexts: context lengths at which KV bytes, peak memory and decode speed (`decode_steps` steps) are
            measured; empty to skip. The tokens come from the first text, repeated as needed.
        top_k: k of vLLM's rule at the first divergent token.
        memory_budget_gib: budget for the largest batch (default: the GPU's memory, else the machine's RAM).
        chat_template: wrap prompts in the tokenizer's chat template (default: when it has one).
        retrieval: a passkey-retrieval probe to run on every variant (off by default: it prefills long prompts),
            e.g. `PasskeyProbe(lengths=(2048, 4096), depths=(0.0, 0.5, 1.0), trials=4)`; its filler is the first
            text's sentences.

    Warnings the variants raise while they run are recorded in `warnings_raised` and listed once in the report
    instead of printed.
    """
    variant_list = resolve_variants(variants)
    prompt_list = _non_empty_strings(prompts if prompts is not None else builtin_prompts(), "prompts")
    text_list = _non_empty_strings(texts if texts is not None else [builtin_text()], "texts")
    counts = dict(max_new_tokens=max_new_tokens, prefill=prefill, eval_tokens=eval_tokens, decode_steps=decode_steps,
                  top_k=top_k)
    for name, value in counts.items():
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    context_list = sorted(set(contexts))
    if any(not isinstance(c, int) or c < 1 for c in context_list):
        raise ValueError(f"contexts {list(contexts)} must be positive token counts")
    device = next(model.parameters()).device
    memory_budget = _memory_budget(memory_budget_gib, device)
    text_ids = [_text_ids(tokenizer, text, i, prefill, eval_tokens, device) for i, text in enumerate(text_list)]
    log = WarningLog()
    for variant in variant_list:  # fail on a bad factory or bad kwargs before the long loops
        with log.running(variant.name):
            variant.make_cache(model)

    use_chat = chat_template if chat_template is not None else bool(getattr(tokenizer, "chat_template", None))
    prompt_ids = [_prompt_ids(tokenizer, p, use_chat, device) for p in prompt_list]
    passkeys = probe_prompts(model, tokenizer, retrieval, text_list[0], use_chat) if retrieval else []
    generations = compare_generations(model, tokenizer, prompt_ids, variant_list, max_new_tokens, top_k, progress, log)
    positions, scores = decode_mode_scores(model, text_ids, prefill, variant_list, progress, log)
    costs = cost_points(model, text_ids[0][0], variant_list, context_list, decode_steps, progress, log)
    answers = []
    if retrieval:
        caches = {v.name: v.make_cache for v in variant_list}
        answers = run_probe(model, tokenizer, passkeys, caches, retrieval.max_new_tokens, progress, log.running)
    return Comparison(
        variants=variant_list,
        prompts=prompt_list,
        generations=generations,
        positions=positions,
        scores=scores,
        buckets=_buckets(positions, prefill, buckets),
        costs=costs,
        weight_bytes=weight_bytes(model),
        memory_budget=memory_budget,
        top_k=top_k,
        device=str(device),
        warnings_raised=list(log.raised.values()),
        machine=machine(device),
        retrieval=answers,
    )


def builtin_prompts() -> list[str]:
    """The built-in prompts (one a line in hf_fp8kv/data/prompts.txt)."""
    return read_lines(resources.files("hf_fp8kv") / "data" / "prompts.txt")


def builtin_text() -> str:
    """The built-in evaluation text, written for this project."""
    return (resources.files("hf_fp8kv") / "data" / "sample_text.txt").read_text(encoding="utf-8")


def read_lines(path) -> list[str]:
    """Non-blank lines of a text file."""
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _non_empty_strings(items: Sequence[str] | str, what: str) -> list[str]:
    items = [items] if isinstance(items, str) else list(items)
    if not items or any(not isinstance(s, str) or not s.strip() for s in items):
        raise ValueError(f"{what} is empty or holds a blank entry: give at least one non-empty string")
    return items


def _text_ids(tokenizer, text: str, index: int, prefill: int, eval_tokens: int | None, device) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
    if ids.shape[1] <= prefill:
        raise ValueError(
            f"text {index + 1} has {ids.shape[1]} tokens, no more than prefill={prefill}: "
            "give a longer text or a smaller prefill"
        )
    return ids if eval_tokens is None else ids[:, : prefill + eval_tokens]


def _prompt_ids(tokenizer, prompt: str, use_chat: bool, device) -> torch.Tensor:
    if use_chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(prompt, return_tensors="pt", add_special_tokens=not use_chat).input_ids.to(device)


def _buckets(positions: torch.Tensor, prefill: int, edges: Sequence[int] | None) -> list[tuple[int, int]]:
    end = int(positions.max()) + 1
    if edges is None:
        edges = [2**k for k in range(1, 40) if prefill < 2**k < end]
    inner = sorted(e for e in set(edges) if prefill < e < end)
    bounds = [prefill, *inner, end]
    return list(zip(bounds[:-1], bounds[1:])) if inner else []


def _memory_budget(gib: float | None, device: torch.device) -> int:
    if gib is not None:
        if gib <= 0:
            raise ValueError(f"memory_budget_gib={gib} must be positive")
        return int(gib * 2**30)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
