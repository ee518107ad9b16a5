"""Peak memory of a long prefill on the CPU: QuantizedFP8Cache vs DynamicCache + sdpa (SmolLM2-135M, fp32).

Each (cache, prompt length) runs in a fresh process: the model is loaded, the resident set measured, the prompt
prefilled in one forward (`logits_to_keep=1`), and the growth of the peak resident set during the prefill
reported (VmHWM, reset just before it through /proc/self/clear_refs), with the prefill time. Linux only.

    python benchmarks/prefill_memory.py --tokens 1024 2048 4096
    python benchmarks/prefill_memory.py --tokens 32768 --caches QuantizedFP8Cache
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from hf_fp8kv.table import format_table

CACHES = ("DynamicCache", "QuantizedFP8Cache")


def status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def child(cache_name: str, tokens: int) -> dict:
    """Runs in the fresh process: one prefill of `tokens` random ids."""
    import torch
    from transformers import DynamicCache

    from hf_fp8kv import QuantizedFP8Cache
    from hf_fp8kv.bundled import load_smollm2

    model, _ = load_smollm2(dtype=torch.float32)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, tokens)
    if cache_name == "DynamicCache":
        cache = DynamicCache(config=model.config)
    else:
        cache = QuantizedFP8Cache(model, scales="dynamic")
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # touches the memory-mapped weights, which would otherwise count as growth
        model(input_ids=ids[:, :8], logits_to_keep=1)
    with open("/proc/self/clear_refs", "w") as clear:  # the peak resident set (VmHWM) starts again from here
        clear.write("5")
    before = status_kb("VmRSS")
    started = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, logits_to_keep=1)
    seconds = time.perf_counter() - started
    peak = status_kb("VmHWM")
    return {"cache": cache_name, "tokens": tokens, "peak growth MB": (peak - before) / 1024, "prefill s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    parser.add_argument("--child", nargs=2, metavar=("CACHE", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    rows = []
    for tokens in args.tokens:
        for cache_name in args.caches:
            run = subprocess.run(
                [sys.executable, __file__, "--child", cache_name, str(tokens)], capture_output=True, text=True
            )
            if run.returncode:
                rows.append({"cache": cache_name, "tokens": tokens, "peak growth MB": f"failed ({run.returncode})"})
                print(run.stderr[-2000:], file=sys.stderr)
                continue
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print(format_table(rows))


if __name__ == "__main__":
    main()
