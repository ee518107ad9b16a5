"""Bytes a static cache allocates: QuantizedFP8Cache(max_cache_len=N) against transformers' StaticCache in bf16.

Each cache is allocated by a 4-token forward on the bundled models (bf16; SmolLM2-135M: 30 full-attention layers,
Gemma 3 270M: 15 sliding layers of 512 tokens and 3 full ones), then its tensors' bytes are summed. Allocation
only: nothing here depends on the machine.

    python benchmarks/static_bytes.py --tokens 2048 8192 32768
"""

from __future__ import annotations

import argparse
import warnings

import torch
from transformers import StaticCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.bundled import load_gemma3, load_smollm2
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.table import format_table

MODELS = {"SmolLM2-135M": load_smollm2, "Gemma 3 270M": load_gemma3}
VARIANTS = {  # the default's scales are the checkpoint's (none here: 1.0 per head, with a warning)
    "default (recent 128 + sinks 4)": {},
    "recent 128 + sinks 4, per-token scales": dict(scales="dynamic"),
    "pure FP8, per-token scales": dict(scales="dynamic", recent_tokens=0, sink_tokens=0),
}


def allocated(model, cache) -> int:
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), **cache_kwargs(cache))
    if isinstance(cache, QuantizedFP8Cache):
        return cache.nbytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*calibrat")  # the default's 1.0 scales: bytes do not depend on them
    rows = []
    for name in args.models:
        model, _ = MODELS[name](dtype=torch.bfloat16)
        for tokens in args.tokens:
            native = allocated(model, StaticCache(config=model.config, max_cache_len=tokens))
            rows.append({"model": name, "max_cache_len": tokens, "cache": "StaticCache bf16",
                         "MiB": f"{native / 2**20:.2f}", "x bf16": "1"})  # fmt: skip
            for variant, window in VARIANTS.items():
                cache = QuantizedFP8Cache(model, max_cache_len=tokens, **window)
                nbytes = allocated(model, cache)
                rows.append({"model": name, "max_cache_len": tokens, "cache": f"ours, {variant}",
                             "MiB": f"{nbytes / 2**20:.2f}", "x bf16": f"{nbytes / native:.4f}"})  # fmt: skip
    print(format_table(rows))


if __name__ == "__main__":
    main()
