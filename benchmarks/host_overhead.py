"""Host (Python) cost of the cache's fast path per layer per decode step, and of the torch (CPU) path.

(1) Triton path with every kernel launch replaced by a no-op: `layer.update` (the write) plus the attention
function (the attend), per layer per decode step, dynamic and static caches. The launch itself (Triton's own
launcher) is not counted; on a GPU it adds its C++ launch cost per kernel.
(2) Torch path: a decode step of a 30-layer tiny Llama (hidden 64) at 32 tokens of context, against
DynamicCache, pure FP8 (static and dynamic scales) and with the recent tokens in full precision.

    python benchmarks/host_overhead.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # plans are built for the CPU; no kernel runs (launches are no-ops)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import PURE_FP8, tiny_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from hf_fp8kv import QuantizedFP8Cache  # noqa: E402
from hf_fp8kv.attention import fp8kv_attention  # noqa: E402
from hf_fp8kv.kernels import triton_launch  # noqa: E402


# Shorter than the default (128 + 4) so that, at these contexts, a step reads sinks, codes and recent tokens alike
# (and stays comparable with the figures in docs/benchmarks.md).
RECENT_AND_SINKS = dict(recent_tokens=32, sink_tokens=4)


def median_us(fn, repeats: int, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(times)


def triton_host_cost(cache_kwargs: dict, repeats: int) -> float:
    """Microseconds of Python per layer per decode step on the Triton path, launches stubbed out."""
    model = tiny_model("llama", num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, hidden_size=256)
    cache = QuantizedFP8Cache(model, backend="triton", **cache_kwargs)
    attention = model.model.layers[0].self_attn
    key = torch.randn(1, 2, 64, 32)
    cache.update(key, key, 0)  # prefill (runs for real, on the interpreter)
    triton_launch.Launch.run = lambda self: None
    step_key = torch.randn(1, 2, 1, 32)
    query = torch.randn(1, 8, 1, 32)
    max_len = cache_kwargs.get("max_cache_len")
    mask = torch.ones(1, 1, 1, max_len, dtype=torch.bool) if max_len else None

    def step():  # the context grows as in a generation (a buffer reallocation every 64 steps included)
        keys, values = cache.update(step_key, step_key, 0)
        fp8kv_attention(attention, query, keys, values, mask, scaling=0.1)

    with torch.inference_mode():
        return median_us(step, repeats)


def torch_step_ratio(steps: int, rounds: int) -> dict[str, float]:
    """Decode step time of the 30-layer tiny Llama, relative to DynamicCache (torch path): the median over
    rounds of each round's ratio (the variants of a round run back to back, each first in turn, so a machine that
    slows down or speeds up between rounds moves both sides of a ratio alike)."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=30)
    ids = torch.randint(3, 120, (1, 32))
    variants = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        "fp8 static scales": lambda: QuantizedFP8Cache(model, scales=1.0, **PURE_FP8),
        "fp8 dynamic scales": lambda: QuantizedFP8Cache(model, scales="dynamic", **PURE_FP8),
        "fp8 dynamic + recent 32 + sinks 4": lambda: QuantizedFP8Cache(model, scales="dynamic", **RECENT_AND_SINKS),
    }
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    base_times = []
    with torch.inference_mode():
        for round_index in range(rounds):
            times = {}
            names = list(variants)
            for name in names[round_index % len(names):] + names[: round_index % len(names)]:  # each one first in turn
                make = variants[name]
                cache = make()
                model(input_ids=ids, cache=cache)
                token = ids[:, -1:]
                for _ in range(3):
                    model(input_ids=token, cache=cache)
                step_times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    model(input_ids=token, cache=cache)
                    step_times.append(time.perf_counter() - start)
                times[name] = statistics.median(step_times)
            base_times.append(times["DynamicCache"])
            for name, t in times.items():
                ratios[name].append(t / times["DynamicCache"])
    return {name: statistics.median(r) for name, r in ratios.items()} | {
        "DynamicCache ms": statistics.median(base_times) * 1e3
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200, help="steps per round (5 rounds)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds of the torch-path ratio")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the torch-path steps (several threads on a busy "
        "machine make these tiny ops wait on each other: 12 ms instead of 6 us for one 40-token sdpa here)"
    )  # fmt: skip
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print("(1) Triton path, Python per layer per decode step (write + attend, launches stubbed):")
    for name, kwargs in {
        "dynamic cache, per-token scales": dict(scales="dynamic", **PURE_FP8),
        "dynamic cache, static scale": dict(scales=1.0, **PURE_FP8),
        "dynamic cache, recent 32 + sinks 4": dict(scales="dynamic", **RECENT_AND_SINKS),
        "static cache (max_cache_len=4096)": dict(scales="dynamic", max_cache_len=4096, **PURE_FP8),
    }.items():
        print(f"  {name:34s} {triton_host_cost(kwargs, args.repeats):7.1f} us")
    torch.set_num_threads(args.threads)
    print(f"(2) torch path, 30-layer tiny Llama decode step at 32 tokens, vs DynamicCache ({args.threads} threads):")
    for name, value in torch_step_ratio(args.steps, args.rounds).items():
        print(f"  {name:34s} {value:7.2f}" + ("" if name.endswith("ms") else "x"))


if __name__ == "__main__":
    main()
