"""Prepared Triton launches: what the launchers run and what `benchmarks/gpu_static.py` compiles for sm_90."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch.library import wrap_triton

# sm_90 (H100 / H200) per-SM limits, for occupancy: registers are allocated per warp in units of 256 from 4
# sub-partitions; shared memory in 128-byte units, 1 KB reserved per block by CUDA
SM90 = dict(registers=65536, shared=233472, reserved=1024, shared_unit=128, register_unit=256, warps=64, blocks=32)


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


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` without its constexpr-function wrapper (a few microseconds per call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def blocks_per_sm(registers: int, warps: int, shared: int, limits: dict = SM90) -> int:
    """Blocks of `warps` warps resident on one SM for a kernel using `registers` per thread and `shared` bytes of
    shared memory per block (CUDA's occupancy rules; 0 if none fits)."""
    unit = limits["register_unit"]
    warp_registers = -(-registers * 32 // unit) * unit
    by_registers = 4 * (limits["registers"] // 4 // warp_registers) // warps
    block_shared = -(-(shared + limits["reserved"]) // limits["shared_unit"]) * limits["shared_unit"]
    return min(by_registers, limits["shared"] // block_shared, limits["warps"] // warps, limits["blocks"])


def compiled_occupancy(launch: Launch, device: torch.device) -> int:
    """Resident blocks per SM of `launch`'s kernel as compiled for `device` (registers and shared memory read
    off the compiled kernel; compiling it now if needed)."""
    with torch.cuda.device(device):
        compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    return max(1, blocks_per_sm(compiled.n_regs, launch.kwargs["num_warps"], compiled.metadata.shared))
