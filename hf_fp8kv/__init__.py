"""hf-fp8kv: an FP8 KV cache for Hugging Face transformers, read directly by FP8 attention kernels."""

from hf_fp8kv.attention import ATTENTION_NAME
from hf_fp8kv.cache import QuantizedFP8Cache
from hf_fp8kv.calibration import calibrate
from hf_fp8kv.comparison import compare
from hf_fp8kv.guard import CacheReuseError
from hf_fp8kv.scales import KVScales, UncalibratedScalesWarning
from hf_fp8kv.sensitivity import layer_sensitivity

__all__ = [
    "ATTENTION_NAME",
    "CacheReuseError",
    "KVScales",
    "QuantizedFP8Cache",
    "UncalibratedScalesWarning",
    "calibrate",
    "compare",
    "layer_sensitivity",
]
