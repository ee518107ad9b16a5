"""A/B comparison of KV caches on one model in one call: greedy outputs, decode-mode quality, memory and speed.

`compare(model, tokenizer)` runs every variant (a cache factory) on the same prompts and texts against the
native `DynamicCache` and returns a `Comparison`, which prints as tables, renders in a notebook, plots and saves.
docs/compare.md explains every column.
"""

from __future__ import annotations

import collections
import contextlib
import html
import math
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tqdm.auto import tqdm
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import Cache

from hf_fp8kv.cache import QuantizedFP8Cache
from hf_fp8kv.evaluate import Quality, TokenScores, decode_mode_logits, greedy_with_logits, topk_rule
from hf_fp8kv.table import format_table

CacheFactory = Callable[[torch.nn.Module], Cache]
VariantSpec = Union[str, CacheFactory, Mapping[str, Any]]
REFERENCE = "native"
HF_FP8 = "hf_quantized_fp8"
# The configuration the report recommends: its first lines say what it gains against REFERENCE and HF_FP8.
RECOMMENDED = "fp8_window"
MIB = 2**20


@dataclass(frozen=True)
class Variant:
    """A named way to build a fresh cache for a model."""

    name: str
    make_cache: CacheFactory
    description: str


def _ours(name: str, note: str = "", /, **kwargs: Any) -> Variant:
    """A `QuantizedFP8Cache(model, **kwargs)` variant, described by that call (and `note`)."""
    call = "QuantizedFP8Cache(" + ", ".join(["model", *(f"{k}={v!r}" for k, v in kwargs.items())]) + ")"
    return Variant(name, lambda model: QuantizedFP8Cache(model, **kwargs), f"{call}: {note}" if note else call)


BUILTIN_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(REFERENCE, lambda model: DynamicCache(config=model.config), "transformers DynamicCache, model dtype"),
        _ours("fp8_window", "e4m3, a scale per token and KV head, the newest 32 and first 4 tokens in the model's "
              "dtype, the defaults; no calibration", scales="dynamic"),
        _ours("fp8_per_token_head", "e4m3, a scale per token and KV head on every token (vLLM's), no calibration",
              scales="dynamic", recent_tokens=0, sink_tokens=0),
        _ours("int8_per_token_head", "int8, a scale per token and KV head", kv_cache_dtype="int8_per_token_head"),
        _ours("fp8_e4m3", "e4m3, the checkpoint's scales, else 1.0 with a warning", kv_cache_dtype="fp8_e4m3"),
        _ours("fp8_e5m2", "e5m2, the checkpoint's scales, else 1.0 with a warning", kv_cache_dtype="fp8_e5m2"),
        Variant(
            HF_FP8,
            lambda model: QuantizedCache(backend="fp8", config=model.config),
            "transformers QuantizedCache(backend='fp8'): per-tensor scale frozen at prefill",
        ),
    )
}


def resolve_variants(variants: Sequence[str] | Mapping[str, VariantSpec] | None) -> list[Variant]:
    """Variants by built-in name, or `{name: built-in name | factory(model) -> Cache | QuantizedFP8Cache kwargs}`.

    The variant named "native" is the reference; the built-in one is added first when it is missing.
    """
    if variants is None:
        specs: dict[str, VariantSpec] = {name: name for name in BUILTIN_VARIANTS}
    elif isinstance(variants, Mapping):
        specs = dict(variants)
    else:
        names = [variants] if isinstance(variants, str) else list(variants)
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"variants {bad!r}: a list holds built-in names; pass {{name: factory or kwargs}} instead")
        specs = {name: name for name in names}
    if not specs:
        raise ValueError("variants is empty: pass at least one variant to compare with the reference")
    resolved = {name: _variant(name, spec) for name, spec in specs.items()}
    reference = resolved.pop(REFERENCE, BUILTIN_VARIANTS[REFERENCE])
    return [reference, *resolved.values()]


def _variant(name: str, spec: VariantSpec) -> Variant:
    if isinstance(spec, str):
        if spec not in BUILTIN_VARIANTS:
            raise ValueError(
                f"unknown variant {spec!r}; valid names: {', '.join(BUILTIN_VARIANTS)} (or pass a cache factory "
                "or a dict of QuantizedFP8Cache arguments under a name of your choice)"
            )
        builtin = BUILTIN_VARIANTS[spec]
        return Variant(name, builtin.make_cache, builtin.description)
    if isinstance(spec, Mapping):
        return _ours(name, **spec)
    if callable(spec):
        return Variant(name, spec, f"user factory {getattr(spec, '__qualname__', type(spec).__name__)}")
    raise TypeError(f"variant {name!r}: expected a built-in name, a factory model -> Cache or a dict, got {spec!r}")


