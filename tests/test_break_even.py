"""The break-even context of decode step time, on synthetic cost points."""

import pytest

from hf_fp8kv.comparison import CostPoint
from hf_fp8kv.comparison.break_even import BreakEven


def points(variant, step_ms):
    return [CostPoint(variant, context, context + 1, 0, 0, ms) for context, ms in step_ms.items()]


NATIVE = points("native", {1024: 10.0, 2048: 14.0, 4096: 22.0, 8192: 38.0})


def test_crossing_is_interpolated_between_the_measured_contexts():
    # ours - native: +2, +1, -2, -6 ms: the gap falls from +1 at 2048 to -2 at 4096, crossing a third of the way
    ours = points("fp8", {1024: 12.0, 2048: 15.0, 4096: 20.0, 8192: 32.0})
    even = BreakEven.of(ours, NATIVE)
    assert even.context == pytest.approx(2048 + 2048 / 3)
    assert (even.between, even.cell()) == ((2048, 4096), "~2731")
    assert even.sentence() == "is no slower from about 2731 tokens of context (interpolated between 2048 and 4096)"


def test_not_within_the_measured_range():
    ours = points("fp8", {1024: 11.0, 2048: 15.0, 4096: 23.0, 8192: 39.0})
    even = BreakEven.of(ours, NATIVE)
    assert (even.context, even.cell()) == (None, ">8192")
    assert even.sentence() == (
        "is still slower at 8192 tokens, the largest measured context: no break-even there"
    )


def test_faster_at_every_measured_context():
    even = BreakEven.of(points("fp8", {1024: 9.0, 2048: 14.0, 4096: 20.0, 8192: 30.0}), NATIVE)
    assert (even.context, even.between, even.cell()) == (1024, None, "<=1024")
    assert even.sentence() == "is no slower at every measured context (1024 to 8192 tokens)"


def test_the_last_crossing_counts_and_only_shared_contexts():
    # faster at 1024, slower at 2048 (noise or overhead), faster from then on: break-even between 2048 and 4096
    ours = points("fp8", {1024: 9.0, 2048: 16.0, 4096: 20.0, 8192: 30.0, 16384: 50.0})
    even = BreakEven.of(ours, NATIVE)
    assert even.measured == (1024, 2048, 4096, 8192) and even.context == pytest.approx(2048 + 2048 / 2)
    # slower again at the largest context: not within the measured range
    assert BreakEven.of(points("fp8", {1024: 12.0, 2048: 13.0, 4096: 23.0}), NATIVE).context is None
    assert BreakEven.of(points("fp8", {512: 1.0}), NATIVE) is None
