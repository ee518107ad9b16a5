"""Random-weight tiny models for broad coverage, and the bundled real models."""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


# no full-precision window: every token is stored as codes as soon as it arrives (what vLLM serves)
PURE_FP8 = dict(recent_tokens=0, sink_tokens=0)


def tiny_model(model_type: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A randomly initialised tiny causal LM of `model_type`, in eval mode (deterministic for a seed)."""
    kwargs = {**TINY, **overrides}
    if "head_dim" not in kwargs and model_type not in ("phi3",):
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def left_padded_mask(first: list[int], columns: int) -> torch.Tensor:
    """An attention mask of `columns` positions: row b's padding before position `first[b]`, then ones."""
    return (torch.arange(columns)[None, :] >= torch.tensor(first)[:, None]).long()


@functools.lru_cache(maxsize=None)
def smollm2(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct (shared by the tests of one session; its attention may be switched to fp8kv,
    which behaves exactly like sdpa for any other cache)."""
    from hf_fp8kv.bundled import load_smollm2

    return load_smollm2(dtype=dtype)
