"""A prepared Triton launch: what the launchers run and what `benchmarks/gpu_static.py` compiles for sm_90."""

from __future__ import annotations

from dataclasses import dataclass

from torch.library import wrap_triton


@dataclass
class Launch:
    """One kernel launch with its grid, positional arguments and keyword arguments (constexprs and the launch
    options `num_warps` / `num_stages`), built by a `plan_*` function without touching a GPU."""

    kernel: object  # triton.runtime.JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def run(self) -> None:
        wrap_triton(self.kernel)[self.grid](*self.args, **self.kwargs)
