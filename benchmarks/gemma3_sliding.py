"""Gemma 3 270M (5 sliding : 1 full, window 512): FP8 on all layers vs sliding layers skipped, on CPU.

Decode-mode quality against DynamicCache over the built-in text (longer than the window), greedy agreement by
vLLM's rule (at the first differing token each side's choice is in the other's top-k), and the KV bytes held.

    python benchmarks/gemma3_sliding.py --tokens 640 --prefix 64 --new 32
"""

from __future__ import annotations

import argparse
import time
from importlib.resources import files

import torch
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.bundled import load_gemma3
from hf_fp8kv.comparison import kv_bytes
from hf_fp8kv.evaluate import decode_mode_logits, greedy_with_logits, quality, topk_rule
from hf_fp8kv.table import format_table

CONFIGURATIONS = {
    "fp8 dynamic, all layers": dict(scales="dynamic"),
    "fp8 dynamic, sliding skipped": dict(scales="dynamic", skip_layers="sliding_window"),
    "fp8 scale 1.0, all layers": dict(scales=1.0),
}


def greedy_agreement(model, ids: torch.Tensor, reference: tuple, cache, new: int, k: int) -> str:
    """vLLM's rule: equal, or at the first difference each choice is in the other's top-k."""
    tokens, logits = greedy_with_logits(model, {"input_ids": ids}, cache, new)
    at, ok = topk_rule(*reference, tokens[0], logits[0], k)
    return "equal" if at is None else f"differ at {at}, top-{k} {'ok' if ok else 'FAILED'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=640, help="text tokens used (window is 512)")
    parser.add_argument("--prefix", type=int, default=64, help="tokens prefilled before decode mode")
    parser.add_argument("--new", type=int, default=32, help="greedy tokens generated after the whole text")
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args()

    model, tokenizer = load_gemma3()
    text = files("hf_fp8kv").joinpath("data/sample_text.txt").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    targets = ids[0, args.prefix :]

    start = time.perf_counter()
    reference_cache = DynamicCache(config=model.config)
    reference = decode_mode_logits(model, ids, args.prefix, reference_cache)
    rows = [{"cache": "DynamicCache (fp32)", "bytes": kv_bytes(reference_cache), "ppl": quality(
        reference, reference, targets).ppl_ref, "seconds": time.perf_counter() - start}]
    ref_tokens, ref_logits = greedy_with_logits(model, {"input_ids": ids}, DynamicCache(config=model.config), args.new)
    reference_greedy = (ref_tokens[0], ref_logits[0])
    for name, kwargs in CONFIGURATIONS.items():
        start = time.perf_counter()
        cache = QuantizedFP8Cache(model, **kwargs)
        logits = decode_mode_logits(model, ids, args.prefix, cache)
        q = quality(reference, logits, targets)
        rows.append({
            "cache": name, "bytes": kv_bytes(cache), "ppl": q.ppl, "ppl_delta_%": q.ppl_delta_pct,
            "kl_mean": q.kl_mean, "kl_p99": q.kl_p99, "top1": q.top1_agreement, "first_flip": q.first_flip,
            "greedy": greedy_agreement(model, ids, reference_greedy, QuantizedFP8Cache(model, **kwargs), args.new,
                                       args.top_k),
            "seconds": time.perf_counter() - start,
        })
    print(f"Gemma 3 270M, {ids.shape[1]} tokens, decode mode from {args.prefix}, greedy {args.new} new tokens")
    print(format_table(rows, ["cache", "bytes", "ppl", "ppl_delta_%", "kl_mean", "kl_p99", "top1", "first_flip",
                              "greedy", "seconds"]))


if __name__ == "__main__":
    main()
