"""Prepared Triton launches: what the launchers run and what `benchmarks/gpu_static.py` compiles for GPU targets."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.library import wrap_triton

from .targets import GpuTarget



@dataclass
class Launch:
    """One kernel launch with its grid, positional arguments and keyword arguments (constexprs and the launch
    options `num_warps` / `num_stages`), built by a `plan_*` function without touching a GPU."""

    kernel: object  # triton.runtime.JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def run(self, traced: bool = False) -> None:
        """Launch; `traced` inside a `triton_op` (its kernels must go through `wrap_triton`)."""
        if traced:
            wrap_triton(self.kernel)[self.grid](*self.args, **self.kwargs)
        else:  # no custom-op machinery outside a compiled graph
            self.kernel[self.grid](*self.args, **self.kwargs)


def launch_all(launches: list[Launch], device: torch.device) -> None:
    """Run `launches` on `device`'s current stream (Triton launches on the current device: with a model spread
    over several GPUs the tensors' device must be made current first)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            for launch in launches:
                launch.run()
        return
    for launch in launches:
        launch.run()


def planes(buffer: torch.Tensor | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value planes of a stacked `[2, batch, heads, slots, head_dim]` buffer, or a placeholder
    pointer twice for a buffer the kernel's constexprs leave unread."""
    return (buffer[0], buffer[1]) if buffer is not None else (placeholder, placeholder)


def plane_strides(buffer: torch.Tensor | None) -> tuple[int, ...]:
    """Batch, head, slot and channel strides of a plane of `buffer` (zeros for an absent one)."""
    return buffer.stride()[1:] if buffer is not None else (0, 0, 0, 0)


# CUDA's grid limits (x, y, z); ROCm's are larger
MAX_GRID = (2**31 - 1, 65535, 65535)


def check_grid(grid: tuple[int, ...], what: str) -> None:
    """Refuse, naming the launch and its sizes, a grid past CUDA's limits (a launch would fail with an opaque
    "invalid argument")."""
    if any(n > limit for n, limit in zip(grid, MAX_GRID)):
        raise ValueError(f"{what}: grid {grid} exceeds the GPU's limits {MAX_GRID}; split the batch into smaller ones")


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` without its constexpr-function wrapper (a few microseconds per call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def compiled_occupancy(launch: Launch, target: GpuTarget, device: torch.device) -> int:
    """Resident blocks per SM of `launch`'s kernel as compiled for `device` (registers and shared memory read
    off the compiled kernel; compiling it now if needed)."""
    with torch.cuda.device(device):
        compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    return max(1, target.blocks_per_sm(compiled.n_regs, launch.kwargs["num_warps"], compiled.metadata.shared))
