"""One decoder layer's FP8 cache: code buffers grown one block at a time, scales beside them, and the newest
(and first) tokens in the model's dtype.

The buffers and which tokens they hold are described in `hf_fp8kv.kernels.view`: codes for every token that
left the full-precision window (each quantized once, when it leaves), `recent_tokens` newest tokens and
`sink_tokens` first real tokens of each row in the model's dtype. `recent_tokens=0, sink_tokens=0` is pure FP8.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_fp8kv.kernels import ops
from hf_fp8kv.kernels.formats import StorageFormat
from hf_fp8kv.kernels.reference import _pieces, materialize
from hf_fp8kv.kernels.view import KVView
from hf_fp8kv.scales import DynamicScales, LayerScales


NO_CONTEXT = contextlib.nullcontext()  # stateless, reentrant


class Float8Bits(NamedTuple):
    """A float8 tensor as its bits (pickling)."""

    bits: torch.Tensor
    dtype: torch.dtype


def _map_float8(value, fn):
    """`value` with `fn` applied to every float8 tensor (or `Float8Bits`) in it, dicts included."""
    if isinstance(value, Float8Bits) or isinstance(value, torch.Tensor) and value.dtype.itemsize == 1 and value.dtype.is_floating_point:
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_float8(item, fn) for key, item in value.items()}
    return value


class QuantizedKV:
    """What `update` hands to the FP8 attention function instead of full-precision tensors: the layer, the
    tokens its attention sees and this update's new (full-precision) states. No copy is made."""

    def __init__(self, layer: "FP8CacheLayer", view: KVView, new_key: torch.Tensor, new_value: torch.Tensor):
        self.layer, self.view, self.new_key, self.new_value = layer, view, new_key, new_value

    @property
    def shape(self) -> tuple[int, int, int, int]:
        _, batch, heads, _, head_dim = self.view.codes.shape
        return (batch, heads, self.layer.visible_length(self.view), head_dim)

    def attend(self, query: torch.Tensor, *, scaling: float, mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """`[batch, q_heads, q_len, head_dim]` attention output of `query` over the cached tokens."""
        if torch.compiler.is_compiling() and not self.layer.is_compileable:
            return _eager_attend(self, query, scaling=scaling, mask=mask, **kwargs)
        layer = self.layer
        layer.capture_sinks(self, mask)
        if layer.static and layer.decode_splits is None and not torch.compiler.is_compiling():
            layer.decode_splits = ops.decode_splits(query, self.view, layer.backend)
        return ops.attend(
            query, self.view, scaling=scaling, mask=mask, backend=layer.backend, plans=layer.plans,
            num_splits=layer.decode_splits if torch.compiler.is_compiling() else None, **kwargs,
        )  # fmt: skip

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values of the visible tokens (the slow path: a full copy)."""
        keys, values = materialize(self.view)
        return keys.to(self.layer.dtype), values.to(self.layer.dtype)


class FP8CacheLayer(CacheLayerMixin):
    """Stores one layer's keys and values as codes of `fmt`, `[2, batch, kv_heads, capacity, head_dim]`.

    Capacity grows `block_size` tokens at a time (the buffer is reallocated and the valid part copied) and
    shrinks after a crop, so the bytes held stay within one block of the bytes used; no per-step `torch.cat`.
    Token t is at slot `t - offset`; the stored tokens are `[first, end)`.
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False
    static = False

    def __init__(
        self,
        fmt: StorageFormat,
        scales: LayerScales,
        block_size: int,
        backend: str | None,
        fast_path: Callable[[], bool],
        layer_idx: int,
        recent_tokens: int = 0,
        sink_tokens: int = 0,
    ):
        super().__init__()
        self.fmt = fmt
        self.scales = scales
        self.block_size = block_size
        self.requested_backend = backend
        self.fast_path = fast_path
        self.layer_idx = layer_idx
        self.recent_tokens = recent_tokens
        self.sink_tokens = sink_tokens
        self._forget()

    def _forget(self) -> None:
        self.first = self.end = self.fp_start = self.offset = 0
        self.stats = torch.zeros(2, 2, dtype=torch.int64)  # keys / values x clipped / non-finite
        self.has_nan = False
        self.sink_rows: list[int] | None = None  # each row's first real token, once known (-1: not yet)
        self.plans: dict = {}  # the Triton launch plans of this layer's kinds of calls
        self.launch_memo: dict = {}  # the plans' launch arguments derived from the current buffers
        self.decode_splits: int | None = None  # static layers: the KV splits of a compiled decode step
        self.is_initialized = False

    @property
    def dynamic(self) -> bool:
        return isinstance(self.scales, DynamicScales)

    # --- pickling: torch pickles a float8 tensor it cannot load back (it has no typed storage), so the codes
    # travel as their uint8 bits; launch plans and memos are rebuilt on use
    def __getstate__(self) -> dict:
        state = {**self.__dict__, "plans": {}, "launch_memo": {}}
        memo: dict[int, Float8Bits] = {}
        return {name: _map_float8(value, lambda t: memo.setdefault(id(t), Float8Bits(t.view(torch.uint8), t.dtype)))
                for name, value in state.items()}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        memo: dict[int, torch.Tensor] = {}
        restore = lambda bits: memo.setdefault(id(bits), bits.bits.view(bits.dtype))  # noqa: E731
        self.__dict__.update({name: _map_float8(value, restore) for name, value in state.items()})

    @property
    def key_codes(self) -> torch.Tensor:
        return self.codes[0]

    @property
    def value_codes(self) -> torch.Tensor:
        return self.codes[1]

    @property
    def key_scale(self) -> torch.Tensor:
        return self.scale[0]

    @property
    def value_scale(self) -> torch.Tensor:
        return self.scale[1]

    @property
    def length(self) -> int:
        """Tokens stored (the sliding layers drop the oldest)."""
        return self._host_end() - self.first

    @property
    def clipped(self) -> torch.Tensor:
        """Values saturated at the format's max, `[keys, values]`."""
        return self.stats[:, 0]

    @property
    def nonfinite(self) -> torch.Tensor:
        """NaN or infinite inputs, `[keys, values]`."""
        return self.stats[:, 1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        if value_states.shape[:2] != key_states.shape[:2] or value_states.shape[-1] != head_dim:
            raise ValueError(
                f"layer {self.layer_idx}: value states {tuple(value_states.shape)} do not match key states "
                f"{tuple(key_states.shape)} (different V head_dim is not supported)"
            )
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.backend = ops.resolve_backend(self.requested_backend, self.device)
        self.stats = self.stats.to(self.device)
        channel = getattr(self.scales, "key_channel", None)
        if channel is not None and tuple(channel.shape) != (kv_heads, head_dim):
            raise ValueError(
                f"layer {self.layer_idx}: key channel scales have shape {tuple(channel.shape)}, keys have "
                f"{kv_heads} KV heads x {head_dim} channels"
            )
        self.key_channel_scale = None if channel is None else channel.to(self.device, torch.float32).contiguous()
        if not self.dynamic and self.scales.key.numel() != kv_heads:
            raise ValueError(
                f"layer {self.layer_idx}: scales are for {self.scales.key.numel()} KV heads, keys have {kv_heads}"
            )
        self._allocate(batch, kv_heads, head_dim)
        self.is_initialized = True

    def _allocate(self, batch: int, kv_heads: int, head_dim: int, slots: int = 0) -> None:
        """The buffers, empty (`slots` code slots)."""
        self.codes = torch.empty(2, batch, kv_heads, slots, head_dim, dtype=self.fmt.dtype, device=self.device)
        if self.dynamic:
            self.scale = torch.empty(2, batch, kv_heads, slots, dtype=torch.float32, device=self.device)
        else:
            self.scale = torch.stack([self.scales.key, self.scales.value]).reshape(2, 1, kv_heads, 1).to(self.device)
        shape = (2, batch, kv_heads)
        self.recent = self._fp_buffer(*shape, self._fp_slots(self.recent_tokens), head_dim) if self.recent_tokens else None
        self.sinks = self._fp_buffer(*shape, self._fp_slots(self.sink_tokens), head_dim) if self.sink_tokens else None
        self.sink_start = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.sink_count = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.launch_memo = {}

    def _fp_buffer(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def _fp_slots(self, tokens: int, held: int = 0) -> int:
        """Slots of a full-precision buffer of at most `tokens` tokens that must hold `held` now: grown with the
        context a block at a time, like the codes. The recent window's token t is at slot t % slots: with fewer
        slots than `recent_tokens`, all the window's tokens still fit, so none leaves it early."""
        return min(tokens, max(math.ceil(held / self.block_size), 1) * self.block_size)

    def _fit_full_precision(self, end: int) -> None:
        """Resize the recent and sink buffers for tokens up to `end` (grow before a write, shrink after a crop),
        keeping the tokens they hold."""
        for name, tokens, held in (("recent", self.recent_tokens, end - self.fp_start), ("sinks", self.sink_tokens, end)):
            buffer = getattr(self, name)
            slots = self._fp_slots(tokens, held)
            if buffer is None or buffer.shape[3] == slots:
                continue
            resized = buffer.new_zeros(*buffer.shape[:3], slots, buffer.shape[4])
            if name == "sinks":  # a row's sink token t is at slot t - sink_start, whatever the slots
                held = min(slots, buffer.shape[3])
                resized[:, :, :, :held] = buffer[:, :, :, :held]
            else:
                for first, stop, slot in _pieces(max(self.fp_start, self.end - slots), self.end, buffer.shape[3]):
                    for piece_first, piece_stop, new_slot in _pieces(first, stop, slots):
                        old_slot = slot + piece_first - first
                        resized[:, :, :, new_slot : new_slot + piece_stop - piece_first] = (
                            buffer[:, :, :, old_slot : old_slot + piece_stop - piece_first]
                        )
            setattr(self, name, resized)
            self.launch_memo = {}

    # --- what the attention reads --------------------------------------------------------------------------
    def view(self, start=None) -> KVView:
        """The stored tokens from `start` (default: all of them)."""
        return KVView(
            self.codes, self.scale, self.fmt, self.first if start is None else start, self.end, self.fp_start,
            self.offset, self.recent, self.sinks if self.sink_rows else None, self.sink_start, self.sink_count,
            self.sink_rows, self.key_channel_scale, self.has_nan, self.static, memo=self.launch_memo,
        )  # fmt: skip

    def visible_length(self, view: KVView) -> int:
        return view.end - view.start

    def capture_sinks(self, kv: QuantizedKV, mask: torch.Tensor | None) -> None:
        """Keep each row's first `sink_tokens` real tokens in full precision, found from the attention mask (the
        first key the last query may see; 0 without a mask) and taken from this update's new states."""
        if not self.sink_tokens or torch.compiler.is_compiling():
            return
        new = kv.new_key.shape[2]
        end = self._host_end()
        arrived = end - new
        if self.sink_rows is None or -1 in self.sink_rows:
            self._find_sink_rows(mask)
        if all(first >= 0 and first + self.sink_tokens <= arrived for first in self.sink_rows):
            return  # every row's sinks are held already
        for row, first in enumerate(self.sink_rows):
            lo, hi = max(first, arrived), min(first + self.sink_tokens, end)
            if first >= 0 and lo < hi:
                self.sinks[0, row, :, lo - first : hi - first] = kv.new_key[row, :, lo - arrived : hi - arrived]
                self.sinks[1, row, :, lo - first : hi - first] = kv.new_value[row, :, lo - arrived : hi - arrived]
        self._sync_sink_tensors()
        kv.view = self.view(kv.view.start)

    def _find_sink_rows(self, mask: torch.Tensor | None) -> None:
        batch = self.codes.shape[1]
        if mask is None:
            rows = [0] * batch
        else:
            last_query = mask[:, 0, -1, :]  # [batch, columns], the columns ending at `end` (or [0, max_len))
            seen = last_query.any(dim=-1)
            first_column = last_query.int().argmax(dim=-1)
            column_start = 0 if self.static else self._host_end() - mask.shape[-1]
            rows = [c + column_start if s else -1 for c, s in zip(first_column.tolist(), seen.tolist())]
        old = self.sink_rows or [-1] * batch
        self.sink_rows = [o if o >= 0 else r for o, r in zip(old, rows)]

    def _sync_sink_tensors(self) -> None:
        rows = torch.tensor(self.sink_rows, dtype=torch.int64)
        counts = (self._host_end() - rows).clamp(0, self.sink_tokens) * (rows >= 0)
        self.sink_start.copy_(rows.clamp_min(0))
        self.sink_count.copy_(counts)

    # --- storage -----------------------------------------------------------------------------------------
    def _buffers(self) -> list[str]:
        """The per-row buffers (batch operations map them)."""
        names = ["codes"] + (["scale"] if self.dynamic else [])
        return names + [n for n in ("recent", "sinks") if getattr(self, n) is not None]

    @property
    def capacity(self) -> int:
        return self.codes.shape[3] if self.is_initialized else 0

    def _make_room(self, new_tokens: int) -> None:
        """Make sure tokens up to `end + new_tokens` have a slot; release a block after a crop."""
        needed = self.end + new_tokens - self.offset
        used = self.end - self.first
        if needed > self.capacity or self.capacity - (used + new_tokens) > self.block_size:
            self._reallocate(math.ceil((used + new_tokens) / self.block_size) * self.block_size)
        self._fit_full_precision(self.end + new_tokens)

    def _reallocate(self, capacity: int) -> None:
        """Move the stored tokens `[first, end)` to the front of new buffers of `capacity` slots."""
        stored = slice(self.first - self.offset, self.end - self.offset)
        for name in ("codes", "scale") if self.dynamic else ("codes",):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:3], capacity, *old.shape[4:])
            new[:, :, :, : self.end - self.first] = old[:, :, :, stored]
            setattr(self, name, new)
        self.offset = self.first
        self.launch_memo = {}

    def _map_buffers(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._buffers():
            setattr(self, name, fn(getattr(self, name)))
        self.launch_memo = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's buffers (codes, per-token scales, full-precision tokens)."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).nbytes for name in self._buffers())

    # --- the cache protocol ------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling() and not self.is_compileable:
            return _eager_update(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.codes.shape[1] or key_states.shape[1] != self.codes.shape[2]:
            raise self._batch_error(key_states)
        kv = self._store(key_states, value_states)
        if self.fast_path():
            return kv, kv
        return kv.dequantized()

    def _batch_error(self, key_states: torch.Tensor) -> ValueError:
        return ValueError(
            f"layer {self.layer_idx}: new key states {tuple(key_states.shape)} do not fit the cache's batch "
            f"{self.codes.shape[1]} x {self.codes.shape[2]} KV heads; use a fresh cache per batch"
        )

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> QuantizedKV:
        """Write the new tokens; the tokens this update's queries attend to."""
        new_tokens = key_states.shape[2]
        self._make_room(new_tokens)
        stored_key = key_states if self.key_channel_scale is None else key_states / self.key_channel_scale[:, None, :]
        # codes are not differentiable; scales must not hold the model's graph (generate runs without grad
        # already: entering no_grad costs 1.6 us, a twentieth of a decode step's host time, measured here)
        with torch.no_grad() if torch.is_grad_enabled() else NO_CONTEXT:
            nan = ops.write(stored_key, value_states, self.view(), self.dynamic, self.stats, self.backend, self.plans)
        self.has_nan |= nan
        self._advance(new_tokens)
        return QuantizedKV(self, self._visible(new_tokens), stored_key, value_states)

    def _host_end(self) -> int:
        """The tokens seen, as a Python int (eager code only)."""
        return self.end

    def _advance(self, new_tokens: int) -> None:
        self.end += new_tokens
        self.fp_start = max(self.fp_start, self.end - self.recent_tokens)

    def _visible(self, new_tokens: int) -> KVView:
        """The tokens the queries of this update attend to (all of them here)."""
        return self.view()

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values of the stored tokens (a full copy)."""
        keys, values = materialize(self.view())
        return keys.to(self.dtype), values.to(self.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.end + query_length, 0

    def get_seq_length(self) -> int:
        return self.end

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget every token and release the buffers; the counts start over."""
        for name in ("codes", "scale", "recent", "sinks", "sink_start", "sink_count"):
            if hasattr(self, name):
                delattr(self, name)
        self._forget()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        self._crop_to(max(self.end + tokens_to_remove, self.first))

    def _crop_to(self, end: int) -> None:
        """Forget the tokens from `end` on (those in the full-precision window stay full precision)."""
        self.end = end
        self.fp_start = min(self.fp_start, end)
        if self.is_initialized:
            self._make_room(0)
            if self.sink_rows:
                self._sync_sink_tensors()

    def _select_rows(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (in that order, repeats allowed): beam reordering and batch operations."""
        if not self.is_initialized:
            return
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        self._map_buffers(lambda t: t.index_select(1, index))
        self.sink_start, self.sink_count = self.sink_start[index], self.sink_count[index]
        if self.sink_rows is not None:
            self.sink_rows = [self.sink_rows[r] for r in rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows([r for r in range(self.codes.shape[1]) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.codes.shape[1])[indices.cpu()].tolist())

    def offload(self) -> None:
        if self.is_initialized:
            self._map_buffers(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.codes.device != self.device:
            self._map_buffers(lambda t: t.to(self.device, non_blocking=True))


# a dynamic layer's Python positions cannot be traced: under torch.compile it runs eagerly (a graph break)
_eager_attend = torch.compiler.disable(QuantizedKV.attend)
_eager_update = torch.compiler.disable(FP8CacheLayer.update)
