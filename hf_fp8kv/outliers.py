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

The candidates are gathered in `stage`, before the write overwrites the recent slots they leave, and judged in
`settle` (the layer's kernels: `kernels/outliers.py` on the torch path, one Triton launch on the other), once the
attention mask has told the sink tracker where each row's real tokens begin (padding and sink tokens never
enter). No host sync: static caches and CUDA graphs run it too. A decode step on the Triton path, once the sinks
are known, writes and judges in one launch instead (`write_and_settle`: no staging copy).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hf_fp8kv.kernels.cpu import ring_pieces
from hf_fp8kv.kernels.outliers import OutlierSet, drop_from
from hf_fp8kv.kernels.view import KVView, coded_end

BUFFERS = ("outlier_kv", "outlier_pos", "outlier_score", "outlier_norms")


class Candidates(NamedTuple):
    """Tokens that got codes in an update of `new_tokens`: positions `[n]` (-1: none) or the first of n consecutive
    ones, exact K/V `[2, batch, kv_heads, n, D]`."""

    positions: torch.Tensor | int
    kv: torch.Tensor
    new_tokens: int


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

    @staticmethod
    def outlier_set(layer) -> OutlierSet:
        offset = getattr(layer, "offset", 0)
        return OutlierSet.of_buffers(OutlierTracker.buffers(layer), layer.scale[0], offset, OutlierTracker.ring(layer))

    @staticmethod
    def buffers(layer) -> tuple[torch.Tensor, ...]:
        """The layer's outlier buffers, in `BUFFERS`' order."""
        return tuple(getattr(layer, name) for name in BUFFERS)

    @staticmethod
    def ring(layer) -> int:
        """The slots of a static sliding layer's ring of codes (else 0: a linear buffer)."""
        return layer.code_slots if layer.is_sliding and layer.is_compileable else 0

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
            kv = torch.stack((key, value))
            if slots:
                held = recent.index_select(3, t.clamp_min(0) % slots)
                kv = torch.where((t < view.end)[:, None], held, kv.index_select(3, (t - view.end).clamp(0, n - 1)))
            self.pending = Candidates(torch.where(t >= view.recent_start, t, -1), kv, n)
            return
        end, recent_start = view.end, view.recent_start
        coded = coded_end(end, recent_start, n, slots)
        if recent_start == coded:
            return
        # (a decode step's one leaving token: one copy, the staging's only op)
        pieces = [recent.narrow(3, slot, stop - first) for first, stop, slot in ring_pieces(recent_start, min(coded, end), slots)]
        if coded > end:  # (stacked: a copy already)
            pieces.append(torch.stack((key[:, :, : coded - end], value[:, :, : coded - end])))
        kv = torch.cat(pieces, dim=3) if len(pieces) > 1 else pieces[0] if coded > end else pieces[0].clone()
        self.pending = Candidates(recent_start, kv, n)

    def write_and_settle(self, layer, view: KVView, key: torch.Tensor, value: torch.Tensor) -> bool:
        """A decode step's write and the judging of the token it gives codes, in one launch where the layer's
        kernels have it (`kernels.write_and_settle`, a compiled graph's op too; no staging copy): each row's sinks
        known (padding and sinks never enter) and no per-channel key scales (the exact keys are the states, as
        `stage` keeps them). Returns whether it wrote the step."""
        if (not self.count or key.shape[2] != 1 or layer.key_channel_scale is not None
                or not layer.sink_tracker.known or not layer.kernels.settles_in_write):  # fmt: skip
            return False
        window = layer.sliding_window if layer.is_sliding else None
        first_real = layer.sink_start + layer.sink_tokens
        layer.kernels.write_and_settle(key, value, view, layer.stats, self.buffers(layer), self.ring(layer), first_real,
                                       window)  # fmt: skip
        return True

    def settle(self, layer) -> None:
        """Judge the staged candidates (`kernels.outliers.settle`): the kept set becomes the best `count` of it and
        them; on a sliding layer, the kept tokens no query of this update sees leave it first."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        first_real = layer.sink_start + layer.sink_tokens  # padding and sinks never enter ([batch])
        first_visible = None
        if layer.is_sliding:  # the update's first query, at end - new_tokens, sees the last `window` tokens
            end = layer.positions[0] if layer.is_compileable and layer.host_positions is None else layer.host_end()
            first_visible = end - (pending.new_tokens + layer.sliding_window - 1)
        layer.kernels.settle_outliers(self.outlier_set(layer), pending.positions, pending.kv, first_real, first_visible)

    def crop(self, layer, end: int | torch.Tensor) -> None:
        """Forget the outliers at or after `end` (a crop): their slots' scales made positive again."""
        self.pending = None
        if self.count and hasattr(layer, "outlier_pos"):
            drop_from(self.outlier_set(layer), end)
