"""Keys centred per block of positions before they are coded, in decode mode: the prototype of issue 35's
block-centred codes, in torch, against DynamicCache.

Each block of `--block` positions' keys (after RoPE, as the cache receives them) is coded less a centre, one per
block and KV head, which is added back when the keys are read (a kernel would add q.centre to the scores of each
KV tile). The centre follows the positions, so RoPE turning a shared offset from block to block costs nothing.
Which centre a block gets, and when its keys are coded:

- `own`: the block's own mean key (a block's mean leaves out the sinks, which are never coded). Its keys can only
  be coded once the block is complete; until then they are read exact, as the default window holds its newest
  tokens. With a window of at least one block every coded token's block is complete, so this costs the window
  nothing; pure FP8 becomes a window of 0-63 tokens ("newest partial block exact" is that window alone).
- `previous`: the mean of the block before (block 0: its own, which the prefix holds), so that every token is
  coded when it is written and pure FP8 stays pure. A cache needs only a running sum of the block's exact keys.
- `previous turned`: the same mean turned by RoPE's rotation over one block of positions (each channel pair's
  angle `inv_freq * block`, from the model's rotary embedding). A key offset that RoPE turns with the position,
  averaged over a block, is the previous block's average turned so; the plain previous mean lags it.

"Where it lowers their scale": a token is centred only where `max|k - c| < max|k|` (its per-token-head scale
drops; "L2 norm": `|k - c| < |k|`, FP8's rounding error being relative per element), one bit per token and KV
head beside its scale; the other tokens are coded as they are, and a kernel adds q.c back only to the centred
ones' scores.

Every row is simulated here (per-token-head e4m3 under a bf16 scale, as the cache stores it) except the library's
own rows, which check the simulation: "pure FP8" must match `QuantizedFP8Cache(recent_tokens=0, sink_tokens=0)`,
"recent R + sinks S" the library's window. A probe, not a cache option.

    python benchmarks/block_centring_probe.py --model gemma3 --tokens 640
    python benchmarks/block_centring_probe.py --model smollm2 --text sample
"""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.evaluate import decode_mode_logits, quality
from hf_fp8kv.table import format_table
from centring_probe import rope_inv_freq
from recent_quality import MODELS, decode_probe_parser, decode_reference
from rotation_probe import quality_columns, stored


