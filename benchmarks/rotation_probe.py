"""Where rotated codes help and where they hurt: one prefill of a bundled model with every layer's keys and values
stored as per-token-head FP8 (bf16 scales, as the cache stores them), rotated or not, against exact attention.
The rows of docs/recent.md's "Which part hurts" paragraph.

Variants: no rotation (and with the keys alone, or the values alone, stored: which of the two the error comes
from); keys and values rotated in Hadamard blocks of 16, 64, ... up to head_dim (the cache's rotation is the
largest); keys only; values only; and the layers chosen by a rounding-error proxy measured on another text
(`--choose-on`): the mean over (query, key) pairs of `sum_i q_i^2 k_i^2` rotated over unrotated, the variance of
q.k's error when each key element is rounded with the same relative error. Above 1, rotating that layer's keys
makes its scores' rounding error larger. Last, the keys centred before they are stored, less a centre that is
added back after: each layer's mean key per KV head and channel over the `--choose-on` text (a score moves by
q.centre, the same for every key of a query, which the softmax cancels), or each block of 64 positions' own mean
key (a kernel would add q.centre back per KV tile). What is rounded is the key's distance from the centre. And the
keys' 1, 2, 4 or 8 channels per KV head of largest `E[q_c^2] E[k_c^2]` on the `--choose-on` text left out of the
codes and their scale, exact (their weight in q.k's error variance; `benchmarks/exact_channels_probe.py` measures
them in decode mode). `--only` runs the rows whose name holds one of its words.

    python benchmarks/rotation_probe.py --model gemma3 --text code --choose-on sample
    python benchmarks/rotation_probe.py --model smollm2 --text code --choose-on sample --only "no rotation" exact
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface

from hf_fp8kv.evaluate import Quality, quality
from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.formats import get_format
from hf_fp8kv.kernels.rotation import hadamard
from hf_fp8kv.table import format_table
from recent_quality import MODELS, TEXTS

FORMAT = get_format("fp8_e4m3")
PAIRS = 256  # (query, key) pairs per layer for the proxy
CENTRE_BLOCK = 64  # positions per block of the block-centred keys (a decode kernel's KV tile)
EXACT_CHANNELS = (1, 2, 4, 8)  # key channels per KV head kept exact (the largest query x key energy)


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` times the block-diagonal Hadamard matrix of `block`-channel blocks (its own inverse)."""
    return hadamard(x.unflatten(-1, (-1, block))).flatten(-2)


def stored(x: torch.Tensor, block: int | None, centre: torch.Tensor | None = None,
           exact: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`x` as the cache would read it back: less `centre`, rotated (`block`), per-token-head e4m3 codes under a
    bf16 scale, rotated back, plus `centre`; the channels `exact` marks (bool `[heads, channels]`) left out of the
    codes and their scale, read as they came."""
    original = x.float()
    x = original if centre is None else original - centre
    if exact is not None:
        x = x.masked_fill(exact[:, None, :], 0.0)
    x = rotate(x, block) if block else x
    scale = reference.dynamic_scale(x, FORMAT, torch.bfloat16)[..., None]
    x = reference.dequantize(reference.quantize(x, scale, FORMAT)[0], scale, FORMAT)
    x = rotate(x, block) if block else x
    x = x if centre is None else x + centre
    return x if exact is None else torch.where(exact[:, None, :], original, x)


def largest_channels(energy: torch.Tensor, count: int) -> torch.Tensor:
    """Bool `[kv_heads, channels]`: each KV head's `count` channels of the largest `energy`."""
    top = energy.topk(count, dim=-1).indices
    return torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, top, True)


