"""What the FP8 prefill's dots cost in quality (`fp8_prefill`, issue 21 item 4), on the bundled real models.

One prefill forward over the first `--tokens` tokens of a text (every query attends over the whole causal
prefix: contractions up to `--tokens` long), with each layer's attention replaced by
`reference.fp8_dots_attention` (the kernel's arithmetic, tile by tile: the query in e4m3 per row, and with the
values' dot, the probabilities (times per-token V scales, with those) in e4m3) and by the exact fp32 attention
(the reference). Keys and values are the
model's own, in fp32: the figures are the dots' error alone, on top of whatever the cache's codes cost. Next-token
perplexity delta, mean and p99 KL, top-1 agreement over every position.

    python benchmarks/fp8_prefill_quality.py                      # SmolLM2-135M, 2048 tokens of the sample
    python benchmarks/fp8_prefill_quality.py --model gemma3 --text code
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface

from hf_fp8kv.evaluate import quality
from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.rotation import hadamard
from hf_fp8kv.table import format_table
from recent_quality import MODELS, TEXTS

VARIANTS = {  # reference.fp8_dots_attention's settings, `per_token`: per-token-head V scales; None: the reference
    "exact (fp32)": None,
    "FP8 QK only (per-token V scales; fp8_prefill before PV went FP8)": dict(fp8_pv=False, per_token=True),
    "FP8 QK + PV (fp8_prefill, per-token V scales)": dict(per_token=True),
    "FP8 QK + PV (fp8_prefill, per-head V scales)": dict(),
    "FP8 QK + PV, two e4m3 terms per operand": dict(terms=2),
    "FP8 QK only, rotated (rotate=True before PV went FP8)": dict(fp8_pv=False, per_token=True, rotate=True),
    "FP8 QK + PV, rotated (rotate=True)": dict(per_token=True, rotate=True),
}
E4M3 = reference.E4M3


def attention_with(fp8: dict | None):
    """An attention function (transformers' interface) over the model's K/V: exact, or the FP8 dots' arithmetic
    (per-token V scales: bf16, rounded up, of the values as the cache would store them, rotated or not)."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
        scaling = module.scaling if scaling is None else scaling
        q_len, kv_len = query.shape[2], key.shape[2]
        mask = reference.causal_mask(q_len, kv_len, sliding_window, query.device)
        if fp8 is None:
            out = reference.attention(query, key, value, scaling=scaling, mask=mask, softcap=kwargs.get("softcap"))
        else:
            settings = dict(fp8)
            if settings.pop("per_token", False):
                stored = hadamard(value.float()) if settings.get("rotate") else value
                settings["value_scales"] = reference.dynamic_scale(stored, E4M3, torch.bfloat16)
            out = reference.fp8_dots_attention(query, key, value, scaling=scaling, mask=mask, **settings)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    return attend


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--text", default="sample", help=f"one of {sorted(TEXTS)}")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    label, load = MODELS[args.model]
    model, tokenizer = load()
    ids = tokenizer(TEXTS[args.text](), return_tensors="pt").input_ids[:, : args.tokens]
    logits = {}
    for name, fp8 in VARIANTS.items():
        key = f"fp8kv_dots_{len(logits)}"
        AttentionInterface.register(key, attention_with(fp8))
        model.set_attn_implementation(key)
        logits[name] = model(input_ids=ids).logits[0, :-1].float()
    reference_logits = logits.pop("exact (fp32)")
    rows = []
    for name, test in logits.items():
        q = quality(reference_logits, test, ids[0, 1:])
        rows.append({"dots": name, "ppl delta": f"{q.ppl_delta_pct:+.3f}%", "KL mean": f"{q.kl_mean:.2e}",
                     "KL p99": f"{q.kl_p99:.2e}", "top-1 agreement": f"{q.top1_agreement:.4f}"})
    print(f"{label}, {ids.shape[1]} tokens of '{args.text}', one prefill; against exact fp32 attention "
          f"(perplexity {quality(reference_logits, reference_logits, ids[0, 1:]).ppl:.3f})")  # fmt: skip
    print(format_table(rows))


if __name__ == "__main__":
    main()
