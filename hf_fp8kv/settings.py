"""The cache's arguments, resolved once: format, each layer's kind and scale scheme, layers kept in the model's
dtype, backend and the recent / sink tokens, as one `CacheSettings` that `QuantizedFP8Cache` and
`continuous_batching.enable` both build their storage from. Every argument is checked here, when the cache is
built, with an error that names it."""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch

from hf_fp8kv import compat
from hf_fp8kv.kernels.formats import StorageFormat, get_format
from hf_fp8kv.kernels.ops import check_backend
from hf_fp8kv.kernels.rotation import hadamard_block
from hf_fp8kv.kernels.targets import device_target
from hf_fp8kv.scale_search import check_scale_search
from hf_fp8kv.scales import (
    CALIBRATE_KEY_CHANNELS, CALIBRATION_WARNING, MIN_MEASURED_TOKENS, LayerScales, MeasuredKeyChannels, ScalesArg,
    UncalibratedScalesWarning, resolve_scales,
)

# Layer types (from `get_layer_types_and_kwargs`) we store; chunked attention caches like a sliding window of the
# chunk size (its mask keeps the chunks apart), as in transformers; "dummy" layers (KV shared with another layer,
# or no attention) hold nothing.
STORED_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
SLIDING_TYPES = compat.SLIDING_TYPES


@dataclass(frozen=True)
class CacheSettings:
    """What a cache's arguments resolve to (see `QuantizedFP8Cache` for each argument's meaning)."""

    fmt: StorageFormat
    layer_types: list[str]  # one per decoder layer
    layer_kwargs: list[dict]  # each layer type's arguments (sliding_window)
    skip: frozenset[int]  # layers kept in the model dtype
    scales: dict[int, LayerScales]  # the scale scheme of each stored layer
    backend: str  # the backend name asked for ("auto", "triton", "torch")
    recent_tokens: int
    sink_tokens: int
    block_size: int
    max_cache_len: int | None
    max_batch_size: int | None
    kv_heads: int
    head_dim: int
    fp8_prefill: bool = False  # a prefill's dots over e4m3 codes on FP8 tensor cores (the Triton backend)
    rotate: bool = False  # codes of the keys and values times a Hadamard matrix (`kernels/rotation.py`)
    outlier_tokens: int = 0  # coded tokens per KV head kept exact too (`hf_fp8kv/outliers.py`)
    scale_search: int = 0  # per-token scales searched among this many candidates (`hf_fp8kv/scale_search.py`)

    def stored(self, layer: int) -> bool:
        """Whether `layer` is stored as codes (not skipped, not a dummy layer)."""
        return layer in self.scales


