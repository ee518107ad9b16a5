"""The two cache operations, write and attend, dispatched to the torch reference or the Triton kernels.

`backend`: "torch", "triton" or "auto" (Triton on CUDA, torch elsewhere); `None` reads the environment
variable HF_FP8KV_BACKEND (default "auto"). "triton" on CPU needs TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import os

import torch

from . import reference
from .formats import StorageFormat, get_format

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(requested: str | None, device: torch.device) -> str:
    """The backend that serves `device`: "torch" or "triton"."""
    name = requested if requested is not None else os.environ.get("HF_FP8KV_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS} (argument or HF_FP8KV_BACKEND)")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"backend='triton' on {device.type} needs TRITON_INTERPRET=1 (the Triton interpreter)")
    return name


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    start: int,
    fmt: StorageFormat,
    dynamic: bool,
    clipped: torch.Tensor,
    backend: str = "torch",
) -> None:
    """Quantize `key`/`value` (`[batch, kv_heads, new, head_dim]`) into the code buffers at `start`.

    Static scales (`[1, kv_heads, 1]`) are read; dynamic ones are computed per token and head and stored into
    the `[batch, kv_heads, capacity]` scale buffers. `clipped` (int64 `[2]`: keys, values) grows by the
    number of values saturated at the format's max.
    """
    if backend == "triton":
        buffers = (key_codes, value_codes, key_scale, value_scale)
        triton_ops().write(key, value, *buffers, start, fmt.name, dynamic, clipped)
        return
    # keys and values go through one quantization: decode writes are tiny, so op count is the cost
    end = start + key.shape[2]
    states = torch.stack((key, value))
    if dynamic:
        scale = reference.dynamic_scale(states, fmt)
        key_scale[:, :, start:end], value_scale[:, :, start:end] = scale
    else:
        scale = torch.stack((key_scale, value_scale))
    codes, n_clipped = reference.quantize(states, scale[..., None], fmt, count_per_row=True)
    key_codes[:, :, start:end], value_codes[:, :, start:end] = codes
    clipped += n_clipped


def attend(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    length: int,
    fmt: StorageFormat,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_channel_scale: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Attention of `query` over the first `length` cached tokens (see `reference.attention`)."""
    kwargs = dict(scaling=scaling, mask=mask, window=window, softcap=softcap, sinks=sinks)
    kwargs["key_channel_scale"] = key_channel_scale
    if backend == "triton":
        return triton_ops().attend(
            query, key_codes, value_codes, key_scale, value_scale, length, fmt.name, scaling, mask, window, softcap,
            sinks, key_channel_scale,
        )  # fmt: skip
    k_scale = key_scale[:, :, :length] if key_scale.shape[-1] > 1 else key_scale
    v_scale = value_scale[:, :, :length] if value_scale.shape[-1] > 1 else value_scale
    return reference.attention(
        query, key_codes[:, :, :length], value_codes[:, :, :length], k_scale, v_scale, fmt, **kwargs
    )


@functools.cache
def triton_ops():
    """`torch.ops.hf_fp8kv`: the Triton launchers registered with `torch.library` as `write` and `attend`
    (`triton_op`, so that `torch.compile` sees through them), on first use."""
    from .triton_attention import attention
    from .triton_write import write_kv

    buffers = {"key_codes", "value_codes", "key_scale", "value_scale", "clipped"}

    @torch.library.triton_op("hf_fp8kv::write", mutates_args=buffers)
    def write_op(
        key: torch.Tensor,
        value: torch.Tensor,
        key_codes: torch.Tensor,
        value_codes: torch.Tensor,
        key_scale: torch.Tensor,
        value_scale: torch.Tensor,
        start: int,
        fmt: str,
        dynamic: bool,
        clipped: torch.Tensor,
    ) -> None:
        write_kv(key, value, key_codes, value_codes, key_scale, value_scale, start, get_format(fmt), dynamic, clipped)

    @torch.library.triton_op("hf_fp8kv::attend", mutates_args=())
    def attend_op(
        query: torch.Tensor,
        key_codes: torch.Tensor,
        value_codes: torch.Tensor,
        key_scale: torch.Tensor,
        value_scale: torch.Tensor,
        length: int,
        fmt: str,
        scaling: float,
        mask: torch.Tensor | None,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        key_channel_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        return attention(
            query, key_codes, value_codes, key_scale, value_scale, length, get_format(fmt), scaling=scaling,
            mask=mask, window=window, softcap=softcap, sinks=sinks, key_channel_scale=key_channel_scale,
        )  # fmt: skip

    return torch.ops.hf_fp8kv
