"""hf-fp8kv: an FP8 KV cache for Hugging Face transformers, read directly by FP8 attention kernels.

`compare` (the A/B report, `hf_fp8kv.comparison`) is imported on first use, so `import hf_fp8kv` stays light.
"""

from hf_fp8kv.attention import ATTENTION_NAME
from hf_fp8kv.cache import QuantizedFP8Cache
from hf_fp8kv.calibration import calibrate
from hf_fp8kv.checkpoint import KVScales
from hf_fp8kv.guard import CacheReuseError
from hf_fp8kv.scales import UncalibratedScalesWarning
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


def __getattr__(name: str):
    if name == "compare":
        from hf_fp8kv.comparison import compare

        return compare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
