"""The report of a comparison: `Comparison` holds what `compare` measured and gives it as text and HTML tables
(opening with what the recommended variant gains), matplotlib plots and saved files."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from hf_fp8kv import retrieval
from hf_fp8kv.comparison.break_even import BreakEven
from hf_fp8kv.comparison.measurement import CostPoint, Generation, RaisedWarning
from hf_fp8kv.comparison.variants import HF_FP8, RECOMMENDED, Variant
from hf_fp8kv.evaluate import Quality, TokenScores
from hf_fp8kv.retrieval import RetrievalTrial
from hf_fp8kv.table import format_table

MIB = 2**20


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
    machine: str = ""  # what measured the step times: the GPU, or the CPU and its torch threads
    retrieval: list[RetrievalTrial] = field(default_factory=list)  # passkey answers, when the probe ran

    @property
    def reference(self) -> str:
        return self.variants[0].name

    # --- the story ---------------------------------------------------------------------------------------
    def headline(self) -> list[str]:
        """The report's first lines: the recommended variant (`RECOMMENDED`), then one sentence each on what it
        gains against the native cache and against transformers' fp8 cache, from which context its decode step is
        no slower than the native cache's (when costs were measured) and which keys it retrieves (when the probe
        ran). Empty when it was not compared."""
        names = [v.name for v in self.variants]
        if RECOMMENDED not in names:
            return []
        lines = [f"Recommended: {RECOMMENDED} = {self.variants[names.index(RECOMMENDED)].description}."]
        for name, label in ((self.reference, "the native cache"), (HF_FP8, "transformers' fp8 cache")):
            if name in names:
                lines.append(f"Against {label} ({name}): {self._gains(name)}.")
        break_even = self.break_even(RECOMMENDED)
        if break_even is not None:
            lines.append(
                f"Break-even of decode step time against {self.reference} on this machine ({self.machine}, batch 1): "
                f"{RECOMMENDED} {break_even.sentence()}."
            )
        if self.retrieval:
            lines.append(f"Passkey retrieval: {retrieval.against_reference(self.retrieval, self.reference, RECOMMENDED)}.")
        return lines

    def break_even(self, variant: str) -> BreakEven | None:
        """Where `variant`'s decode step time falls to the reference's (None without common cost points)."""
        return BreakEven.of(*([p for p in self.costs if p.variant == name] for name in (variant, self.reference)))

    def _gains(self, other: str) -> str:
        ours, theirs = Quality.of(self.scores[RECOMMENDED]), Quality.of(self.scores[other])
        if other == self.reference:
            parts = [f"mean KL {ours.kl_mean:.2g} and {100 * ours.top1_agreement:.1f}% top-1 agreement with it"]
        else:
            parts = [
                f"{relative(ours.kl_mean, theirs.kl_mean, 'lower', 'higher')} mean KL "
                f"({ours.kl_mean:.2g} vs {theirs.kl_mean:.2g})",
                f"top-1 agreement {100 * ours.top1_agreement:.1f}% vs {100 * theirs.top1_agreement:.1f}%",
            ]
        largest = {p.variant: p for p in self.costs}  # costs are in increasing context order
        if RECOMMENDED in largest and other in largest:
            a, b = largest[RECOMMENDED], largest[other]
            parts.insert(0, f"{relative(a.kv_bytes, b.kv_bytes, 'smaller', 'larger')} KV cache")
            parts.append(
                f"{relative(a.step_ms, b.step_ms, 'less', 'more')} time per decode step "
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
            if self.retrieval:
                row["retrieval_%"] = 100.0 * retrieval.found_rate(self.retrieval, variant.name)
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
                break_even = self.break_even(variant.name)
                row["break_even"] = "-" if variant.name == self.reference or break_even is None else break_even.cell()
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
        if self.retrieval:
            tables["Passkey retrieval (keys found / trials, by context length and key depth)"] = (
                retrieval.retrieval_rows(self.retrieval)
            )
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
    def plots(self) -> dict[str, Callable[[Comparison, Any], None]]:
        """The plots by name: the three of `PLOTS`, and the retrieval map when the probe ran."""
        return {**PLOTS, "retrieval": Comparison._plot_retrieval} if self.retrieval else PLOTS

    def plot(self):
        """A matplotlib Figure with the plots side by side."""
        from matplotlib.figure import Figure

        plots = self.plots()
        figure = Figure(figsize=(6 * len(plots), 4.5), layout="constrained")
        for ax, draw in zip(figure.subplots(1, len(plots)), plots.values()):
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
        for name, draw in self.plots().items():
            figure = Figure(figsize=(7, 4.5), layout="constrained")
            draw(self, figure.add_subplot())
            paths.append(out / f"{name}.png")
            figure.savefig(paths[-1], dpi=110)
        return paths

    def _plot_kl(self, ax) -> None:
        last = int(self.positions.max()) + 1
        ones = torch.ones(len(self.positions), dtype=torch.float64)
        counts = torch.zeros(last, dtype=torch.float64).index_add_(0, self.positions, ones)
        span = max(1, len(counts.nonzero()) // 32)
        for variant in self.variants[1:]:
            kl = self.scores[variant.name].kl.double()
            sums = torch.zeros(last, dtype=torch.float64).index_add_(0, self.positions, kl)
            seen = counts > 0
            mean = sums[seen] / counts[seen]
            smooth = torch.nn.functional.avg_pool1d(mean[None, None], span, 1, 0, count_include_pad=False)[0, 0]
            x = seen.nonzero()[:, 0][span - 1 :]
            ax.plot(x.numpy(), smooth.clamp_min(1e-9).numpy(), label=variant.name)
        ax.set(yscale="log", xlabel="context position (tokens)", ylabel=f"KL vs {self.reference} (mean of {span})")
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

    def _plot_retrieval(self, ax) -> None:
        """One map per variant, side by side in `ax`: the share of keys found by context length and key depth."""
        table = retrieval.cells(self.retrieval)
        lengths = sorted({length for length, _ in table})
        depths = sorted({depth for _, depth in table})
        ax.set_axis_off()
        ax.set_title("Passkey retrieval: keys found by context length and depth")
        width = 1 / len(self.variants)
        for i, variant in enumerate(self.variants):
            inner = ax.inset_axes((i * width + 0.15 * width, 0.12, 0.8 * width, 0.78))
            rates = torch.full((len(lengths), len(depths)), float("nan"))
            for (length, depth), outcomes in table.items():
                found = outcomes[variant.name]
                rates[lengths.index(length), depths.index(depth)] = sum(found) / len(found)
                inner.text(depths.index(depth), lengths.index(length), f"{sum(found)}/{len(found)}",
                           ha="center", va="center", fontsize="x-small")  # fmt: skip
            inner.imshow(rates.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            inner.set_xticks(range(len(depths)), [f"{100 * d:.0f}" for d in depths], fontsize="x-small")
            inner.set_yticks(range(len(lengths)), lengths if i == 0 else [], fontsize="x-small")
            inner.set_title(variant.name, fontsize="small")
            inner.set_xlabel("depth %", fontsize="x-small")
            if i == 0:
                inner.set_ylabel("context (tokens)", fontsize="small")


PLOTS: dict[str, Callable[[Comparison, Any], None]] = {
    "kl_vs_position": Comparison._plot_kl,
    "memory_vs_context": Comparison._plot_memory,
    "step_time_vs_context": Comparison._plot_step_time,
}


def relative(value: float, other: float, less: str, more: str) -> str:
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
