"""Key channels kept exact, in decode mode: issue 35's probe of what the keys' few large channels cost an FP8
cache, in torch, against DynamicCache.

FP8 rounds each element relative to its size, so a key channel's share of q.k's rounding error goes with
`E[q_c^2] E[k_c^2]`; in the bundled models a few channels per KV head hold most of it (Gemma 3: the largest 4 of
256 hold 55-88% in most layers). Per layer and KV head, the `N` channels of largest `E[q_c^2] E[k_c^2]` over a
prefill of another text (`--choose-on`) are left out of the key codes and their scale and read as they came (a
cache would hold them in the model's dtype: `2 N` bytes per token and KV head). Everything else is simulated as
the cache stores it (`block_centring_probe.SimulatedCodes`: per-token-head e4m3 under a bf16 scale, the window
rows' recent and sink tokens exact); the library's own rows check the simulation.

    python benchmarks/exact_channels_probe.py --model gemma3 --tokens 640
    python benchmarks/exact_channels_probe.py --model smollm2 --text sample --choose-on code
"""

from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface

from hf_fp8kv import QuantizedFP8Cache
from block_centring_probe import SimulatedCodes, print_rows, quality_rows
from recent_quality import MODELS, decode_probe_parser, decode_reference
from rotation_probe import Probe, largest_channels, prefill

CHOOSE_TOKENS = 1024  # tokens of the other text whose prefill chooses the channels


def chosen_energy(load, text: str) -> dict[int, torch.Tensor]:
    """Each layer's `channel_energy` over one exact prefill of `CHOOSE_TOKENS` tokens of TEXTS[`text`]
    (`rotation_probe.Probe` records it), by a model of its own (`load()`: the measured one keeps its attention
    implementation untouched)."""
    model, tokenizer = load(dtype=torch.float32)
    probe = Probe()
    AttentionInterface.register("fp8kv_exact_channels_probe", probe)
    model.set_attn_implementation("fp8kv_exact_channels_probe")
    prefill(model, tokenizer, text, CHOOSE_TOKENS)
    return probe.energy


@torch.inference_mode()
def main() -> None:
    parser = decode_probe_parser(__doc__, window_rows=True)
    parser.add_argument("--choose-on", default="sample", help="the text whose prefill chooses the channels")
    parser.add_argument("--channels", type=int, nargs="*", default=[2, 4, 8], help="exact key channels per KV head")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    label, load = MODELS[args.model]
    energy = chosen_energy(load, args.choose_on)
    model, tokenizer = load(dtype=torch.float32)
    ids, reference_logits = decode_reference(model, tokenizer, args)
    window = f"recent {args.recent} + sinks 4"

    def simulated(recent: int, sinks: int, channels: int = 0) -> SimulatedCodes:
        exact = {layer: largest_channels(e, channels) for layer, e in energy.items()} if channels else None
        return SimulatedCodes(model, recent, sinks, 64, exact_channels=exact)

    caches = {
        "pure FP8 (the library)": lambda: QuantizedFP8Cache(model, scales="dynamic", recent_tokens=0, sink_tokens=0),
        "pure FP8": lambda: simulated(0, 0),
        **{f"pure FP8, {n} key channels exact": (lambda n=n: simulated(0, 0, n)) for n in args.channels},
        f"{window} (the library)": lambda: QuantizedFP8Cache(model, scales="dynamic", recent_tokens=args.recent,
                                                             sink_tokens=4),
        window: lambda: simulated(args.recent, 4),
        **{f"{window}, {n} key channels exact": (lambda n=n: simulated(args.recent, 4, n)) for n in args.channels},
    }  # fmt: skip
    rows = quality_rows(model, ids, args.prefix, reference_logits, caches, args.rows)
    own = chosen_energy(load, args.text)  # what the measured text itself would choose
    for n in args.channels:  # how much of each layer's and KV head's E[q^2] E[k^2] its chosen channels hold
        shares = torch.cat([(e.topk(n, dim=-1).values.sum(-1) / e.sum(-1)) for e in energy.values()])
        same = sum((largest_channels(e, n) & largest_channels(own[layer], n)).sum().item()
                   for layer, e in energy.items())  # fmt: skip
        print(f"the {n} chosen channels hold {shares.min():.0%}-{shares.max():.0%} of a KV head's E[q^2] E[k^2] on "
              f"'{args.choose_on}' (median {shares.median():.0%}); {same} of {n * shares.numel()} are the ones "
              f"'{args.text}' would choose")  # fmt: skip
    print_rows(rows, label, args, ids,
               f"per-token-head e4m3 (bf16 scales); channels chosen on {CHOOSE_TOKENS} tokens of '{args.choose_on}'")


if __name__ == "__main__":
    main()
