"""The break-even context: from which context length a cache's decode step is no slower than the reference's, on
the machine that measured both (what users ask first: from which context length is FP8 worth it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hf_fp8kv.comparison.measurement import CostPoint


@dataclass(frozen=True)
class BreakEven:
    """Where a cache's step time falls to the reference's and stays there up to the largest measured context:
    `context` is interpolated linearly between the two measured contexts around that last crossing; it is the
    smallest measured context when the cache is never slower, None when it is still slower at the largest."""

    context: float | None
    measured: tuple[int, ...]  # the contexts both were measured at
    between: tuple[int, int] | None = None  # the measured contexts around an interpolated crossing

    @classmethod
    def of(cls, points: Sequence[CostPoint], reference: Sequence[CostPoint]) -> BreakEven | None:
        """From one cache's cost points and the reference's (None when they share no context)."""
        reference_ms = {p.context: p.step_ms for p in reference}
        gaps = [(p.context, p.step_ms - reference_ms[p.context]) for p in points if p.context in reference_ms]
        if not gaps:
            return None
        measured = tuple(context for context, _ in gaps)
        slower = [i for i, (_, gap) in enumerate(gaps) if gap > 0]
        if not slower:
            return cls(float(measured[0]), measured)
        if slower[-1] == len(gaps) - 1:
            return cls(None, measured)
        (low, gap_low), (high, gap_high) = gaps[slower[-1]], gaps[slower[-1] + 1]
        return cls(low + (high - low) * gap_low / (gap_low - gap_high), measured, (low, high))

    def cell(self) -> str:
        """For a table: "<=128" (never slower), "~2900", ">1024" (not within the measured range)."""
        if self.context is None:
            return f">{self.measured[-1]}"
        if self.between is None:
            return f"<={self.measured[0]}"
        return f"~{self.context:.0f}"

    def sentence(self) -> str:
        """The same in words, after the cache's name: "is no slower from about 2731 tokens of context (...)"."""
        if self.context is None:
            return f"is still slower at {self.measured[-1]} tokens, the largest measured context: no break-even there"
        if self.between is None:
            return f"is no slower at every measured context ({self.measured[0]} to {self.measured[-1]} tokens)"
        low, high = self.between
        return f"is no slower from about {self.context:.0f} tokens of context (interpolated between {low} and {high})"
