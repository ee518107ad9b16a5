"""Recent and sink tokens under continuous batching: which request holds which slot of model-dtype rows, and
what each step reads and writes there.

Besides its pages, a request in flight holds a slot of rows in the model's dtype (`paged.RecentRows`, one set per
layer): its newest `recent` tokens in a ring and its first `sinks` tokens. The attention reads those keys from the
rows and every other key from its codes, as the dense cache reads its recent and sink buffers, so a request gets
`QuantizedFP8Cache`'s numbers.

Each token is stored once, as the dense cache stores it: a token is encoded into its FP8 page row when it leaves
the recent ones (`GroupStep.evicted`: from its ring row, the same model-dtype values), or when it arrives already
older than them (a prompt longer than `recent`: `GroupStep.coded`). The pages of a request's newest tokens are
therefore not written, and the allocator lends them no memory (`continuous_batching.VIRTUAL_BLOCK`). A layer
group that cannot do so (sliding layers, whose ring of pages transformers keeps, or a group with layers kept in
the model's dtype, which hold no rows) writes every token to its page row when it arrives.

A request holds the tokens it computed itself while holding its slot, and its sink tokens: when it starts past
position 0 (a prompt prefix taken from the prefix cache), its sink rows are copied from an earlier request with the
same first `sinks` tokens (the same tokens at the same positions: the same keys and values), a live one or one
kept when it was released (`kept`: the sink rows of up to `slots` such prompts, least recently used first out; none
found: its sink tokens are read from their codes). Its other tokens before that start are read from their codes.
(A request back from a CPU swap starts past 0 too: swapping is on only where no group stores each token once, the
newest tokens being in no page.) Slots are taken when transformers' scheduler first admits a request (`admit`: none
free, the request waits as for pages) and given back with its blocks.

Outlier tokens (`outlier_tokens`, `kernels/outliers.py`'s rule) follow the slot too: per KV head, the `outliers`
coded tokens of best score, in rows after the sink rows, with their positions, scores and running norm sums
(`SlotOutliers`). The candidates are the tokens leaving the recent ones in a step and the new ones already older
(`GroupStep.evicted` and `coded`: in a group storing each token once, those it encodes), judged per request in
position order before the attention; on a sliding layer the kept tokens a window behind leave first. A request
taking a slot starts with an empty set (one starting past position 0 too: its prefix is read from codes).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from hf_fp8kv.kernels.paged import RecentRows
from hf_fp8kv.kernels.outliers import KeptSet, judge


@dataclass
class Held:
    """A request's slot, its first `sinks` token ids (None: fewer known at admission), the first position it
    computed while holding it (None until its first step), whether its sink rows hold all its sink tokens, and its
    tokens once its last step started has run."""

    slot: int
    key: tuple[int, ...] | None = None
    first: int | None = None
    sinks: bool = False
    end: int = 0


class OutlierCandidates(NamedTuple):
    """A step's outlier candidates of one group, per request with some: slots int64 `[requests]`, their indices
    among the tokens leaving the recent ones (`GroupStep.evicted`), then the new ones already older (`coded`) int64
    `[requests, n]`, and positions int64 `[requests, n]` (in order; -1 pads)."""

    slots: torch.Tensor
    index: torch.Tensor
    positions: torch.Tensor
    first_visible: torch.Tensor  # int64 [requests]: the first position the step's queries see (sliding layers)


class SlotOutliers:
    """One layer's outlier tokens of every slot: their K/V in the slot rows `rows` (`[slots, outliers, 2, kv_heads,
    head_dim]`, a view), positions int32 `[slots, kv_heads, outliers]` (-1: empty), scores fp32 (-inf: empty), and
    the running sum and count of the key norms fp32 `[2, slots, kv_heads]`."""

    def __init__(self, rows: torch.Tensor):
        slots, count, _, kv_heads, _ = rows.shape
        self.rows = rows
        self.positions = torch.full((slots, kv_heads, count), -1, dtype=torch.int32, device=rows.device)
        self.scores = torch.full((slots, kv_heads, count), -math.inf, device=rows.device)
        self.norms = torch.zeros(2, slots, kv_heads, device=rows.device)

    def clear(self, slot: int) -> None:
        """Slot `slot`'s set made empty (its rows are then never read)."""
        self.positions[slot] = -1
        self.scores[slot] = -math.inf
        self.norms[:, slot] = 0

    def copy(self, source: int, target: int) -> None:
        """Slot `target`'s set becomes a copy of `source`'s (its rows are copied with the slot's)."""
        self.positions[target], self.scores[target] = self.positions[source], self.scores[source]
        self.norms[:, target] = self.norms[:, source]

    def judge(self, candidates: OutlierCandidates, states: torch.Tensor, sinks: int) -> None:
        """Update the sets of the candidates' slots with them (`states` `[2, kv_heads, tokens, head_dim]`: the
        exact K/V the candidates index; tokens before `sinks` never enter)."""
        slots, index, positions, first_visible = candidates
        kv = states.index_select(2, index.clamp_min(0).flatten()).unflatten(2, index.shape).transpose(1, 2)
        kept = KeptSet(self.rows[slots].permute(2, 0, 3, 1, 4), self.positions[slots], self.scores[slots],
                       self.norms[:, slots])  # fmt: skip
        new = judge(kept, positions, positions >= sinks, kv, first_visible)
        self.rows[slots] = new.kv.permute(1, 3, 0, 2, 4)
        self.positions[slots], self.scores[slots], self.norms[:, slots] = new.positions, new.scores, new.norms


@dataclass(frozen=True)
class LayerRows:
    """One layer's rows of every slot `[slots * per_slot, 2, kv_heads, head_dim]` (recent, sink, then outlier
    rows), on a layer with sink tokens the kept sink rows `[kept prompts * sinks, 2, kv_heads, head_dim]`, and on
    one with outlier tokens their sets."""

    rows: torch.Tensor
    per_slot: int
    kept: torch.Tensor | None
    outliers: SlotOutliers | None


@dataclass(frozen=True)
class GroupStep:
    """What the requests of one step read and write in the rows of one layer group (an allocator)."""

    requests: torch.Tensor  # int32 [4, requests]: slot, sink count, recent start, first key position
    host: tuple[list[int], list[int], list[int], list[int]]
    sources: torch.Tensor  # int64: the step's new tokens to copy into the rows...
    targets: torch.Tensor  # int64: ...and the rows they go to
    # storing each token once (else empty): the ring rows of the tokens leaving the recent ones, then the step's
    # new tokens already older than them (their query rows), to encode at their page rows `code_targets`
    evicted: torch.Tensor
    coded: torch.Tensor
    code_targets: torch.Tensor
    candidates: OutlierCandidates | None = None  # (outlier tokens) the tokens getting codes, per request


class RequestSlots:
    """The slots of one cache: `slots` requests at a time hold their `recent` newest and `sinks` first tokens, and
    per layer the outlier tokens `add_layer` gives it room for."""

    def __init__(self, recent: int, sinks: int, slots: int):
        self.recent, self.sinks, self.slots = recent, sinks, slots
        self.free = list(range(slots - 1, -1, -1))
        self.held: dict[str, Held] = {}
        self.layers: list[LayerRows] = []
        self.kept: OrderedDict[tuple[int, ...], int] = OrderedDict()  # first tokens -> kept entry, oldest use first
        self.scheduled: list[tuple[str, int, int]] = []  # (request id, past length, new tokens) of the next step
        self._batch: object = None  # the index lists transformers fills for the step being scheduled
        self.step: list[tuple[str, int, int]] = []
        self.groups: dict[int, GroupStep] = {}

    def add_layer(self, rows: torch.Tensor, sinks: int, outliers: int = 0) -> LayerRows:
        """Register a layer's slot rows, of `sinks` sink and `outliers` outlier tokens (with room for `slots`
        prompts' kept sink rows when it holds sink tokens)."""
        per_slot = self.recent + sinks + outliers
        kept = rows.new_zeros(self.slots * self.sinks, *rows.shape[1:]) if sinks else None
        held = rows.view(self.slots, per_slot, *rows.shape[1:])[:, self.recent + sinks :] if outliers else None
        layer = LayerRows(rows, per_slot, kept, SlotOutliers(held) if outliers else None)
        self.layers.append(layer)
        return layer

    def admit(self, request_id: str, tokens: list[int], past: int) -> bool:
        """Give `request_id` (`tokens`: its first ones; `past`: the position it starts at) a slot unless it holds
        one, with the sink rows of an earlier request with the same first tokens when it starts past position 0;
        False when none is free."""
        if request_id in self.held:
            return True
        if not self.free:
            return False
        key = tuple(tokens[: self.sinks]) if self.sinks and len(tokens) >= self.sinks else None
        held = self.held[request_id] = Held(self.free.pop(), key)
        for layer in self._outlier_layers():  # (an empty set, whoever held the slot)
            layer.outliers.clear(held.slot)
        if past and key is not None:
            held.sinks = self._take_sinks(held)
        return True

    def release(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is None:
            return
        if held.sinks and held.key is not None:
            self._keep_sinks(held)
        self.free.append(held.slot)

    def _sink_rows(self, slot: int, layer: LayerRows) -> torch.Tensor:
        start = slot * layer.per_slot + self.recent
        return layer.rows[start : start + self.sinks]

    def _kept_rows(self, entry: int, layer: LayerRows) -> torch.Tensor:
        return layer.kept[entry * self.sinks : (entry + 1) * self.sinks]

    def _keep_sinks(self, held: Held) -> None:
        """Keep a released request's sink rows for later requests with its first tokens (the least recently used
        entry makes room)."""
        if held.key in self.kept:
            self.kept.move_to_end(held.key)
            return
        entry = len(self.kept) if len(self.kept) < self.slots else self.kept.popitem(last=False)[1]
        self.kept[held.key] = entry
        for layer in self._sink_layers():
            self._kept_rows(entry, layer).copy_(self._sink_rows(held.slot, layer))

    def _take_sinks(self, held: Held) -> bool:
        """Copy into `held`'s slot the sink rows of a kept or live request with its first tokens; whether found."""
        entry = self.kept.get(held.key)
        live = next((other.slot for other in self.held.values() if other.key == held.key and other.sinks), None)
        if entry is None and live is None:
            return False
        if entry is not None:
            self.kept.move_to_end(held.key)
        for layer in self._sink_layers():
            rows = self._kept_rows(entry, layer) if entry is not None else self._sink_rows(live, layer)
            self._sink_rows(held.slot, layer).copy_(rows)
        return True

    def _sink_layers(self) -> list[LayerRows]:
        return [layer for layer in self.layers if layer.kept is not None]

    def _outlier_layers(self) -> list[LayerRows]:
        return [layer for layer in self.layers if layer.outliers is not None]

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
            for request_id, past, new in self.step:  # (a request's own sink tokens are in its rows once it runs)
                held = self.held[request_id]
                held.sinks |= held.first == 0 and past + new >= self.sinks
                held.end = past + new

    def first_position(self, request_id: str, past: int) -> int:
        """The first position `request_id` computes while holding its slot (`past`, its start, until known)."""
        held = self.held.get(request_id)
        return past if held is None or held.first is None else held.first

    def group(self, index: int, sinks: int, keys_read, device: torch.device, place=None,
              outliers: int = 0) -> GroupStep:  # fmt: skip
        """This step's reads and writes in the rows of group `index` (`sinks`: its sink tokens, 0 for sliding
        layers; `keys_read(past, new)`: the cached keys it reads; `place(request_id, positions)`: the page rows of
        a request's positions, for a group storing each token once, else None; `outliers`: its outlier tokens per
        KV head, in rows after the sink rows)."""
        step = self.groups.get(index)
        if step is None:
            step = self.groups[index] = self._group_step(sinks, outliers, keys_read, device, place)
        return step

    def _group_step(self, sinks: int, outliers: int, keys_read, device: torch.device, place) -> GroupStep:
        per_slot, recent = self.recent + sinks + outliers, self.recent
        columns = ([], [], [], [])
        sources, targets = [], []
        evicted, coded, evicted_targets, coded_targets = [], [], [], []
        judged = []  # (outlier tokens) per request: slot, indices among the evicted, among the coded, positions
        query_row = 0
        for request_id, past, new in self.step:
            held = self.held[request_id]
            end, base = past + new, held.slot * per_slot
            recent_start = max(held.first, end - recent)
            key_start = past - keys_read(past, new)
            if place is not None or outliers:  # the ring's tokens now older than the recent ones, the new ones already so
                leaving = range(max(held.first, past - recent), min(recent_start, past))
                arriving = range(past, min(recent_start, end))
                if outliers and (leaving or arriving):
                    judged.append((held.slot, range(len(evicted), len(evicted) + len(leaving)),
                                   range(len(coded), len(coded) + len(arriving)), [*leaving, *arriving], key_start))  # fmt: skip
                evicted += self.ring_rows(request_id, leaving, per_slot)
                coded += [query_row + position - past for position in arriving]
            if place is not None:  # (a group storing each token once encodes them now)
                evicted_targets += place(request_id, leaving)
                coded_targets += place(request_id, arriving)
            sinks_held = min(sinks, end) if held.first == 0 or held.sinks else 0
            for column, value in zip(columns, (held.slot, sinks_held, recent_start, key_start)):
                column.append(value)
            for position in range(past, min(end, sinks)):  # sink tokens arriving
                sources.append(query_row + position - past)
                targets.append(base + recent + position)
            for position in range(max(past, recent_start), end):  # the newest tokens, into the ring
                sources.append(query_row + position - past)
                targets.append(base + position % recent)
            query_row += new
        lists = (sources, targets, evicted, coded, evicted_targets + coded_targets)
        index = torch.tensor([i for part in lists for i in part], dtype=torch.int64).to(device, non_blocking=True)
        parts = index.split([len(part) for part in lists])
        candidates = self._candidates(judged, len(evicted), device) if judged else None
        return GroupStep(torch.tensor(columns, dtype=torch.int32).to(device, non_blocking=True), columns, *parts,
                         candidates)  # fmt: skip

    @staticmethod
    def _candidates(judged: list, evicted: int, device: torch.device) -> OutlierCandidates:
        """The outlier candidates of a step, each request's padded to the most (`evicted`: the tokens leaving the
        ring, encoded before the coded ones)."""
        width = max(len(positions) for *_, positions, _ in judged)

        def padded(row: list[int]) -> list[int]:
            return row + [-1] * (width - len(row))

        index = [padded([*left, *(evicted + i for i in arrived)]) for _, left, arrived, _, _ in judged]
        table = torch.tensor([index, [padded(positions) for *_, positions, _ in judged]], dtype=torch.int64)
        rows = torch.tensor([[slot for slot, *_ in judged], [first for *_, first in judged]])
        slots, first_visible = rows.to(device, non_blocking=True)
        return OutlierCandidates(slots, *table.to(device, non_blocking=True), first_visible)

    def fork(self, parent: str, children: list[str]) -> list[str]:
        """Give forked `children` slots holding a copy of `parent`'s rows; returns the children that got one (the
        others are left to transformers to prefill anew)."""
        held = self.held[parent]
        forked = children[: len(self.free)]
        for child in forked:
            self.held[child] = replace(held, slot=self.free.pop())
            for layer in self.layers:
                source, target = held.slot * layer.per_slot, self.held[child].slot * layer.per_slot
                layer.rows[target : target + layer.per_slot] = layer.rows[source : source + layer.per_slot]
                if layer.outliers is not None:
                    layer.outliers.copy(held.slot, self.held[child].slot)
        return forked

    def ring_rows(self, request_id: str, positions: range, per_slot: int) -> list[int]:
        """The rows of a request's recent `positions` in a layer with `per_slot` rows per slot."""
        base = self.held[request_id].slot * per_slot
        return [base + position % self.recent for position in positions]

    def rows_of(self, step: GroupStep, layer: LayerRows, sinks: int) -> RecentRows:
        """One layer's `RecentRows` for this step."""
        if layer.outliers is None:
            return RecentRows(layer.rows, self.recent, sinks, step.requests, step.host)
        outliers = layer.outliers.positions
        return RecentRows(layer.rows, self.recent, sinks, step.requests, step.host, outliers.shape[-1], outliers)
