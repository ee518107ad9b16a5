"""The dynamic storage policy: buffers that grow with the context a block at a time, positions as Python ints.

Capacity grows `block_size` tokens at a time (the buffer is reallocated and the valid part copied) and shrinks
after a crop, so the bytes held stay within one block of the bytes used; no per-step `torch.cat`. Token t is at
slot `t - offset`; the stored tokens are `[first, end)`, with codes up to `recent_start` (the recent tokens are held
only in the recent buffer: each token is stored once). The recent and sink buffers grow and shrink the same way.

`DynamicFP8SlidingLayer` has the contract of transformers' `DynamicSlidingWindowLayer`: an update attends over the
last `window - 1` stored tokens plus the new ones (a prefill longer than the window sees all of its tokens, the
mask encodes the window), then only the last `window - 1` are kept; `get_seq_length` counts every token seen;
`activate_past_recording` keeps the old tokens until `crop` (assisted decoding). Dropping old tokens only moves
`first`: the kept tokens move to the front of the buffers when new ones do not fit, so a decode step copies
nothing and a compaction (one window of codes) happens once per block.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from hf_fp8kv.kernels.cpu import ring_pieces
from hf_fp8kv.kernels.view import KVView, coded_end, copy_slots
from hf_fp8kv.layer import FP8Layer
from hf_fp8kv.outliers import BUFFERS as OUTLIER_BUFFERS
from hf_fp8kv.scales import key_channel_ratios


class DynamicFP8Layer(FP8Layer):
    """A full-attention layer's codes in buffers grown one block at a time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first = self.end = self.recent_start = self.offset = 0

    def _allocate(self, batch: int, kv_heads: int, head_dim: int) -> None:
        self._new_buffers(batch, kv_heads, head_dim, 0, self._fp_slots(self.recent_tokens), self._fp_slots(self.sink_tokens))

    @property
    def length(self) -> int:
        """Tokens stored (the sliding layers drop the oldest)."""
        return self.end - self.first

    @property
    def capacity(self) -> int:
        return self.codes.shape[3] if self.is_initialized else 0

    def host_end(self) -> int:
        return self.end

    def view(self, start=None) -> KVView:
        """The stored tokens from `start` (default: all of them)."""
        tracker = self.sink_tracker
        return KVView(
            codes=self.codes, scales=self.scale, fmt=self.fmt, per_token=self.per_token,
            start=self.first if start is None else start, end=self.end, recent_start=self.recent_start,
            offset=self.offset, recent=self.recent, sinks=self.sinks if tracker.rows else None,
            sink_start=self.sink_start, sink_count=self.sink_count, sink_rows=tracker.rows,
            key_channel_scale=self.key_channel_scale, has_nan=self.has_nan, memo=self.kernels.memo,
            value_tiled=self.kernels.value_tiled, rotate=self.rotate, **self.outlier_view(), **self.scale_search.view(),
        )  # fmt: skip

    def visible_length(self, view: KVView) -> int:
        return view.end - view.start

    # --- storage -----------------------------------------------------------------------------------------------
    def _fp_slots(self, tokens: int, held: int = 0) -> int:
        """Slots of a full-precision buffer of at most `tokens` tokens that must hold `held` now: grown with the
        context a block at a time, like the codes. The recent token t is at slot t % slots: with fewer slots than
        `recent_tokens`, all the recent tokens still fit, so none leaves the buffer early."""
        return min(tokens, max(math.ceil(held / self.block_size), 1) * self.block_size)

    def _fit_full_precision(self, end: int, shrink: bool = False) -> None:
        """Resize the recent and sink buffers for tokens up to `end` (grow before a write when the tokens they must
        hold do not fit, `shrink` after a crop), keeping the tokens they hold. (A decode step's case, nothing to
        do, is decided in a comparison per buffer.)"""
        recent, sinks = self.recent, self.sinks
        if recent is not None and (shrink or recent.shape[3] < min(self.recent_tokens, end - self.recent_start)):
            self._fit("recent", self.recent_tokens, end - self.recent_start)
        if sinks is not None and (shrink or sinks.shape[3] < min(self.sink_tokens, end)):
            self._fit("sinks", self.sink_tokens, end)

    def _fit(self, name: str, tokens: int, held: int) -> None:
        buffer = getattr(self, name)
        slots = self._fp_slots(tokens, held)
        if buffer.shape[3] != slots:
            setattr(self, name, self._resized(name, buffer, slots))

    def _resized(self, name: str, buffer: torch.Tensor, slots: int) -> torch.Tensor:
        resized = buffer.new_zeros(*buffer.shape[:3], slots, buffer.shape[4])
        if name == "sinks":  # a row's sink token t is at slot t - sink_start, whatever the slots
            kept = min(slots, buffer.shape[3])
            resized[:, :, :, :kept] = buffer[:, :, :, :kept]
            return resized
        for first, stop, slot in ring_pieces(max(self.recent_start, self.end - slots), self.end, buffer.shape[3]):
            for piece_first, piece_stop, new_slot in ring_pieces(first, stop, slots):
                old_slot = slot + piece_first - first
                resized[:, :, :, new_slot : new_slot + piece_stop - piece_first] = (
                    buffer[:, :, :, old_slot : old_slot + piece_stop - piece_first]
                )
        return resized

    def _make_room(self, new_tokens: int) -> None:
        """Make sure the tokens with codes after this update have a slot (the newest `recent_tokens` have none:
        they are held only in the recent buffer); release a block after a crop."""
        coded = self._coded_end(new_tokens)
        used = max(coded - self.first, 0)
        if coded - self.offset > self.capacity or self.capacity - used > self.block_size:
            self._reallocate(math.ceil(used / self.block_size) * self.block_size)
        self._fit_full_precision(self.end + new_tokens, shrink=not new_tokens)

    def _measure_key_channels(self, key_states: torch.Tensor, new_tokens: int) -> None:
        """Until this update codes tokens every key is held in the recent buffer, as it came; then the channels are
        measured over those keys and the update's (non-finite values left out), and the held keys (recent and
        sinks) are divided by them, as the keys of later updates will be: powers of two, so the same bits."""
        if self._coded_end(new_tokens) == self._coded_end(0):
            return
        amax = _finite_amax(key_states)
        if self.recent is not None:
            for first, stop, slot in ring_pieces(self.recent_start, self.end, self.recent.shape[3]):
                amax = torch.maximum(amax, _finite_amax(self.recent[0, :, :, slot : slot + stop - first]))
        channel = key_channel_ratios(amax, amax.amax(dim=1, keepdim=True))
        for held in (self.recent, self.sinks):
            if held is not None:
                held[0] /= channel[:, None, :].to(held.dtype)
        if self.scale_search.energy is not None:  # (the queries' squares, in the space the keys are coded in)
            self.scale_search.energy *= channel.square()
        self.key_channel_scale = channel

    def _coded_end(self, new_tokens: int) -> int:
        return coded_end(self.end, self.recent_start, new_tokens, self.recent_tokens)

    def _reallocate(self, capacity: int) -> None:
        """Move the stored codes (tokens `[first, coded end)`) to the front of new buffers of `capacity` slots."""
        held = max(self._coded_end(0) - self.first, 0)
        first = self.first - self.offset
        codes = self.codes.new_empty(*self.codes.shape[:3], capacity, self.codes.shape[4])
        copy_slots(codes, self.codes, first, held, self.kernels.value_tiled)
        self.codes = codes
        if self.per_token:
            scale = self.scale.new_empty(*self.scale.shape[:3], capacity)
            scale[:, :, :, :held] = self.scale[:, :, :, first : first + held]
            self.scale = scale
        self.offset = self.first

    def _map_buffers(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._buffers():
            setattr(self, name, fn(getattr(self, name)))

    def _advance(self, new_tokens: int) -> None:
        self.end += new_tokens
        self.recent_start = max(self.recent_start, self.end - self.recent_tokens)

    def _visible(self, view: KVView, new_tokens: int) -> KVView:
        view.end, view.recent_start = self.end, self.recent_start  # (one view a step: building one costs 1 us)
        return view

    # --- the cache protocol ------------------------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.end + query_length, 0

    def get_seq_length(self) -> int:
        return self.end

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget every token and release the buffers; the counts start over."""
        for name in ("codes", "scale", "recent", "sinks", "sink_start", "sink_count", *OUTLIER_BUFFERS):
            self.__dict__.pop(name, None)
        self.outlier_tracker.pending = None
        self.pending = None  # (its token is forgotten with the rest)
        self.first = self.end = self.recent_start = self.offset = 0
        self.key_channel_scale = None  # (set again by the next first update, or measured again)
        self.stats = torch.zeros(2, 2, dtype=torch.int64)
        self.has_nan = False
        self.sink_tracker.reset()
        self.scale_search.reset()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        self.write_pending()
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        self._crop_to(max(self.end + tokens_to_remove, self.first))

    def _crop_to(self, end: int) -> None:
        """Forget the tokens from `end` on (those among the recent tokens stay full precision)."""
        self.end = end
        self.recent_start = min(self.recent_start, end)
        if self.is_initialized:
            self._make_room(0)
            self.sink_tracker.sync(self)
            self.outlier_tracker.crop(self, end)

    def _select_rows(self, rows: list[int]) -> None:
        self.write_pending()
        self.outlier_tracker.settle(self)
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        self._map_buffers(lambda t: t.index_select(1, index))
        self.sink_start, self.sink_count = self.sink_start[index], self.sink_count[index]
        self.sink_tracker.select(rows)

    def offload(self) -> None:
        self.write_pending()
        if self.is_initialized:
            self._map_buffers(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        self.write_pending()
        if self.is_initialized and self.codes.device != self.device:
            self._map_buffers(lambda t: t.to(self.device, non_blocking=True))


def _finite_amax(keys: torch.Tensor) -> torch.Tensor:
    """fp32 `[kv_heads, head_dim]` max of |keys| (`[batch, kv_heads, tokens, head_dim]`), non-finite ones as 0."""
    return keys.detach().float().abs().nan_to_num(0.0, 0.0).amax(dim=(0, 2))


class DynamicFP8SlidingLayer(DynamicFP8Layer):
    """A dynamic layer that keeps only the last `sliding_window - 1` tokens (chunked layers: `chunk_size - 1`)."""

    is_sliding = True

    def __init__(self, *args, sliding_window: int, **kwargs):
        super().__init__(*args, **{**kwargs, "sink_tokens": 0})  # the window drops the first tokens anyway
        if sliding_window < 2:
            raise ValueError(f"layer {self.layer_idx}: sliding_window={sliding_window} must be at least 2")
        self.sliding_window = sliding_window
        self.record_past = False

    def activate_past_recording(self, **kwargs) -> None:
        """Keep every token until the next `crop`, so that it can roll the layer back (assisted decoding). The
        arguments transformers >= 5.25 passes (`recurrent_states_to_keep`) are for recurrent layers' states."""
        self.record_past = True

    def _make_room(self, new_tokens: int) -> None:
        # One spare block beyond what the window needs, so that a compaction happens once per block of steps.
        coded = self._coded_end(new_tokens)
        target = (math.ceil(max(coded - self.first, 0) / self.block_size) + 1) * self.block_size
        if coded - self.offset > self.capacity or self.capacity > target:
            self._reallocate(target)
        self._fit_full_precision(self.end + new_tokens, shrink=not new_tokens)

    def _keep_last(self, tokens: int) -> None:
        self.first = max(self.first, self.end - tokens)

    def _visible(self, view: KVView, new_tokens: int) -> KVView:
        view = super()._visible(view, new_tokens)
        view.start = max(self.first, self.end - (self.sliding_window - 1 + new_tokens))
        if not self.record_past:
            self._keep_last(self.sliding_window - 1)  # the dropped codes stay in the buffers until the next write
        return view

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = max(self.end - self.sliding_window + 1, 0)
        if self.end >= self.sliding_window:
            return self.sliding_window - 1 + query_length, kv_offset
        return self.end + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` tokens and keep at most `sliding_window - 1` (so `crop(0)` may trim), as
        transformers' `DynamicSlidingWindowLayer` does (its count of tokens seen drops by the tokens removed); a crop
        that would leave the next token without tokens an earlier crop dropped is refused (transformers' would drop
        them silently)."""
        self.write_pending()
        if self.end >= self.sliding_window and not self.record_past:
            raise RuntimeError(
                f"layer {self.layer_idx}: crop() after the sliding window ({self.sliding_window}) was reached needs "
                "activate_past_recording() before the tokens to remove were added"
            )
        needed = max(self.end + min(tokens_to_remove, 0) - (self.sliding_window - 1), 0)  # the oldest token seen next
        if needed < self.first:
            raise RuntimeError(
                f"layer {self.layer_idx}: after crop({tokens_to_remove}) the next token sees tokens from {needed} on, "
                f"but this sliding-window layer holds tokens from {self.first} on: an earlier crop kept the last "
                f"sliding_window - 1 = {self.sliding_window - 1} (as transformers' DynamicSlidingWindowLayer does). "
                "Crop by the whole count at once, after activate_past_recording()"
            )
        if self.end < self.sliding_window:
            super().crop(tokens_to_remove)
            return
        if tokens_to_remove > 0:
            raise RuntimeError(
                f"layer {self.layer_idx}: once the sliding window is reached, crop() takes a negative number of "
                f"tokens to remove, not {tokens_to_remove}"
            )
        end = self.end + tokens_to_remove
        self.first = min(max(self.first, end - (self.sliding_window - 1)), end)
        self._crop_to(end)
