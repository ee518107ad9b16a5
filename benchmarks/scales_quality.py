"""Quality of each scale scheme on SmolLM2-135M (or Gemma 3 270M): the tables of docs/scales.md.

Calibration data: the first half of the built-in text, in chunks of `--chunk` tokens. Held-out: the second
half; `--prefix` tokens are context, every later token is scored. Each scheme's cache is compared with the
full-precision DynamicCache on the same text: perplexity delta, mean / p99 KL, top-1 agreement, clipped values.
Every token is stored in FP8 (`recent_tokens=0, sink_tokens=0`): with the default window one pass would not be
decode mode (every query would see the text's last 128 tokens in full precision, not its own last 128).

By default the held-out text goes through each cache in one pass: our cache quantizes new tokens before its
attention reads them, so every query sees the same quantized past as in decode mode (checked by
tests/test_sensitivity.py::test_one_pass_through_the_cache_is_decode_mode). `--decode` feeds the tokens one
at a time instead (hf_fp8kv.evaluate.decode_mode_logits; slower).

    python benchmarks/scales_quality.py
    python benchmarks/scales_quality.py --model gemma3
    python benchmarks/scales_quality.py --decode --tokens 320
"""

from __future__ import annotations

import argparse
import time
import warnings
from importlib.resources import files

import torch
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache, calibrate, layer_sensitivity
from hf_fp8kv.bundled import load_gemma3, load_smollm2
from hf_fp8kv.evaluate import decode_mode_logits, quality
from hf_fp8kv.table import format_table

MODELS = {"smollm2": ("SmolLM2-135M", load_smollm2), "gemma3": ("Gemma 3 270M", load_gemma3)}


@torch.inference_mode()
def logits_through(model, ids: torch.Tensor, prefix: int, cache, decode: bool) -> torch.Tensor:
    """Logits predicting tokens `prefix..` of `ids` through `cache`."""
    if decode:
        return decode_mode_logits(model, ids, prefix, cache)
    return model(input_ids=ids, cache=cache).logits[0, prefix - 1 : -1].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--tokens", type=int, default=0, help="held-out tokens (0: the whole second half)")
    parser.add_argument("--prefix", type=int, default=64, help="held-out tokens used as context only")
    parser.add_argument("--chunk", type=int, default=256, help="calibration sample length in tokens")
    parser.add_argument("--decode", action="store_true", help="feed held-out tokens one at a time")
    parser.add_argument("--skip-layers", default=None, help="e.g. 0,1,2: use these instead of layer_sensitivity's")
    args = parser.parse_args()

    title, load = MODELS[args.model]
    model, tokenizer = load()
    text = (files("hf_fp8kv") / "data" / "sample_text.txt").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids
    half = ids.shape[1] // 2
    chunks = [ids[:, start : start + args.chunk] for start in range(0, half, args.chunk)]
    held_out = ids[:, half:] if not args.tokens else ids[:, half : half + args.tokens]
    targets = held_out[0, args.prefix :]
    print(f"{title} fp32; calibration {half} tokens in {len(chunks)} chunks; held-out {held_out.shape[1]} "
          f"tokens ({args.prefix} context, {len(targets)} scored); {'decode' if args.decode else 'one-pass'} mode")  # fmt: skip

    start = time.perf_counter()
    calibrated = {
        (strategy, channels): calibrate(model, chunks, strategy=strategy, key_channels=channels, progress=False)
        for strategy in ("tensor", "attn_head")
        for channels in (False, True)
    }
    clipped_999 = calibrate(model, chunks, percentile=99.9, progress=False)
    print(f"calibration: {time.perf_counter() - start:.0f} s")

    if args.skip_layers is not None:
        skip_layers = [int(i) for i in args.skip_layers.split(",")]
    else:
        start = time.perf_counter()
        sensitivity = layer_sensitivity(model, chunks[:2], scales=calibrated[("tensor", False)], progress=False)
        print(f"sensitivity (per-tensor scales, first 2 calibration chunks): {time.perf_counter() - start:.0f} s")
        print(sensitivity)
        skip_layers = sensitivity.skip_layers

    schemes = {
        "scale 1.0 (uncalibrated)": dict(scales=1.0),
        "calibrated per-tensor": dict(scales=calibrated[("tensor", False)]),
        "calibrated per-tensor, p99.9 clip": dict(scales=clipped_999),
        "calibrated per-head": dict(scales=calibrated[("attn_head", False)]),
        "per-tensor + key channels": dict(scales=calibrated[("tensor", True)]),
        "per-head + key channels": dict(scales=calibrated[("attn_head", True)]),
        "dynamic per-token-head": dict(scales="dynamic"),
        f"per-tensor, skip_layers={skip_layers}": dict(scales=calibrated[("tensor", False)], skip_layers=skip_layers),
    }
    reference = logits_through(model, held_out, args.prefix, DynamicCache(config=model.config), args.decode)
    rows = []
    for name, kwargs in schemes.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scale 1.0 is uncalibrated on purpose
            cache = QuantizedFP8Cache(model, recent_tokens=0, sink_tokens=0, **kwargs)
        result = quality(reference, logits_through(model, held_out, args.prefix, cache, args.decode), targets)
        rows.append({
            "scales": name, "dppl %": round(result.ppl_delta_pct, 3), "mean KL": result.kl_mean,
            "p99 KL": result.kl_p99, "top-1": round(result.top1_agreement, 4),
            "clipped": sum(row["clipped"] for row in cache.summary()),
        })  # fmt: skip
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\nreference perplexity {result.ppl_ref:.3f}\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
