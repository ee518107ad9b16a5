"""hf-fp8kv: an FP8 KV cache for Hugging Face transformers, read directly by FP8 attention kernels."""

from hf_fp8kv.attention import ATTENTION_NAME
from hf_fp8kv.cache import QuantizedFP8Cache
from hf_fp8kv.guard import CacheReuseError

__all__ = ["ATTENTION_NAME", "CacheReuseError", "QuantizedFP8Cache"]
