"""`layer_sensitivity`: how much each layer's FP8 cache moves the output, and which layers to keep in BF16.

Each measurement is one forward pass of the text through a `QuantizedFP8Cache`. Our cache quantizes the new
tokens before attention reads them (the FP8 attention reads the stored codes, the slow path dequantizes
them), so one pass sees the same quantized past as decode mode, at a fraction of the cost. That holds for pure
FP8 storage, which is what is measured (`recent_tokens=0, sink_tokens=0`): the recent tokens in full precision of the
newest tokens lowers every layer's error alike and is not a per-layer choice.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_fp8kv import compat
from hf_fp8kv.cache import QuantizedFP8Cache
from hf_fp8kv.calibration import model_inputs
from hf_fp8kv.evaluate import per_token_kl
from hf_fp8kv.scales import ScalesArg, UncalibratedScalesWarning
from hf_fp8kv.table import format_table


@dataclass
class SensitivityReport:
    """Per-layer divergence with only that layer quantized, and the suggested `skip_layers`.

    `rows`: `{layer, kl_mean, top1}` per quantized layer; `kl_all`: mean KL with every layer quantized;
    `skip_layers`: the most sensitive layers, added one by one until the measured KL reached `target_kl`
    (or `max_skip` layers); `kl_with_skip`: the measured KL with them kept in full precision.
    """

    rows: list[dict[str, Any]]
    kl_all: float
    target_kl: float
    skip_layers: list[int]
    kl_with_skip: float

    def __str__(self) -> str:
        ranked = sorted(self.rows, key=lambda row: -row["kl_mean"])
        return (
            format_table(ranked)
            + f"\nmean KL, every layer FP8: {self.kl_all:.4g}; target {self.target_kl:.4g}"
            + f"\nsuggested skip_layers={self.skip_layers}: mean KL {self.kl_with_skip:.4g}"
        )


@torch.inference_mode()
def layer_sensitivity(
    model: torch.nn.Module,
    texts: Any,
    tokenizer=None,
    *,
    scales: ScalesArg = "auto",
    kv_cache_dtype: str = "fp8",
    target_kl: float | None = None,
    max_skip: int | None = None,
    max_length: int | None = 512,
    progress: bool = True,
) -> SensitivityReport:
    """Each layer's contribution to the output divergence (mean KL against the full-precision cache with only
    that layer in FP8) and the `skip_layers` that bring the whole model to `target_kl`.

    `texts`: as `calibrate`'s data. `target_kl` defaults to half the KL with every layer in FP8; `max_skip`
    to a quarter of the layers.
    """
    inputs = list(model_inputs(texts, tokenizer, max_length, model.device))
    reference = [compat.forward(model, DynamicCache(config=model.config), **x).logits.float() for x in inputs]
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers

    def measure(skip: list[int]) -> tuple[float, float]:
        kls, agree = [], []
        for x, ref in zip(inputs, reference):
            cache = QuantizedFP8Cache(
                model, kv_cache_dtype=kv_cache_dtype, scales=scales, skip_layers=skip, recent_tokens=0, sink_tokens=0
            )
            logits = compat.forward(model, cache, **x).logits.float()
            valid = x["attention_mask"].bool() if "attention_mask" in x else torch.ones(ref.shape[:2], dtype=bool)
            kls.append(per_token_kl(ref[valid], logits[valid]))
            agree.append(ref[valid].argmax(-1) == logits[valid].argmax(-1))
        return torch.cat(kls).mean().item(), torch.cat(agree).float().mean().item()

    QuantizedFP8Cache(model, kv_cache_dtype=kv_cache_dtype, scales=scales)  # warns once if scales fall back to 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncalibratedScalesWarning)
        kl_all, _ = measure([])
        rows = []
        for layer in tqdm(range(num_layers), desc="layers", disable=not progress):
            kl, top1 = measure([i for i in range(num_layers) if i != layer])
            rows.append({"layer": layer, "kl_mean": kl, "top1": top1})
        target = kl_all / 2 if target_kl is None else target_kl
        limit = max(1, num_layers // 4) if max_skip is None else max_skip
        skip, kl_skip = [], kl_all
        for row in sorted(rows, key=lambda r: -r["kl_mean"]):
            if kl_skip <= target or len(skip) >= limit:
                break
            skip.append(row["layer"])
            kl_skip, _ = measure(sorted(skip))
    return SensitivityReport(rows, kl_all, target, sorted(skip), kl_skip)
