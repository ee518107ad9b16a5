"""One sliding-window (or chunked-attention) layer's FP8 cache: a trimmed buffer of the last window's codes.

Same contract as transformers' `DynamicSlidingWindowLayer`: an update attends over the last `window - 1` stored
tokens plus the new ones (a prefill longer than the window sees all of its tokens, the mask encodes the window),
then only the last `window - 1` are kept; `get_seq_length` counts every token seen; `get_mask_sizes` gives the
mask's `(kv_length, kv_offset)`; `activate_past_recording` keeps the old tokens until `crop` (assisted decoding).
A full-precision recent window lies inside the sliding window; sink tokens do not apply (the window drops them).

Dropping old tokens only moves `first`: the kept tokens are moved to the front of the buffers when new ones do
not fit, so a decode step copies nothing and a compaction (one window of codes) happens once per block.
"""

from __future__ import annotations

import math

from hf_fp8kv.kernels.view import KVView
from hf_fp8kv.layer import FP8CacheLayer


class FP8SlidingWindowLayer(FP8CacheLayer):
    """`FP8CacheLayer` that keeps only the last `sliding_window - 1` tokens (chunked layers: `chunk_size - 1`)."""

    is_sliding = True

    def __init__(self, *args, sliding_window: int, **kwargs):
        super().__init__(*args, **{**kwargs, "sink_tokens": 0})
        if sliding_window < 2:
            raise ValueError(f"layer {self.layer_idx}: sliding_window={sliding_window} must be at least 2")
        self.sliding_window = sliding_window
        self.record_past = False

    def activate_past_recording(self) -> None:
        """Keep every token until the next `crop`, so that it can roll the layer back (assisted decoding)."""
        self.record_past = True

    def _make_room(self, new_tokens: int) -> None:
        # One spare block beyond what the window needs, so that a compaction happens once per block of steps.
        used = self.end - self.first + new_tokens
        target = (math.ceil(used / self.block_size) + 1) * self.block_size
        if self.end + new_tokens - self.offset > self.capacity or self.capacity > target:
            self._reallocate(target)
        self._fit_full_precision(self.end + new_tokens)

    def _keep_last(self, tokens: int) -> None:
        self.first = max(self.first, self.end - tokens)

    def _visible(self, new_tokens: int) -> KVView:
        view = self.view(max(self.first, self.end - (self.sliding_window - 1 + new_tokens)))
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
        transformers' `DynamicSlidingWindowLayer` does (its count of tokens seen drops by the tokens removed)."""
        if self.end < self.sliding_window:
            super().crop(tokens_to_remove)
            return
        if not self.record_past:
            raise RuntimeError(
                f"layer {self.layer_idx}: crop() after the sliding window ({self.sliding_window}) was reached needs "
                "activate_past_recording() before the tokens to remove were added"
            )
        if tokens_to_remove > 0:
            raise RuntimeError(
                f"layer {self.layer_idx}: once the sliding window is reached, crop() takes a negative number of "
                f"tokens to remove, not {tokens_to_remove}"
            )
        end = self.end + tokens_to_remove
        self.first = min(max(self.first, end - (self.sliding_window - 1)), end)
        self._crop_to(end)