def kv_bytes(cache: Cache) -> int:
    """Bytes of the tensors a cache holds: `cache.nbytes` when it reports it, else its layers' tensors."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _cache_tensors(cache)}
    return sum(storages.values())


def _cache_tensors(cache: Cache) -> list[torch.Tensor]:
    """Every tensor attribute of the cache's layers (also inside tuples, lists and dicts)."""
    return [leaf for layer in cache.layers for leaf in tree_leaves(vars(layer)) if isinstance(leaf, torch.Tensor)]


def builtin_prompts() -> list[str]:
    """The built-in prompts (one a line in hf_fp8kv/data/prompts.txt)."""
    return read_lines(resources.files("hf_fp8kv") / "data" / "prompts.txt")


def builtin_text() -> str:
    """The built-in evaluation text, written for this project."""
    return (resources.files("hf_fp8kv") / "data" / "sample_text.txt").read_text(encoding="utf-8")


def read_lines(path) -> list[str]:
    """Non-blank lines of a text file."""
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# --- results -----------------------------------------------------------------------------------------------


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


class _WarningLog:
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


@dataclass(repr=False)
class Comparison:
    """What `compare` measured; `str()` / notebook display give the tables, `plot()` and `save()` the figures."""

    variants: list[Variant]
    prompts: list[str]
    generations: list[Generation]
    positions: torch.Tensor  # context length when each scored token was predicted
    scores: dict[str, TokenScores]
    buckets: list[tuple[int, int]]
    costs: list[CostPoint]
    weight_bytes: int
    memory_budget: int
    top_k: int
    device: str
    warnings_raised: list[RaisedWarning] = field(default_factory=list)

    @property
    def reference(self) -> str:
        return self.variants[0].name

    # --- the story ---------------------------------------------------------------------------------------
    def headline(self) -> list[str]:
        """The report's first lines: the recommended variant (`RECOMMENDED`), then one sentence each on what it
        gains against the native cache and against transformers' fp8 cache. Empty when it was not compared."""
        names = [v.name for v in self.variants]
        if RECOMMENDED not in names:
            return []
        lines = [f"Recommended: {RECOMMENDED} = {self.variants[names.index(RECOMMENDED)].description}."]
        for name, label in ((self.reference, "the native cache"), (HF_FP8, "transformers' fp8 cache")):
            if name in names:
                lines.append(f"Against {label} ({name}): {self._gains(name)}.")
        return lines

    def _gains(self, other: str) -> str:
        ours, theirs = Quality.of(self.scores[RECOMMENDED]), Quality.of(self.scores[other])
        if other == self.reference:
            parts = [f"mean KL {ours.kl_mean:.2g} and {100 * ours.top1_agreement:.1f}% top-1 agreement with it"]
        else:
            parts = [
                f"{_relative(ours.kl_mean, theirs.kl_mean, 'lower', 'higher')} mean KL "
                f"({ours.kl_mean:.2g} vs {theirs.kl_mean:.2g})",
                f"top-1 agreement {100 * ours.top1_agreement:.1f}% vs {100 * theirs.top1_agreement:.1f}%",
            ]
        largest = {p.variant: p for p in self.costs}  # costs are in increasing context order
        if RECOMMENDED in largest and other in largest:
            a, b = largest[RECOMMENDED], largest[other]
            parts.insert(0, f"{_relative(a.kv_bytes, b.kv_bytes, 'smaller', 'larger')} KV cache")
            parts.append(
                f"{_relative(a.step_ms, b.step_ms, 'less', 'more')} time per decode step "
                f"({a.step_ms:.3g} vs {b.step_ms:.3g} ms; both at {a.context} tokens, batch 1)"
            )
        return ", ".join(parts)

    # --- tables ----------------------------------------------------------------------------------------
    def summary_rows(self) -> list[dict]:
        """One row per variant: verdict, quality over all scored tokens, memory and speed at the largest context."""
        rows = []
        largest = {p.variant: p for p in self.costs}  # costs are in increasing context order
        ref_cost = largest.get(self.reference)
        for variant in self.variants:
            gens = [g for g in self.generations if g.variant == variant.name]
            diverged = [g for g in gens if g.diverges_at is not None]
            q = Quality.of(self.scores[variant.name])
            row = {
                "variant": variant.name,
                "verdict": self._verdict(variant.name, diverged),
                "diverged": f"{len(diverged)}/{len(gens)}",
                "ppl_delta_%": q.ppl_delta_pct,
                "kl_mean": q.kl_mean,
                "top1_%": 100.0 * q.top1_agreement,
            }
            point = largest.get(variant.name)
            if point is not None:
                per_token = point.kv_bytes / point.tokens
                row.update(
                    {
                        "kv_bytes/token": round(per_token),
                        "kv_vs_ref_%": 100.0 * point.kv_bytes / ref_cost.kv_bytes,
                        f"tok/s@{point.context}": point.tokens_per_s,
                        f"max_batch@{point.context}": self.max_batch(per_token, point.context),
                    }
                )
            rows.append(row)
        return rows

    def _verdict(self, name: str, diverged: list[Generation]) -> str:
        if name == self.reference:
            return "reference"
        if not diverged:
            return "identical"
        return "diverges, top-k ok" if all(g.topk_rule for g in diverged) else "FAILS top-k rule"

    def max_batch(self, bytes_per_token: float, context: int) -> int:
        """Sequences of `context` tokens whose KV fits in the memory budget beside the weights."""
        return max(int((self.memory_budget - self.weight_bytes) // (bytes_per_token * context)), 0)

    def generation_rows(self) -> list[dict]:
        return [
            {
                "prompt": g.prompt + 1,
                "variant": g.variant,
                "diverges_at": "-" if g.diverges_at is None else g.diverges_at,
                f"top-{self.top_k}_rule": {None: "-", True: "ok", False: "FAIL"}[g.topk_rule],
                "output (first divergent token in [[ ]])": g.marked(),
            }
            for g in self.generations
        ]

    def quality_rows(self) -> list[dict]:
        rows = []
        for label, mask in [("all", None), *((f"{lo}-{hi - 1}", self._in_bucket(lo, hi)) for lo, hi in self.buckets)]:
            for variant in self.variants:
                scores = self.scores[variant.name]
                positions = self.positions
                if mask is not None:
                    scores, positions = scores.select(mask), positions[mask]
                q = Quality.of(scores)
                rows.append(
                    {
                        "context": label,
                        "variant": variant.name,
                        "tokens": len(positions),
                        "ppl": q.ppl,
                        "ppl_delta_%": q.ppl_delta_pct,
                        "kl_mean": q.kl_mean,
                        "kl_p99": q.kl_p99,
                        "top1_%": 100.0 * q.top1_agreement,
                        "first_flip_at": "-" if q.first_flip is None else int(positions[q.first_flip]),
                    }
                )
        return rows

    def _in_bucket(self, lo: int, hi: int) -> torch.Tensor:
        return (self.positions >= lo) & (self.positions < hi)

    def cost_rows(self) -> list[dict]:
        return [
            {
                "variant": p.variant,
                "context": p.context,
                "kv_MiB": p.kv_bytes / MIB,
                "peak_MiB": p.peak_bytes / MIB,
                "ms/step": p.step_ms,
                "tok/s": p.tokens_per_s,
            }
            for p in self.costs
        ]

    def tables(self) -> dict[str, list[dict]]:
        """Every table of the report, by title."""
        tables = {
            "Summary": self.summary_rows(),
            "Greedy outputs": self.generation_rows(),
            "Decode-mode quality by context length": self.quality_rows(),
        }
        if self.costs:
            tables["Cost (batch 1)"] = self.cost_rows()
        return tables

    def header(self) -> list[str]:
        """What was measured how: device, memory, the variants and the prompts."""
        return [
            f"device {self.device}; weights {self.weight_bytes / MIB:.1f} MiB; memory budget "
            f"{self.memory_budget / 2**30:.1f} GiB; {len(self.positions)} tokens scored in decode mode",
            "variants:",
            *(f"  {v.name}: {v.description}" for v in self.variants),
            *(f"prompt {i + 1}: {p}" for i, p in enumerate(self.prompts)),
        ]

    def _sections(self) -> list[tuple[str, list[str], list[dict]]]:
        """(title, lines, table) in report order: the summary (headline, warnings, table, header), then the rest."""
        tables = self.tables()
        story = self.headline() + [w.line() for w in self.warnings_raised]
        summary = ("Summary", story, tables.pop("Summary"))
        return [summary, ("", self.header(), []), *((title, [], rows) for title, rows in tables.items())]

    def __str__(self) -> str:
        blocks = []
        for title, lines, rows in self._sections():
            block = "\n".join([f"== {title} ==", *lines] if title else lines)
            if rows:
                block += ("\n\n" if lines else "\n") + format_table(rows)
            blocks.append(block)
        return "\n\n".join(blocks)

    def __repr__(self) -> str:
        return f"<Comparison of {', '.join(v.name for v in self.variants)}: print() it for the report>"

    def _repr_html_(self) -> str:
        parts = []
        for title, lines, rows in self._sections():
            parts.append(f"<h4>{html.escape(title)}</h4>" if title else "")
            parts.append("<p>" + "<br>".join(html.escape(line) for line in lines) + "</p>" if lines else "")
            parts.append(_html_table(rows) if rows else "")
        return "\n".join(p for p in parts if p)

    # --- figures ---------------------------------------------------------------------------------------
    def plot(self):
        """A matplotlib Figure with the three plots side by side."""
        from matplotlib.figure import Figure

        figure = Figure(figsize=(18, 4.5), layout="constrained")
        for ax, draw in zip(figure.subplots(1, len(PLOTS)), PLOTS.values()):
            draw(self, ax)
        return figure

    def save(self, directory: str | os.PathLike) -> list[Path]:
        """Write report.txt, report.html and one PNG per plot into `directory`; returns the paths."""
        from matplotlib.figure import Figure

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "report.txt", out / "report.html"]
        paths[0].write_text(str(self) + "\n", encoding="utf-8")
        paths[1].write_text(self._repr_html_(), encoding="utf-8")
        for name, draw in PLOTS.items():
            figure = Figure(figsize=(7, 4.5), layout="constrained")
            draw(self, figure.add_subplot())
            paths.append(out / f"{name}.png")
            figure.savefig(paths[-1], dpi=110)
        return paths

    def _plot_kl(self, ax) -> None:
        last = int(self.positions.max()) + 1
        ones = torch.ones(len(self.positions), dtype=torch.float64)
        counts = torch.zeros(last, dtype=torch.float64).index_add_(0, self.positions, ones)
        window = max(1, len(counts.nonzero()) // 32)
        for variant in self.variants[1:]:
            kl = self.scores[variant.name].kl.double()
            sums = torch.zeros(last, dtype=torch.float64).index_add_(0, self.positions, kl)
            seen = counts > 0
            mean = sums[seen] / counts[seen]
            smooth = torch.nn.functional.avg_pool1d(mean[None, None], window, 1, 0, count_include_pad=False)[0, 0]
            x = seen.nonzero()[:, 0][window - 1 :]
            ax.plot(x.numpy(), smooth.clamp_min(1e-9).numpy(), label=variant.name)
        ax.set(yscale="log", xlabel="context position (tokens)", ylabel=f"KL vs {self.reference} (mean of {window})")
        ax.set_title("Decode-mode KL by position")
        _legend(ax)

    def _plot_memory(self, ax) -> None:
        for variant, color in zip(self.variants, _colors()):
            points = [p for p in self.costs if p.variant == variant.name]
            contexts = [p.context for p in points]
            ax.plot(contexts, [p.kv_bytes / MIB for p in points], "o-", color=color, label=variant.name)
            ax.plot(contexts, [(p.peak_bytes - self.weight_bytes) / MIB for p in points], "x--", color=color)
        ax.set(xlabel="context (tokens)", ylabel="MiB (solid: KV held; dashed: step peak - weights)")
        ax.set_title("Memory vs context (batch 1)")
        _legend(ax)

    def _plot_step_time(self, ax) -> None:
        for variant in self.variants:
            points = [p for p in self.costs if p.variant == variant.name]
            ax.plot([p.context for p in points], [p.step_ms for p in points], "o-", label=variant.name)
        ax.set(xlabel="context (tokens)", ylabel="ms per decode step", title="Decode step time vs context (batch 1)")
        _legend(ax)


PLOTS: dict[str, Callable[[Comparison, Any], None]] = {
    "kl_vs_position": Comparison._plot_kl,
    "memory_vs_context": Comparison._plot_memory,
    "step_time_vs_context": Comparison._plot_step_time,
}


def _relative(value: float, other: float, less: str, more: str) -> str:
    """How `value` compares with `other`: "3.7x smaller", "12% smaller", "4% larger" (with less="smaller")."""
    if value == other:
        return "the same"
    small, large = sorted((value, other))
    word = less if value < other else more
    if small <= 0:
        return word
    if large / small >= 1.5:
        return f"{large / small:.1f}x {word}"
    return f"{100 * (1 - small / large if value < other else large / small - 1):.0f}% {word}"


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _colors():
    from matplotlib import rcParams

    return rcParams["axes.prop_cycle"].by_key()["color"] * 4


def _html_table(rows: list[dict]) -> str:
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return html.escape(text).replace("[[", "<mark>").replace("]]", "</mark>")

    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


# --- measurements --------------------------------------------------------------------------------------------


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
    log = _WarningLog()
    for variant in variant_list:  # fail on a bad factory or bad kwargs before the long loops
        with log.running(variant.name):
            variant.make_cache(model)

    use_chat = chat_template if chat_template is not None else bool(getattr(tokenizer, "chat_template", None))
    prompt_ids = [_prompt_ids(tokenizer, p, use_chat, device) for p in prompt_list]
    generations = _compare_generations(
        model, tokenizer, prompt_ids, variant_list, max_new_tokens, top_k, progress, log
    )
    positions, scores = _decode_mode_scores(model, text_ids, prefill, variant_list, progress, log)
    costs = []
    for variant in tqdm(variant_list if context_list else [], desc="cost", disable=not progress):
        with log.running(variant.name):
            costs += _measure_costs(model, variant, text_ids[0][0], context_list, decode_steps)
    return Comparison(
        variants=variant_list,
        prompts=prompt_list,
        generations=generations,
        positions=positions,
        scores=scores,
        buckets=_buckets(positions, prefill, buckets),
        costs=costs,
        weight_bytes=_weight_bytes(model),
        memory_budget=memory_budget,
        top_k=top_k,
        device=str(device),
        warnings_raised=list(log.raised.values()),
    )


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


def _compare_generations(
    model, tokenizer, prompt_ids, variants, max_new_tokens, top_k, progress, log: _WarningLog
) -> list[Generation]:
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


def _decode_mode_scores(
    model, text_ids, prefill, variants, progress, log: _WarningLog
) -> tuple[torch.Tensor, dict[str, TokenScores]]:
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


def _buckets(positions: torch.Tensor, prefill: int, edges: Sequence[int] | None) -> list[tuple[int, int]]:
    end = int(positions.max()) + 1
    if edges is None:
        edges = [2**k for k in range(1, 40) if prefill < 2**k < end]
    inner = sorted(e for e in set(edges) if prefill < e < end)
    bounds = [prefill, *inner, end]
    return list(zip(bounds[:-1], bounds[1:])) if inner else []


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


@torch.inference_mode()
def _measure_costs(model, variant: Variant, text: torch.Tensor, contexts: list[int], steps: int) -> list[CostPoint]:
    """Grow one cache through `contexts` (a prefill chunk up to each), timing `steps` decode steps at each; the
    tokens are `text`'s, repeated as needed."""
    needed = contexts[-1] + (steps + 1) * len(contexts)
    ids = text.repeat(math.ceil(needed / len(text)))
    cache = variant.make_cache(model)
    length, points = 0, []

    def forward(end: int) -> None:
        model(input_ids=ids[None, length:end], cache=cache, use_cache=True)

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


def _step_peak_bytes(model, cache: Cache, step: Callable[[], None]) -> int:
    """Peak bytes allocated during one step: CUDA's counter on GPU; on CPU, the weights plus the peak of the
    live tensors (the cache's and every op output) counted by `_LiveTensorBytes`."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device)
    with _LiveTensorBytes(_cache_tensors(cache)) as live:
        step()
    return _weight_bytes(model) + live.peak


class _LiveTensorBytes(TorchDispatchMode):
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


def _memory_budget(gib: float | None, device: torch.device) -> int:
    if gib is not None:
        if gib <= 0:
            raise ValueError(f"memory_budget_gib={gib} must be positive")
        return int(gib * 2**30)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
