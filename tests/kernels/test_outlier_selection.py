"""The outlier tokens' selection: `outliers.settle` (torch) against its definition, the Triton kernel against it."""

import dataclasses
import math

import pytest
import torch
from streams import Stream, advance, empty_view, tokens

from hf_fp8kv.kernels import ops, outliers, triton_outliers
from hf_fp8kv.kernels.triton_write import write_kv

BATCH, HEADS, HEAD_DIM, SLOTS = 2, 3, 24, 96


def empty_set(count: int, dtype: torch.dtype, scale_dtype: torch.dtype, offset: int, generator,
              ring: int = 0) -> outliers.OutlierSet:  # fmt: skip
    scales = (torch.rand(BATCH, HEADS, SLOTS + 5, generator=generator) + 0.1).to(scale_dtype)[..., 3 : 3 + SLOTS]
    return outliers.OutlierSet(
        torch.zeros(2, BATCH, HEADS, count, HEAD_DIM, dtype=dtype), torch.full((BATCH, HEADS, count), -1),
        torch.full((BATCH, HEADS, count), -math.inf), torch.zeros(2, BATCH, HEADS), scales, offset, ring,
    )  # fmt: skip


def updates(sizes: list[int], dtype: torch.dtype, offset: int, generator, invalid: bool = False):
    """Candidates of consecutive updates: positions from `offset`, keys of varied norms (a NaN key in one token;
    with `invalid`, some positions -1, as a static cache stages them)."""
    first = offset
    for n in sizes:
        kv = torch.randn(2, BATCH, HEADS, n, HEAD_DIM, generator=generator)
        kv[0] *= torch.rand(BATCH, HEADS, n, 1, generator=generator) * 3 + 0.1
        if first <= offset + 7 < first + n:
            kv[0, 1, 2, offset + 7 - first, 5] = math.nan
        positions = torch.arange(first, first + n)
        if invalid:
            positions[::3] = -1
        yield positions, kv.to(dtype)
        first += n


def as_sets(outlier_set: outliers.OutlierSet) -> list[dict]:
    """Per (row, head): {position: (keys, values, score)}."""
    kv, positions, scores = outlier_set.kv, outlier_set.positions, outlier_set.scores
    return [{int(t): (kv[:, b, h, i], float(scores[b, h, i])) for i, t in enumerate(positions[b, h].tolist()) if t >= 0}
            for b in range(positions.shape[0]) for h in range(positions.shape[1])]  # fmt: skip


