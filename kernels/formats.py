"""Storage formats of the quantized KV cache: one table entry per format, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Per-token scales are bf16 values, rounded up when written: 2 bytes per token and head in the dense cache (pages
# keep them in fp32 bytes); quality measured unchanged against fp32 (docs/recent.md)
PER_TOKEN_SCALE_DTYPE = torch.bfloat16

TINY_SCALE = 2.0**-126  # the smallest per-token scale: an all-zero row gets it (its codes are 0 whatever it is)


@dataclass(frozen=True)
class StorageFormat:
    """How one storage format stores a value: its dtype, its largest finite value and how scales map onto it.

    `ocp_scale_factor` multiplies scales calibrated for the OCP e4m3fn format (what checkpoints carry): the same
    bits decode to half the value in e4m3fnuz, so its scales are doubled, as vLLM does on ROCm.

    `per_token_max` is what a per-token scale maps a row's amax to: the format's max, except e4m3fnuz where vLLM
    divides by 224, not 240 (its comment: 240 "will cause accuracy issue on dynamic quantization"); checkpoint
    scales keep 240 as the saturation bound there, as vLLM does.

    A value counts as clipped when `|x / scale| > clip_bound`, the max plus half the code spacing there: beyond
    it saturation, not rounding, decides the code.

    `fp16_shift` / `fp16_factor` describe the exact bit decode (the CPU path and the Triton interpreter): the
    code, sign-extended to int16 and shifted left by `fp16_shift` (bit 14 cleared for e4m3 formats), is an fp16
    whose value times `fp16_factor` is the code's value. torch converts fp8 to float at ~0.4 G elements/s on
    CPU; this runs at ~2.7 G elements/s (8.8 M codes: 3.3 ms against 22 ms, docs/benchmarks.md). It is exact for
    finite codes; `nan_code_mask` / `nan_code` (a code is NaN iff `code & mask == nan_code`, as uint8) mark the
    NaN codes it would misread.
    """

    name: str
    dtype: torch.dtype
    max: float
    clip_bound: float
    ocp_scale_factor: float = 1.0
    per_token_only: bool = False
    fp16_shift: int = 0
    fp16_factor: float = 1.0
    per_token_max: float = 0.0  # 0: the format's max
    nan_code_mask: int = 0
    nan_code: int = -1  # -1: the bit decode reads NaN codes right (e5m2) or there are none (int8)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def row_max(self) -> float:
        """What a per-token scale maps a row's amax to."""
        return self.per_token_max or self.max


FORMATS: dict[str, StorageFormat] = {
    "fp8_e4m3": StorageFormat(
        "fp8_e4m3", torch.float8_e4m3fn, 448.0, 464.0, fp16_shift=7, fp16_factor=256.0, nan_code_mask=0x7F,
        nan_code=0x7F,
    ),
    "fp8_e5m2": StorageFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 61440.0, fp16_shift=8, fp16_factor=1.0),
    "fp8_e4m3fnuz": StorageFormat(
        "fp8_e4m3fnuz", torch.float8_e4m3fnuz, 240.0, 248.0, ocp_scale_factor=2.0, fp16_shift=7, fp16_factor=128.0,
        per_token_max=224.0, nan_code_mask=0xFF, nan_code=0x80,
    ),
    "int8_per_token_head": StorageFormat("int8_per_token_head", torch.int8, 127.0, 127.5, per_token_only=True),
}  # fmt: skip
ALIASES = {"fp8": "fp8_e4m3"}


def get_format(name: str) -> StorageFormat:
    """The storage format called `name` (vLLM's `kv_cache_dtype` spelling); a clear error for any other name."""
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        valid = ", ".join(repr(n) for n in [*ALIASES, *FORMATS])
        raise ValueError(f"kv_cache_dtype={name!r} is not a storage format; valid names: {valid}")
    return FORMATS[key]
