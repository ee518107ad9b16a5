"""Calibrate FP8 KV scales for a model, use them in generate, save them, and export a copy for `vllm serve`.

    python examples/calibrate.py                      # SmolLM2-135M, bundled offline
    python examples/calibrate.py --model path/to/model --out ./my-model-fp8kv
"""

from __future__ import annotations

import argparse
from importlib.resources import files

from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_fp8kv import KVScales, QuantizedFP8Cache, calibrate
from hf_fp8kv.bundled import smollm2_dir
from hf_fp8kv.compat import cache_kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory or cached Hub name (default: SmolLM2)")
    parser.add_argument("--out", default="smollm2-fp8kv", help="where to write the model copy for vLLM")
    parser.add_argument("--strategy", default="tensor", choices=["tensor", "attn_head"])
    args = parser.parse_args()

    model_dir = args.model or smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    # Calibration text: use text like your traffic; here the first paragraphs of the bundled sample.
    paragraphs = (files("hf_fp8kv") / "data" / "sample_text.txt").read_text().split("\n\n")
    scales = calibrate(model, paragraphs[:8], tokenizer, strategy=args.strategy)

    cache = QuantizedFP8Cache(model, scales=scales)
    prompt = tokenizer("The lighthouse keeper wrote", return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False, **cache_kwargs(cache))
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    print(cache)  # per layer: storage, granularity, source of the scales, K/V scales, bytes, clipped values

    path = scales.save(f"{args.out}-scales.safetensors")
    assert all(KVScales.load(path).key[i].flatten().equal(scales.key[i]) for i in scales.layers)
    exported = scales.export_for_vllm(model_dir, args.out)
    print(f"scales: {path}\nvLLM-ready copy: {exported}  (vllm serve {exported} --kv-cache-dtype fp8)")


if __name__ == "__main__":
    main()
