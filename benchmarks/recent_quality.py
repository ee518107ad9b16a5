"""Quality and bytes of the recent tokens in full precision (newest `recent_tokens` + first `sink_tokens` in the model's
dtype over an FP8 past) on the bundled real models: the table of docs/recent.md.

Decode mode: `--prefix` tokens of the bundled text are prefilled, then every later token is fed one at a time
(`--tokens` in all), through each variant's cache and through DynamicCache (the reference): perplexity delta,
mean and p99 KL of the next-token distributions, top-1 agreement, and the decode time relative to
DynamicCache (same run). Bytes: each cache filled with 2k and 8k random tokens in a bf16 model, against a bf16
DynamicCache.

    python benchmarks/recent_quality.py                    # SmolLM2-135M
    python benchmarks/recent_quality.py --model gemma3
    python benchmarks/recent_quality.py --text code --variants 0 5 9   # held-out text, variants by index
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import time
from pathlib import Path
import warnings
from importlib.resources import files

import torch
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache, calibrate
from hf_fp8kv.bundled import load_gemma3, load_smollm2
from hf_fp8kv.evaluate import decode_mode_logits, quality
from hf_fp8kv.table import format_table

MODELS = {"smollm2": ("SmolLM2-135M", load_smollm2), "gemma3": ("Gemma 3 270M", load_gemma3)}
# `scales=KEY_CHANNELS`: per-token scales with per-channel key scales, `calibrate(strategy="token")` on the first
# `--calibrate-tokens` (1,024) tokens of `--calibrate-on` (another text than `--text`, or the same one's first tokens)
KEY_CHANNELS = "key channels calibrated on another text"
DEFAULTS = {name: p.default for name, p in inspect.signature(QuantizedFP8Cache).parameters.items()}


def decode_probe_parser(description: str, window_rows: bool = False) -> argparse.ArgumentParser:
    """The decode-mode probes' shared arguments: the model, the text, its tokens (prefix + decoded), the prefix;
    with `window_rows`, the window rows' recent tokens and the rows to run."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--text", default="code", help=f"one of {sorted(TEXTS)}")
    parser.add_argument("--tokens", type=int, default=1152, help="text tokens: prefix + decoded")
    parser.add_argument("--prefix", type=int, default=128)
    if window_rows:
        parser.add_argument("--recent", type=int, default=128, help="the window rows' recent tokens (sinks: 4)")
        parser.add_argument("--rows", type=int, nargs="*", help="the rows to run, by index (default: all)")
    return parser


