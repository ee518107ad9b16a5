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


def settle(
    outliers: OutlierSet, positions: torch.Tensor | int, candidates: torch.Tensor, first_real: torch.Tensor,
    first_visible: int | torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Judge the tokens at `positions` `[n]` (-1: none; in order; an int: the first of n consecutive ones) that just
    got codes, `candidates` `[2, batch, kv_heads, n, head_dim]` their exact keys and values: those of row b at or
    after `first_real[b]` (its first token past padding and sinks) with a finite norm join the running mean and the
    race; the set becomes the best N of it and them. The kept tokens' key scales end negative, every other one's
    that was kept positive again. `first_visible` (sliding layers): kept tokens before it leave the set first, and
    candidates before it (gone from the window, maybe from the buffer) never enter."""
    if first_visible is not None:
        evict(outliers, first_visible)
    keys = candidates[0]
    if isinstance(positions, int):
        positions = torch.arange(positions, positions + keys.shape[2], device=keys.device)
    norms = keys.float().abs().sum(-1)  # [batch, kv_heads, n]
    valid = (positions >= 0) & (positions[None, :] >= first_real[:, None])
    if first_visible is not None:
        valid = valid & (positions >= first_visible)
    valid = valid[:, None, :] & norms.isfinite()
    added = torch.where(valid, norms, 0.0)
    # the running sums in the order the Triton kernel adds: the total so far, then each candidate
    running_sum = torch.cat((outliers.norms[0, :, :, None], added), -1).cumsum(-1)[..., 1:]
    running_count = outliers.norms[1, :, :, None] + valid.cumsum(-1)
    score = torch.where(valid, -norms * running_count / running_sum.clamp_min(1e-30), -math.inf)
    outliers.norms[0] = running_sum[..., -1] if running_sum.shape[-1] else outliers.norms[0]
    outliers.norms[1] = running_count[..., -1] if running_count.shape[-1] else outliers.norms[1]

    count = outliers.positions.shape[-1]
    best, index = score.topk(min(count, score.shape[-1]), dim=-1)
    if keys.device.type == "cpu" and not torch.compiler.is_compiling() and score.shape[-1]:
        # on the CPU (op-dispatch bound) a step whose token enters no set ends here: most steps, once the sets
        # are full (SmolLM2, 300 decode steps at 600-900 tokens, one thread: 1.23x -> 1.19x the default's time)
        if not bool((best[..., 0] > outliers.scores.amin(-1)).any()):
            return
    new_positions = torch.where(best > -math.inf, positions[index], -1)
    picked = candidates.gather(3, index[None, ..., None].expand(2, -1, -1, -1, candidates.shape[-1]))
    all_scores = torch.cat((outliers.scores, best), dim=-1)
    all_positions = torch.cat((outliers.positions, new_positions), dim=-1)
    all_kv = torch.cat((outliers.kv, picked.to(outliers.kv.dtype)), dim=3)
    kept, index = all_scores.topk(count, dim=-1)
    old_positions = outliers.positions.clone()
    outliers.scores.copy_(kept)
    outliers.positions.copy_(all_positions.gather(-1, index))
    outliers.kv.copy_(all_kv.gather(3, index[None, ..., None].expand(2, -1, -1, -1, candidates.shape[-1])))
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
