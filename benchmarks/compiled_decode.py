"""Compiled decode on the CPU: the static FP8 cache vs transformers' StaticCache, both under torch.compile.

SmolLM2-135M-Instruct. For each model dtype and context: a cache of `max_cache_len = context + 64`, prefilled
eagerly with `context` tokens of the built-in text, then `--steps` single-token decode steps through
`torch.compile(model.forward, fullgraph=True)` (inductor), interleaved rounds, median step. Prints each step time
and the ratio to StaticCache (same run).

    python benchmarks/compiled_decode.py --contexts 1024 4096 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from importlib.resources import files

import torch
from transformers import StaticCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.bundled import load_smollm2
from hf_fp8kv.table import format_table

VARIANTS = {
    "StaticCache": lambda model, length: StaticCache(config=model.config, max_cache_len=length),
    "ours static fp8_e4m3 per-token-head": lambda model, length: QuantizedFP8Cache(
        model, scales="dynamic", max_cache_len=length, recent_tokens=0, sink_tokens=0
    ),
    "ours static, recent 32 + sinks 4 (default)": lambda model, length: QuantizedFP8Cache(
        model, scales="dynamic", max_cache_len=length
    ),
}


@torch.inference_mode()
def measure(model, forward, ids: torch.Tensor, context: int, steps: int, rounds: int) -> list[dict]:
    caches = {name: make(model, context + 64) for name, make in VARIANTS.items()}
    for cache in caches.values():
        model(input_ids=ids[:, :context], cache=cache)
    compile_seconds, times = {}, {name: [] for name in caches}
    for round_ in range(rounds + 1):  # round 0 compiles (and warms up); interleaved so noise hits all alike
        for name, cache in caches.items():
            for step in range(steps):
                position = context + round_ * steps + step
                started = time.perf_counter()
                forward(
                    input_ids=ids[:, position : position + 1], cache=cache, position_ids=torch.tensor([[position]])
                )
                elapsed = time.perf_counter() - started
                if round_:
                    times[name].append(elapsed)
                elif step == 0:
                    compile_seconds[name] = elapsed
    base = statistics.median(times["StaticCache"])
    return [
        {"context": context, "variant": name, "ms/step": 1e3 * statistics.median(t),
         "time x": statistics.median(t) / base, "first step s (compile)": compile_seconds[name]}
        for name, t in times.items()
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes:
        model, tokenizer = load_smollm2(dtype=getattr(torch, dtype))
        forward = torch.compile(model.forward, fullgraph=True)
        text = files("hf_fp8kv").joinpath("data/sample_text.txt").read_text()
        ids = tokenizer(text * (1 + max(args.contexts) // 1500), return_tensors="pt").input_ids
        rows = [row for c in args.contexts for row in measure(model, forward, ids, c, args.steps, args.rounds)]
        print(f"\nSmolLM2-135M-Instruct, {dtype}, compiled decode, torch {torch.__version__}, {args.threads} threads")
        print(format_table(rows), flush=True)


if __name__ == "__main__":
    main()
