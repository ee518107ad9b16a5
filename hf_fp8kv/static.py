"""Static FP8 cache layers, for `torch.compile` and CUDA graphs: preallocated buffers, positions on the device.

Like transformers' `StaticLayer`: the buffers are allocated at the first update (from the key states' batch)
for `max_cache_len` tokens and then only written in place; the stored length lives in a device tensor, so no
Python number that changes per step reaches a kernel, a shape or a guard, and `get_mask_sizes` is
`(max_cache_len, 0)`: the mask covers every slot. Full-attention layers hold token t at slot t; sliding-window
layers are rings of `min(sliding_window, max_cache_len)` slots (token t at slot t % slots) that a decode step
writes in place; an update of several tokens once the ring is full (a long prompt, a chat turn) needs older
tokens than the ring holds, so it runs, eagerly, over a temporary linear copy of the window.

Every static buffer has one spare slot at the end: the torch path's branch-free writes send there what has
nowhere to go (a token that is not leaving the window yet), where the Triton kernels mask it out.
"""

from __future__ import annotations

import torch

from hf_fp8kv.kernels import ops
from hf_fp8kv.kernels.view import KVView
from hf_fp8kv.layer import FP8CacheLayer, QuantizedKV


class StaticFP8Layer(FP8CacheLayer):
    """An `FP8CacheLayer` with `max_cache_len` preallocated slots and device-side positions."""

    is_compileable = True
    static = True

    def __init__(self, *args, max_cache_len: int, max_batch_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size

    def _forget(self) -> None:
        super()._forget()
        self.positions = torch.zeros(2, dtype=torch.int64)  # end, fp_start
        self.position_views = (self.positions[0], self.positions[1])
        # `positions` on the host for the eager paths; None after a compiled step moved them (read back once)
        self.host_positions: tuple[int, int] | None = (0, 0)
        self.step_deltas: dict[int, torch.Tensor] = {}  # fp_start's move (0 or 1) -> a decode step's device delta

    def _host_positions(self) -> tuple[int, int]:
        if self.host_positions is None:
            end, fp_start = self.positions.tolist()
            self.host_positions = (end, fp_start)
        return self.host_positions

    @property
    def ring_slots(self) -> int:
        return self.max_cache_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch = key_states.shape[0]
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(
                f"layer {self.layer_idx}: a batch of {batch} rows exceeds this static cache's max_batch_size="
                f"{self.max_batch_size}"
            )
        super().lazy_initialization(key_states, value_states)

    def _allocate(self, batch: int, kv_heads: int, head_dim: int, slots: int = 0) -> None:
        super()._allocate(batch, kv_heads, head_dim, self.ring_slots + 1)  # + the spare slot
        self.positions = self.positions.to(self.device)
        self.position_views = (self.positions[0], self.positions[1])
        if self.dynamic:
            self.scale.fill_(1.0)
        self.codes.view(torch.uint8).zero_()
        if not torch.compiler.is_compiling():  # fixed addresses: no recompilation, CUDA graphs can replay
            for name in (*self._buffers(), "positions", "stats", "sink_start", "sink_count"):
                torch._dynamo.mark_static_address(getattr(self, name))

    @property
    def end(self):
        return self.positions[0] if self.is_initialized else 0

    @end.setter
    def end(self, value) -> None:  # only `_forget` assigns it: positions start over
        pass

    @property
    def fp_start(self):
        return self.positions[1] if self.is_initialized else 0

    @fp_start.setter
    def fp_start(self, value) -> None:
        pass

    def view(self, start=None) -> KVView:
        # views of `positions` made once: 3 us a step less, but a compiled graph takes its own (the buffer is static)
        end, fp_start = (self.positions[0], self.positions[1]) if torch.compiler.is_compiling() else self.position_views
        return KVView(
            self.codes, self.scale, self.fmt, 0, end, fp_start, 0, self.recent,
            self.sinks if self.sink_rows else None, self.sink_start, self.sink_count, None, self.key_channel_scale,
            True, True, self.is_sliding, self.positions, memo=self.launch_memo,
        )  # fmt: skip

    def visible_length(self, view: KVView) -> int:
        return self.ring_slots

    def _host_end(self) -> int:
        return self._host_positions()[0]

    def _make_room(self, new_tokens: int) -> None:
        if new_tokens > self.max_cache_len and not self.is_sliding:
            raise ValueError(
                f"layer {self.layer_idx}: {new_tokens} new tokens do not fit this static cache's "
                f"max_cache_len={self.max_cache_len}; build QuantizedFP8Cache(model, max_cache_len=...) larger"
            )
        if not torch.compiler.is_compiling() and not self.is_sliding:
            end = self._host_end()
            if end + new_tokens > self.max_cache_len:
                raise ValueError(
                    f"layer {self.layer_idx}: {end} cached + {new_tokens} new tokens exceed this static cache's "
                    f"max_cache_len={self.max_cache_len}"
                )

    def _advance(self, new_tokens: int) -> None:
        if torch.compiler.is_compiling():
            self.positions[0] += new_tokens
            torch.maximum(self.positions[1], self.positions[0] - self.recent_tokens, out=self.positions[1])
            self.host_positions = None  # the host learns the new positions when it next needs them
            return
        end, fp_start = self._host_positions()
        end, moved = end + new_tokens, max(fp_start, end + new_tokens - self.recent_tokens) - fp_start
        if new_tokens == 1:  # an eager decode step: one in-place add of a delta kept on the device (1 op, not 5)
            if moved not in self.step_deltas:
                self.step_deltas[moved] = torch.tensor([1, moved], device=self.positions.device)
            self.positions.add_(self.step_deltas[moved])
        else:
            self.positions[0] = end
            self.positions[1] = fp_start + moved
        self.host_positions = (end, fp_start + moved)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.positions[0] if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Forget every token; the buffers (and their addresses) stay."""
        if not self.is_initialized:
            return
        self.positions.zero_()
        self.stats.zero_()
        self.host_positions = (0, 0)
        self.sink_rows = None
        self.has_nan = False

    def _crop_to(self, end: int) -> None:
        fp_start = min(self._host_positions()[1], end)
        self.positions[0], self.positions[1] = end, fp_start
        self.host_positions = (end, fp_start)
        if self.sink_rows:
            self._sync_sink_tensors()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        self._crop_to(max(self._host_end() + tokens_to_remove, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder rows in place (the buffers keep their addresses)."""
        if self.is_initialized:
            rows = beam_idx.tolist()
            index = beam_idx.to(self.device)
            for name in self._buffers():
                buffer = getattr(self, name)
                buffer.copy_(buffer.index_select(1, index))
            self.sink_start.copy_(self.sink_start[index])
            self.sink_count.copy_(self.sink_count[index])
            if self.sink_rows is not None:
                self.sink_rows = [self.sink_rows[r] for r in rows]


class StaticFP8SlidingLayer(StaticFP8Layer):
    """A static sliding-window (or chunked) layer: a ring of `min(sliding_window, max_cache_len)` slots."""

    is_sliding = True

    def __init__(self, *args, sliding_window: int, **kwargs):
        super().__init__(*args, **{**kwargs, "sink_tokens": 0})
        self.sliding_window = sliding_window

    @property
    def ring_slots(self) -> int:
        return min(self.sliding_window, self.max_cache_len)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new_tokens = key_states.shape[2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        compiling = torch.compiler.is_compiling()
        host = self.host_positions if compiling else self._host_positions()  # compiled: guarded, None once moved
        if new_tokens == 1 or (host is not None and host[0] + new_tokens <= self.ring_slots):
            return super().update(key_states, value_states, *args, **kwargs)
        if compiling:
            raise RuntimeError(
                f"layer {self.layer_idx}: a static sliding-window layer takes several tokens at once only outside "
                "torch.compile (compile the decode step, as generate does)"
            )
        return self._update_over_copy(key_states, value_states)

    def _update_over_copy(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Several tokens once the ring is full: write them into a linear copy of the window, attend over it,
        then keep its last `ring_slots` tokens in the ring."""
        new_tokens, slots = key_states.shape[2], self.ring_slots
        end, fp_start = self._host_positions()
        first = max(end - (self.sliding_window - 1), 0)
        held = torch.arange(first, end, device=self.device)
        copy = FP8CacheLayer(self.fmt, self.scales, slots, self.requested_backend, self.fast_path, self.layer_idx,
                      self.recent_tokens, 0)  # fmt: skip
        for name in ("device", "dtype", "backend", "key_channel_scale", "stats", "has_nan", "recent", "sinks",
                     "sink_start", "sink_count"):  # fmt: skip
            setattr(copy, name, getattr(self, name))
        copy.codes = self.codes.view(torch.uint8).index_select(3, held % slots).view(self.fmt.dtype)
        copy.scale = self.scale.index_select(3, held % slots) if self.dynamic else self.scale
        copy.first = copy.offset = first
        copy.end, copy.fp_start = end, fp_start
        copy.is_initialized = True
        kv_copy = copy._store(key_states, value_states)
        # the copy's last `slots` tokens become the ring's
        kept = torch.arange(copy.end - slots, copy.end, device=self.device)
        kept = kept[kept >= 0]
        self.codes.view(torch.uint8).index_copy_(
            3, kept % slots, copy.codes.view(torch.uint8).index_select(3, kept - copy.offset)
        )
        if self.dynamic:
            self.scale.index_copy_(3, kept % slots, copy.scale.index_select(3, kept - copy.offset))
        self.has_nan = copy.has_nan
        self._advance(new_tokens)
        kv_copy.view.mask_start = 0  # the static mask covers [0, max_cache_len)
        kv = QuantizedKV(self, kv_copy.view, kv_copy.new_key, kv_copy.new_value)
        return (kv, kv) if self.fast_path() else kv.dequantized()
