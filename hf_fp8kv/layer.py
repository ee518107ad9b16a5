"""One decoder layer's FP8 cache: code buffers grown one block at a time, scales beside them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_fp8kv.kernels import ops
from hf_fp8kv.kernels.formats import StorageFormat
from hf_fp8kv.kernels.reference import dequantize
from hf_fp8kv.scales import DynamicScales, LayerScales


@dataclass
class QuantizedKV:
    """What `update` hands to the FP8 attention function instead of full-precision tensors: the layer's
    buffers and which tokens the attention sees (`length` of them from buffer index `start`). No copy is made."""

    layer: "FP8CacheLayer"
    length: int
    start: int = 0

    def buffer(self, name: str) -> torch.Tensor:
        """The visible tokens of one of the layer's buffers (a view; a static scale is returned whole)."""
        tensor = getattr(self.layer, name)
        if name.endswith("_scale") and not self.layer.dynamic:
            return tensor
        return tensor[:, :, self.start : self.start + self.length] if self.start else tensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        batch, heads, _, head_dim = self.layer.key_codes.shape
        return (batch, heads, self.length, head_dim)

    def attend(self, query: torch.Tensor, *, scaling: float, mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """`[batch, q_heads, q_len, head_dim]` attention output of `query` over the cached tokens."""
        layer = self.layer
        return ops.attend(
            query,
            self.buffer("key_codes"),
            self.buffer("value_codes"),
            self.buffer("key_scale"),
            self.buffer("value_scale"),
            self.length,
            layer.fmt,
            scaling=scaling,
            mask=mask,
            key_channel_scale=layer.key_channel_scale,
            backend=layer.backend,
            **kwargs,
        )

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values of the visible tokens (the slow path: a full copy)."""
        layer = self.layer

        def one(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            row_scale = scale[:, :, : self.length, None] if layer.dynamic else scale[..., None]
            return dequantize(codes[:, :, : self.length], row_scale, layer.fmt).to(layer.dtype)

        keys = one(self.buffer("key_codes"), self.buffer("key_scale"))
        if layer.key_channel_scale is not None:
            keys = (keys * layer.key_channel_scale[:, None, :]).to(layer.dtype)
        return keys, one(self.buffer("value_codes"), self.buffer("value_scale"))


class FP8CacheLayer(CacheLayerMixin):
    """Stores one layer's keys and values as codes of `fmt`, `[batch, kv_heads, capacity, head_dim]`.

    Capacity grows `block_size` tokens at a time (the buffer is reallocated and the valid part copied), so the
    bytes held stay within one block of the bytes used; no per-step `torch.cat`. The stored tokens are buffer
    indices `[start, start + length)`; `start` is 0 here and moves in the sliding-window subclass.
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(
        self,
        fmt: StorageFormat,
        scales: LayerScales,
        block_size: int,
        backend: str | None,
        fast_path: Callable[[], bool],
        layer_idx: int,
    ):
        super().__init__()
        self.fmt = fmt
        self.scales = scales
        self.block_size = block_size
        self.requested_backend = backend
        self.fast_path = fast_path
        self.layer_idx = layer_idx
        self.start = 0
        self.length = 0
        self.clipped = torch.zeros(2, dtype=torch.int64)

    @property
    def dynamic(self) -> bool:
        return isinstance(self.scales, DynamicScales)

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
        self.clipped = self.clipped.to(self.device)
        self.key_codes = torch.empty(batch, kv_heads, 0, head_dim, dtype=self.fmt.dtype, device=self.device)
        self.value_codes = torch.empty_like(self.key_codes)
        channel = getattr(self.scales, "key_channel", None)
        if channel is not None and tuple(channel.shape) != (kv_heads, head_dim):
            raise ValueError(
                f"layer {self.layer_idx}: key channel scales have shape {tuple(channel.shape)}, keys have "
                f"{kv_heads} KV heads x {head_dim} channels"
            )
        self.key_channel_scale = None if channel is None else channel.to(self.device)
        if self.dynamic:
            self.key_scale = torch.empty(batch, kv_heads, 0, dtype=torch.float32, device=self.device)
            self.value_scale = torch.empty_like(self.key_scale)
        else:
            if self.scales.key.numel() != kv_heads:
                raise ValueError(
                    f"layer {self.layer_idx}: scales are for {self.scales.key.numel()} KV heads, keys have {kv_heads}"
                )
            self.key_scale = self.scales.key.reshape(1, kv_heads, 1).to(self.device)
            self.value_scale = self.scales.value.reshape(1, kv_heads, 1).to(self.device)
        self.is_initialized = True

    # --- storage -----------------------------------------------------------------------------------------
    def _buffers(self) -> list[str]:
        return ["key_codes", "value_codes"] + (["key_scale", "value_scale"] if self.dynamic else [])

    @property
    def capacity(self) -> int:
        return self.key_codes.shape[2] if self.is_initialized else 0

    def _make_room(self, new_tokens: int) -> None:
        """Make sure `new_tokens` fit after the stored ones."""
        needed = self.start + self.length + new_tokens
        if needed > self.capacity:
            self._reallocate(math.ceil(needed / self.block_size) * self.block_size)

    def _reallocate(self, capacity: int) -> None:
        """Move the stored tokens to the front of new buffers of `capacity` tokens."""
        stored = slice(self.start, self.start + self.length)
        for name in self._buffers():
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, *old.shape[3:])
            new[:, :, : self.length] = old[:, :, stored]
            setattr(self, name, new)
        self.start = 0

    def _visible(self, new_tokens: int) -> QuantizedKV:
        """The tokens the queries of this update attend to (all of them here)."""
        return QuantizedKV(self, self.length, self.start)

    def _map_buffers(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._buffers():
            setattr(self, name, fn(getattr(self, name)))

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's buffers (codes and per-token scales, capacity included)."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).nbytes for name in self._buffers())

    # --- the cache protocol ------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.key_codes.shape[0] or key_states.shape[1] != self.key_codes.shape[1]:
            raise ValueError(
                f"layer {self.layer_idx}: new key states {tuple(key_states.shape)} do not fit the cache's batch "
                f"{self.key_codes.shape[0]} x {self.key_codes.shape[1]} KV heads; use a fresh cache per batch"
            )
        new_tokens = key_states.shape[2]
        self._make_room(new_tokens)
        end = self.start + self.length
        if self.key_channel_scale is not None:  # static per-channel key scale: attention folds it into the query
            key_states = key_states / self.key_channel_scale[:, None, :]
        ops.write(
            key_states,
            value_states,
            self.key_codes,
            self.value_codes,
            self.key_scale,
            self.value_scale,
            end,
            self.fmt,
            self.dynamic,
            self.clipped,
            backend=self.backend,
        )
        self.length += new_tokens
        view = self._visible(new_tokens)
        if self.fast_path():
            return view, view
        return view.dequantized()

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values of the stored tokens (a full copy)."""
        return QuantizedKV(self, self.length, self.start).dequantized()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget every token and release the buffers; the scales and the clipped count start over."""
        for name in ("key_codes", "value_codes", "key_scale", "value_scale"):
            if hasattr(self, name):
                delattr(self, name)
        self.start = self.length = 0
        self.clipped = torch.zeros(2, dtype=torch.int64)
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            index = beam_idx.to(self.device)
            self._map_buffers(lambda t: t.index_select(0, index))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_buffers(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_buffers(lambda t: t[indices])

    def offload(self) -> None:
        if self.is_initialized:
            self._map_buffers(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.key_codes.device != self.device:
            self._map_buffers(lambda t: t.to(self.device, non_blocking=True))
