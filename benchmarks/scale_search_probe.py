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
  (`--weights-text`); in `--mode decode` as `--decode-weights` says (`DECODE_WEIGHTS`): the prompt's, another
  text's, or a running mean of every query the layer saw.

Values take `mse` where a row says so (their error reaches the output as `sum_t p_t e_t`, unweighted).

`--mode prefill`: one prefill of `--tokens` tokens, every layer's K/V read back as stored, against the exact
model (as `rotation_probe.py`). `--mode decode`: the prompt prefilled, then every later token one at a time,
against DynamicCache; each token coded once, when it leaves the `--recent` newest tokens (the first `--sinks`
stay exact), under the query weights of that moment, as a cache would write it. A probe, not a cache option.

    python benchmarks/scale_search_probe.py --model gemma3 --mode prefill --tokens 512
    python benchmarks/scale_search_probe.py --model gemma3 --mode decode --tokens 640 --rows 0 2 4
    python benchmarks/scale_search_probe.py --model gemma3 --tokens 1152 --decode-weights running --rows 0 5
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
# decode mode's query weights: where they come from, and when a token is coded against them
DECODE_WEIGHTS = {
    "prompt": "the prompt's queries (its tokens coded after its attention)",
    "text": "the queries of --weights-text's prefill",
    "running": "a running mean of every query the layer saw before the token was coded (the prompt's own tokens "
               "coded before its attention: unweighted)",
    "running-deferred": "a running mean of every query the layer saw, the coding token's step included (the "
                         "write in the attention launch)",
}


