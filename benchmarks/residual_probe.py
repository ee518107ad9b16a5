"""Where the default window's error comes from, in decode mode: issue 35's probe of what is left once the recent
and sink tokens are exact (Gemma 3 stays above the 2e-4 mean KL target in FP8 with every lever measured), in
torch, against DynamicCache.

Every row codes the same tokens as the default window (recent 128 + sinks 4: per-token-head e4m3 under a bf16
scale, `block_centring_probe.SimulatedCodes`) but only part of them: the keys alone or the values alone (the other
read exact), the sliding-window layers alone or the full-attention ones alone. The library's own row checks the
simulation; pure FP8's keys and values alone come beside it for scale.

    python benchmarks/residual_probe.py --model gemma3 --tokens 640
    python benchmarks/residual_probe.py --model smollm2 --text sample
"""

from __future__ import annotations

import warnings

import torch

from hf_fp8kv import QuantizedFP8Cache
from block_centring_probe import SimulatedCodes, print_rows, quality_rows
from recent_quality import MODELS, decode_probe_parser, decode_reference


@torch.inference_mode()
def main() -> None:
    args = decode_probe_parser(__doc__, window_rows=True).parse_args()
    warnings.simplefilter("ignore")
    label, load = MODELS[args.model]
    model, tokenizer = load(dtype=torch.float32)
    ids, reference = decode_reference(model, tokenizer, args)
    window = f"recent {args.recent} + sinks 4"
    text_config = model.config.get_text_config(decoder=True)
    types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
    kinds = {kind: {i for i, k in enumerate(types) if k == kind} for kind in dict.fromkeys(types)}

    def simulated(recent: int, sinks: int, **kwargs) -> SimulatedCodes:
        return SimulatedCodes(model, recent, sinks, block=64, **kwargs)

    caches = {
        f"{window} (the library)": lambda: QuantizedFP8Cache(model, scales="dynamic", recent_tokens=args.recent,
                                                             sink_tokens=4),
        window: lambda: simulated(args.recent, 4),
        f"{window}, keys alone coded": lambda: simulated(args.recent, 4, coded="keys"),
        f"{window}, values alone coded": lambda: simulated(args.recent, 4, coded="values"),
        **{f"{window}, {kind} layers alone coded ({len(layers)} of {len(types)})":
           (lambda layers=layers: simulated(args.recent, 4, coded_layers=layers))
           for kind, layers in kinds.items() if len(kinds) > 1},
        "pure FP8, keys alone coded": lambda: simulated(0, 0, coded="keys"),
        "pure FP8, values alone coded": lambda: simulated(0, 0, coded="values"),
    }  # fmt: skip
    rows = quality_rows(model, ids, args.prefix, reference, caches, args.rows)
    print_rows(rows, label, args, ids, "per-token-head e4m3 (bf16 scales)")


if __name__ == "__main__":
    main()