class SimulatedCodes(DynamicCache):
    """DynamicCache whose `update` returns K/V as an FP8 cache would read them back: tokens older than the newest
    `recent` and not among the first `sinks` (full-attention layers) are coded; keys (and values with
    `centre_values`) less their block's centre (`centre`: None, "own", "previous" or "previous turned"), with
    `choose` ("amax" or "l2") only where that lowers the token's amax (its scale) or L2 norm. With `hold_partial`
    (implied by "own") the newest partial block stays exact. `coded`: "keys" or "values" alone (the other read
    exact), in the layers `coded_layers` (default: all)."""

    def __init__(self, model, recent: int, sinks: int, block: int, centre: str | None = None,
                 centre_values: bool = False, hold_partial: bool = False,
                 choose: str | None = None, rotate: bool = False, coded_centre: bool = False,
                 exact_channels: dict[int, torch.Tensor] | None = None, coded: str = "keys and values",
                 coded_layers: set[int] | None = None) -> None:  # fmt: skip
        super().__init__(config=model.config)
        text_config = model.config.get_text_config(decoder=True)
        types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
        self.sinks = [sinks if kind == "full_attention" else 0 for kind in types]
        self.recent, self.centre, self.block, self.centre_values = recent, centre, block, centre_values
        self.hold_partial = hold_partial or centre == "own"
        self.choose, self.coded_centre, self.exact_channels = choose, coded_centre, exact_channels or {}
        self.rotation = text_config.head_dim if rotate else None
        self.coded, self.coded_layers = coded, coded_layers
        self.inv_freq = rope_inv_freq(model)
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        held = self.history.get(layer_idx)
        all_keys = key_states if held is None else torch.cat([held[0], key_states], dim=2)
        all_values = value_states if held is None else torch.cat([held[1], value_states], dim=2)
        self.history[layer_idx] = (all_keys, all_values)
        length, window = all_keys.shape[2], keys.shape[2]
        layer_coded = self.coded_layers is None or layer_idx in self.coded_layers
        read_keys, read_values = all_keys, all_values
        if layer_coded and self.coded != "values":
            read_keys = self.read(all_keys, layer_idx, self.centre, self.exact_channels.get(layer_idx))
        if layer_coded and self.coded != "keys":
            read_values = self.read(all_values, layer_idx, self.centre if self.centre_values else None)
        return read_keys[:, :, length - window :], read_values[:, :, length - window :]

    def read(self, x: torch.Tensor, layer: int, centre: str | None, exact: torch.Tensor | None = None) -> torch.Tensor:
        """All of `x` `[batch, heads, positions, dim]` as read back after coding, the channels `exact` marks (bool
        `[heads, dim]`) left out of the codes."""
        length = x.shape[2]
        coded_end = max(length - self.recent, 0)
        if self.hold_partial:
            coded_end = min(coded_end, length // self.block * self.block)
        out = x.clone()
        start = min(self.sinks[layer], coded_end)
        if coded_end > start:
            centres = self.centres(x, layer, centre)
            if centres is not None and self.coded_centre:  # a centre held as e4m3 codes under its own scale
                centres = stored(centres, None)
            coded = slice(start, coded_end)
            read = stored(x[:, :, coded], self.rotation, None if centres is None else centres[:, :, coded], exact)
            if self.choose and centres is not None:  # centred only where it lowers the token's amax or L2 norm
                norm = dict(amax=torch.inf, l2=2)[self.choose]
                plain = x[:, :, coded].float().norm(p=norm, dim=-1, keepdim=True)
                centred = (x[:, :, coded].float() - centres[:, :, coded]).norm(p=norm, dim=-1, keepdim=True)
                read = torch.where(centred < plain, read, stored(x[:, :, coded], self.rotation))
            out[:, :, coded] = read.to(x.dtype)
        return out

    def centres(self, x: torch.Tensor, layer: int, centre: str | None) -> torch.Tensor | None:
        """Each position's centre `[batch, heads, positions, dim]`, fp32 (None: no centre). A block's mean leaves
        out the sinks, which are never coded."""
        if centre is None:
            return None
        blocks = x.float().split(self.block, dim=2)
        sinks = self.sinks[layer]
        means = [(b[:, :, sinks:] if i == 0 and sinks < b.shape[2] else b).mean(2, keepdim=True)
                 for i, b in enumerate(blocks)]  # fmt: skip
        if centre != "own":
            means = means[:1] + [self.turn(m, layer) if centre == "previous turned" else m for m in means[:-1]]
        return torch.cat([m.expand_as(b) for m, b in zip(means, blocks)], dim=2)

    def turn(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """`x` turned by RoPE's rotation over `block` positions (rotate_half's layout: pair i is channels i and
        i + d/2)."""
        angle = self.inv_freq[layer] * self.block
        cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([angle.sin(), angle.sin()])
        return x * cos + rotate_half(x) * sin


def quality_rows(model, ids: torch.Tensor, prefix: int, reference: torch.Tensor, caches: dict, indices) -> list[dict]:
    """Each cache factory's decode-mode quality against the `reference` logits (the rows `indices` name; every row
    when empty), each printed as it comes."""
    rows = []
    for index, (name, cache) in enumerate(caches.items()):
        if indices and index not in indices:
            continue
        q = quality(reference, decode_mode_logits(model, ids, prefix, cache()), ids[0, prefix:])
        rows.append({"K/V": name} | quality_columns(q) | {"ppl delta": f"{q.ppl_delta_pct:+.2f}%"})
        print(index, rows[-1], flush=True)
    return rows


def print_rows(rows: list[dict], label: str, args, ids: torch.Tensor, details: str) -> None:
    """The rows' table under its heading: the model (`label`), the text and its tokens, what the rows simulate."""
    print(f"{label}, '{args.text}' ({ids.shape[1]} tokens, {args.prefix} prefilled), decode mode against "
          f"DynamicCache; {details}")  # fmt: skip
    print(format_table(rows))


@torch.inference_mode()
def main() -> None:
    parser = decode_probe_parser(__doc__, window_rows=True)
    parser.add_argument("--block", type=int, default=64, help="positions per centred block")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    label, load = MODELS[args.model]
    model, tokenizer = load(dtype=torch.float32)
    ids, reference = decode_reference(model, tokenizer, args)
    window = f"recent {args.recent} + sinks 4"

    def simulated(recent: int, sinks: int, **kwargs) -> SimulatedCodes:
        return SimulatedCodes(model, recent, sinks, args.block, **kwargs)

    caches = {
        "pure FP8 (the library)": lambda: QuantizedFP8Cache(model, scales="dynamic", recent_tokens=0, sink_tokens=0),
        "pure FP8": lambda: simulated(0, 0),
        "pure FP8, keys less the previous block's mean": lambda: simulated(0, 0, centre="previous"),
        "pure FP8, keys less the previous block's mean turned by RoPE":
            lambda: simulated(0, 0, centre="previous turned"),
        "pure FP8, keys less the previous block's mean turned by RoPE, where it lowers their scale":
            lambda: simulated(0, 0, centre="previous turned", choose="amax"),
        "pure FP8, keys and values less the previous block's mean":
            lambda: simulated(0, 0, centre="previous", centre_values=True),
        "pure FP8, newest partial block exact": lambda: simulated(0, 0, hold_partial=True),
        "pure FP8, newest partial block exact, keys less their block's mean": lambda: simulated(0, 0, centre="own"),
        "the same, values too": lambda: simulated(0, 0, centre="own", centre_values=True),
        f"{window} (the library)": lambda: QuantizedFP8Cache(model, scales="dynamic", recent_tokens=args.recent,
                                                             sink_tokens=4),
        window: lambda: simulated(args.recent, 4),
        f"{window}, keys less their block's mean": lambda: simulated(args.recent, 4, centre="own"),
        f"{window}, keys less their block's mean, where it lowers their scale":
            lambda: simulated(args.recent, 4, centre="own", choose="amax"),
        f"{window}, keys less the previous block's mean turned by RoPE":
            lambda: simulated(args.recent, 4, centre="previous turned"),
        f"{window}, keys and values less their block's mean":
            lambda: simulated(args.recent, 4, centre="own", centre_values=True),
        "pure FP8, keys less the previous block's mean turned by RoPE, where it lowers their L2 norm":
            lambda: simulated(0, 0, centre="previous turned", choose="l2"),
        f"{window}, keys less their block's mean, where it lowers their L2 norm":
            lambda: simulated(args.recent, 4, centre="own", choose="l2"),
        "pure FP8, keys less the previous block's mean turned by RoPE, where it lowers their scale, the centre "
        "held as e4m3": lambda: simulated(0, 0, centre="previous turned", choose="amax", coded_centre=True),
        "pure FP8, rotated": lambda: simulated(0, 0, rotate=True),
        "pure FP8, rotated, keys less the previous block's mean turned by RoPE, where it lowers their scale":
            lambda: simulated(0, 0, centre="previous turned", choose="amax", rotate=True),
    }  # fmt: skip
    rows = quality_rows(model, ids, args.prefix, reference, caches, args.rows)
    print_rows(rows, label, args, ids, f"per-token-head e4m3 (bf16 scales), blocks of {args.block} positions")


if __name__ == "__main__":
    main()
