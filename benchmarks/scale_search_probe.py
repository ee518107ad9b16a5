"""Per-token-head scales searched within one octave, in torch: a lever on pure FP8's quality that only the write
would change (issue 35's pure-FP8 target), against exact attention.

A per-token-head scale `amax / 448` maps the row's largest element to e4m3's largest code exactly and leaves the
rest where they fall on the 3-bit mantissa grid. Any scale in `[s, 2s)` also keeps the row in range and moves
every element's rounding. Here each row's scale is chosen among `s * 2^(i / steps)`, `i < steps` (each rounded up
to bf16, as the cache stores scales), as the one with the least error:

- `mse`: the sum of squared errors of the row;
- `query`: the same, each channel weighted by the queries' mean square on it (per layer and KV head): the error
  a key adds to `q.k` is `sum_c q_c e_c`, whose mean square over queries is about `sum_c E[q_c^2] e_c^2`.
  The weights come from other queries than the ones measured: in `--mode prefill` another text's prefill
  (`--weights-text`), in `--mode decode` the prompt's own (the `--prefix` tokens' queries, which a cache sees
  in its prefill's attention).

Values take `mse` where a row says so (their error reaches the output as `sum_t p_t e_t`, unweighted).

`--mode prefill`: one prefill of `--tokens` tokens, every layer's K/V read back as stored, against the exact
model (as `rotation_probe.py`). `--mode decode`: the prompt prefilled, then every later token one at a time, the
whole past read back as stored at every step, against DynamicCache (as `block_centring_probe.py`). A probe, not a
cache option.

    python benchmarks/scale_search_probe.py --model gemma3 --mode prefill --tokens 512
    python benchmarks/scale_search_probe.py --model gemma3 --mode decode --tokens 640 --rows 0 2 4
"""

from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface, DynamicCache

from hf_fp8kv.evaluate import decode_mode_logits, quality
from hf_fp8kv.kernels import reference
from hf_fp8kv.table import format_table
from recent_quality import MODELS, TEXTS, decode_probe_parser
from rotation_probe import FORMAT, prefill, quality_columns, stored

# name: (keys' error, values' error, candidates per octave); None: the plain amax scale
ROWS = {
    "pure FP8 (amax scales)": (None, None, 1),
    "keys searched (mse), 8 per octave": ("mse", None, 8),
    "keys and values searched (mse), 8 per octave": ("mse", "mse", 8),
    "keys and values searched (mse), 16 per octave": ("mse", "mse", 16),
    "keys searched against the queries' weights, values (mse), 8 per octave": ("query", "mse", 8),
    "keys searched against the queries' weights, values (mse), 16 per octave": ("query", "mse", 16),
}


def round_up_to_bf16(scale: torch.Tensor) -> torch.Tensor:
    held = scale.to(torch.bfloat16)
    return torch.where(held.float() < scale, torch.nextafter(held, torch.full_like(held, torch.inf)), held).float()