def searched(x: torch.Tensor, steps: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[batch, kv_heads, positions, head_dim]` as read back from e4m3 codes under each row's searched scale
    (`weight` `[1, kv_heads, 1, head_dim]`: the channels' weights, else 1)."""
    x = x.float()
    amax_scale = reference.dynamic_scale(x, FORMAT, torch.bfloat16)[..., None]
    best = best_error = None
    for i in range(steps):
        scale = reference.round_up_to_bf16((amax_scale * 2 ** (i / steps)).contiguous())
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
    and channel, then attends in fp32 (`reference.attention`).

    Recorded: with `running`, every query the layer sees (a running mean); else the first call with more than one
    query (a prefill) only. With `setting` (prefill mode) it reads K/V back as stored first. With `cache` (decode
    mode, a `CodedOnce`) it attends to the cache's tokens as stored, coded by `cache.code` here, once each: with
    `deferred` after this call's queries are recorded (a write in the attention launch), else before (a write by
    the cache's update, before the attention)."""

    def __init__(self, running: bool = False, deferred: bool = False) -> None:
        self.sums: dict[int, tuple[torch.Tensor, int]] = {}
        self.setting: tuple | None = None
        self.cache: CodedOnce | None = None
        self.recording, self.running, self.deferred = True, running, deferred

    @property
    def weights(self) -> dict[int, torch.Tensor]:
        return {layer: total / count for layer, (total, count) in self.sums.items()}

    def _record(self, layer: int, query: torch.Tensor, kv_heads: int) -> None:
        if not self.recording or (not self.running and (layer in self.sums or query.shape[2] == 1)):
            return
        squares = (query.float() ** 2).unflatten(1, (kv_heads, -1))
        total, count = self.sums.get(layer, (0.0, 0))
        self.sums[layer] = (total + squares.sum((0, 2, 3))[None, :, None], count + squares[0, 0, :, :, 0].numel())

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                 **kwargs):  # fmt: skip
        layer = module.layer_idx
        if self.cache is not None and not self.deferred:
            key, value = self.cache.code(layer, key.shape[2], self.weights.get(layer))
        self._record(layer, query, key.shape[1])
        if self.cache is not None and self.deferred:
            key, value = self.cache.code(layer, key.shape[2], self.weights.get(layer))
        if self.setting is not None:
            key_error, value_error, steps = self.setting
            key = read_back(key, key_error, steps, self.weights.get(layer))
            value = read_back(value, value_error, steps, None)
        mask = reference.causal_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        out = reference.attention(query, key, value, scaling=scaling, mask=mask, softcap=kwargs.get("softcap"))
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


class CodedOnce(DynamicCache):
    """DynamicCache (which keeps the exact K/V, sliding layers as transformers does) beside each layer's tokens as
    the FP8 cache would read them back: a token is coded once, when it leaves the newest `recent` tokens, under
    the layer's query weights of that moment (`code`); the first `sinks` tokens and the newest `recent` stay
    exact."""

    def __init__(self, model, setting: tuple, recent: int = 0, sinks: int = 0) -> None:
        super().__init__(config=model.config)
        self.setting, self.recent, self.sinks = setting, recent, sinks
        self.exact: dict[int, list[torch.Tensor]] = {}  # layer -> [keys, values] `[1, kv_heads, t, head_dim]`
        self.read: dict[int, list[torch.Tensor]] = {}  # layer -> the coded tokens, read back

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        exact = self.exact.setdefault(layer_idx, [key_states[:, :, :0], value_states[:, :, :0]])
        exact[:] = [torch.cat((held, new), 2) for held, new in zip(exact, (key_states, value_states))]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def code(self, layer: int, length: int, weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's last `length` tokens as stored, after coding those that left the recent tokens."""
        exact = self.exact[layer]
        read = self.read.setdefault(layer, [exact[0][:, :, :0], exact[1][:, :, :0]])
        total, coded = exact[0].shape[2], read[0].shape[2]
        leaving = max(total - self.recent, coded)
        if leaving > coded:
            key_error, value_error, steps = self.setting
            key_error = "mse" if key_error == "query" and weight is None else key_error
            new = [x[:, :, coded:leaving] for x in exact]
            new = [read_back(new[0], key_error, steps, weight), read_back(new[1], value_error, steps, None)]
            read[:] = [torch.cat((held, x), 2) for held, x in zip(read, new)]
        sinks = min(self.sinks, leaving)
        stored = [torch.cat((x[:, :, :sinks], r[:, :, sinks:], x[:, :, leaving:]), 2) for x, r in zip(exact, read)]
        return stored[0][:, :, -length:], stored[1][:, :, -length:]


@torch.inference_mode()
def main() -> None:
    parser = decode_probe_parser(__doc__)
    parser.add_argument("--mode", choices=("prefill", "decode"), default="decode")
    parser.add_argument("--weights-text", default="sample", help="the text the query weights come from (prefill "
                        "mode; decode mode with --decode-weights text)")
    parser.add_argument("--decode-weights", choices=DECODE_WEIGHTS, nargs="+", default=["prompt"],
                        help="decode mode, each in turn: " + "; ".join(f"{k}: {v}" for k, v in DECODE_WEIGHTS.items()))
    parser.add_argument("--recent", type=int, default=0, help="decode mode: the newest tokens kept exact")
    parser.add_argument("--sinks", type=int, default=0, help="decode mode: the first tokens kept exact")
    parser.add_argument("--rows", type=int, nargs="*", help="the rows to run, by index (default: all)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    label, load = MODELS[args.model]
    model, tokenizer = load(dtype=torch.float32)
    attention = QueryWeights()
    AttentionInterface.register("fp8kv_scale_search_probe", attention)
    model.set_attn_implementation("fp8kv_scale_search_probe")
    modes = args.decode_weights if args.mode == "decode" else ["text"]
    text_sums = {}
    if "text" in modes:
        prefill(model, tokenizer, args.weights_text, args.tokens)
        text_sums = dict(attention.sums)
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
        for mode in modes if setting[0] == "query" else modes[:1]:
            attention.sums = dict(text_sums) if mode == "text" else {}
            attention.recording = mode != "text"
            attention.running, attention.deferred = mode.startswith("running"), mode in ("prompt", "running-deferred")
            if args.mode == "prefill":
                attention.setting = setting
                logits = prefill(model, tokenizer, args.text, args.tokens)[0]
                attention.setting = None
            else:
                attention.cache = CodedOnce(model, setting, args.recent, args.sinks)
                logits = decode_mode_logits(model, ids, args.prefix, attention.cache)
                attention.cache = None
            q = quality(reference_logits, logits, targets)
            weights = f", weights: {mode}" if setting[0] == "query" and args.mode == "decode" else ""
            rows.append({"K/V (e4m3, per-token-head bf16 scales)": name + weights} | quality_columns(q)
                        | {"ppl delta": f"{q.ppl_delta_pct:+.2f}%"})  # fmt: skip
            print(index, rows[-1], flush=True)
    if args.mode == "prefill":
        print(f"{label}, '{args.text}' ({args.tokens} tokens), one prefill against the exact model; the query "
              f"weights from '{args.weights_text}'")  # fmt: skip
    else:
        print(f"{label}, '{args.text}' ({args.tokens} tokens), decode mode ({args.prefix} prefilled) against "
              f"DynamicCache, recent {args.recent} + sinks {args.sinks} exact; the query weights:")  # fmt: skip
        for mode in modes:
            print(f"- {mode}: " + DECODE_WEIGHTS[mode].replace("--weights-text", repr(args.weights_text)))
    print(format_table(rows))


if __name__ == "__main__":
    main()
