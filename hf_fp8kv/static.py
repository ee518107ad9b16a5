"""The static storage policy, for `torch.compile` and CUDA graphs: preallocated buffers, positions on the device.

Like transformers' `StaticLayer`: the buffers are allocated at the first update for `max_cache_len` tokens (and
`max_batch_size` rows, else the first batch's) and then only written in place; the stored length lives in a
device tensor, so no Python number that changes per step reaches a kernel, a shape or a guard, and
`get_mask_sizes` is `(max_cache_len, 0)`: the mask covers every position. The cache holds at most
`max_cache_len` tokens on every layer, each stored once: the recent tokens in the model's dtype, every other one
as codes. Full-attention layers hold token t's codes at slot t, in `max_cache_len - recent_tokens` slots;
sliding-window layers hold a window of `min(sliding_window, max_cache_len)` tokens, the codes of those before the
recent ones in a ring of that many slots less the recent ones (token t at slot t % slots), which a decode step
writes in place; an update of several tokens once the ring is full (a long prompt, a chat turn) needs older
tokens than the ring holds, so it runs, eagerly, over a temporary linear copy of the window.

Every static buffer has one spare slot at the end: the torch path's branch-free writes send there what has
nowhere to go (a token that is not leaving the recent buffer yet), where the Triton kernels mask it out. A batch
of fewer rows than allocated uses the buffers' first rows (views kept per batch size, so a compiled graph keeps
its inputs).
"""

from __future__ import annotations

import torch

from hf_fp8kv.kernels.view import VALUE_TILE, KVView, store_token_major, token_major
from hf_fp8kv.layer import FP8Layer, QuantizedKV