def searched(x: torch.Tensor, steps: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[batch, kv_heads, positions, head_dim]` as read back from e4m3 codes under each row's searched scale
    (`weight` `[1, kv_heads, 1, head_dim]`: the channels' weights, else 1)."""
    x = x.float()
    amax_scale = reference.dynamic_scale(x, FORMAT, torch.bfloat16)[..., None]
    best = best_error = None
    for i in range(steps):
        scale = round_up_to_bf16(amax_scale * 2 ** (i / steps))
        read = reference.dequantize(reference.quantize(x, scale, FORMAT)[0], scale, FORMAT)
        error = ((x - read) ** 2 * (1.0 if weight is None else weight)).sum(-1, keepdim=True)
        if best is None:
            best, best_error = read, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, read, best), torch.where(better, error, best_error)
    return best


def read_back(x: torch.Tensor, error: str | None, steps: int, weight: torch.Tensor | None) -> torch.Tensor:
    if error is None:
        return stored(x, None).to(x.dtype)
    return searched(x, steps, weight if error == "query" else None).to(x.dtype)


class QueryWeights:
    """An attention function (transformers' interface) that records each layer's mean square query per KV head
    and channel from the first call with more than one query (a prefill), then attends; with
    `setting` (prefill mode) it reads K/V back as stored first. Attention in fp32 (`reference.attention`)."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}
        self.setting: tuple | None = None
        self.recording = True

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                 **kwargs):  # fmt: skip
        layer = module.layer_idx
        if self.recording and layer not in self.weights and query.shape[2] > 1:
            group = query.shape[1] // key.shape[1]
            squares = (query.float() ** 2).unflatten(1, (key.shape[1], group))
            self.weights[layer] = squares.mean((0, 2, 3))[None, :, None]
        if self.setting is not None:
            key_error, value_error, steps = self.setting
            key = read_back(key, key_error, steps, self.weights.get(layer))
            value = read_back(value, value_error, steps, None)
        mask = reference.causal_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        out = reference.attention(query, key, value, scaling=scaling, mask=mask, softcap=kwargs.get("softcap"))
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


class SearchedCodes(DynamicCache):
    """DynamicCache whose `update` returns the whole past as read back from codes under searched scales (decode
    mode; the keys' weights: `weights`' for the layer once recorded, else `mse`)."""

    def __init__(self, model, setting: tuple, weights: dict[int, torch.Tensor]) -> None:
        super().__init__(config=model.config)
        self.setting, self.weights = setting, weights

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        key_error, value_error, steps = self.setting
        weight = self.weights.get(layer_idx)
        key_error = "mse" if key_error == "query" and weight is None else key_error
        return read_back(keys, key_error, steps, weight), read_back(values, value_error, steps, None)


@torch.inference_mode()
def main() -> None:
    parser = decode_probe_parser(__doc__)
    parser.add_argument("--mode", choices=("prefill", "decode"), default="decode")
    parser.add_argument("--weights-text", default="sample", help="the text the query weights come from (prefill "
                        "mode; decode mode with --decode-weights text)")
    parser.add_argument("--decode-weights", choices=("prompt", "text"), default="prompt",
                        help="decode mode: the weights from the prompt's queries, or from --weights-text's prefill")
    parser.add_argument("--rows", type=int, nargs="*", help="the rows to run, by index (default: all)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    label, load = MODELS[args.model]
    model, tokenizer = load(dtype=torch.float32)
    attention = QueryWeights()
    AttentionInterface.register("fp8kv_scale_search_probe", attention)
    model.set_attn_implementation("fp8kv_scale_search_probe")
    if args.mode == "prefill" or args.decode_weights == "text":
        prefill(model, tokenizer, args.weights_text, args.tokens)
        attention.recording = False
    if args.mode == "prefill":
        reference_logits, targets = prefill(model, tokenizer, args.text, args.tokens)
    else:
        ids = tokenizer(TEXTS[args.text](), return_tensors="pt").input_ids[:, : args.tokens]
        targets = ids[0, args.prefix :]
        reference_logits = decode_mode_logits(model, ids, args.prefix, DynamicCache(config=model.config))
    rows = []
    for index, (name, setting) in enumerate(ROWS.items()):
        if args.rows and index not in args.rows:
            continue
        if args.mode == "prefill":
            attention.setting = setting
            logits = prefill(model, tokenizer, args.text, args.tokens)[0]
            attention.setting = None
        else:
            if attention.recording:
                attention.weights.clear()  # the prompt's queries, recorded in this run's prefill
            logits = decode_mode_logits(model, ids, args.prefix, SearchedCodes(model, setting, attention.weights))
        q = quality(reference_logits, logits, targets)
        rows.append({"K/V (e4m3, per-token-head bf16 scales)": name} | quality_columns(q)
                    | {"ppl delta": f"{q.ppl_delta_pct:+.2f}%"})  # fmt: skip
        print(index, rows[-1], flush=True)
    weights = "the prompt's queries" if attention.recording else f"the query weights from '{args.weights_text}'"
    against = "one prefill against the exact model" if args.mode == "prefill" else (
        f"decode mode ({args.prefix} prefilled) against DynamicCache")  # fmt: skip
    print(f"{label}, '{args.text}' ({args.tokens} tokens), {against}; {weights}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
