"""Decode-mode quality: prefill a prefix, then feed the text one token at a time through the cache.

A single prefill pass attends to the new tokens as they are written, so decode mode is where a quantized
cache's error shows: every later token reads the stored past.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from hf_fp8kv import compat


@torch.inference_mode()
def decode_mode_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prefix: int,
    cache,
    progress: bool = False,
    step_callback: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """fp32 logits `[len - prefix, vocab]`: row i predicts token `prefix + i` of `input_ids` (`[1, len]`)."""
    length = input_ids.shape[1]
    if not 0 < prefix < length:
        raise ValueError(f"prefix={prefix} must be between 1 and the text length - 1 ({length - 1} tokens)")
    out = compat.forward(model, cache, input_ids=input_ids[:, :prefix], logits_to_keep=1)
    rows = [out.logits[0, -1].float()]
    for position in tqdm(range(prefix, length - 1), disable=not progress, desc="decode", leave=False):
        out = compat.forward(model, cache, input_ids=input_ids[:, position : position + 1])
        rows.append(out.logits[0, -1].float())
        if step_callback is not None:
            step_callback(position)
    return torch.stack(rows)


@dataclass
class TokenScores:
    """Per predicted token: reference and test negative log-likelihoods, KL(reference || test), top-1 agreement."""

    nll_ref: torch.Tensor
    nll: torch.Tensor
    kl: torch.Tensor
    agree: torch.Tensor

    @classmethod
    def of(cls, ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor) -> "TokenScores":
        def nll(logits: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")

        return cls(
            nll_ref=nll(ref_logits),
            nll=nll(test_logits),
            kl=per_token_kl(ref_logits, test_logits),
            agree=ref_logits.argmax(-1) == test_logits.argmax(-1),
        )

    @classmethod
    def cat(cls, parts: "list[TokenScores]") -> "TokenScores":
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("nll_ref", "nll", "kl", "agree")))

    def select(self, mask: torch.Tensor) -> "TokenScores":
        return TokenScores(self.nll_ref[mask], self.nll[mask], self.kl[mask], self.agree[mask])


@dataclass
class Quality:
    """Quality of `test` logits against reference logits on the same text."""

    ppl_ref: float
    ppl: float
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    first_flip: int | None  # index (from the first predicted token) of the first argmax disagreement

    @property
    def ppl_delta_pct(self) -> float:
        return 100.0 * (self.ppl / self.ppl_ref - 1.0)

    @classmethod
    def of(cls, scores: TokenScores) -> "Quality":
        if len(scores.kl) == 0:
            raise ValueError("no predicted tokens to score")
        flips = (~scores.agree).nonzero()
        return cls(
            ppl_ref=scores.nll_ref.mean().exp().item(),
            ppl=scores.nll.mean().exp().item(),
            kl_mean=scores.kl.mean().item(),
            kl_p99=torch.quantile(scores.kl, 0.99).item(),
            top1_agreement=scores.agree.float().mean().item(),
            first_flip=int(flips[0, 0]) if len(flips) else None,
        )


def per_token_kl(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || test) of the next-token distributions, one value per row."""
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    test = torch.log_softmax(test_logits.float(), dim=-1)
    return (ref.exp() * (ref - test)).sum(dim=-1).clamp_min(0.0)


def quality(ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor) -> Quality:
    """Perplexities, KL and top-1 agreement of `test_logits` against `ref_logits` for next tokens `targets`."""
    return Quality.of(TokenScores.of(ref_logits, test_logits, targets))


@torch.inference_mode()
def greedy_with_logits(model: torch.nn.Module, inputs: dict, cache, max_new_tokens: int, **generate_kwargs):
    """Greedy `generate` through `cache`: new tokens `[batch, new]` and raw logits `[batch, new, vocab]` (fp32)."""
    out = model.generate(
        **inputs,
        **compat.cache_kwargs(cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **generate_kwargs,
    )
    new_tokens = out.sequences[:, inputs["input_ids"].shape[1] :]
    return new_tokens, torch.stack(out.logits, dim=1).float()


def topk_rule(
    ref_tokens: torch.Tensor, ref_logits: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, k: int = 5
) -> tuple[int | None, bool]:
    """vLLM's greedy-agreement rule for one sequence: the first position where the tokens differ (None when
    they agree throughout), and whether each side's choice there is in the other's top-k logits."""
    length = min(len(ref_tokens), len(tokens))
    differ = (ref_tokens[:length] != tokens[:length]).nonzero()
    if len(differ) == 0:
        return None, True
    at = int(differ[0, 0])
    ok = bool(tokens[at] in ref_logits[at].topk(k).indices and ref_tokens[at] in logits[at].topk(k).indices)
    return at, ok
