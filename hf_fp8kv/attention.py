"""The FP8 attention and mask functions, registered in transformers under one name per fallback.

The model is switched to FP8 attention once (by `QuantizedFP8Cache(model)` or `from_pretrained(...,
attn_implementation="fp8kv")`). For any other cache, or for a layer kept in the model dtype, both functions
hand over, unchanged, to the implementation the model used before (sdpa or eager), so outputs stay
bit-identical; for our FP8 layers the attention reads the cache's codes directly. The name carries that
previous implementation ("fp8kv": sdpa, "fp8kv_eager": eager), so each model keeps its own, and a copied or
pickled model keeps it too.
"""

from __future__ import annotations

import sys
import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_fp8kv import compat

ATTENTION_NAME = "fp8kv"
# our attention's names -> the implementation each hands over to (the model's implementation before the switch)
FP8_ATTENTION_NAMES = {ATTENTION_NAME: "sdpa", f"{ATTENTION_NAME}_eager": "eager"}
FALLBACKS = tuple(FP8_ATTENTION_NAMES.values())
OUTPUT_ATTENTIONS_WARNING = (
    "FP8 KV cache attention does not return attention weights (output_attentions=True): the layers it serves "
    "give none. Use another cache (or attn_implementation='eager' without QuantizedFP8Cache) to get them."
)


class FP8KeyStates:
    """What a cache of ours returns from `update` (as the key states) to be read by the FP8 attention: it attends
    for it. `QuantizedKV` (a layer's buffers) and `PagedKV` (continuous batching's pages) are the two."""

    def attend(
        self, query: torch.Tensor, *, scaling: float, mask: torch.Tensor | None = None, window: int | None = None,
        softcap: float | None = None, sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`[batch, q_heads, q_len, head_dim]` attention output of `query` over the cached tokens."""
        raise NotImplementedError


def is_fp8_attention(implementation: str | None) -> bool:
    """Whether `implementation` (a config's `_attn_implementation`) is one of our attention's names."""
    return implementation in FP8_ATTENTION_NAMES


def attention_implementation(config) -> str | None:
    """`config._attn_implementation`, read past transformers' attribute hooks (2 us through them, 0.1 us here: a
    read per layer per decode step); plainly inside a compiled graph (where the read costs nothing)."""
    if not torch.compiler.is_compiling():
        stored = object.__getattribute__(config, "__dict__")
        if "_attn_implementation_internal" in stored:
            return stored["_attn_implementation_internal"]
    return config._attn_implementation


def fallback_implementation(config) -> str:
    """The attention implementation the model used before it was switched to FP8 attention (sdpa by default)."""
    return FP8_ATTENTION_NAMES.get(config._attn_implementation, "sdpa")


def fp8kv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over our FP8 cache when `key` is its view, else the model's previous implementation."""
    paged = compat.paged_cache_from_kwargs(kwargs)
    if paged is not None and not isinstance(key, FP8KeyStates):  # continuous batching left the write to us
        key, value = paged.update(key, value, module.layer_idx, kwargs)
    if not isinstance(key, FP8KeyStates):
        fallback = fallback_implementation(module.config)
        if fallback == "eager":  # each model has its own eager function (Gemma 2's applies softcap)
            function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", eager_attention_forward)
        else:
            function = ALL_ATTENTION_FUNCTIONS[fallback]
        return function(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if module.training and dropout:
        raise ValueError("FP8 KV cache attention is for inference: attention dropout is not supported")
    if kwargs.get("output_attentions"):
        warnings.warn(OUTPUT_ATTENTIONS_WARNING, stacklevel=2)
    out = key.attend(
        query,
        scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
        mask=_boolean_mask(attention_mask),
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sink_logits=kwargs.get("s_aux"),
    )
    return out.transpose(1, 2).contiguous(), None


def _boolean_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The sdpa (bool) or eager (0 / min float) 4D mask, which carries the causal and window rules, as bool."""
    if attention_mask is None:
        return None
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


def fp8kv_mask(*args, config=None, **kwargs):
    """The previous implementation's mask, so that both our attention and a fallback layer can read it."""
    return ALL_MASK_ATTENTION_FUNCTIONS[fallback_implementation(config)](*args, config=config, **kwargs)


def register() -> None:
    """Register our names in transformers' attention and mask interfaces (done on import)."""
    for name in FP8_ATTENTION_NAMES:
        AttentionInterface.register(name, fp8kv_attention)
        AttentionMaskInterface.register(name, fp8kv_mask)


def use_fp8_attention(target) -> bool:
    """Switch a model (and its sub-models) or a bare config to FP8 attention, each config under the name of its
    current implementation (a config already switched keeps its name).

    Returns False, changing nothing, when an implementation is in use that we cannot hand back to
    (flash/flex/custom): the cache then returns dequantized tensors to it (the slow path).
    """
    is_model = isinstance(target, torch.nn.Module)
    if is_model:
        candidates = [m.config for m in target.modules() if hasattr(m, "config")]
    else:
        candidates = [target, *(getattr(target, key, None) for key in getattr(target, "sub_configs", {}))]
    configs = list({id(c): c for c in candidates if c is not None}.values())
    if any(c._attn_implementation not in (*FALLBACKS, *FP8_ATTENTION_NAMES, None) for c in configs):
        return False
    names = [_fp8_name(c._attn_implementation) for c in configs]
    if is_model and len(set(names)) == 1:
        target.set_attn_implementation(names[0])
    else:
        for config, name in zip(configs, names):
            config._attn_implementation = name
    return True


def _fp8_name(implementation: str | None) -> str:
    if is_fp8_attention(implementation):
        return implementation
    fallback = implementation or "sdpa"
    return next(name for name, previous in FP8_ATTENTION_NAMES.items() if previous == fallback)


register()