def channel_energy(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Per KV head and channel, the mean square query (over the head's query heads and positions) times the mean
    square key: the weight of a channel's relative rounding error in q.k's error variance (`[kv_heads, channels]`)."""
    kv_heads = key.shape[1]
    queries = query.float()[0].square().mean(1).unflatten(0, (kv_heads, -1)).mean(1)
    return queries * key.float()[0].square().mean(1)


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each position's block mean of `x` `[batch, heads, positions, channels]` over blocks of `block` positions
    (the last block: the positions it has)."""
    blocks = x.float().split(block, dim=2)
    return torch.cat([b.mean(2, keepdim=True).expand_as(b) for b in blocks], dim=2)


def quality_columns(q: Quality) -> dict[str, str]:
    """The probes' three quality columns: mean and p99 KL against exact attention, top-1 agreement."""
    return {"KL mean": f"{q.kl_mean:.2e}", "KL p99": f"{q.kl_p99:.2e}", "top-1 agreement": f"{q.top1_agreement:.4f}"}


def proxy(query: torch.Tensor, keys: torch.Tensor) -> float:
    """Rotated over unrotated mean of `sum_i q_i^2 k_i^2` over random (query, earlier key) pairs of the second
    half of the text."""
    q = query.float()[0]
    k = keys.float()[0].repeat_interleave(q.shape[0] // keys.shape[1], 0)
    generator = torch.Generator().manual_seed(0)
    length = q.shape[1]
    rows = torch.randint(length // 2, length, (PAIRS,), generator=generator)
    columns = (torch.rand(PAIRS, generator=generator) * rows).long()
    q, k = q[:, rows], k[:, columns]
    plain, rotated = (q**2 * k**2).sum(-1).mean(), (hadamard(q) ** 2 * hadamard(k) ** 2).sum(-1).mean()
    return (rotated / plain).item()


class Probe:
    """An attention function (transformers' interface) storing K/V as `self.setting` says; records the proxy and
    each layer's mean key `[1, kv_heads, 1, head_dim]`."""

    def __init__(self) -> None:
        # None: exact; else key_block, value_block, layers (None: every layer), optionally exact, centred
        self.setting: dict | None = None
        self.proxies: dict[int, float] = {}
        self.mean_keys: dict[int, torch.Tensor] = {}
        self.energy: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                 **kwargs):  # fmt: skip
        layer, length = module.layer_idx, query.shape[2]
        self.proxies[layer] = proxy(query, key)
        if self.setting is None:
            self.mean_keys[layer] = key.float().mean(2, keepdim=True)
            self.energy[layer] = channel_energy(query, key)
        else:
            chosen = self.setting["layers"] is None or layer in self.setting["layers"]
            exact = self.setting.get("exact", "")  # "keys" / "values": left out of the codes
            centred = self.setting.get("centred")  # None, {layer: mean key} or a block of positions
            centre = block_means(key, centred) if isinstance(centred, int) else (centred[layer] if centred else None)
            channels = self.setting.get("exact_channels")  # None or {layer: bool [kv_heads, head_dim]}
            key = key if exact == "keys" else stored(key, self.setting["key_block"] if chosen else None, centre,
                                                     channels[layer] if channels else None)  # fmt: skip
            value = value if exact == "values" else stored(value, self.setting["value_block"] if chosen else None)
        mask = reference.causal_mask(length, length, sliding_window, query.device)
        out = reference.attention(query, key, value, scaling=scaling, mask=mask, softcap=kwargs.get("softcap"))
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


def prefill(model, tokenizer, text: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits `[tokens - 1, vocab]` of one prefill of the first `tokens` tokens of TEXTS[`text`], and the
    tokens they predict."""
    ids = tokenizer(TEXTS[text](), return_tensors="pt").input_ids[:, :tokens]
    return model(input_ids=ids).logits[0, :-1].float(), ids[0, 1:]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--text", default="code", help=f"one of {sorted(TEXTS)}")
    parser.add_argument("--choose-on", default="sample", help="the text the proxy chooses the rotated layers on")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--only", nargs="*", default=None, help="only the rows whose name contains one of these")
    args = parser.parse_args()
    label, load = MODELS[args.model]
    model, tokenizer = load()
    probe = Probe()
    AttentionInterface.register("fp8kv_rotation_probe", probe)
    model.set_attn_implementation("fp8kv_rotation_probe")

    def logits(text: str, setting: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        probe.setting = setting
        return prefill(model, tokenizer, text, args.tokens)

    logits(args.choose_on, None)
    chosen = sorted(layer for layer, ratio in probe.proxies.items() if ratio < 1)
    mean_keys, energy = dict(probe.mean_keys), dict(probe.energy)
    reference_logits, targets = logits(args.text, None)
    proxies = dict(probe.proxies)
    head_dim = model.config.get_text_config(decoder=True).head_dim
    blocks = [b for b in (16, 64, 128, 256) if b <= head_dim and head_dim % b == 0]
    settings = {"no rotation": dict(key_block=None, value_block=None, layers=None),
                "no rotation, keys alone (values exact)": dict(key_block=None, value_block=None, layers=None,
                                                               exact="values"),
                "no rotation, values alone (keys exact)": dict(key_block=None, value_block=None, layers=None,
                                                               exact="keys")}  # fmt: skip
    settings |= {f"keys and values, blocks of {b}": dict(key_block=b, value_block=b, layers=None) for b in blocks}
    settings |= {
        "keys only": dict(key_block=head_dim, value_block=None, layers=None),
        "values only": dict(key_block=None, value_block=head_dim, layers=None),
        f"layers the proxy chose on '{args.choose_on}'": dict(key_block=head_dim, value_block=head_dim, layers=chosen),
        f"keys centred on their mean over '{args.choose_on}'": dict(key_block=None, value_block=None, layers=None,
                                                                  centred=mean_keys),
        "keys centred, keys and values rotated": dict(key_block=head_dim, value_block=head_dim, layers=None,
                                                     centred=mean_keys),
        f"keys centred per {CENTRE_BLOCK} positions on their mean": dict(key_block=None, value_block=None, layers=None,
                                                                       centred=CENTRE_BLOCK),
    }
    settings |= {
        f"keys' {n} channels of most query x key energy on '{args.choose_on}' exact": dict(
            key_block=None, value_block=None, layers=None,
            exact_channels={layer: largest_channels(e, n) for layer, e in energy.items()})
        for n in EXACT_CHANNELS
    }  # fmt: skip
    rows = []
    for name, setting in settings.items():
        if args.only is not None and not any(part in name for part in args.only):
            continue
        q = quality(reference_logits, logits(args.text, setting)[0], targets)
        rows.append({"stored as e4m3": name} | quality_columns(q))
    print(f"{label}, {len(targets) + 1} tokens of '{args.text}', one prefill; every layer's K/V per-token-head e4m3 "
          f"(bf16 scales), against exact attention")  # fmt: skip
    print(format_table(rows))
    print("proxy (rotated / unrotated) per layer on this text:",
          " ".join(f"{proxies[layer]:.2f}" for layer in sorted(proxies)))  # fmt: skip
    print(f"layers rotated by the proxy on '{args.choose_on}': {chosen}")


if __name__ == "__main__":
    main()
