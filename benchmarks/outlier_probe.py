"""Which tokens beyond the first 4 are worth keeping exact (issue 35, item 2): one prefill of a bundled model with
every layer's K/V stored as per-token-head e4m3 (bf16 scales, as rotation_probe.stored) except the tokens kept
exact, against exact attention. The rows of docs/recent.md's "Outlier tokens beyond the sinks" paragraph.

Kept exact: the first `--sinks` tokens (what the cache keeps today) and, per layer and per KV head, at most N more,
each token's fate decided when it is written from its own key and the keys before it. Its score is its key's norm
over the running mean of that norm over the non-sink tokens up to it, and the rules keep:

- the largest key L2 norms: a per-token-head scale gives every key the same relative error, so the largest keys
  carry the largest absolute error in their scores;
- the smallest key L1 norms: the rule of Outlier Tokens Tracing (Su et al., ACL 2025, arXiv:2505.10938: a token's
  S_i = ||K_i||_1, and the tokens of lowest S_i in each quantization group go to a full-precision outlier pool);
  OTT pairs it with per-channel key quantization, whose ranges those tokens stretch;
- random scores, the control: whether the rule matters or only the count (`--seeds` of them, averaged);
- the first 4 + N tokens: more sinks, no rule.

The set is a running top-N of the scores: a token enters when it outscores the weakest kept one, which is then
quantized (its exact K/V still at hand), so a cache needs N slots per layer and head and no threshold to tune;
query t reads the set as it stood when token t was written. (A "first N over a threshold" set is as bounded, but
fills up on whatever comes first and needs a threshold per model.) KVSink (Su and Yuan, arXiv:2508.04257) predicts
sinks from the massive activations in one layer's residual stream, not from K/V: a cache that sees only K/V cannot
apply it, so it is not measured here.

`--recent R` keeps each query's R newest keys exact too, as the cache does (R = 128 by default there); a token
then enters the race when it leaves the window, when the cache would quantize it.

Columns: mean and p99 KL and top-1 agreement against exact attention; "exact attention on kept", the share of the
exact attention (mean over layers, KV heads and queries) on the sinks and outliers the last query reads exact,
which says whether a rule finds sink-like tokens. Then the positions each rule keeps most often, with their tokens.

    python benchmarks/outlier_probe.py --model gemma3 --text code
    python benchmarks/outlier_probe.py --model gemma3 --text code --recent 128
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from dataclasses import dataclass, fields

import torch
from transformers import AttentionInterface

from hf_fp8kv.evaluate import Quality, quality
from hf_fp8kv.kernels import reference
from hf_fp8kv.table import format_table
from recent_quality import MODELS, TEXTS
from rotation_probe import prefill, quality_columns, stored

NORMS = {"largest key L2 norm": (2, 1.0), "smallest key L1 norm (OTT)": (1, -1.0)}  # rule: (norm order, sign)


def scores(key: torch.Tensor, rule: str, sinks: int, seed: int) -> torch.Tensor:
    """Write-time scores `[kv_heads, length]` of a layer's keys `[1, kv_heads, length, D]` (the highest are kept
    first); -inf on the sinks, which are kept anyway and left out of the running mean."""
    key = key[0].float()
    if rule == "random":
        score = torch.rand(key.shape[:2], generator=torch.Generator().manual_seed(seed))
    else:
        order, sign = NORMS[rule]
        norm = key.norm(p=order, dim=-1)
        running = norm.cumsum(-1) - norm[:, :sinks].sum(-1, keepdim=True)
        score = sign * norm / (running / torch.arange(1 - sinks, key.shape[1] - sinks + 1)).clamp(min=1e-30)
    score[:, :sinks] = -math.inf
    return score


def kept(score: torch.Tensor, count: int, recent: int) -> torch.Tensor:
    """`[kv_heads, query, key]`: whether query t reads key j exact, j being among the `count` best scores of the
    tokens up to t - `recent` (a running top-`count` of the tokens out of the recent window, so decided when the
    cache quantizes them: j leaves the set once `count` later tokens outscore it)."""
    outscored = (score[:, :, None] > score[:, None, :]).cumsum(1)  # [h, t, j]: tokens i <= t scoring above j
    heads, length = score.shape
    visible = torch.ones(length, length, dtype=torch.bool).tril()
    keep = (outscored < count) & visible & score.isfinite()[:, None, :]
    return torch.cat([torch.zeros(heads, recent, length, dtype=torch.bool), keep[:, : length - recent]], dim=1)


@dataclass(frozen=True)
class Setting:
    """The tokens kept exact: the first `sinks`, and `count` more per layer and KV head by `rule`."""

    sinks: int = 0
    count: int = 0
    rule: str | None = None
    seed: int = 0
    recent: int = 0  # and each query's newest keys (itself included): the cache's recent window

    @property
    def name(self) -> str:
        recent = f"recent {self.recent} + " if self.recent else ""
        if not self.sinks and not self.count:
            return recent + "sinks 0" if self.recent else "none (pure FP8)"
        return recent + f"sinks {self.sinks}" + (f" + {self.count}, {self.rule}" if self.count else "")

    def chosen(self, key: torch.Tensor, layer: int) -> torch.Tensor:
        """`[kv_heads, query, key]`: whether each query reads each key exact as a sink or an outlier."""
        heads, length = key.shape[1], key.shape[2]
        if self.count:
            score = scores(key, self.rule, self.sinks, seed=self.seed * 1000 + layer)
            chosen = kept(score, self.count, min(self.recent, length))
        else:
            chosen = torch.zeros(heads, length, length, dtype=torch.bool)
        chosen[..., : self.sinks] = True
        return chosen

    def window(self, length: int) -> torch.Tensor:
        """`[query, key]`: whether each key is among the query's `recent` newest."""
        return torch.ones(length, length, dtype=torch.bool).tril().triu(1 - self.recent)


