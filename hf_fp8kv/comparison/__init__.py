"""A/B comparison of KV caches on one model in one call: greedy outputs, decode-mode quality, memory and speed.

`compare(model, tokenizer)` runs every variant (a cache factory) on the same prompts and texts against the
native `DynamicCache` and returns a `Comparison`, which prints as tables, renders in a notebook, plots and saves.
docs/compare.md explains every column. `variants`: what is compared; `measurement`: what is measured;
`report`: the `Comparison`; `break_even`: from which context a cache's decode step is no slower than the
reference's; `run`: `compare` itself. The passkey-retrieval probe it can run is `hf_fp8kv.retrieval`.
"""

from hf_fp8kv.comparison.measurement import CostPoint, Generation, LiveTensorBytes, RaisedWarning, kv_bytes
from hf_fp8kv.comparison.report import Comparison
from hf_fp8kv.comparison.run import builtin_prompts, builtin_text, compare, read_lines
from hf_fp8kv.comparison.variants import BUILTIN_VARIANTS, HF_FP8, RECOMMENDED, REFERENCE, Variant, resolve_variants
from hf_fp8kv.retrieval import PasskeyProbe

__all__ = [
    "BUILTIN_VARIANTS",
    "HF_FP8",
    "RECOMMENDED",
    "REFERENCE",
    "Comparison",
    "CostPoint",
    "Generation",
    "LiveTensorBytes",
    "PasskeyProbe",
    "RaisedWarning",
    "Variant",
    "builtin_prompts",
    "builtin_text",
    "compare",
    "kv_bytes",
    "read_lines",
    "resolve_variants",
]
