"""Recent and sink tokens under continuous batching: which request holds which slot of model-dtype rows, and
what each step reads and writes there.

Every token is written to its FP8 page row when it arrives, so the pages alone always hold every token (blocks
shared by prefix caching, forked, offloaded or copied stay complete). Besides its pages, a request in flight
holds a slot of rows in the model's dtype (`paged.RecentRows`, one set per layer): its newest `recent` tokens in
a ring and its first `sinks` tokens. The attention reads those keys from the rows and every other key from its
codes, as the dense cache reads its recent and sink buffers, so a request gets `QuantizedFP8Cache`'s numbers.

A request holds only the tokens it computed itself while holding its slot: a prompt prefix taken from the prefix
cache, or the tokens before a CPU swap, are read from their codes. Slots are taken when transformers' scheduler
first admits a request (`admit`: none free, the request waits as for pages) and given back with its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_fp8kv.kernels.paged import RecentRows


@dataclass
class Held:
    """A request's slot, and the first position it computed while holding it (None until its first step)."""

    slot: int
    first: int | None = None


@dataclass(frozen=True)
class GroupStep:
    """What the requests of one step read and write in the rows of one layer group (an allocator)."""

    requests: torch.Tensor  # int32 [4, requests]: slot, sink count, recent start, first key position
    host: tuple[list[int], list[int], list[int], list[int]]
    sources: torch.Tensor  # int64: the step's new tokens to copy into the rows...
    targets: torch.Tensor  # int64: ...and the rows they go to


class RequestSlots:
    """The slots of one cache: `slots` requests at a time hold their `recent` newest and `sinks` first tokens."""

    def __init__(self, recent: int, sinks: int, slots: int):
        self.recent, self.sinks, self.slots = recent, sinks, slots
        self.free = list(range(slots - 1, -1, -1))
        self.held: dict[str, Held] = {}
        self.scheduled: list[tuple[str, int, int]] = []  # (request id, past length, new tokens) of the next step
        self._batch: object = None  # the index lists transformers fills for the step being scheduled
        self.step: list[tuple[str, int, int]] = []
        self.groups: dict[int, GroupStep] = {}

    def admit(self, request_id: str) -> bool:
        """Give `request_id` a slot unless it holds one; False when none is free."""
        if request_id in self.held:
            return True
        if not self.free:
            return False
        self.held[request_id] = Held(self.free.pop())
        return True

    def release(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.free.append(held.slot)

    def release_all(self) -> None:
        self.held.clear()
        self.free = list(range(self.slots - 1, -1, -1))

    def schedule(self, request_id: str, past: int, new: int, batch: object) -> None:
        """Note a request of the step being prepared (`batch`: the index lists transformers builds it with)."""
        if batch is not self._batch:
            self._batch, self.scheduled = batch, []
        held = self.held[request_id]
        if held.first is None:
            held.first = past
        self.scheduled.append((request_id, past, new))

    def start_step(self) -> None:
        """The forward of the last step prepared begins (its first layer's update)."""
        if self.scheduled:
            self.step, self.scheduled, self._batch, self.groups = self.scheduled, [], None, {}

    def group(self, index: int, sinks: int, keys_read, device: torch.device) -> GroupStep:
        """This step's reads and writes in the rows of group `index` (`sinks`: its sink tokens, 0 for sliding
        layers; `keys_read(past, new)`: the cached keys it reads)."""
        step = self.groups.get(index)
        if step is None:
            step = self.groups[index] = self._group_step(sinks, keys_read, device)
        return step

    def _group_step(self, sinks: int, keys_read, device: torch.device) -> GroupStep:
        per_slot, recent = self.recent + sinks, self.recent
        columns = ([], [], [], [])
        sources, targets = [], []
        query_row = 0
        for request_id, past, new in self.step:
            held = self.held[request_id]
            end, base = past + new, held.slot * per_slot
            recent_start = max(held.first, end - recent)
            for column, value in zip(columns, (held.slot, min(sinks, end) if held.first == 0 else 0, recent_start,
                                               past - keys_read(past, new))):  # fmt: skip
                column.append(value)
            for position in range(past, min(end, sinks)):  # sink tokens arriving
                sources.append(query_row + position - past)
                targets.append(base + recent + position)
            for position in range(max(past, recent_start), end):  # the newest tokens, into the ring
                sources.append(query_row + position - past)
                targets.append(base + position % recent)
            query_row += new
        index = torch.tensor([sources, targets], dtype=torch.int64).to(device, non_blocking=True)
        return GroupStep(torch.tensor(columns, dtype=torch.int32).to(device, non_blocking=True), columns, *index)

    def fork(self, parent: str, children: list[str], rows: list[torch.Tensor], rows_per_slot: list[int]) -> list[str]:
        """Give forked `children` slots holding a copy of `parent`'s rows (`rows`: every layer's, with its rows
        per slot); returns the children that got one (the others are left to transformers to prefill anew)."""
        held = self.held[parent]
        forked = children[: len(self.free)]
        for child in forked:
            self.admit(child)
            self.held[child].first = held.first
            for layer_rows, per_slot in zip(rows, rows_per_slot):
                source, target = held.slot * per_slot, self.held[child].slot * per_slot
                layer_rows[target : target + per_slot] = layer_rows[source : source + per_slot]
        return forked

    def rows_of(self, step: GroupStep, rows: torch.Tensor, sinks: int) -> RecentRows:
        """One layer's `RecentRows` for this step."""
        return RecentRows(rows, self.recent, sinks, step.requests, step.host)
