"""The sink tokens' bookkeeping: each row's first real tokens, kept in the model's dtype by its layer.

Which token is a row's first real one is found from the attention mask (the first key the last query may see;
0 without a mask), on the host, once per row; the sink tokens are then copied from the updates' new states into
the layer's `sinks` buffer, and `sink_start` / `sink_count` (device tensors the kernels read) follow.
"""

from __future__ import annotations

import torch


class SinkTracker:
    """The sink rows of one layer (`rows[b]`: row b's first real token, -1 while unknown; None: none known)."""

    def __init__(self, count: int):
        self.count = count
        self.rows: list[int] | None = None

    @property
    def known(self) -> bool:
        """Whether every row's first real token is known (none to know without sinks)."""
        return not self.count or (self.rows is not None and -1 not in self.rows)

    def capture(self, layer, new_key: torch.Tensor, new_value: torch.Tensor, mask: torch.Tensor | None, view) -> bool:
        """Copy the sink tokens among this update's new states into `layer.sinks` (`view`: what the update's
        queries see); returns whether the sinks changed (the caller then takes a new view)."""
        if not self.count or torch.compiler.is_compiling():
            return False
        end = layer.host_end()
        arrived = end - new_key.shape[2]
        if self.rows is None or -1 in self.rows:
            self._find_rows(mask, layer.sinks.shape[1], end, view)
        if all(first >= 0 and first + self.count <= arrived for first in self.rows):
            return False  # every row's sinks are held already
        for row, first in enumerate(self.rows):
            lo, hi = max(first, arrived), min(first + self.count, end)
            if first >= 0 and lo < hi:
                layer.sinks[0, row, :, lo - first : hi - first] = new_key[row, :, lo - arrived : hi - arrived]
                layer.sinks[1, row, :, lo - first : hi - first] = new_value[row, :, lo - arrived : hi - arrived]
        self.sync(layer)
        return True

    def _find_rows(self, mask: torch.Tensor | None, batch: int, end: int, view) -> None:
        if mask is None:
            rows = [0] * batch
        else:
            last_query = mask[:, 0, -1, :]  # [batch, columns]
            seen = last_query.any(dim=-1)
            first_column = last_query.int().argmax(dim=-1)
            start = view.mask_start if view.mask_start is not None else 0 if view.static else end - mask.shape[-1]
            rows = [c + start if s else -1 for c, s in zip(first_column.tolist(), seen.tolist())]
        old = self.rows or [-1] * batch
        self.rows = [o if o >= 0 else r for o, r in zip(old, rows)]

    def sync(self, layer) -> None:
        """`layer.sink_start` / `sink_count` from the rows and the tokens seen (after an update or a crop)."""
        if not self.rows:
            return
        rows = torch.tensor(self.rows, dtype=torch.int64)
        counts = (layer.host_end() - rows).clamp(0, self.count) * (rows >= 0)
        layer.sink_start.copy_(rows.clamp_min(0))
        layer.sink_count.copy_(counts)

    def select(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (beam reordering, batch operations)."""
        if self.rows is not None:
            self.rows = [self.rows[r] for r in rows]

    def reset(self) -> None:
        self.rows = None
