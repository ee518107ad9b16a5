"""What every FP8 cache layer shares, whatever its storage policy (`dynamic.py`, `static.py`): the format, the
scale scheme, the clipped / non-finite counts, the kernel handle, the sink tokens' bookkeeping, the update
protocol, batch operations, bytes held and pickling; and `QuantizedKV`, what `update` hands the FP8 attention.

The buffers and which tokens they hold are described in `hf_fp8kv.kernels.view`: codes for every token that left
the recent buffer (each quantized once, when it leaves), the `recent_tokens` newest tokens and the
`sink_tokens` first real tokens of each row in the model's dtype, and per KV head the `outlier_tokens` coded
tokens `outliers.py` keeps exact too. `recent_tokens=0, sink_tokens=0, outlier_tokens=0` is pure FP8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_fp8kv.attention import FP8KeyStates
from hf_fp8kv.kernels import ops
from hf_fp8kv.kernels.cpu import materialize
from hf_fp8kv.kernels.formats import PER_TOKEN_SCALE_DTYPE, StorageFormat
from hf_fp8kv.kernels.view import VALUE_TILE, KVView, NewToken
from hf_fp8kv.outliers import BUFFERS as OUTLIER_BUFFERS
from hf_fp8kv.outliers import OutlierTracker
from hf_fp8kv.scale_search import ScaleSearch
from hf_fp8kv.scales import LayerScales, MeasuredKeyChannels
from hf_fp8kv.sinks import SinkTracker

NO_CONTEXT = contextlib.nullcontext()  # stateless, reentrant


class QuantizedKV(FP8KeyStates):
    """What `update` hands to the FP8 attention function instead of full-precision tensors: the layer, the
    tokens its attention sees and this update's new (full-precision) states. No copy is made. `pending`: the
    update's write, left to the attention launch that reads it (`FP8Layer.write_pending`)."""

    def __init__(
        self, layer: "FP8Layer", view: KVView, new_key: torch.Tensor, new_value: torch.Tensor,
        pending: NewToken | None = None,
    ):  # fmt: skip
        self.layer, self.view, self.new_key, self.new_value, self.pending = layer, view, new_key, new_value, pending

    @property
    def shape(self) -> tuple[int, int, int, int]:
        _, batch, heads, _, head_dim = self.view.codes.shape
        return (batch, heads, self.layer.visible_length(self.view), head_dim)

    def attend(self, query: torch.Tensor, *, scaling: float, mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """`[batch, q_heads, q_len, head_dim]` attention output of `query` over the cached tokens."""
        layer = self.layer
        if torch.compiler.is_compiling() and not layer.is_compileable:
            return _eager_attend(self, query, scaling=scaling, mask=mask, **kwargs)
        if layer.sink_tracker.capture(layer, self.new_key, self.new_value, mask, self.view):
            layer.write_pending()
            self.view = layer.view(self.view.start)
        layer.outlier_tracker.settle(layer)  # (the sinks known: padding and sinks never enter)
        if self.pending is not None and layer.pending is self:  # this launch writes the update's token
            kwargs["new_token"], self.pending, layer.pending = self.pending, None, None
        out = layer.kernels.attend(query, self.view, scaling=scaling, mask=mask, **kwargs)
        # (the queries' sums after the attention that read them: see scale_search.py)
        if not layer.kernels.sums_in_attention(self.view, query.shape[2]):
            layer.scale_search.observe(query, layer.key_channel_scale, layer.rotate, layer.backend)
        return out

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values of the visible tokens (the slow path: a full copy)."""
        self.layer.write_pending()
        self.layer.outlier_tracker.settle(self.layer)
        return self.layer.materialize(self.view)


class Float8Bits(NamedTuple):
    """A float8 tensor as its bits (pickling)."""

    bits: torch.Tensor
    dtype: torch.dtype


class FP8Layer(CacheLayerMixin):
    """One decoder layer's FP8 cache: what the storage policies share. A policy (`DynamicFP8Layer`,
    `StaticFP8Layer` and their sliding variants) allocates the buffers, places the tokens (its positions), and
    implements the rollback and batch operations on them."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

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
        fp8_prefill: bool = False,
        rotate: bool = False,
        outlier_tokens: int = 0,
        scale_search: int = 0,
    ):
        super().__init__()
        self.fmt = fmt
        self.scales = scales
        self.per_token = scales.per_token
        self.block_size = block_size
        self.requested_backend = backend
        self.fast_path = fast_path
        self.layer_idx = layer_idx
        self.recent_tokens = recent_tokens
        self.fp8_prefill = fp8_prefill
        self.rotate = rotate
        self.sink_tracker = SinkTracker(sink_tokens)
        self.outlier_tracker = OutlierTracker(outlier_tokens)
        self.scale_search = ScaleSearch(scale_search)
        self.stats = torch.zeros(2, 2, dtype=torch.int64)  # keys / values x clipped / non-finite
        self.has_nan = False
        self.kernels: ops.TorchLayerKernels | None = None
        self.is_initialized = False
        self.pending: QuantizedKV | None = None  # the last update, if its write waits for the attention launch

    def write_pending(self) -> None:
        """Write the last update's token if the attention launch that was to write it has not run (something read
        the layer first: a fallback attention, a batch operation, a crop, a read of the buffers)."""
        kv, self.pending = self.pending, None
        if kv is None or kv.pending is None:
            return
        new, kv.pending = kv.pending, None
        view = kv.view
        if not view.static:  # (the view is the one after the update)
            view = dataclasses.replace(view, end=view.end - 1, recent_start=new.recent_start)
        self._write_stored(new.key, new.value, view)

    @property
    def sink_tokens(self) -> int:
        return self.sink_tracker.count

    @property
    def outlier_tokens(self) -> int:
        return self.outlier_tracker.count

    def outlier_view(self) -> dict:
        """The view's outlier fields (`KVView.outliers`, `outlier_pos`)."""
        if not self.outlier_tokens:
            return {}
        return dict(outliers=self.outlier_kv, outlier_pos=self.outlier_pos[0])

    @property
    def clipped(self) -> torch.Tensor:
        """Values saturated at the format's max, `[keys, values]`."""
        self.write_pending()
        return self.stats[:, 0]

    @property
    def nonfinite(self) -> torch.Tensor:
        """NaN or infinite inputs, `[keys, values]`."""
        self.write_pending()
        return self.stats[:, 1]

    @property
    def key_codes(self) -> torch.Tensor:
        self.write_pending()
        return self.codes[0]

    @property
    def value_codes(self) -> torch.Tensor:
        self.write_pending()
        return self.codes[1]

    @property
    def key_scale(self) -> torch.Tensor:
        self.write_pending()
        return self.scale[0]

    @property
    def value_scale(self) -> torch.Tensor:
        self.write_pending()
        return self.scale[1]

    # --- allocation ------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        if value_states.shape[:2] != key_states.shape[:2] or value_states.shape[-1] != head_dim:
            raise ValueError(
                f"layer {self.layer_idx}: value states {tuple(value_states.shape)} do not match key states "
                f"{tuple(key_states.shape)} (different V head_dim is not supported)"
            )
        self.device = key_states.device
        self.dtype = key_states.dtype
        if self.fp8_prefill:  # (a cache built from the model checked its devices already)
            ops.check_fp8_prefill(self.requested_backend, self.device, self.fmt)
        self.backend = ops.backend_for(self.requested_backend, self.device)
        self.kernels = self.backend.layer_kernels(fp8_prefill=self.fp8_prefill)
        if self.kernels.value_tiled:  # codes held in whole blocks of tiled values, which the attention reads whole
            self.block_size = math.lcm(self.block_size, VALUE_TILE)
        self.stats = self.stats.to(self.device)
        channel = getattr(self.scales, "key_channel", None)
        if channel is not None and tuple(channel.shape) != (kv_heads, head_dim):
            raise ValueError(
                f"layer {self.layer_idx}: key channel scales have shape {tuple(channel.shape)}, keys have "
                f"{kv_heads} KV heads x {head_dim} channels"
            )
        self.key_channel_scale = None if channel is None else channel.to(self.device, torch.float32).contiguous()
        if not self.per_token and self.scales.key.numel() != kv_heads:
            raise ValueError(
                f"layer {self.layer_idx}: scales are for {self.scales.key.numel()} KV heads, keys have {kv_heads}"
            )
        self._allocate(batch, kv_heads, head_dim)
        self.scale_search.allocate(kv_heads, head_dim, self.device)
        self.is_initialized = True

    def _allocate(self, batch: int, kv_heads: int, head_dim: int) -> None:
        raise NotImplementedError

    def _new_buffers(self, batch: int, kv_heads: int, head_dim: int, slots: int, recent: int, sinks: int) -> None:
        """Zeroed buffers: codes and scales for `slots` tokens, `recent` and `sinks` slots in the model's dtype."""
        self.codes = torch.zeros(2, batch, kv_heads, slots, head_dim, dtype=torch.uint8, device=self.device).view(
            self.fmt.dtype
        )
        if self.per_token:  # rows on whole 4-byte words (an even row length): the attention kernel reads them as words
            even = slots + slots % 2
            self.scale = torch.ones(2, batch, kv_heads, even, dtype=PER_TOKEN_SCALE_DTYPE, device=self.device)[..., :slots]
        else:
            self.scale = torch.stack([self.scales.key, self.scales.value]).reshape(2, 1, kv_heads, 1).to(self.device)
        shape = (2, batch, kv_heads)
        self.recent = self._fp_buffer(*shape, recent, head_dim) if self.recent_tokens else None
        self.sinks = self._fp_buffer(*shape, sinks, head_dim) if self.sink_tokens else None
        self.sink_start = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.sink_count = torch.zeros(batch, dtype=torch.int64, device=self.device)
        if self.outlier_tokens:
            self.outlier_tracker.allocate(self, batch, kv_heads, head_dim)

    def _fp_buffer(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def _buffers(self) -> list[str]:
        """The per-row buffers (batch operations map them)."""
        names = ["codes"] + (["scale"] if self.per_token else [])
        names += [n for n in ("recent", "sinks") if getattr(self, n) is not None]
        return names + (list(OUTLIER_BUFFERS) if self.outlier_tokens else [])

    # --- the update ------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling() and not self.is_compileable:
            return _eager_update(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.codes.shape[1] or key_states.shape[1] != self.codes.shape[2]:
            raise self._batch_error(key_states)
        kv = self._store(key_states, value_states)
        return (kv, kv) if self.fast_path() else kv.dequantized()

    def _batch_error(self, key_states: torch.Tensor) -> ValueError:
        return ValueError(
            f"layer {self.layer_idx}: new key states {tuple(key_states.shape)} do not fit the cache's batch "
            f"{self.codes.shape[1]} x {self.codes.shape[2]} KV heads; use a fresh cache per batch"
        )

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> QuantizedKV:
        """Write the new tokens (a decode step's on the Triton path: by the attention launch that reads them, see
        `write_pending`); the tokens this update's queries attend to."""
        new_tokens = key_states.shape[2]
        self.write_pending()  # (the last update's, if no attention read it)
        self.outlier_tracker.settle(self)
        if self.key_channel_scale is None and isinstance(self.scales, MeasuredKeyChannels):
            self._measure_key_channels(key_states, new_tokens)
        self._make_room(new_tokens)
        view = self.view()
        pending = None
        if self.outlier_tracker.write_and_settle(self, view, key_states, value_states):
            self.has_nan = True  # (as the Triton write reports: NaN codes may be written)
            stored_key = key_states
        else:
            self.outlier_tracker.stage(view, key_states, value_states)
            if self.kernels.writes_in_attention(view, new_tokens):
                pending = NewToken(self._stored_key(key_states), value_states, self.stats, view.recent_start)
                self.has_nan = True
                stored_key = pending.key
            else:
                stored_key = self._write(key_states, value_states, view)
        self._advance(new_tokens)
        kv = QuantizedKV(self, self._visible(view, new_tokens), stored_key, value_states, pending)
        self.pending = kv if pending is not None else None
        return kv

    def _stored_key(self, key_states: torch.Tensor) -> torch.Tensor:
        """The keys as stored: divided by the per-channel key scales, if any (the attention folds them back), in
        the keys' dtype (the fp32 scales promoted a bf16 model's keys, which the Triton write refused beside bf16
        values)."""
        if self.key_channel_scale is None:
            return key_states
        return (key_states / self.key_channel_scale[:, None, :]).to(key_states.dtype)

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, view: KVView) -> torch.Tensor:
        """Write the new tokens into `view`'s buffers; the keys as stored (`_stored_key`)."""
        key = self._stored_key(key_states)
        self._write_stored(key, value_states, view)
        return key

    def _write_stored(self, key: torch.Tensor, value: torch.Tensor, view: KVView) -> None:
        """Write keys as stored and values into `view`'s buffers."""
        # codes are not differentiable; scales must not hold the model's graph (generate runs without grad
        # already: entering no_grad costs 1.6 us, a twentieth of a decode step's host time, measured here)
        with torch.no_grad() if torch.is_grad_enabled() else NO_CONTEXT:
            self.has_nan |= self.kernels.write(key, value, view, self.stats)

    def _measure_key_channels(self, key_states: torch.Tensor, new_tokens: int) -> None:
        """`MeasuredKeyChannels`: set `key_channel_scale` if this update codes the layer's first tokens."""
        raise NotImplementedError

    def _make_room(self, new_tokens: int) -> None:
        raise NotImplementedError

    def _advance(self, new_tokens: int) -> None:
        raise NotImplementedError

    def _visible(self, view: KVView, new_tokens: int) -> KVView:
        """The tokens the queries of this update attend to (all of them, but for sliding layers): `view`, the
        write's, moved past the new tokens (device positions move by themselves)."""
        return view

    def view(self, start=None) -> KVView:
        raise NotImplementedError

    def host_end(self) -> int:
        """The tokens seen, as a Python int (eager code only)."""
        raise NotImplementedError

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values of the stored tokens (a full copy)."""
        self.write_pending()
        return self.materialize(self.view())

    def materialize(self, view: KVView) -> tuple[torch.Tensor, torch.Tensor]:
        """`view`'s keys and values in the model's dtype, `visible_length` of them (a static layer's buffers may
        hold slots past its max_cache_len: whole blocks of tiled values)."""
        keys, values = materialize(view)
        length = self.visible_length(view)
        return keys[:, :, :length].to(self.dtype), values[:, :, :length].to(self.dtype)

    # --- batch operations ------------------------------------------------------------------------------------
    def _select_rows(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (in that order, repeats allowed): beam reordering and batch operations."""
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows([r for r in range(self.codes.shape[1]) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.codes.shape[1])[indices.cpu()].tolist())

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's buffers (codes, per-token scales, recent and sink tokens)."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).nbytes for name in self._buffers())

    # --- pickling: torch pickles a float8 tensor it cannot load back (it has no typed storage), so the codes
    # travel as their uint8 bits; the kernel handle is rebuilt (its plans and memos are caches)
    def __getstate__(self) -> dict:
        self.write_pending()
        state = {**self.__dict__, "kernels": None}
        memo: dict[int, Float8Bits] = {}
        return {name: _map_float8(value, lambda t: memo.setdefault(id(t), Float8Bits(t.view(torch.uint8), t.dtype)))
                for name, value in state.items()}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        memo: dict[int, torch.Tensor] = {}
        restore = lambda bits: memo.setdefault(id(bits), bits.bits.view(bits.dtype))  # noqa: E731
        self.__dict__.update({name: _map_float8(value, restore) for name, value in state.items()})
        self.__dict__.setdefault("pending", None)  # (a layer pickled before the attention wrote decode steps)
        self.__dict__.setdefault("scale_search", ScaleSearch(0))  # (or before scale_search)
        if self.is_initialized:
            self.kernels = self.backend.layer_kernels(fp8_prefill=self.fp8_prefill)


def _map_float8(value, fn):
    """`value` with `fn` applied to every float8 tensor (or `Float8Bits`) in it, dicts included."""
    if isinstance(value, Float8Bits) or isinstance(value, torch.Tensor) and value.dtype.itemsize == 1 and value.dtype.is_floating_point:
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_float8(item, fn) for key, item in value.items()}
    return value


# a dynamic layer's Python positions cannot be traced: under torch.compile it runs eagerly (a graph break)
_eager_attend = torch.compiler.disable(QuantizedKV.attend)
_eager_update = torch.compiler.disable(FP8Layer.update)
