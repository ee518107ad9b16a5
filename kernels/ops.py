"""The two cache operations, write and attend, dispatched to the torch reference or the Triton kernels.

`backend`: "torch", "triton" or "auto" (Triton on CUDA, torch elsewhere); `None` reads the environment
variable HF_FP8KV_BACKEND (default "auto"). "triton" on CPU needs TRITON_INTERPRET=1 (bf16 models run right
there too: the kernels' dots take fp16 operands, never the interpreter's broken bf16 dot).
"""

from __future__ import annotations

import functools
import os

import torch

from . import reference
from .formats import get_format
from .view import KVView

BACKENDS = ("auto", "triton", "torch")


def check_backend(requested: str | None) -> str:
    """The backend name asked for (argument, else HF_FP8KV_BACKEND, else "auto"), validated."""
    name = requested if requested is not None else os.environ.get("HF_FP8KV_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS} (argument or HF_FP8KV_BACKEND)")
    return name


def resolve_backend(requested: str | None, device: torch.device) -> str:
    """The backend that serves `device`: "torch" or "triton"."""
    name = check_backend(requested)
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
    view: KVView,
    dynamic: bool,
    stats: torch.Tensor,
    backend: str = "torch",
    plans: dict | None = None,
) -> bool:
    """Store the new tokens `[view.end, view.end + n)` in the buffers of `view` (see `reference.write`);
    returns whether NaN codes may have been written. `plans`: the Triton launch plans the caller keeps."""
    if backend == "triton":
        if torch.compiler.is_compiling():  # an opaque op in the graph (static views only: compileable caches)
            triton_ops().write(key, value, view.codes, view.scales, view.recent, stats, view.positions, view.fmt.name,
                               dynamic, view.ring)  # fmt: skip
            return True
        from .triton_write import write_kv

        write_kv(key, value, view, dynamic, stats, plans)
        return True
    return reference.write(key, value, view, dynamic, stats)


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of `query` `[batch, q_heads, q_len, head_dim]` over the tokens of `view` (see
    `reference.attend`); returns `[batch, q_heads, q_len, head_dim]` in the query's dtype. `num_splits`: the
    Triton kernel's KV splits (default: from the GPU's occupancy; inside a compiled graph: 1 unless given)."""
    if backend == "triton":
        from .triton_attention import attention

        if torch.compiler.is_compiling():  # an opaque op in the graph (static views only: compileable caches)
            return triton_ops().attend(
                query, view.codes, view.scales, view.recent, view.sinks, view.sink_start, view.sink_count,
                view.positions, mask, sinks, view.key_channel_scale, view.fmt.name, view.ring, scaling, window or 0,
                softcap or 0.0, num_splits or 1,
            )  # fmt: skip

        return attention(
            query, view, scaling=scaling, mask=mask, window=window, softcap=softcap, sinks=sinks, plans=plans,
            num_splits=num_splits,
        )
    return reference.attend(query, view, scaling=scaling, mask=mask, window=window, softcap=softcap, sinks=sinks)


# --- the same operations as custom ops, for torch.compile graphs --------------------------------------------------
@functools.cache
def triton_ops():
    """`torch.ops.hf_fp8kv`: `write` and `attend` registered with `torch.library.triton_op` (on first use), over
    a static view's flat tensors, so that `torch.compile` puts the Triton kernels in its graph (and CUDA graphs
    capture them) without tracing the launchers' Python.

    Capture safety: the views are static (positions read on the device by the kernels, never by the host), the
    grid is fixed (the split count of a full buffer, passed in; empty splits write an empty partial result),
    every buffer keeps its address (marked static), and nothing syncs with the host.
    """
    from .triton_attention import AttentionPlan
    from .triton_write import WritePlan

    written = {"codes", "scales", "recent", "stats"}

    @torch.library.triton_op("hf_fp8kv::write", mutates_args=written)
    def write_op(
        key: torch.Tensor, value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
        recent: torch.Tensor | None, stats: torch.Tensor, positions: torch.Tensor, fmt: str, dynamic: bool, ring: bool,
    ) -> None:  # fmt: skip
        view = _static_view(codes, scales, positions, fmt, ring, recent)
        for launch in WritePlan(key, value, view, dynamic, stats).launches(key, value, view, stats):
            launch.run(traced=True)

    @torch.library.triton_op("hf_fp8kv::attend", mutates_args=())
    def attend_op(
        query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, recent: torch.Tensor | None,
        sinks: torch.Tensor | None, sink_start: torch.Tensor | None, sink_count: torch.Tensor | None,
        positions: torch.Tensor, mask: torch.Tensor | None, sink_logits: torch.Tensor | None,
        channel: torch.Tensor | None, fmt: str, ring: bool, scaling: float, window: int, softcap: float,
        num_splits: int,
    ) -> torch.Tensor:  # fmt: skip
        view = _static_view(codes, scales, positions, fmt, ring, recent)
        view.sinks, view.sink_start, view.sink_count, view.key_channel_scale = sinks, sink_start, sink_count, channel
        settings = (scaling, window or None, softcap or None, num_splits)
        out, launches = AttentionPlan(query, view, mask, sink_logits, *settings).launches(query, view, mask, sink_logits)
        for launch in launches:
            launch.run(traced=True)
        return out

    return torch.ops.hf_fp8kv


def _static_view(codes, scales, positions, fmt: str, ring: bool, recent) -> KVView:
    return KVView(codes, scales, get_format(fmt), 0, positions[0], positions[1], 0, recent, static=True, ring=ring,
                  positions=positions)  # fmt: skip


def decode_splits(query: torch.Tensor, view: KVView, backend: str) -> int:
    """The Triton kernel's KV splits for a decode step over a static view (from the GPU's occupancy; 1 on the
    torch backend), computed outside the compiled graph that will use it."""
    if backend != "triton":
        return 1
    from .triton_attention import AttentionPlan

    step = query[:, :, -1:]
    return AttentionPlan(step, view, None, None, 1.0).splits(step, view)