def attention_mass(query: torch.Tensor, key: torch.Tensor, scaling: float, mask: torch.Tensor) -> torch.Tensor:
    """`[kv_heads, length]`: each key's share of its layer's exact attention, over the queries and the query heads
    of its KV head."""
    group = query.shape[1] // key.shape[1]
    logits = query.float() @ key.float().repeat_interleave(group, 1).transpose(-1, -2) * scaling
    probs = torch.softmax(logits.masked_fill(~mask, -math.inf), dim=-1)[0]
    return probs.mean(1).unflatten(0, (key.shape[1], group)).mean(1)


class Probe:
    """An attention function (transformers' interface): exact attention while `setting` is None (recording each
    layer's attention mass), else K/V stored as e4m3 but for the tokens `setting` keeps exact (recording the set
    the last query reads)."""

    def __init__(self) -> None:
        self.setting: Setting | None = None
        self.mass: dict[int, torch.Tensor] = {}
        self.final: dict[int, torch.Tensor] = {}  # layer: [kv_heads, length] kept for the last query

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                 **kwargs):  # fmt: skip
        layer, length = module.layer_idx, query.shape[2]
        causal = reference.causal_mask(length, length, sliding_window, query.device)
        if self.setting is None:
            self.mass[layer] = attention_mass(query, key, scaling, causal)
            mask = causal
        else:
            chosen = self.setting.chosen(key, layer)
            self.final[layer] = chosen[:, -1]
            exact = chosen | self.setting.window(length)
            # each key twice, stored then exact; the mask lets each query see one of the two
            mask = torch.cat([causal & ~exact, causal & exact], dim=-1)
            mask = mask.repeat_interleave(query.shape[1] // key.shape[1], 0)[None]
            key = torch.cat([stored(key, None), key.float()], dim=2)
            value = torch.cat([stored(value, None), value.float()], dim=2)
        out = reference.attention(query, key, value, scaling=scaling, mask=mask, softcap=kwargs.get("softcap"))
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def share_kept(self) -> float:
        """Mean over layers and KV heads of the exact attention mass on the sinks and outliers the last query
        reads exact."""
        shares = [(self.mass[layer] * kept).sum(-1).mean() for layer, kept in self.final.items()]
        return torch.stack(shares).mean().item()

    def kept_tokens(self) -> Counter:
        """How many (layer, KV head) sets the last query reads hold each position."""
        return Counter(torch.cat([kept.nonzero()[:, 1] for kept in self.final.values()]).tolist())


def average(qualities: list[Quality]) -> Quality:
    """The metrics averaged over runs (the random control's seeds)."""
    if len(qualities) == 1:
        return qualities[0]
    means = {f.name: sum(getattr(q, f.name) for q in qualities) / len(qualities) for f in fields(Quality)[:-1]}
    return Quality(**means, first_flip=None)


def settings(sinks: int, counts: list[int], seeds: int, recent: int) -> list[list[Setting]]:
    """The rows, each a list of settings whose metrics are averaged (the random control's seeds)."""
    rows = [[Setting(recent=recent)], [Setting(sinks, recent=recent)]]
    for count in counts:
        rows.append([Setting(sinks + count, recent=recent)])
        rows += [[Setting(sinks, count, rule, recent=recent)] for rule in NORMS]
        rows.append([Setting(sinks, count, "random", seed, recent) for seed in range(seeds)])
    return rows


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--text", default="code", help=f"one of {sorted(TEXTS)}")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--recent", type=int, default=0, help="each query's newest keys kept exact too (cache: 128)")
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32], help="N: outlier tokens kept")
    parser.add_argument("--seeds", type=int, default=3, help="random control: sets drawn, averaged")
    parser.add_argument("--show", type=int, default=12, help="positions listed per rule (at the smallest N)")
    args = parser.parse_args()
    label, load = MODELS[args.model]
    model, tokenizer = load()
    probe = Probe()
    AttentionInterface.register("fp8kv_outlier_probe", probe)
    model.set_attn_implementation("fp8kv_outlier_probe")
    reference_logits, targets = prefill(model, tokenizer, args.text, args.tokens)
    rows, picked, spread = [], {}, []
    for row in settings(args.sinks, args.counts, args.seeds, args.recent):
        runs = []
        for setting in row:
            probe.setting = setting
            q = quality(reference_logits, prefill(model, tokenizer, args.text, args.tokens)[0], targets)
            runs.append((q, probe.share_kept()))
            if setting.rule and setting.count == min(args.counts) and setting.seed == 0:
                picked[setting.rule] = probe.kept_tokens()
        name = row[0].name + (f" (mean of {len(row)} seeds)" if len(row) > 1 else "")
        q, share = average([q for q, _ in runs]), sum(share for _, share in runs) / len(runs)
        if len(runs) > 1:
            spread.append(f"N={row[0].count}: " + " ".join(f"{q.kl_mean:.2e}" for q, _ in runs))
        rows.append({"kept exact": name} | quality_columns(q) | {"exact attention on kept": f"{share:.3f}"})
        print(rows[-1], flush=True)
    print(f"{label}, {len(targets) + 1} tokens of '{args.text}', one prefill; every layer's K/V per-token-head e4m3 "
          f"(bf16 scales) but the tokens kept exact (per layer and KV head), against exact attention"
          + (f"; each query's {args.recent} newest keys exact too" if args.recent else ""))  # fmt: skip
    print(format_table(rows))
    print("random control, KL mean per seed:", "; ".join(spread))
    tokens = [None] + targets.tolist()  # the first token is a sink: never listed
    slots = len(probe.final) * next(iter(probe.final.values())).shape[0]
    for rule, counts in picked.items():
        top = [(position, count) for position, count in counts.most_common() if position >= args.sinks]
        listed = ", ".join(f"{position} {tokenizer.decode([tokens[position]])!r} {count}/{slots}"
                           for position, count in top[: args.show])  # fmt: skip
        print(f"sinks {args.sinks} + {min(args.counts)}, {rule}: position, token, (layer, KV head) sets holding it: "
              f"{listed}")  # fmt: skip


if __name__ == "__main__":
    main()
