"""Decode-mode speed and KV bytes on CPU: DynamicCache vs transformers' QuantizedCache(fp8) vs ours.

For each model dtype and context: prefill `context` tokens of the built-in text, then time `--steps` single-token
decode steps through each cache (interleaved rounds, median step time). Prints ratios to DynamicCache.

    python benchmarks/cpu_decode.py --contexts 1024 2048 4096 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from importlib.resources import files
from transformers import DynamicCache, QuantizedCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.bundled import load_smollm2
from hf_fp8kv.comparison import kv_bytes
from hf_fp8kv.table import format_table

VARIANTS = {
    "DynamicCache": lambda m: DynamicCache(config=m.config),
    "transformers QuantizedCache(fp8)": lambda m: QuantizedCache(backend="fp8", config=m.config),
    "ours fp8_e4m3 static": lambda m: QuantizedFP8Cache(m, scales=1.0, recent_tokens=0, sink_tokens=0),
    "ours fp8_e4m3 dynamic": lambda m: QuantizedFP8Cache(m, scales="dynamic", recent_tokens=0, sink_tokens=0),
    "ours fp8_e4m3 dynamic, rotated": lambda m: QuantizedFP8Cache(m, scales="dynamic", recent_tokens=0, sink_tokens=0,
                                                                 rotate=True),
    "ours fp8_e4m3 dynamic + recent 128 + sinks 4 (default)": lambda m: QuantizedFP8Cache(m, scales="dynamic"),
    "ours fp8_e4m3 dynamic + recent 128 + sinks 4, rotated": lambda m: QuantizedFP8Cache(m, scales="dynamic",
                                                                                        rotate=True),
}


@torch.inference_mode()
def measure(model, ids: torch.Tensor, context: int, steps: int, rounds: int) -> list[dict]:
    caches = {name: make(model) for name, make in VARIANTS.items()}
    for cache in caches.values():
        model(input_ids=ids[:, :context], cache=cache)
    times = {name: [] for name in caches}
    for round_ in range(rounds):  # interleave variants so machine noise hits them alike
        for name, cache in caches.items():
            for step in range(steps):
                position = context + round_ * steps + step
                start = time.perf_counter()
                model(input_ids=ids[:, position : position + 1], cache=cache)
                times[name].append(time.perf_counter() - start)
    base_time = statistics.median(times["DynamicCache"])
    base_bytes = kv_bytes(caches["DynamicCache"])
    rows = []
    for name, cache in caches.items():
        step = statistics.median(times[name])
        rows.append({"context": context, "variant": name, "ms/step": 1e3 * step, "tok/s": 1 / step,
                     "time x": step / base_time, "KV MiB": kv_bytes(cache) / 2**20,
                     "bytes x": kv_bytes(cache) / base_bytes})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes:
        model, tokenizer = load_smollm2(dtype=getattr(torch, dtype))
        text = files("hf_fp8kv").joinpath("data/sample_text.txt").read_text()
        ids = tokenizer(text * (1 + max(args.contexts) // 1500), return_tensors="pt").input_ids
        rows = [row for context in args.contexts for row in measure(model, ids, context, args.steps, args.rounds)]
        print(f"\nSmolLM2-135M-Instruct, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(format_table(rows))


if __name__ == "__main__":
    main()