def decode_reference(model, tokenizer, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The probes' reference: the ids of `args.text`'s first `args.tokens` tokens, and DynamicCache's decode-mode
    logits over them (`args.prefix` prefilled)."""
    ids = tokenizer(TEXTS[args.text](), return_tensors="pt").input_ids[:, : args.tokens]
    return ids, decode_mode_logits(model, ids, args.prefix, DynamicCache(config=model.config))


def _recent(recent: int, sinks: int, **kwargs) -> tuple[str, dict]:
    name = f"recent {recent} + sinks {sinks}"
    if (recent, sinks) == (DEFAULTS["recent_tokens"], DEFAULTS["sink_tokens"]):
        name += " (the default)"
    kwargs = dict(recent_tokens=recent, sink_tokens=sinks, **kwargs)
    return (name + (", scales auto (1.0)" if kwargs["scales"] == "auto" else "")), kwargs


VARIANTS = dict([
    ("fp8 e4m3 per-token-head (recent 0 + sinks 0)", dict(scales="dynamic", recent_tokens=0, sink_tokens=0)),
    *(_recent(r, s, scales="dynamic") for r, s in ((0, 4), (16, 0), (16, 4), (32, 4), (48, 4), (64, 0), (64, 4),
                                                    (96, 4), (128, 4))),
    _recent(DEFAULTS["recent_tokens"], DEFAULTS["sink_tokens"], scales="auto"),
    ("int8 per-token-head (recent 0 + sinks 0)",
     dict(kv_cache_dtype="int8_per_token_head", scales="dynamic", recent_tokens=0, sink_tokens=0)),
    # rotated codes (issue 35): pure FP8 and the recommended window
    ("fp8 e4m3 per-token-head (recent 0 + sinks 0), rotated",
     dict(scales="dynamic", recent_tokens=0, sink_tokens=0, rotate=True)),
    ("recent 128 + sinks 4, rotated", dict(scales="dynamic", recent_tokens=128, sink_tokens=4, rotate=True)),
    # outlier tokens (issue 35): 16 per layer and KV head beside the sinks, with and without the window
    ("recent 128 + sinks 4 + outliers 16", dict(scales="dynamic", recent_tokens=128, sink_tokens=4, outlier_tokens=16)),
    ("recent 128 + sinks 4 + outliers 32", dict(scales="dynamic", recent_tokens=128, sink_tokens=4, outlier_tokens=32)),
    ("fp8 e4m3 per-token-head, sinks 4 + outliers 16",
     dict(scales="dynamic", recent_tokens=0, sink_tokens=4, outlier_tokens=16)),
    # int8 per token and head with the window, and with per-channel key scales calibrated on another text
    ("int8 per-token-head, recent 128 + sinks 4",
     dict(kv_cache_dtype="int8_per_token_head", scales="dynamic", recent_tokens=128, sink_tokens=4)),
    ("int8 per-token-head + key channels, recent 128 + sinks 4",
     dict(kv_cache_dtype="int8_per_token_head", scales=KEY_CHANNELS, recent_tokens=128, sink_tokens=4)),
    ("int8 per-token-head + key channels (recent 0 + sinks 0)",
     dict(kv_cache_dtype="int8_per_token_head", scales=KEY_CHANNELS, recent_tokens=0, sink_tokens=0)),
    ("fp8 e4m3 per-token-head + key channels, recent 128 + sinks 4",
     dict(scales=KEY_CHANNELS, recent_tokens=128, sink_tokens=4)),
    # per-token scales searched within an octave, 16 candidates (issue 35): pure FP8 and the recommended window
    ("fp8 e4m3 per-token-head (recent 0 + sinks 0), scales searched (16)",
     dict(scales="dynamic", recent_tokens=0, sink_tokens=0, scale_search=16)),
    ("recent 128 + sinks 4, scales searched (16)",
     dict(scales="dynamic", recent_tokens=128, sink_tokens=4, scale_search=16)),
    ("recent 128 + sinks 4 + outliers 16, scales searched (16)",
     dict(scales="dynamic", recent_tokens=128, sink_tokens=4, outlier_tokens=16, scale_search=16)),
    # int8 and FP8 with per-channel key scales each layer measures from its own keys (no calibration pass)
    ("int8 per-token-head + measured key channels, recent 128 + sinks 4",
     dict(kv_cache_dtype="int8_per_token_head", scales="dynamic_key_channels", recent_tokens=128, sink_tokens=4)),
    ("fp8 e4m3 per-token-head + measured key channels, recent 128 + sinks 4",
     dict(scales="dynamic_key_channels", recent_tokens=128, sink_tokens=4)),
])  # fmt: skip
# Texts unlike the bundled sample (the held-out measurements of docs/recent.md): Python's own source code and the
# Apache License 2.0 as transformers ships it, wherever they are installed; any other file by its path
TEXTS = {
    "sample": lambda: files("hf_fp8kv").joinpath("data/sample_text.txt").read_text(),
    "code": lambda: inspect.getsource(argparse),
    "legal": lambda: importlib.metadata.distribution("transformers").read_text("licenses/LICENSE"),
}


def kv_bytes(model, tokens: int, **cache_kwargs) -> int:
    """Bytes a cache holds while decoding at `tokens` tokens of context (a prefill of `tokens - 1` random tokens,
    then one decode step, in every layer), the model in bf16. The decode step counts: after a prefill, sliding
    layers hold the prompt's codes until their next write."""
    config = model.config
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cache = QuantizedFP8Cache(config=config, **cache_kwargs) if cache_kwargs else DynamicCache(config=config)
    for step in (tokens - 1, 1):
        for layer in range(text.num_hidden_layers):
            kv = torch.randn(2, 1, text.num_key_value_heads, step, head_dim, dtype=torch.bfloat16)
            cache.update(kv[0], kv[1], layer)
    if isinstance(cache, QuantizedFP8Cache):
        return cache.nbytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--tokens", type=int, default=1152, help="text tokens: prefix + decoded")
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), help="names, or indices into the list")
    parser.add_argument("--text", default="sample", help=f"one of {sorted(TEXTS)}, or the path of a text file")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady times on a shared machine)")
    parser.add_argument("--calibrate-on", help="the text key channels are calibrated on (default: 'sample', or "
                        "'code' when --text is 'sample')")  # fmt: skip
    parser.add_argument("--calibrate-tokens", type=int, default=1024, help="the tokens key channels are calibrated on")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    name, load = MODELS[args.model]
    model, tokenizer = load(dtype=torch.float32)
    text = TEXTS[args.text]() if args.text in TEXTS else Path(args.text).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    if ids.shape[1] < args.tokens:
        raise SystemExit(f"--text {args.text} has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
    names = list(VARIANTS)
    variants = [names[int(v)] if v.isdigit() else v for v in args.variants]
    with torch.inference_mode():
        started = time.perf_counter()
        reference = decode_mode_logits(model, ids, args.prefix, DynamicCache(config=model.config))
        reference_seconds = time.perf_counter() - started
    targets = ids[0, args.prefix :]
    bf16 = {tokens: kv_bytes(model, tokens) for tokens in (2048, 8192)}
    rows = []
    calibrate_on = args.calibrate_on or ("code" if args.text == "sample" else "sample")
    key_channels = None
    for variant in variants:
        kwargs = VARIANTS[variant]
        if kwargs["scales"] == KEY_CHANNELS:
            key_channels = key_channels or calibrate(model, TEXTS[calibrate_on](), tokenizer, strategy="token",
                                                     key_channels=True, max_length=args.calibrate_tokens,
                                                     progress=False)  # fmt: skip
            kwargs = dict(kwargs, scales=key_channels)
            tokens = "" if args.calibrate_tokens == 1024 else f", first {args.calibrate_tokens} tokens"
            variant += f" (on {calibrate_on!r}{tokens})"
        with torch.inference_mode():
            started = time.perf_counter()
            logits = decode_mode_logits(model, ids, args.prefix, QuantizedFP8Cache(model, **kwargs))
            seconds = time.perf_counter() - started
        q = quality(reference, logits, targets)
        rows.append({
            "variant": variant, "ppl delta %": f"{q.ppl_delta_pct:+.2f}", "mean KL": f"{q.kl_mean:.2e}",
            "p99 KL": f"{q.kl_p99:.2e}", "top-1 %": f"{100 * q.top1_agreement:.1f}",
            "bytes vs bf16 @2k": f"{kv_bytes(model, 2048, **kwargs) / bf16[2048]:.3f}",
            "@8k": f"{kv_bytes(model, 8192, **kwargs) / bf16[8192]:.3f}",
            "decode time vs DynamicCache": f"{seconds / reference_seconds:.2f}",
        })  # fmt: skip
        print(rows[-1], flush=True)
    print(f"{name}, fp32, text {args.text!r}, decode mode: {args.prefix}-token prefix then {ids.shape[1] - args.prefix} tokens one at a "
          "time, against DynamicCache; bytes: bf16 model, against a bf16 DynamicCache")  # fmt: skip
    print(format_table(rows))


if __name__ == "__main__":
    main()
