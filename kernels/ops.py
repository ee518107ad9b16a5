"""The two cache operations, write and attend, dispatched to the torch reference or the Triton kernels.

`backend`: "torch", "triton" or "auto" (Triton on CUDA, torch elsewhere); `None` reads the environment
variable HF_FP8KV_BACKEND (default "auto"). "triton" on CPU needs TRITON_INTERPRET=1, and there computes in
fp32 (the interpreter's bf16 dot is broken: bf16 queries are refused with a clear error).
"""

from __future__ import annotations

import os

import torch

from . import reference
from .view import KVView

BACKENDS = ("auto", "triton", "torch")


def check_backend(requested: str | None) -> str:
    """The backend name asked for (argument, else HF_FP8KV_BACKEND, else "auto"), validated."""
    name = requested if requested is not None else os.environ.get("HF_FP8KV_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS} (argument or HF_FP8KV_BACKEND)")
    return name


def resolve_backend(requested: str | None, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The backend that serves `device` (and model `dtype`): "torch" or "triton"."""
    name = check_backend(requested)
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "triton" and device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"backend='triton' on {device.type} needs TRITON_INTERPRET=1 (the Triton interpreter)")
        if dtype == torch.bfloat16:
            raise ValueError(
                "backend='triton' under TRITON_INTERPRET=1 cannot run a bf16 model: the Triton interpreter's bf16 "
                "dot multiplies raw bits (wrong results). Use backend='torch' (the default off GPU) or fp32/fp16."
            )
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
    view: KVView,
    dynamic: bool,
    stats: torch.Tensor,
    backend: str = "torch",
    plans: dict | None = None,
) -> bool:
    """Store the new tokens `[view.end, view.end + n)` in the buffers of `view` (see `reference.write`);
    returns whether NaN codes may have been written. `plans`: the Triton launch plans the caller keeps."""
    if backend == "triton":
        from .triton_write import write_kv

        write_kv(key, value, view, dynamic, stats, plans)
        return True
    return reference.write(
        key, value, view.codes, view.scales, view.recent, view.end, view.fp_start, view.offset, view.fmt, dynamic,
        stats, view.ring,
    )  # fmt: skip


def attend(
    query: torch.Tensor,
    view: KVView,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "torch",
    plans: dict | None = None,
) -> torch.Tensor:
    """Attention of `query` `[batch, q_heads, q_len, head_dim]` over the tokens of `view` (see
    `reference.attend`); returns `[batch, q_heads, q_len, head_dim]` in the query's dtype."""
    if backend == "triton":
        from .triton_attention import attention

        return attention(
            query, view, scaling=scaling, mask=mask, window=window, softcap=softcap, sinks=sinks, plans=plans
        )
    return reference.attend(query, view, scaling=scaling, mask=mask, window=window, softcap=softcap, sinks=sinks)