class StaticFP8Layer(FP8Layer):
    """A full-attention layer with `max_cache_len` preallocated slots and device-side positions."""

    is_compileable = True

    def __init__(self, *args, max_cache_len: int, max_batch_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.recent_tokens = min(self.recent_tokens, max_cache_len)  # no more tokens than the cache holds
        self.positions = torch.zeros(3, dtype=torch.int64)  # end, recent_start, the write kernel's ticket
        self.position_views = (self.positions[0], self.positions[1])
        # `positions` on the host for the eager paths; None after a compiled step moved them (read back once)
        self.host_positions: tuple[int, int] | None = (0, 0)
        self.step_deltas: dict[int, torch.Tensor] = {}  # recent_start's move (0 or 1) -> a decode step's delta
        self.rows: int | None = None  # the batch served (None: the next update's)

    @property
    def ring_slots(self) -> int:
        """The columns the tokens lie on (`KVView.columns`): token t at column t."""
        return self.max_cache_len

    @property
    def code_slots(self) -> int:
        """The tokens with codes at most: every one but the recent ones (each token is stored once; at least one
        slot)."""
        return max(self.ring_slots - self.recent_tokens, 1)

    def _host_positions(self) -> tuple[int, int]:
        if self.host_positions is None:
            end, recent_start = self.positions[:2].tolist()
            self.host_positions = (end, recent_start)
        return self.host_positions

    def host_end(self) -> int:
        return self._host_positions()[0]

    @property
    def length(self) -> int:
        return min(self.host_end(), self.ring_slots)

    @property
    def capacity(self) -> int:
        return self.ring_slots if self.is_initialized else 0

    # --- allocation: buffers for max_batch_size rows, of which a batch uses the first -------------------------
    def _allocate(self, batch: int, kv_heads: int, head_dim: int) -> None:
        rows = self.max_batch_size if self.max_batch_size is not None else batch
        slots = self.code_slots
        if self.kernels.value_tiled and not self.is_sliding:  # whole blocks of tiled values (a ring keeps its size)
            slots += -slots % VALUE_TILE
        self._new_buffers(rows, kv_heads, head_dim, slots + 1, self.recent_tokens, self.sink_tokens)
        self.positions = self.positions.to(self.device)
        self.position_views = (self.positions[0], self.positions[1])
        self.storage = {name: getattr(self, name) for name in (*self._buffers(), "sink_start", "sink_count")}
        self.row_views: dict[int, dict[str, torch.Tensor]] = {}
        if not torch.compiler.is_compiling():  # fixed addresses: no recompilation, CUDA graphs can replay
            for name in ("positions", "stats"):
                torch._dynamo.mark_static_address(getattr(self, name))
        self._use_rows(batch)

    @property
    def allocated_rows(self) -> int:
        return self.storage["codes"].shape[1]

    def _use_rows(self, rows: int) -> None:
        """Serve a batch of `rows` rows from the first rows of the buffers (the same views for the same batch
        size: compiled graphs keep their inputs)."""
        if rows > self.allocated_rows:
            limit = "max_batch_size" if self.max_batch_size is not None else "its first batch (max_batch_size unset)"
            raise ValueError(
                f"layer {self.layer_idx}: a batch of {rows} rows exceeds this static cache's {self.allocated_rows} "
                f"rows ({limit}); build QuantizedFP8Cache(model, max_cache_len=..., max_batch_size={rows})"
            )
        if rows not in self.row_views:
            views = {name: buffer.narrow(_batch_dim(buffer), 0, rows) for name, buffer in self.storage.items()}
            if not torch.compiler.is_compiling():  # fixed addresses: no recompilation, CUDA graphs can replay
                for view in views.values():
                    torch._dynamo.mark_static_address(view)
            self.row_views[rows] = views
        for name, view in self.row_views[rows].items():
            setattr(self, name, view)
        self.rows = rows

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated (for `max_batch_size` rows, `max_cache_len` tokens)."""
        return sum(self.storage[name].nbytes for name in self._buffers()) if self.is_initialized else 0

    # --- the update --------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and self.rows is None:  # the first update since `reset`: any batch that fits
            self._use_rows(key_states.shape[0])
        return super().update(key_states, value_states, *args, **kwargs)

    def _batch_error(self, key_states: torch.Tensor) -> ValueError:
        return ValueError(
            f"layer {self.layer_idx}: new key states {tuple(key_states.shape)} do not fit this static cache's batch of "
            f"{self.rows} rows x {self.codes.shape[2]} KV heads; call cache.reset() before another batch (of at most "
            f"{self.allocated_rows} rows)"
        )

    def view(self, start=None) -> KVView:
        # views of `positions` made once: 3 us a step less, but a compiled graph takes its own (the buffer is static)
        end, recent_start = (self.positions[0], self.positions[1]) if torch.compiler.is_compiling() else self.position_views
        tracker = self.sink_tracker
        return KVView(
            codes=self.codes, scales=self.scale, fmt=self.fmt, per_token=self.per_token, end=end,
            recent_start=recent_start, ring=self.is_sliding, recent=self.recent,
            sinks=self.sinks if tracker.rows else None, sink_start=self.sink_start, sink_count=self.sink_count,
            key_channel_scale=self.key_channel_scale, positions=self.positions, memo=self.kernels.memo,
            value_tiled=self.kernels.value_tiled, columns=self.ring_slots, rotate=self.rotate, **self.outlier_view(),
            **self.scale_search.view(),
        )  # fmt: skip

    def visible_length(self, view: KVView) -> int:
        return self.ring_slots

    def _make_room(self, new_tokens: int) -> None:
        """A static cache holds at most `max_cache_len` tokens, on every layer (a sliding layer's mask columns are
        positions `[0, max_cache_len)` too)."""
        if new_tokens > self.max_cache_len:
            raise ValueError(
                f"layer {self.layer_idx}: {new_tokens} new tokens do not fit this static cache's "
                f"max_cache_len={self.max_cache_len}; build QuantizedFP8Cache(model, max_cache_len=...) larger"
            )
        if not torch.compiler.is_compiling():
            end = self.host_end()
            if end + new_tokens > self.max_cache_len:
                raise ValueError(
                    f"layer {self.layer_idx}: {end} cached + {new_tokens} new tokens exceed this static cache's "
                    f"max_cache_len={self.max_cache_len}"
                )

    def _advance(self, new_tokens: int, on_device: bool | None = None) -> None:
        """Move the positions past `new_tokens`: the host's, and the device's unless the write kernel moved them
        (`on_device`: None, as the kernels say; a write into a copy of the buffers never does)."""
        if on_device is None:
            on_device = not self.kernels.advances_positions
        if torch.compiler.is_compiling():
            if on_device:
                self.positions[0] += new_tokens
                torch.maximum(self.positions[1], self.positions[0] - self.recent_tokens, out=self.positions[1])
            self.host_positions = None  # the host learns the new positions when it next needs them
            return
        end, recent_start = self._host_positions()
        end, moved = end + new_tokens, max(recent_start, end + new_tokens - self.recent_tokens) - recent_start
        if on_device and new_tokens == 1:  # an eager decode step: one in-place add of a delta kept on the device
            if moved not in self.step_deltas:
                self.step_deltas[moved] = torch.tensor([1, moved, 0], device=self.positions.device)
            self.positions.add_(self.step_deltas[moved])  # (1 op, not 5)
        elif on_device:
            self.positions[0] = end
            self.positions[1] = recent_start + moved
        self.host_positions = (end, recent_start + moved)

    # --- the cache protocol ------------------------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        self.write_pending()  # (the device positions move with the write)
        return self.positions[0] if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Forget every token; the buffers (and their addresses) stay."""
        if not self.is_initialized:
            return
        self.pending = None  # (its token is forgotten with the rest)
        self.positions.zero_()
        self.stats.zero_()
        self.host_positions = (0, 0)
        self.sink_tracker.reset()
        self.outlier_tracker.clear(self.storage)
        self.scale_search.reset()
        self.has_nan = False
        self.rows = None

    def crop(self, tokens_to_remove: int) -> None:
        self.write_pending()
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        end = max(self.host_end() + tokens_to_remove, 0)
        recent_start = min(self._host_positions()[1], end)
        self.positions[0], self.positions[1] = end, recent_start
        self.host_positions = (end, recent_start)
        self.sink_tracker.sync(self)
        self.outlier_tracker.crop(self, end)

    def _select_rows(self, rows: list[int]) -> None:
        """In place, in the first rows of the buffers (their addresses stay)."""
        self.write_pending()
        if len(rows) > self.allocated_rows:
            self._use_rows(len(rows))  # raises, naming max_batch_size
        self.outlier_tracker.settle(self)
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        picked = {name: getattr(self, name).index_select(_batch_dim(buffer), index) for name, buffer in self.storage.items()}
        for name, buffer in self.storage.items():
            buffer.narrow(_batch_dim(buffer), 0, len(rows)).copy_(picked[name])
        self._use_rows(len(rows))
        self.sink_tracker.select(rows)

    # --- pickling: views are rebuilt on load (plain pickle copies each tensor's storage: views would come back
    # detached from their buffers)
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for name in ("position_views", "row_views", *getattr(self, "storage", {})):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.position_views = (self.positions[0], self.positions[1])
        if self.is_initialized:
            rows, self.rows, self.row_views = self.rows, None, {}
            self._use_rows(rows if rows is not None else self.allocated_rows)
            self.rows = rows


class StaticFP8SlidingLayer(StaticFP8Layer):
    """A static sliding-window (or chunked) layer: a ring of `min(sliding_window, max_cache_len)` slots."""

    is_sliding = True

    def __init__(self, *args, sliding_window: int, **kwargs):
        super().__init__(*args, **{**kwargs, "sink_tokens": 0})  # the window drops the first tokens anyway
        self.sliding_window = sliding_window
        # the oldest token whose codes the ring still holds, as of the last crop: a crop lowers recent_start, not
        # what the ring's slots overwrote before it
        self.ring_floor = 0

    @property
    def ring_slots(self) -> int:
        return min(self.sliding_window, self.max_cache_len)

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can always roll the layer back: only when its ring never wraps (`max_cache_len <=
        sliding_window`), as for transformers' static sliding layer; else `crop` refuses to drop tokens whose ring
        slots overwrote tokens still needed."""
        return self.max_cache_len <= self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        self.write_pending()
        if tokens_to_remove < 0 and self.is_initialized:
            end, recent_start = self._host_positions()
            needed = max(end + tokens_to_remove - (self.sliding_window - 1), 0)  # the oldest token seen next
            # recent_start only grows between crops, so it is the furthest the codes have come since the last one
            self.ring_floor = held = max(self.ring_floor, recent_start - self.code_slots)
            if needed < held:
                raise RuntimeError(
                    f"layer {self.layer_idx}: after crop({tokens_to_remove}) the next token sees tokens from {needed} "
                    f"on, but this static sliding-window layer's ring of {self.ring_slots} slots has overwritten "
                    f"tokens {needed}..{held - 1}. A static cache on a sliding-window model cannot roll back once its "
                    "ring is full (assisted or prompt-lookup decoding): use the dynamic cache (no max_cache_len), or "
                    f"max_cache_len <= sliding_window ({self.sliding_window})"
                )
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.ring_floor = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new_tokens = key_states.shape[2]
        compiling = torch.compiler.is_compiling()
        host = self.host_positions if compiling else self._host_positions()  # compiled: guarded, None once moved
        if new_tokens == 1 or (host is not None and host[0] + new_tokens <= self.ring_slots):
            return super().update(key_states, value_states, *args, **kwargs)
        if compiling:
            raise RuntimeError(
                f"layer {self.layer_idx}: a static sliding-window layer takes several tokens at once only outside "
                "torch.compile (compile the decode step, as generate does)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.rows is None:
            self._use_rows(key_states.shape[0])
        if key_states.shape[0] != self.rows or key_states.shape[1] != self.codes.shape[2]:
            raise self._batch_error(key_states)
        kv = self._store_over_copy(key_states, value_states)
        return (kv, kv) if self.fast_path() else kv.dequantized()

    def _store_over_copy(self, key_states: torch.Tensor, value_states: torch.Tensor) -> QuantizedKV:
        """Several tokens once the ring is full: they are written into a linear copy of the coded tokens they may
        see (and of the recent tokens that leave the recent buffer now, whose codes are written then), attend over
        it, and its last `code_slots` coded tokens become the ring's."""
        self.write_pending()
        new_tokens, slots = key_states.shape[2], self.code_slots
        self._make_room(new_tokens)
        end, recent_start = self._host_positions()
        first = min(max(end - (self.sliding_window - 1), 0), recent_start)
        held = torch.arange(first, recent_start, device=self.device) % slots
        ring = token_major(self.codes, self.kernels.value_tiled)  # (the copy is token-major: the kernels read both)
        codes = self.codes.new_empty(*self.codes.shape[:3], end + new_tokens - first, self.codes.shape[4])
        codes.view(torch.uint8)[:, :, :, : recent_start - first] = ring.view(torch.uint8).index_select(3, held)
        scales = self.scale
        if self.per_token:
            scales = self.scale.new_empty(*self.scale.shape[:3], codes.shape[3])
            scales[:, :, :, : recent_start - first] = self.scale.index_select(3, held)
        linear = KVView(
            codes=codes, scales=scales, fmt=self.fmt, per_token=self.per_token, start=first, end=end,
            recent_start=recent_start, offset=first, recent=self.recent, key_channel_scale=self.key_channel_scale,
            rotate=self.rotate, **self.outlier_view(), **self.scale_search.view(),
        )  # fmt: skip
        stored_key = self._write(key_states, value_states, linear)
        linear.end, linear.recent_start = end + new_tokens, max(recent_start, end + new_tokens - self.recent_tokens)
        linear.mask_start = 0  # the static mask covers [0, max_cache_len)
        kept = torch.arange(max(linear.recent_start - slots, first), linear.recent_start, device=self.device)
        ring.view(torch.uint8).index_copy_(3, kept % slots, codes.view(torch.uint8).index_select(3, kept - first))
        store_token_major(self.codes, ring, self.kernels.value_tiled)
        if self.per_token:
            self.scale.index_copy_(3, kept % slots, scales.index_select(3, kept - first))
        self._advance(new_tokens, on_device=True)  # (the write went to the copy)
        return QuantizedKV(self, linear, stored_key, value_states)


def _batch_dim(buffer: torch.Tensor) -> int:
    return 0 if buffer.dim() == 1 else 1  # sink_start / sink_count [batch]; the others [2, batch, ...]
