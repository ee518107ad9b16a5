"""`calibrate`: static K/V scales from running the model over calibration data.

Keys are observed after RoPE (and any key norm) exactly as the cache receives them: a recording
`DynamicCache` is passed through the model's forward and sees every layer's `update`. The statistics cover
the whole data set (min-max over every token, not the last batch); padding tokens are left out.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_fp8kv import compat
from hf_fp8kv.checkpoint import KVScales
from hf_fp8kv.kernels.formats import get_format
from hf_fp8kv.scales import key_channel_ratios
from hf_fp8kv.settings import check_count

OCP_MAX = get_format("fp8_e4m3").max  # scales are stored in the OCP e4m3 convention: amax / 448
# A channel's max is estimated from fewer values than its head's and new text exceeds it (SmolLM2, min-max
# channels: 26,949 keys saturated on 831 held-out tokens). e4m3's relative precision is the same over its
# normal range, so 4x headroom costs only the bottom of the subnormals (docs/scales.md).
CHANNEL_HEADROOM = 4.0
STRATEGIES = ("tensor", "attn_head", "token")
NAMED_SKIPS = 10  # the skipped samples a warning names


def calibrate(
    model: torch.nn.Module,
    data: Any,
    tokenizer=None,
    *,
    strategy: str = "tensor",
    key_channels: bool = False,
    percentile: float | None = None,
    max_length: int | None = None,
    progress: bool = True,
) -> KVScales:
    """Static K/V scales of every layer of `model` from a run over `data`.

    Args:
        data: a string or list of strings (tokenized with `tokenizer`), a list of input-id tensors, or an
            iterable (e.g. a DataLoader) of dicts of model inputs (`input_ids`, `attention_mask`, ...).
        strategy: "tensor" (one K and one V scale per layer), "attn_head" (one per KV head) or "token" (per-token
            scales at run time, `KVScales.dynamic`: only the key channels are calibrated, so `key_channels=True`).
        key_channels: also calibrate a static per-channel key scale (folded into the query at run time):
            `CHANNEL_HEADROOM` x the channel's max over the head's (or layer's) max, at most 1; with "token" the
            channel's max over its head's, which evens out the channels a per-token int8 scale divides; each
            rounded up to a power of two (docs/scales.md).
        percentile: clip the scales to this percentile (0-100] of the per-token maxima of |x| (the token's head
            vector, or all its heads for "tensor"), so the rarest outlier tokens saturate; None = min-max.
        max_length: truncate each sample to this many tokens (at least 1).

    A sample of zero tokens (an empty text, say a blank line of a data set) is skipped with a warning naming it.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    if strategy == "token" and (not key_channels or percentile is not None):
        raise ValueError("strategy='token' calibrates only per-channel key scales (the cache computes the rest per "
                         "token): pass key_channels=True and no percentile")
    if percentile is not None and not 0 < percentile <= 100:
        raise ValueError(f"percentile={percentile} must be in (0, 100]")
    if max_length is not None:
        check_count("max_length", max_length, minimum=1)
    observer = _Observer(keep_tokens=percentile is not None)
    total = len(data) if isinstance(data, (list, tuple)) else None
    # only the cache's inputs matter: skip the LM head for all but one position where the model allows it
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    empty = []  # the indices of samples of zero tokens: the model's forward fails on them
    with torch.inference_mode():
        for index, inputs in enumerate(tqdm(model_inputs(data, tokenizer, max_length, model.device), total=total,
                                            desc="calibrate", disable=not progress)):  # fmt: skip
            if not inputs["input_ids"].numel():
                empty.append(index)
                continue
            mask = inputs.get("attention_mask")
            compat.forward(model, _RecordingCache(model.config, observer, mask), **inputs, **extra)
            observer.tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
    if empty:
        named = ", ".join(f"data[{i}]" for i in empty[:NAMED_SKIPS]) + (", ..." if len(empty) > NAMED_SKIPS else "")
        warnings.warn(f"calibrate skipped {len(empty)} sample(s) of zero tokens: {named}", stacklevel=2)
    if not observer.channel_amax:
        raise ValueError("calibration saw no keys: data was empty (or every sample had zero tokens) or the model "
                         "never called the cache")  # fmt: skip
    return observer.scales(strategy, key_channels, percentile)


def model_inputs(
    data: Any, tokenizer, max_length: int | None, device: torch.device | str = "cpu"
) -> Iterator[dict[str, torch.Tensor]]:
    """Each item of `data` (text, input-id tensor or dict of model inputs) as a dict of model input tensors."""
    if isinstance(data, (str, torch.Tensor)):
        data = [data]
    if not isinstance(data, Iterable):
        raise TypeError(f"data of type {type(data).__name__}: expected texts, input-id tensors or dicts of inputs")
    for item in data:
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("the data are strings: pass tokenizer= to tokenize them")
            item = tokenizer(item, return_tensors="pt")
        if isinstance(item, torch.Tensor):
            item = {"input_ids": item if item.dim() == 2 else item.reshape(1, -1)}
        if not isinstance(item, Mapping) or "input_ids" not in item:
            raise TypeError(f"data item of type {type(item).__name__}: expected a text, an input-id tensor or a "
                            "dict of model inputs with input_ids")  # fmt: skip
        inputs = {k: v.to(device) for k, v in item.items() if isinstance(v, torch.Tensor) and k != "labels"}
        if max_length is not None:
            inputs = {k: v[:, :max_length] if v.dim() == 2 else v for k, v in inputs.items()}
        yield inputs


class _Observer:
    """Running statistics of every layer's keys and values: |x| max per (head, channel) and, for percentile
    clipping, per token and head."""

    def __init__(self, keep_tokens: bool):
        self.keep_tokens = keep_tokens
        self.channel_amax: dict[tuple[int, str], torch.Tensor] = {}
        self.token_amax: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.tokens = 0

    def observe(self, layer: int, which: str, states: torch.Tensor, valid: torch.Tensor | None) -> None:
        magnitude = states.detach().float().abs()
        if not torch.isfinite(magnitude).all():
            raise ValueError(f"layer {layer} {'keys' if which == 'k' else 'values'} have non-finite values during "
                             "calibration: the model itself overflows")  # fmt: skip
        if valid is not None:  # [batch, tokens], 0 = padding
            magnitude = magnitude * valid[:, None, -states.shape[2] :, None].to(magnitude)
        amax = magnitude.amax(dim=(0, 2)).cpu()
        key = (layer, which)
        self.channel_amax[key] = torch.maximum(self.channel_amax[key], amax) if key in self.channel_amax else amax
        if self.keep_tokens:
            per_token = magnitude.amax(dim=-1).transpose(0, 1).flatten(1)  # [heads, batch * tokens]
            if valid is not None:
                per_token = per_token[:, valid[:, -states.shape[2] :].flatten().bool()]
            self.token_amax.setdefault(key, []).append(per_token.cpu())

    def scales(self, strategy: str, key_channels: bool, percentile: float | None) -> KVScales:
        per_token = strategy == "token"
        result = KVScales(dynamic=per_token)
        source = f"calibrated ({self.tokens} tokens, {strategy}{', key channels' if key_channels else ''})"
        for layer in sorted({layer for layer, _ in self.channel_amax}):
            result.sources[layer] = source
            if not per_token:
                amax = {which: self._amax(layer, which, strategy, percentile) for which in ("k", "v")}
                result.key[layer], result.value[layer] = (torch.where(a > 0, a / OCP_MAX, 1.0) for a in amax.values())
            if key_channels:  # (per token: no headroom, nothing saturates; the channels' spread is what counts)
                channel = self.channel_amax[(layer, "k")]
                reference = channel.amax() if strategy == "tensor" else channel.amax(dim=1, keepdim=True)
                headroom = 1.0 if per_token else CHANNEL_HEADROOM
                result.key_channel[layer] = key_channel_ratios(channel, reference, headroom)
        return result

    def _amax(self, layer: int, which: str, strategy: str, percentile: float | None) -> torch.Tensor:
        """`[1]` (tensor) or `[kv_heads]` (attn_head) amax, clipped to the percentile of the token maxima."""
        if percentile is None:
            head_amax = self.channel_amax[(layer, which)].amax(dim=1)
            return head_amax.amax().reshape(1) if strategy == "tensor" else head_amax
        tokens = torch.cat(self.token_amax[(layer, which)], dim=1)
        if strategy == "tensor":
            return torch.quantile(tokens.amax(dim=0), percentile / 100).reshape(1)
        return torch.quantile(tokens, percentile / 100, dim=1)


class _RecordingCache(DynamicCache):
    """A `DynamicCache` that shows every layer's new keys and values to an observer."""

    def __init__(self, config, observer: _Observer, attention_mask: torch.Tensor | None):
        super().__init__(config=config)
        self.observer = observer
        self.valid = attention_mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.observer.observe(layer_idx, "k", key_states, self.valid)
        self.observer.observe(layer_idx, "v", value_states, self.valid)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
