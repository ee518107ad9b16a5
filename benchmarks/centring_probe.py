"""Keys centred before they are coded, in decode mode: pure FP8 (per-token-head e4m3 on every token) against the
same cache fed each layer's keys less a fixed centre, the mean key (after RoPE, as the cache receives it) per KV
head and channel over a prefill of another text. Every key of a query moves by the same q.centre, which the
softmax cancels (pure FP8 holds no token exact, and neither model caps its logits), so only the codes' rounding
changes: it rounds the key's distance from the centre. A probe, not a cache option: the subtraction is made in
`update` and kept in the stored keys.

    python benchmarks/centring_probe.py --model gemma3 --tokens 640 --calibrate-tokens 640
    python benchmarks/centring_probe.py --model gemma3 --tokens 640 --low-frequency 0.8
"""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.evaluate import decode_mode_logits, quality
from recent_quality import MODELS, TEXTS, decode_probe_parser

PURE_FP8 = dict(scales="dynamic", recent_tokens=0, sink_tokens=0)


class CentredKeys(QuantizedFP8Cache):
    """Pure FP8 whose layer `i` stores its keys less `centre[i]` (`[1, kv_heads, 1, head_dim]`)."""

    def __init__(self, model, centre: dict[int, torch.Tensor]) -> None:
        super().__init__(model, **PURE_FP8)
        self.centre = centre

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key_states = key_states - self.centre[layer_idx].to(key_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def mean_keys(model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each layer's mean key over what a DynamicCache holds after prefilling `ids` (a sliding layer: its window)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return {i: layer.keys.float().mean(2, keepdim=True) for i, layer in enumerate(cache.layers)}


def rope_inv_freq(model) -> list[torch.Tensor]:
    """Each layer's RoPE inverse frequencies `[head_dim / 2]`, from the model's rotary embedding (Gemma 3: one set
    per layer type)."""
    rotary, text_config = model.model.rotary_emb, model.config.get_text_config(decoder=True)
    types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
    per_type = [getattr(rotary, f"{kind}_inv_freq", None) for kind in types]
    return [rotary.inv_freq if inv_freq is None else inv_freq for inv_freq in per_type]


def low_frequency(model, centre: dict[int, torch.Tensor], radians: float, tokens: int) -> dict[int, torch.Tensor]:
    """`centre` on the channel pairs RoPE turns by less than `radians` over `tokens` positions, 0 elsewhere."""
    inv_freq = rope_inv_freq(model)
    kept = {}
    for layer, mean in centre.items():
        slow = (inv_freq[layer] * tokens < radians).to(mean.dtype)
        kept[layer] = mean * torch.cat([slow, slow])  # rotate_half's layout: pair i is channels i and i + d/2
    return kept


@torch.inference_mode()
def main() -> None:
    parser = decode_probe_parser(__doc__)
    parser.add_argument("--calibrate-on", default="sample", help="the text whose mean keys are the centre")
    parser.add_argument("--calibrate-tokens", type=int, default=1024)
    parser.add_argument("--low-frequency", type=float, help="keep the centre only on channel pairs RoPE turns by "
                        "less than this many radians over --calibrate-tokens positions")  # fmt: skip
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    label, load = MODELS[args.model]
    model, tokenizer = load(dtype=torch.float32)
    calibration = tokenizer(TEXTS[args.calibrate_on](), return_tensors="pt").input_ids[:, : args.calibrate_tokens]
    centre = mean_keys(model, calibration)
    if args.low_frequency is not None:
        centre = low_frequency(model, centre, args.low_frequency, args.calibrate_tokens)
    ids = tokenizer(TEXTS[args.text](), return_tensors="pt").input_ids[:, : args.tokens]
    reference = decode_mode_logits(model, ids, args.prefix, DynamicCache(config=model.config))
    print(f"{label}, '{args.text}' ({args.tokens} tokens, {args.prefix} prefilled), decode mode against DynamicCache; "
          f"centre: the mean key over {args.calibrate_tokens} tokens of '{args.calibrate_on}'"
          + ("" if args.low_frequency is None else f", pairs turning < {args.low_frequency} rad only"))  # fmt: skip
    caches = {"pure FP8": QuantizedFP8Cache(model, **PURE_FP8), "keys centred": CentredKeys(model, centre)}
    for name, cache in caches.items():
        q = quality(reference, decode_mode_logits(model, ids, args.prefix, cache), ids[0, args.prefix :])
        print(f"{name:13s} KL mean {q.kl_mean:.2e}  p99 {q.kl_p99:.2e}  top-1 {q.top1_agreement:.4f}  "
              f"ppl delta {q.ppl_delta_pct:+.2f}%")  # fmt: skip


if __name__ == "__main__":
    main()
