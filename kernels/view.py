"""What one layer's attention reads: FP8 codes over a timeline, plus full-precision recent and sink tokens.

Tokens are numbered by their position in the sequence (the timeline, shared by every batch row, padding
included). A layer stores:

- codes `[2, batch, kv_heads, slots, head_dim]` (keys, values) of the storage format, token t at slot
  `(t - offset) % slots` (a linear buffer when the tokens fit, a ring for static sliding-window layers),
  with scales `[2, 1 | batch, kv_heads, 1 | slots]` (static per head, or per token and head);
- `recent` `[2, batch, kv_heads, R, head_dim]` in the model's dtype: tokens `[fp_start, end)` at slot `t % R`;
- `sinks` `[2, batch, kv_heads, S, head_dim]` in the model's dtype: row b's tokens
  `[sink_start[b], sink_start[b] + sink_count[b])` (its first real tokens) at slot `t - sink_start[b]`.

The attention sees tokens `[start, end)`: sink tokens from `sinks`, tokens at or after `fp_start` from `recent`,
every other one from the codes (so each token is read from exactly one place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from .formats import StorageFormat

Derived = TypeVar("Derived")  # what `KVView.derived` builds
Position = int | torch.Tensor  # a Python int, or a 0-dim int64 device tensor (static caches, CUDA graphs)


@dataclass
class KVView:
    codes: torch.Tensor
    scales: torch.Tensor
    fmt: StorageFormat
    start: Position
    end: Position
    fp_start: Position
    offset: int = 0
    recent: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    sink_start: torch.Tensor | None = None
    sink_count: torch.Tensor | None = None
    sink_rows: list[int] | None = None  # dynamic buffers: each row's first sink token (-1: none yet), on the host
    key_channel_scale: torch.Tensor | None = None
    has_nan: bool = True  # NaN codes may exist (the bit decode then needs its NaN select)
    static: bool = False  # a static cache: positions are device tensors and the mask covers [0, max_len)
    ring: bool = False  # the codes are a ring (static sliding layers); else token t is at slot t - offset
    positions: torch.Tensor | None = None  # static: int64 [2] holding `end`, `fp_start` (which are views of it)
    mask_start: int | None = None  # the position of the mask's first column (None: the mask ends at `end`)
    memo: dict | None = None  # launch arguments derived from the buffers, shared by the views of these buffers

    @property
    def slots(self) -> int:
        """Slots that hold tokens (static buffers have one more at the end, where writes with nowhere to go land)."""
        return self.codes.shape[3] - self.static

    @property
    def dynamic(self) -> bool:
        return self.scales.shape[3] > 1

    def sink_spans(self) -> dict[tuple[int, int], list[int]]:
        """`{(first token, count): [rows]}` of the sink tokens held (dynamic buffers, from `sink_rows`)."""
        spans: dict[tuple[int, int], list[int]] = {}
        for row, first in enumerate(self.sink_rows or ()):
            count = min(max(self.end - first, 0), self.sinks.shape[3]) if first >= 0 else 0
            if count:
                spans.setdefault((first, count), []).append(row)
        return spans

    def shared_sink_count(self) -> int | None:
        """The sink tokens every row holds from `start` on (0 without sinks; dynamic buffers, from `sink_rows`, as
        `sink_spans` counts them), or None when the rows' sinks differ."""
        rows = self.sink_rows if self.sinks is not None else None
        if not rows or rows[0] < 0 and rows.count(-1) == len(rows):
            return 0
        if rows.count(rows[0]) != len(rows) or rows[0] != self.start:
            return None
        return min(self.end - self.start, self.sinks.shape[3])

    def derived(self, owner: object, build: Callable[["KVView"], Derived]) -> Derived:
        """`build(self)`: what depends on the buffers alone (launch arguments, views of them), kept in `memo`
        under `owner` for the next views of the same buffers (whoever replaces a buffer starts a new memo)."""
        if self.memo is None:
            return build(self)
        entry = self.memo.get(owner)
        if entry is None or entry[0] is not self.codes or entry[1] is not self.scales:
            entry = self.memo[owner] = (self.codes, self.scales, build(self))
        return entry[2]