def resolve_settings(
    config,
    *,
    kv_cache_dtype: str = "fp8",
    scales: ScalesArg = "auto",
    skip_layers: str | Iterable[int | str] = (),
    backend: str | None = None,
    recent_tokens: int = 0,
    sink_tokens: int = 0,
    block_size: int = 64,
    max_cache_len: int | None = None,
    max_batch_size: int | None = None,
    offloading: bool = False,
    fp8_prefill: bool = False,
    rotate: bool = False,
    outlier_tokens: int = 0,
    scale_search: int = 0,
) -> CacheSettings:
    """Resolve and check a cache's arguments for the model of `config` (warns when the scales fall back to 1.0)."""
    text_config = config.get_text_config(decoder=True)
    context = getattr(text_config, "max_position_embeddings", None)
    recent_tokens = check_count("recent_tokens", recent_tokens, maximum=context)
    sink_tokens = check_count("sink_tokens", sink_tokens, maximum=context)
    outlier_tokens = check_count("outlier_tokens", outlier_tokens, maximum=context)
    block_size = check_count("block_size", block_size, minimum=1)
    if max_cache_len is not None:
        max_cache_len = check_count("max_cache_len", max_cache_len, minimum=1)
        if offloading:
            raise ValueError("offloading=True and max_cache_len: a static cache keeps its buffers in place (no offloading)")
    if max_batch_size is not None:
        if max_cache_len is None:
            raise ValueError("max_batch_size applies to a static cache: pass max_cache_len too")
        max_batch_size = check_count("max_batch_size", max_batch_size, minimum=1)
    backend = check_backend(backend)
    fmt = get_format(platform_dtype(kv_cache_dtype))
    if not isinstance(fp8_prefill, bool):
        raise ValueError(f"fp8_prefill={fp8_prefill!r} must be True or False")
    if not isinstance(rotate, bool):
        raise ValueError(f"rotate={rotate!r} must be True or False")
    if fp8_prefill and fmt.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_prefill=True runs its dots on e4m3fn codes (kv_cache_dtype='fp8_e4m3'), not {fmt.name!r}")
    layer_types, layer_kwargs = compat.layer_types_and_kwargs(text_config)
    check_supported(text_config, layer_types)
    skip = skip_layer_indices(skip_layers, layer_types)
    stored = [i for i, kind in enumerate(layer_types) if i not in skip and kind in STORED_TYPES]
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    checkpoint = getattr(config, "_name_or_path", "") or None
    layer_scales, uncalibrated = resolve_scales(scales, fmt, stored, len(layer_types), kv_heads, checkpoint)
    if any(isinstance(s, MeasuredKeyChannels) for s in layer_scales.values()):
        check_measured_channels(recent_tokens, max_cache_len, rotate)
    if rotate:
        check_rotation(head_dim, layer_scales, uncalibrated)
    if outlier_tokens:
        check_per_token(f"outlier_tokens={outlier_tokens}", layer_scales,
                        "the attention finds a kept token by its key scale, stored negated")  # fmt: skip
    if check_scale_search(scale_search):
        check_per_token(f"scale_search={scale_search}", layer_scales, "it searches each token's own scale")
    if uncalibrated:
        warnings.warn(CALIBRATION_WARNING, UncalibratedScalesWarning, stacklevel=3)
    return CacheSettings(
        fmt, list(layer_types), list(layer_kwargs), frozenset(skip), layer_scales, backend, recent_tokens, sink_tokens,
        block_size, max_cache_len, max_batch_size, kv_heads, head_dim, fp8_prefill, rotate, outlier_tokens,
        scale_search,
    )  # fmt: skip


def check_rotation(head_dim: int, layer_scales: dict[int, LayerScales], uncalibrated: bool) -> None:
    """Refuse `rotate=True` where it cannot work: an odd head_dim (no Hadamard block), static scales measured on
    unrotated keys and values (a rotated token's amax may be up to sqrt(block) times its own: they would clip)."""
    if hadamard_block(head_dim) < 2:
        raise ValueError(f"rotate=True needs an even head_dim (Hadamard blocks of 2^k channels); this model's is {head_dim}")
    static = sorted({s.source for s in layer_scales.values() if not s.per_token})
    if static and not uncalibrated:
        raise ValueError(
            f"rotate=True with static scales ({', '.join(static)}): they were measured on unrotated keys and values, "
            "which a rotation spreads (a token's amax may grow up to sqrt(head_dim)x and clip); use scales='dynamic' "
            "(per token and head) with rotate=True, or rotate=False"
        )


def check_measured_channels(recent_tokens: int, max_cache_len: int | None, rotate: bool) -> None:
    """Refuse `scales="dynamic_key_channels"` where its measurement cannot be made or would be poor."""
    if max_cache_len is not None:
        raise ValueError(
            "scales='dynamic_key_channels' measures a layer's key channels when its first token is coded, which a "
            f"static cache's compiled step cannot do; {CALIBRATE_KEY_CHANNELS}"
        )
    if rotate:
        raise ValueError("scales='dynamic_key_channels' with rotate=True: a rotation mixes the channels these scales "
                         "set apart (not measured); use one or the other")  # fmt: skip
    if recent_tokens < MIN_MEASURED_TOKENS:
        raise ValueError(
            f"scales='dynamic_key_channels' with recent_tokens={recent_tokens}: the key channels are measured over "
            f"the recent tokens when the first one is coded, and need at least {MIN_MEASURED_TOKENS} of them "
            f"(channels measured on a few tokens are worse than none: docs/recent.md); raise recent_tokens, or "
            f"{CALIBRATE_KEY_CHANNELS}"
        )


