"""Outlier tokens' selection, the torch path and the oracle of `triton_outliers.py`: per row and KV head, the coded
tokens of best score `-|k|_1 / mean` (the mean of the key L1 norms of the row's candidates up to and including it)
kept exact, at most N (the rule and why: `hf_fp8kv/outliers.py`).

A kept token keeps its codes; its key scale is stored negated, which the attention reads as "in the outlier buffer"
(`KVView.outliers`). Sets are compared as sets: which slot holds a token does not matter to the attention, and a
tie with the weakest kept score may go either way. On a sliding-window layer a kept token no query will see again
leaves the set (`first_visible`); its scale is made positive again where its slot is still its own (a linear
buffer: a crop may show it again), not in a ring, whose slot a later token may hold.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class OutlierSet(NamedTuple):
    """One layer's outlier tokens: `kv` `[2, batch, kv_heads, N, head_dim]` (model dtype), `positions` `[batch,
    kv_heads, N]` int64 (-1: empty), `scores` `[batch, kv_heads, N]` fp32 (-inf: empty), `norms` `[2, batch,
    kv_heads]` fp32 (running sum and count of the candidates' key norms), `key_scales` `[batch, kv_heads, slots]`
    (the per-token key scales); token t's code slot is `t - offset`, or `t % ring` in a ring (`ring` > 0)."""

    kv: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    norms: torch.Tensor
    key_scales: torch.Tensor
    offset: int
    ring: int = 0

    @classmethod
    def of_buffers(cls, buffers: tuple, key_scales: torch.Tensor, offset: int, ring: int) -> OutlierSet:
        """The set over a layer's outlier buffers (kv, positions, scores, norms; positions and scores with a
        leading 1, as a layer holds them: `hf_fp8kv/outliers.py`)."""
        kv, positions, scores, norms = buffers
        return cls(kv, positions[0], scores[0], norms, key_scales, offset, ring)


class KeptSet(NamedTuple):
    """Outlier sets of `[rows, kv_heads]`: their tokens' K/V `[2, rows, kv_heads, N, head_dim]`, positions `[rows,
    kv_heads, N]` (-1: empty), scores `[rows, kv_heads, N]` (-inf: empty), running sum and count of the key norms
    `[2, rows, kv_heads]` (fp32). The dense cache's sets (`OutlierSet`) and continuous batching's request slots'
    (`paged_recent.SlotOutliers`, whose pages requests share: not marked, the attention compares positions)."""

    kv: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    norms: torch.Tensor


def judge(
    kept: KeptSet, positions: torch.Tensor, valid: torch.Tensor, candidates: torch.Tensor,
    first_visible: torch.Tensor | None = None,
) -> KeptSet:  # fmt: skip
    """The sets `kept` after the candidates, in position order: tokens `positions` `[rows, n]` (`valid` `[rows, n]`:
    those that may enter), their exact K/V `candidates` `[2, rows, kv_heads, n, head_dim]`; the new sets are the
    best N of the old ones and the candidates (ties arbitrary). `first_visible` `[rows]` (sliding layers): each row's
    kept tokens before it leave first, and its candidates before it never enter (nothing is marked: `settle` is
    the dense cache's, with its key scales)."""
    if first_visible is not None:
        gone = (kept.positions >= 0) & (kept.positions < first_visible[:, None, None])
        kept = kept._replace(positions=kept.positions.masked_fill(gone, -1), scores=kept.scores.masked_fill(gone, -math.inf))
        valid = valid & (positions >= first_visible[:, None])
    score, norms = _scores(kept.norms, valid, candidates[0])
    return _merge(kept._replace(norms=norms), positions, score, candidates)


def _scores(norms: torch.Tensor, valid: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate's score `-|k|_1 / mean` (-inf where not `valid` `[rows, n]` or its norm is not finite), and
    the running sum and count of the norms after them."""
    key_norms = keys.float().abs().sum(-1)  # [rows, kv_heads, n]
    valid = valid[:, None, :] & key_norms.isfinite()
    added = torch.where(valid, key_norms, 0.0)
    # the running sums in the order the Triton kernel adds: the total so far, then each candidate
    running_sum = torch.cat((norms[0, :, :, None], added), -1).cumsum(-1)
    running_count = torch.cat((norms[1, :, :, None], valid.float()), -1).cumsum(-1)
    score = torch.where(valid, -key_norms * running_count[..., 1:] / running_sum[..., 1:].clamp_min(1e-30), -math.inf)
    return score, torch.stack((running_sum[..., -1], running_count[..., -1]))


def _merge(kept: KeptSet, positions: torch.Tensor, score: torch.Tensor, candidates: torch.Tensor) -> KeptSet:
    count, head_dim = kept.positions.shape[-1], candidates.shape[-1]
    best, index = score.topk(min(count, score.shape[-1]), dim=-1)
    new_positions = torch.where(best > -math.inf, positions[:, None, :].expand_as(score).gather(-1, index), -1)
    picked = candidates.gather(3, index[None, ..., None].expand(2, -1, -1, -1, head_dim))
    all_scores = torch.cat((kept.scores, best), dim=-1)
    all_positions = torch.cat((kept.positions, new_positions.to(kept.positions.dtype)), dim=-1)
    all_kv = torch.cat((kept.kv, picked.to(kept.kv.dtype)), dim=3)
    scores, index = all_scores.topk(count, dim=-1)
    kv = all_kv.gather(3, index[None, ..., None].expand(2, -1, -1, -1, head_dim))
    return KeptSet(kv, all_positions.gather(-1, index), scores, kept.norms)


def settle(
    outliers: OutlierSet, positions: torch.Tensor | int, candidates: torch.Tensor, first_real: torch.Tensor,
    first_visible: int | torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Judge the tokens at `positions` `[n]` (-1: none; in order; an int: the first of n consecutive ones) that just
    got codes, `candidates` `[2, batch, kv_heads, n, head_dim]` their exact keys and values: those of row b at or
    after `first_real[b]` (its first token past padding and sinks) with a finite norm join the running mean and the
    race (`judge`). The kept tokens' key scales end negative, every other one's that was kept positive again.
    `first_visible` (sliding layers): kept tokens before it leave the set first, and candidates before it (gone
    from the window, maybe from the buffer) never enter."""
    if first_visible is not None:
        evict(outliers, first_visible)
    keys = candidates[0]
    if isinstance(positions, int):
        positions = torch.arange(positions, positions + keys.shape[2], device=keys.device)
    valid = (positions >= 0) & (positions[None, :] >= first_real[:, None])
    if first_visible is not None:
        valid = valid & (positions >= first_visible)
    score, norms = _scores(outliers.norms, valid, keys)
    outliers.norms.copy_(norms)
    if keys.device.type == "cpu" and not torch.compiler.is_compiling() and score.shape[-1]:
        # on the CPU (op-dispatch bound) a step whose token enters no set ends here: most steps, once the sets
        # are full (SmolLM2, 300 decode steps at 600-900 tokens, one thread: 1.23x -> 1.19x the default's time)
        if not bool((score.amax(-1) > outliers.scores.amin(-1)).any()):
            return
    kept = KeptSet(outliers.kv, outliers.positions, outliers.scores, outliers.norms)
    new = _merge(kept, positions.expand(valid.shape), score, candidates)
    old_positions = outliers.positions.clone()
    for now, then in zip(kept[:3], new[:3]):
        now.copy_(then)
    mark(outliers, old_positions, negative=False)
    mark(outliers, outliers.positions, negative=True)


def evict(outliers: OutlierSet, first_visible: int | torch.Tensor) -> None:
    """Forget the kept tokens before `first_visible` (out of a sliding window: no query sees them again); in a
    linear buffer their key scales made positive again."""
    gone = (outliers.positions >= 0) & (outliers.positions < first_visible)
    if not outliers.ring:
        mark(outliers, torch.where(gone, outliers.positions, -1), negative=False)
    outliers.positions.masked_fill_(gone, -1)
    outliers.scores.masked_fill_(gone, -math.inf)


def drop_from(outliers: OutlierSet, end: int | torch.Tensor) -> None:
    """Forget the outlier tokens at or after `end` (a crop); their key scales made positive again."""
    dropped = outliers.positions >= end
    mark(outliers, torch.where(dropped, outliers.positions, -1), negative=False)
    outliers.positions.masked_fill_(dropped, -1)
    outliers.scores.masked_fill_(dropped, -math.inf)


def slot_of(outliers: OutlierSet, positions: torch.Tensor) -> torch.Tensor:
    """The code slots of tokens at `positions`."""
    return positions % outliers.ring if outliers.ring else positions - outliers.offset


def mark(outliers: OutlierSet, positions: torch.Tensor, negative: bool) -> None:
    """The key scales of the tokens at `positions` `[batch, kv_heads, N]` (-1: none; a token whose slot the buffer
    no longer has: none) made negative (`negative`) or positive. Each (row, head)'s empty entries write what its
    first entry writes, so no two writes to one element differ."""
    scales = outliers.key_scales
    slots = slot_of(outliers, positions)
    held = (positions >= 0) & (slots >= 0) & (slots < scales.shape[-1])
    slots = slots.clamp(0, scales.shape[-1] - 1)
    now = scales.gather(-1, slots)
    value = torch.where(held, -now.abs() if negative else now.abs(), now)
    first = held.int().argmax(-1, keepdim=True)  # the first held entry (0 when none is: it writes what it read)
    scales.scatter_(-1, torch.where(held, slots, slots.gather(-1, first)), torch.where(held, value, value.gather(-1, first)))