CASES = [
    dict(sizes=[40, 1, 1, 1, 9, 1], count=4),
    dict(sizes=[2, 1, 1, 30], count=8),  # fewer candidates than slots at first
    dict(sizes=[50, 1, 1], count=3, dtype=torch.bfloat16, scale_dtype=torch.bfloat16, offset=11),
    dict(sizes=[20, 20, 1], count=5, dtype=torch.float16, invalid=True),
    dict(sizes=[30, 1], count=16, scale_dtype=torch.bfloat16),
]
# sliding layers: kept tokens a window behind leave the set (a linear buffer's scales made positive again, a ring's
# left as they are), on the host or read from the device
WINDOW_CASES = [
    dict(sizes=[30, 1, 1, 1, 1, 1, 1, 1, 1, 9, 1], count=4, window=12, offset=3),
    # (a ring's slots hold the window's coded tokens: no two kept tokens share one)
    dict(sizes=[30, 1, 1, 1, 1, 1, 1, 1, 1, 9, 1], count=4, window=12, ring=40, scale_dtype=torch.bfloat16),
    dict(sizes=[30, 1, 1, 1, 5, 1], count=3, window=10, on_device=True, invalid=True),
    # candidates already out of the window (a dynamic sliding layer whose recent tokens outnumber its window): never in
    dict(sizes=[30, 1, 1, 9, 1], count=3, lag=5, offset=2),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_settle_keeps_the_best_scores_and_marks_their_key_scales(case):
    """After every update the set is the best `count` scores `-|k|_1 / mean(|k_i|_1 up to it)` of the valid tokens
    so far (a row's tokens before `first_real` and a NaN key never count), with the exact K/V; exactly the kept
    tokens' key scales are negative, every magnitude unchanged."""
    dtype, scale_dtype, offset = case.get("dtype", torch.float32), case.get("scale_dtype", torch.float32), case.get("offset", 0)
    generator = torch.Generator().manual_seed(0)
    kept = empty_set(case["count"], dtype, scale_dtype, offset, generator)
    magnitudes = kept.key_scales.abs().clone()
    first_real = torch.tensor([offset + 5, offset])
    seen_t, seen_kv = [], []
    for positions, kv in updates(case["sizes"], dtype, offset, generator, case.get("invalid", False)):
        outliers.settle(kept, positions, kv, first_real)
        seen_t.append(positions)
        seen_kv.append(kv)
        t, kv_all = torch.cat(seen_t), torch.cat(seen_kv, dim=3)
        norms = kv_all[0].float().abs().sum(-1)
        valid = ((t >= 0) & (t[None, :] >= first_real[:, None]))[:, None, :] & norms.isfinite()
        for b in range(BATCH):
            for h in range(HEADS):
                ok = valid[b, h]
                row = norms[b, h][ok]
                score = -row / (row.cumsum(0) / torch.arange(1, len(row) + 1))
                best = score.topk(min(case["count"], len(row))).indices
                expected = {int(t[ok][i]): kv_all[:, b, h, ok][:, i] for i in best.tolist()}
                got = as_sets(kept)[b * HEADS + h]
                assert set(got) == set(expected)
                for position, values in expected.items():
                    assert torch.equal(got[position][0], values)
                negative = (kept.key_scales[b, h] < 0).nonzero().flatten() + offset
                assert set(negative.tolist()) == set(expected)
    assert torch.equal(kept.key_scales.abs(), magnitudes)


@pytest.mark.parametrize("case", CASES + WINDOW_CASES, ids=str)
def test_triton_settle_matches_the_torch_one(case):
    """The same sets, K/V, scores (to fp32 rounding of the norms), running sums and key scales (bit for bit), for
    positions given one by one or as the first of consecutive ones."""
    dtype, scale_dtype, offset = case.get("dtype", torch.float32), case.get("scale_dtype", torch.float32), case.get("offset", 0)
    sets = [empty_set(case["count"], dtype, scale_dtype, offset, torch.Generator().manual_seed(0), case.get("ring", 0))
            for _ in range(2)]  # fmt: skip
    first_real = torch.tensor([offset + 5, offset])
    end = offset
    for positions, kv in updates(case["sizes"], dtype, offset, torch.Generator().manual_seed(1), case.get("invalid", False)):
        end += kv.shape[3]  # (the update's first query, at end - n, sees the last `window` tokens)
        first_visible = end - kv.shape[3] - case["window"] + 1 if "window" in case else None
        if "lag" in case:
            first_visible = end - case["lag"]
        if case.get("on_device"):
            first_visible = torch.tensor(first_visible)
        if not case.get("invalid"):  # consecutive tokens, as a dynamic cache stages them: their first position
            positions = int(positions[0])
        outliers.settle(sets[0], positions, kv, first_real, first_visible)
        triton_outliers.settle(sets[1], positions, kv, first_real, first_visible)
        if first_visible is not None:
            assert ((sets[0].positions < 0) | (sets[0].positions >= first_visible)).all()
        for torch_kept, triton_kept in zip(*map(as_sets, sets)):
            assert set(torch_kept) == set(triton_kept)
            for position, (values, score) in torch_kept.items():
                assert torch.equal(triton_kept[position][0], values)
                assert triton_kept[position][1] == pytest.approx(score, rel=1e-5)
        torch.testing.assert_close(sets[1].norms, sets[0].norms, rtol=1e-6, atol=0)
        assert torch.equal(sets[1].key_scales, sets[0].key_scales)


@pytest.mark.parametrize("ring", [0, 16])
def test_evict_forgets_tokens_out_of_the_window(ring):
    """A linear buffer's evicted tokens get positive scales again (a crop may show them again); a ring's slots are
    left alone (a later token may hold them)."""
    generator = torch.Generator().manual_seed(0)
    kept = empty_set(4, torch.float32, torch.float32, 0, generator, ring)
    for positions, kv in updates([60], torch.float32, 0, generator):
        outliers.settle(kept, positions, kv, torch.zeros(BATCH, dtype=torch.int64))
    before, scales = kept.positions.clone(), kept.key_scales.clone()
    outliers.evict(kept, 30)
    assert torch.equal(kept.positions, torch.where(before < 30, -1, before))
    gone = before[before < 30]
    restored = kept.key_scales.flatten(0, 1).gather(-1, (before % ring if ring else before).flatten(0, 1))
    assert ((restored > 0) == (before < 30).flatten(0, 1) if not ring else restored == scales.flatten(0, 1).gather(
        -1, (before % ring).flatten(0, 1))).all() and len(gone)  # fmt: skip


def test_drop_from_forgets_later_tokens_and_restores_their_scales():
    generator = torch.Generator().manual_seed(0)
    kept = empty_set(4, torch.float32, torch.float32, 0, generator)
    magnitudes = kept.key_scales.clone()
    for positions, kv in updates([60], torch.float32, 0, generator):
        outliers.settle(kept, positions, kv, torch.zeros(BATCH, dtype=torch.int64))
    before = kept.positions.clone()
    outliers.drop_from(kept, 30)
    assert torch.equal(kept.positions, torch.where(before >= 30, -1, before))
    assert (kept.scores[kept.positions < 0] == -math.inf).all()
    negative = kept.key_scales < 0
    assert negative.sum() == (kept.positions >= 0).sum() and torch.equal(kept.key_scales.abs(), magnitudes)


def test_the_kernel_refuses_strided_channels():
    kept = empty_set(4, torch.float32, torch.float32, 0, torch.Generator().manual_seed(0))
    candidates = torch.randn(2, BATCH, HEADS, HEAD_DIM, 3).transpose(-1, -2)  # channels 3 apart
    with pytest.raises(ValueError, match="contiguous channels"):
        triton_outliers.plan_settle(kept, 0, candidates, torch.zeros(BATCH, dtype=torch.int64))


# decode steps written and judged in one launch (`triton_outliers.write_and_settle`): dynamic and static views, a
# sliding layer's window over a linear buffer and a static ring, no recent buffer (the new token gets codes), a
# recent buffer still filling (nothing gets codes at first), rotated codes, formats and model dtypes
FUSED_CASES = [
    (Stream(recent=4, updates=[30] + [1] * 8), dict(count=3)),
    (Stream(recent=4, updates=[30] + [1] * 8, dtype=torch.bfloat16, fmt="fp8_e5m2", tiled=True), dict(count=4)),
    (Stream(updates=[20] + [1] * 6, scale_dtype=torch.float32), dict(count=3)),
    (Stream(recent=8, updates=[5] + [1] * 7), dict(count=2)),
    (Stream(static=48, recent=4, updates=[20] + [1] * 8, tiled=True), dict(count=3)),
    (Stream(static=16, ring=True, recent=3, updates=[10] + [1] * 10, tiled=True), dict(count=3, window=16)),
    (Stream(recent=4, updates=[30] + [1] * 8, rotate=True, dtype=torch.float16), dict(count=3, window=12)),
    (Stream(recent=4, updates=[30] + [1] * 6, fmt="fp8_e4m3fnuz"), dict(count=5)),
    # searched scales: the write's search as `write_kv`'s (held to the oracle in test_triton_write.py)
    (Stream(recent=4, updates=[30] + [1] * 6, scale_search=16, dtype=torch.bfloat16), dict(count=3)),
    (Stream(static=48, updates=[20] + [1] * 6, scale_search=8, rotate=True, tiled=True), dict(count=3)),
]


@pytest.mark.parametrize("stream, case", FUSED_CASES, ids=str)
def test_a_decode_steps_write_and_judging_in_one_launch_are_write_then_settle(stream, case):
    """Each step's codes, scales (their signs too), recent slots, statistics and static positions bit for bit
    those of `write_kv` then `outliers.settle` of the token it gave codes (its exact rows read before the write;
    an empty turn where none did), the sets the same (K/V exact, scores and norms to fp32 rounding). Static views
    through the registered op a compiled graph calls (the eager static step's launch: the dynamic views')."""
    window = case.get("window")
    generator = torch.Generator().manual_seed(3)
    kv = tokens(stream, generator)
    view, stats = empty_view(stream, generator), torch.zeros(2, 2, dtype=torch.int64)
    prefill = stream.updates[0]
    write_kv(kv[0, :, :, :prefill], kv[1, :, :, :prefill], view, stats, advance=view.static)
    if not view.static:
        advance(view, stream, prefill)
    count, first_real = case["count"], torch.tensor([2, 0])
    ring = view.slots if stream.ring else 0
    shape = (stream.batch, stream.kv_heads, count)
    oracle = outliers.OutlierSet(
        torch.zeros(2, *shape, stream.head_dim, dtype=stream.dtype), torch.full(shape, -1),
        torch.full(shape, -math.inf), torch.zeros(2, *shape[:2]), view.scales[0], view.offset, ring,
    )  # fmt: skip
    coded = max(prefill - stream.recent, 0)
    first_visible = prefill - window if window else None
    outliers.settle(oracle, 0, kv[:, :, :, :coded], first_real, first_visible)  # (the prompt's, the same for both)
    buffers = [name for name in ("codes", "scales", "recent", "positions") if getattr(view, name) is not None]
    fused_view = dataclasses.replace(view, **{name: getattr(view, name).clone() for name in buffers})
    if view.static:
        fused_view.end, fused_view.recent_start = fused_view.positions[0], fused_view.positions[1]
    fused = oracle._replace(kv=oracle.kv.clone(), positions=oracle.positions.clone(), scores=oracle.scores.clone(),
                            norms=oracle.norms.clone(), key_scales=fused_view.scales[0])  # fmt: skip
    fused_stats = stats.clone()
    entered = []
    for t in range(prefill, stream.length):
        new = kv[:, :, :, t : t + 1]
        recent_start = int(view.positions[1]) if view.static else view.recent_start
        leaving = t - stream.recent
        if stream.recent and leaving >= recent_start and leaving >= (0 if stream.ring else view.offset):
            candidate, position = view.recent[:, :, :, leaving % stream.recent].clone()[:, :, :, None], leaving
        elif stream.recent:
            candidate, position = torch.zeros_like(new), -1
        else:
            candidate, position = new.clone(), t
        entered += [position] if position >= 0 else []
        write_kv(new[0], new[1], view, stats, advance=view.static)
        if not view.static:
            advance(view, stream, 1)
        outliers.settle(oracle, torch.tensor([position]), candidate, first_real, t + 1 - window if window else None)
        if view.static:  # the registered op a compiled graph calls (over a layer's buffers: leading 1s)
            ops.triton_ops().write_settle(
                new[0], new[1], fused_view.codes, fused_view.scales, fused_view.recent, fused_stats,
                fused_view.positions, fused.kv, fused.positions[None], fused.scores[None], fused.norms, first_real,
                fused_view.fmt.name, fused_view.ring, fused_view.rotate, ring, window or 0, fused_view.search_energy,
                fused_view.scale_search,
            )  # fmt: skip
        else:
            triton_outliers.write_and_settle(new[0], new[1], fused_view, fused_stats, fused, first_real, window)
        if not view.static:
            advance(fused_view, stream, 1)
        for name in buffers:
            assert torch.equal(getattr(fused_view, name).view(torch.uint8), getattr(view, name).view(torch.uint8)), t
        assert torch.equal(fused_stats, stats)
        for want, got in zip(as_sets(oracle), as_sets(fused)):
            assert set(got) == set(want), t
            for kept, (values, score) in want.items():
                assert torch.equal(got[kept][0], values) and got[kept][1] == pytest.approx(score, rel=1e-5)
        torch.testing.assert_close(fused.norms, oracle.norms, rtol=1e-6, atol=0)
    assert entered and torch.isin(oracle.positions, torch.tensor(entered)).any()  # tokens of the steps won places


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake-tensor tracing of Triton kernels needs a GPU")
def test_registered_write_settle_traces_for_torch_compile():
    """`hf_fp8kv::write_settle` (a compiled static step with outlier tokens) passes torch's op checks: its fake
    version's outputs and the buffers it declares it writes."""
    stream = Stream(static=48, recent=4, updates=[20], tiled=True)
    view = empty_view(stream, torch.Generator().manual_seed(0), device="cuda")
    kv = tokens(stream, torch.Generator().manual_seed(1)).cuda()
    stats = torch.zeros(2, 2, dtype=torch.int64, device="cuda")
    write_kv(kv[0], kv[1], view, stats, advance=True)
    shape = (stream.batch, stream.kv_heads, 3)
    args = (
        kv[0, :, :, -1:], kv[1, :, :, -1:], view.codes, view.scales, view.recent, stats, view.positions,
        torch.zeros(2, *shape, stream.head_dim, dtype=stream.dtype, device="cuda"),
        torch.full((1, *shape), -1, device="cuda"), torch.full((1, *shape), -math.inf, device="cuda"),
        torch.zeros(2, *shape[:2], device="cuda"), torch.zeros(stream.batch, dtype=torch.int64, device="cuda"),
        view.fmt.name, view.ring, view.rotate, 0, 0, None, 0,
    )  # fmt: skip
    torch.library.opcheck(
        ops.triton_ops().write_settle.default, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic")
    )


def test_a_write_that_settles_refuses_what_it_cannot_do_by_name():
    """More than one new token, scales that are not per token, strided outlier buffers: each refused, naming it."""
    stream = Stream(recent=4, updates=[10])
    view, stats = empty_view(stream, torch.Generator().manual_seed(0)), torch.zeros(2, 2, dtype=torch.int64)
    kept = outliers.OutlierSet(torch.zeros(2, 2, 2, 3, 80), torch.full((2, 2, 3), -1), torch.full((2, 2, 3), -math.inf),
                               torch.zeros(2, 2, 2), view.scales[0], 0)  # fmt: skip
    first_real, new = torch.zeros(2, dtype=torch.int64), torch.randn(2, 2, 2, 2, 80)
    with pytest.raises(ValueError, match="takes one new token and per-token scales, got 2 tokens"):
        triton_outliers.plan_write_settle(new[0], new[1], view, stats, kept, first_real)
    per_head = Stream(recent=4, updates=[10], scales="per-head")
    static_view = empty_view(per_head, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="per_token=False"):
        triton_outliers.plan_write_settle(new[0, :, :, :1], new[1, :, :, :1], static_view, stats, kept, first_real)
    strided = kept._replace(kv=torch.zeros(2, 2, 2, 80, 3).transpose(-1, -2))
    with pytest.raises(ValueError, match="contiguous channels"):
        triton_outliers.plan_write_settle(new[0, :, :, :1], new[1, :, :, :1], view, stats, strided, first_real)