def check_per_token(option: str, layer_scales: dict[int, LayerScales], why: str) -> None:
    """Refuse `option` (its name and value) without per-token scales, saying `why` it needs them."""
    static = sorted({s.source for s in layer_scales.values() if not s.per_token})
    if static:
        raise ValueError(f"{option} needs per-token scales (scales='dynamic'), not static ones ({', '.join(static)}): "
                         f"{why}")  # fmt: skip


def platform_dtype(kv_cache_dtype: str) -> str:
    """On ROCm, "fp8" means the format of the current GPU's FP8 hardware, as in vLLM: e4m3fnuz on MI300 (gfx94x,
    also assumed where no GPU is visible), e4m3fn on MI355 (gfx950) and others; else the name itself."""
    if kv_cache_dtype != "fp8" or not torch.version.hip:
        return kv_cache_dtype
    return device_target(torch.device("cuda")).default_fp8 if torch.cuda.is_available() else "fp8_e4m3fnuz"


def check_count(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """`value` as an int (any integral number: numpy's too), checked against its bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(
            f"{name}={value!r} exceeds the model's context (max_position_embeddings={maximum}); to keep every token "
            "in the model's dtype, skip the layers (skip_layers) or use transformers' DynamicCache"
        )
    return int(value)


def skip_layer_indices(skip_layers: str | Iterable[int | str], layer_types: list[str]) -> set[int]:
    """Layer indices named by `skip_layers`: indices (ints or digit strings) and "sliding_window"."""
    if not isinstance(skip_layers, (str, Iterable)):
        raise ValueError(
            f"skip_layers={skip_layers!r}: pass a list of layer indices and/or 'sliding_window' (e.g. "
            f"skip_layers=[{skip_layers!r}])"
        )
    items = [s for s in skip_layers.split(",") if s.strip()] if isinstance(skip_layers, str) else list(skip_layers)
    skip, bad = set(), []
    for item in items:
        name = item.strip() if isinstance(item, str) else item
        if name == "sliding_window":
            skip.update(i for i, kind in enumerate(layer_types) if kind in SLIDING_TYPES)
            continue
        index = int(name) if isinstance(name, str) and name.isdigit() else name
        if isinstance(index, numbers.Integral) and not isinstance(index, bool) and 0 <= index < len(layer_types):
            skip.add(int(index))
        else:
            bad.append(item)
    if bad:
        raise ValueError(
            f"skip_layers {bad} are neither layer indices of this model (0..{len(layer_types) - 1}) nor "
            "'sliding_window'"
        )
    return skip


def check_supported(text_config, layer_types: list[str]) -> None:
    """Refuse, naming the model type, a model whose cache is not per-token K/V of full, sliding or chunked layers."""
    model_type = text_config.model_type
    if getattr(text_config, "kv_lora_rank", None):
        raise ValueError(
            f"model type {model_type!r} caches MLA latents (kv_lora_rank={text_config.kv_lora_rank}), not per-head "
            "K/V: QuantizedFP8Cache cannot serve it"
        )
    if getattr(text_config, "is_encoder_decoder", False):
        raise ValueError(f"model type {model_type!r} is encoder-decoder: QuantizedFP8Cache serves decoder-only models")
    for i, layer_type in enumerate(layer_types):
        if layer_type not in (*STORED_TYPES, *compat.NO_CACHE_TYPES):
            raise ValueError(
                f"layer {i} of model type {model_type!r} is a {layer_type!r} layer: QuantizedFP8Cache stores "
                f"per-token K/V of {', '.join(STORED_TYPES)} layers only"
            )
