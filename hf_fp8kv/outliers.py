"""Outlier tokens: per layer and KV head, at most `count` coded tokens kept in the model's dtype beside the sinks,
chosen by the rule of Outlier Tokens Tracing (Su et al., ACL 2025, arXiv:2505.10938) as measured in
docs/recent.md: the smallest key L1 norms, each over the running mean of the norms before it.

A token enters the race when it gets codes (when it leaves the recent tokens, or is written straight to codes):
its score is `-|k|_1 / mean`, the mean over the row's non-sink coded tokens up to it, and the kept set is a running
top-`count` of the scores (a token leaves it, and is read from its codes again, once `count` later tokens outscore
it). Every coded token keeps its codes; a kept one's key scale is stored negated, which the attention reads as
"not here, in the outlier buffer" (so outliers need per-token scales), and its K/V are read from:

- `outlier_kv` `[2, batch, kv_heads, count, head_dim]` in the model's dtype;
- `outlier_pos` `[1, batch, kv_heads, count]` int64: each slot's token, -1 when empty;
- `outlier_score` `[1, batch, kv_heads, count]` fp32 (-inf when empty) and `outlier_norms` `[2, batch, kv_heads]`
  fp32 (the running sum and count of the key norms).

`judge` is the rule itself, over kept sets of any rows: continuous batching's request slots call it too
(`paged_recent.SlotOutliers`; there the pages, which requests share, are not marked: the attention compares each
token's position with the kept ones). The candidates are gathered in `stage`, before the write overwrites the
recent slots they leave, and judged in `settle`, once the attention mask has told the sink tracker where each
row's real tokens begin (padding and sink tokens never enter). Everything is device tensor ops of fixed shapes: no
host sync (static caches, CUDA graphs).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hf_fp8kv.kernels.view import KVView, coded_end

BUFFERS = ("outlier_kv", "outlier_pos", "outlier_score", "outlier_norms")


class Candidates(NamedTuple):
    """Tokens that got codes in an update: positions `[n]`, exact keys and values `[batch, kv_heads, n, D]`."""

    positions: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


class KeptSet(NamedTuple):
    """Outlier sets of `[rows, kv_heads]`: their tokens' K/V `[2, rows, kv_heads, count, D]`, positions
    `[rows, kv_heads, count]` (-1: an empty slot), scores `[rows, kv_heads, count]` (-inf: empty), and the running
    sum and count of the key norms `[2, rows, kv_heads]` (fp32)."""

    kv: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    norms: torch.Tensor


def judge(kept: KeptSet, t: torch.Tensor, valid: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> KeptSet:
    """The sets `kept` after the candidates, in position order: tokens `t` `[rows, n]` (`valid` `[rows, n]`: those
    that enter; padding and sinks do not), their exact `key` / `value` `[rows, kv_heads, n, D]`. Each candidate's
    score is `-|k|_1` over the running mean of its row's entered norms up to it; the new sets are the top `count`
    of the old ones and the candidates (ties arbitrary)."""
    count = kept.positions.shape[-1]
    norms = key.float().abs().sum(-1)  # [rows, kv_heads, n]
    valid = valid[:, None, :] & norms.isfinite()
    kept_norms = torch.where(valid, norms, 0.0)
    running_sum = kept.norms[0, :, :, None] + kept_norms.cumsum(-1)
    running_count = kept.norms[1, :, :, None] + valid.cumsum(-1)
    score = torch.where(valid, -norms * running_count / running_sum.clamp_min(1e-30), -math.inf)
    totals = torch.stack((kept.norms[0] + kept_norms.sum(-1), kept.norms[1] + valid.sum(-1)))

    best, index = score.topk(min(count, score.shape[-1]), dim=-1)
    positions = torch.where(best > -math.inf, t[:, None, :].expand_as(score).gather(-1, index), -1)
    picked = index[..., None].expand(-1, -1, -1, key.shape[-1])
    new_kv = torch.stack((key.gather(2, picked), value.gather(2, picked))).to(kept.kv.dtype)
    all_score = torch.cat((kept.scores, best), dim=-1)
    all_pos = torch.cat((kept.positions, positions.to(kept.positions.dtype)), dim=-1)
    all_kv = torch.cat((kept.kv, new_kv), dim=3)
    score, index = all_score.topk(count, dim=-1)
    kv = all_kv.gather(3, index[None, ..., None].expand(2, -1, -1, -1, key.shape[-1]))
    return KeptSet(kv, all_pos.gather(-1, index), score, totals)


class OutlierTracker:
    """The outlier tokens of one layer (`count` per row and KV head; 0: none)."""

    def __init__(self, count: int):
        self.count = count
        self.pending: Candidates | None = None

    def allocate(self, layer, batch: int, kv_heads: int, head_dim: int) -> None:
        """Empty outlier buffers on `layer` (see the module docstring)."""
        shape, device = (batch, kv_heads, self.count), layer.device
        layer.outlier_kv = torch.zeros(2, *shape, head_dim, dtype=layer.dtype, device=device)
        layer.outlier_pos = torch.full((1, *shape), -1, dtype=torch.int64, device=device)
        layer.outlier_score = torch.full((1, *shape), -math.inf, device=device)
        layer.outlier_norms = torch.zeros(2, batch, kv_heads, device=device)

    def clear(self, buffers: dict[str, torch.Tensor]) -> None:
        """Forget every outlier, in place (a static layer's reset, `buffers` its storage: the addresses stay)."""
        self.pending = None
        if self.count:
            buffers["outlier_pos"].fill_(-1)
            buffers["outlier_score"].fill_(-math.inf)
            buffers["outlier_norms"].zero_()

    def stage(self, view: KVView, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep the tokens this write gives codes (`view`: the buffers before it; `key`/`value` the new states): those
        leaving the recent buffer (copied, the write overwrites their slots) and new ones written straight to codes."""
        if not self.count:
            return
        n, recent = key.shape[2], view.recent
        slots = recent.shape[3] if recent is not None else 0
        if view.static:  # device positions: the n tokens before the newest `slots`, those before recent_start invalid
            t = view.end - slots + torch.arange(n, device=key.device)
            kv = [key, value]
            if slots:
                from_recent = (t < view.end)[None, None, :, None]
                direct = (t - view.end).clamp(0, n - 1)
                kv = [torch.where(from_recent, recent[i].index_select(2, t.clamp_min(0) % slots), states.index_select(2, direct))
                      for i, states in enumerate(kv)]  # fmt: skip
            self.pending = Candidates(torch.where(t >= view.recent_start, t, -1), *kv)
            return
        end, recent_start = view.end, view.recent_start
        coded = coded_end(end, recent_start, n, slots)
        leaving = torch.arange(recent_start, min(coded, end), device=key.device)
        direct = max(coded - end, 0)
        if leaving.numel() or direct:
            kv = [torch.cat((recent[i].index_select(2, leaving % slots), states[:, :, :direct]), dim=2) if len(leaving)
                  else states[:, :, :direct] for i, states in enumerate((key, value))]  # fmt: skip
            self.pending = Candidates(torch.arange(recent_start, coded, device=key.device), *kv)

    def settle(self, layer) -> None:
        """Judge the staged candidates: the kept set becomes the top `count` of it and them, the key scales of the
        kept tokens negated, of those that left it made positive again."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        t, key, value = pending
        first_real = layer.sink_start + layer.sink_tokens  # padding and sinks never enter ([batch])
        valid = (t >= 0) & (t[None, :] >= first_real[:, None])
        kept = KeptSet(layer.outlier_kv, layer.outlier_pos[0], layer.outlier_score[0], layer.outlier_norms)
        old_pos = layer.outlier_pos[0].clone()
        for now, new in zip(kept, judge(kept, t.expand(valid.shape), valid, key, value)):
            now.copy_(new)
        mark(layer.scale[0], old_pos, layer.slot_of, negative=False)
        mark(layer.scale[0], layer.outlier_pos[0], layer.slot_of, negative=True)

    def crop(self, layer, end: int | torch.Tensor) -> None:
        """Forget the outliers at or after `end` (a crop): their slots' scales made positive again."""
        self.pending = None
        if not self.count or not hasattr(layer, "outlier_pos"):
            return
        dropped = layer.outlier_pos[0] >= end
        mark(layer.scale[0], torch.where(dropped, layer.outlier_pos[0], -1), layer.slot_of, negative=False)
        layer.outlier_pos[0] = torch.where(dropped, -1, layer.outlier_pos[0])
        layer.outlier_score[0] = torch.where(dropped, -math.inf, layer.outlier_score[0])


def mark(scales: torch.Tensor, positions: torch.Tensor, slot_of, negative: bool) -> None:
    """Key scales `scales` `[batch, kv_heads, slots]` of the tokens at `positions` `[batch, kv_heads, N]` (-1: none)
    made negative (`negative`) or positive. Each (row, head)'s empty entries write what its first entry writes,
    so no two writes to one element differ."""
    held = positions >= 0
    slots = slot_of(positions).clamp(0, scales.shape[-1] - 1)
    now = scales.gather(-1, slots)
    value = torch.where(held, -now.abs() if negative else now.abs(), now)
    first = held.int().argmax(-1, keepdim=True)  # the first held entry (0 when none is: it writes what it read)
    scales.scatter_(-1, torch.where(held, slots, slots.gather(-1, first)), torch.where(held, value, value.gather(-1, first)))
