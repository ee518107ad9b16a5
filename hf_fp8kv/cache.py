"""`QuantizedFP8Cache`: a transformers `Cache` that stores K/V in FP8 and is read by FP8 attention."""

from __future__ import annotations

import sys
import warnings
from typing import Iterable

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from hf_fp8kv import compat
from hf_fp8kv.attention import ATTENTION_NAME, attention_implementation, is_fp8_attention, use_fp8_attention
from hf_fp8kv.dynamic import DynamicFP8Layer, DynamicFP8SlidingLayer
from hf_fp8kv.guard import TokenHistory, install_generation_guard
from hf_fp8kv.kernels import ops
from hf_fp8kv.layer import FP8Layer
from hf_fp8kv.scales import MeasuredKeyChannels, ScalesArg
from hf_fp8kv.settings import CacheSettings, resolve_settings
from hf_fp8kv.static import StaticFP8Layer, StaticFP8SlidingLayer
from hf_fp8kv.table import format_table

SLOW_PATH_WARNING = (
    "QuantizedFP8Cache: the model does not run the '{name}' attention ({reason}), so every step dequantizes the "
    "whole cache to full precision (slow path). Load the model with attn_implementation='sdpa', 'eager' or "
    "'{name}' to read FP8 directly."
)
# Layer type -> its storage policy's layers: (dynamic, static) FP8 layers, transformers' layer for a skipped one
POLICIES = {
    "full_attention": (DynamicFP8Layer, StaticFP8Layer, DynamicLayer),
    "sliding_attention": (DynamicFP8SlidingLayer, StaticFP8SlidingLayer, DynamicSlidingWindowLayer),
    "chunked_attention": (DynamicFP8SlidingLayer, StaticFP8SlidingLayer, DynamicSlidingWindowLayer),
}
# Models whose attention reshapes or post-processes K/V after `update`: they need real tensors.
POST_PROCESSING_MODEL_TYPES = frozenset({"idefics", "clvp", "moonshine"})


class QuantizedFP8Cache(Cache):
    """A KV cache that stores keys and values in FP8 (or int8) and is read by FP8 attention.

    `QuantizedFP8Cache(model)` (or `config=model.config`) then `model.generate(..., past_key_values=cache)`
    (or `cache=cache`). Building it from the model switches the model's attention to "fp8kv", which behaves
    exactly like the previous implementation for every other cache. A filled cache refuses a prompt that does not
    continue its tokens (`CacheReuseError`; where that check applies: `hf_fp8kv.guard`). It is for inference: no
    gradient reaches the keys and values it holds (a forward pass with gradients on gives no_grad's outputs).

    Args:
        kv_cache_dtype: "fp8" / "fp8_e4m3" (default; "fp8" is "fp8_e4m3fnuz" on ROCm), "fp8_e5m2",
            "fp8_e4m3fnuz" (checkpoint scales doubled, max 240), "int8_per_token_head".
        scales: "auto" (the checkpoint's scales in any convention, else 1.0 with a warning), "dynamic" (per
            token and head), "dynamic_key_channels" (per token and head, keys divided first by per-channel scales
            each layer measures from its keys when its first token is coded: with int8 no calibration pass is
            needed; dynamic caches with `recent_tokens >= 64`, docs/recent.md), a float, a `KVScales`
            (`hf_fp8kv.calibrate(...)`, `KVScales.from_pretrained`), the path of a scales file, or per-layer K/V
            scales (`{layer: (k, v)}` or a list with one `(k, v)` per layer; each a float or one value per KV head).
        skip_layers: layers kept in the model dtype (transformers' own layers): indices, "sliding_window" (every
            sliding and chunked layer, as vLLM's `--kv-cache-dtype-skip-layers`), or a mix such as
            `["sliding_window", 0]` or "sliding_window,0".
        backend: "auto", "triton" or "torch" (default: env HF_FP8KV_BACKEND, else "auto").
        block_size: tokens added per buffer growth (on the Triton backend rounded up to a multiple of 64, the
            blocks its value codes are stored in).
        recent_tokens: the newest tokens of each sequence kept in the model's dtype (default 128), stored only
            there: a token is quantized once, when it leaves them.
        sink_tokens: the first real tokens of each sequence (attention sinks) kept in the model's dtype
            (full-attention layers; default 4). `recent_tokens=0, sink_tokens=0` is pure FP8, what vLLM
            serves. The defaults and their measurements: docs/recent.md.
        max_cache_len: makes the cache static (for `torch.compile` and CUDA graphs): buffers for this many
            tokens, allocated at the first update, positions kept on the device, `is_compileable` True.
        max_batch_size: with `max_cache_len`, the largest batch the cache accepts (default: the first batch's).
        fp8_prefill: run a prefill's attention dots over e4m3 codes on FP8 tensor cores (the Triton backend, fp16
            or bf16 models): the query and the probabilities rounded to e4m3. Off by default: it cost SmolLM2's
            prefill a mean KL of 3e-3 (docs/benchmarks.md, issue 21 round 3); not timed on a GPU yet.
        rotate: store each coded token's keys and values times a Hadamard matrix over the head dimension
            (FlashAttention-3's "incoherent processing": outlier channels spread before FP8 rounds them); the
            attention rotates the query once and the output back, the recent and sink tokens stay as they came.
            Needs per-token scales (`scales="dynamic"`) or the uncalibrated 1.0. Measurements: docs/recent.md.
        outlier_tokens: per layer and KV head, at most this many coded tokens kept in the model's dtype too (on
            sliding layers, among those the window still shows), those of smallest key L1 norm over the running
            mean (Outlier Tokens Tracing's rule: delimiters that draw attention like sinks); chosen as they get
            codes, read exact by the attention.
            Needs per-token scales (`scales="dynamic"`); default 0. Measurements: docs/recent.md.
        scale_search: each coded token's per-token scale chosen among this many (2-128, a power of two) in one
            octave above its amax scale, the one with the least error (the keys' weighted by the queries' mean
            square per channel, `hf_fp8kv/scale_search.py`); 0 (default): the amax scale. Needs per-token scales.
            Measurements, and why it is not the default: docs/recent.md.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        config=None,
        kv_cache_dtype: str = "fp8",
        scales: ScalesArg = "auto",
        skip_layers: str | Iterable[int | str] = (),
        backend: str | None = None,
        block_size: int = 64,
        recent_tokens: int = 128,
        sink_tokens: int = 4,
        max_cache_len: int | None = None,
        max_batch_size: int | None = None,
        offloading: bool = False,
        fp8_prefill: bool = False,
        rotate: bool = False,
        outlier_tokens: int = 0,
        scale_search: int = 0,
    ):
        if model is None and config is None:
            raise ValueError("QuantizedFP8Cache needs the model (or config=model.config)")
        config = config if config is not None else model.config
        settings = resolve_settings(
            config, kv_cache_dtype=kv_cache_dtype, scales=scales, skip_layers=skip_layers, backend=backend,
            recent_tokens=recent_tokens, sink_tokens=sink_tokens, block_size=block_size, max_cache_len=max_cache_len,
            max_batch_size=max_batch_size, offloading=offloading, fp8_prefill=fp8_prefill, rotate=rotate,
            outlier_tokens=outlier_tokens, scale_search=scale_search,
        )  # fmt: skip
        self.fmt = settings.fmt
        if settings.fp8_prefill and model is not None:
            for device in {parameter.device for parameter in model.parameters()}:
                ops.check_fp8_prefill(settings.backend, device, settings.fmt)
        text_config = config.get_text_config(decoder=True)
        layers = [self._layer(settings, i) for i in range(len(settings.layer_types))]
        super().__init__(layers=layers, offloading=offloading)
        self.attention_config = text_config
        self.token_history = TokenHistory()
        self._slow_path_warned = False
        self._caller_config = None  # the config of the attention module of the current `update`, when known
        self._post_processing = text_config.model_type in POST_PROCESSING_MODEL_TYPES
        use_fp8_attention(model if model is not None else config)
        if model is not None:
            install_generation_guard(model)

    def _layer(self, settings: CacheSettings, i: int):
        """Layer `i`'s storage: an FP8 layer of its type and policy, transformers' own layer when skipped."""
        kind, kwargs = settings.layer_types[i], settings.layer_kwargs[i]
        if kind not in POLICIES:
            return compat.no_cache_layer(kind)
        dynamic, static, skipped = POLICIES[kind]
        if i in settings.skip:
            # a static cache's masks cover [0, max_cache_len) on every layer type: every slot in full precision
            return StaticLayer(max_cache_len=settings.max_cache_len) if settings.max_cache_len else skipped(**kwargs)
        extra = {}
        if settings.max_cache_len is not None:
            dynamic, extra = static, dict(max_cache_len=settings.max_cache_len, max_batch_size=settings.max_batch_size)
        return dynamic(
            settings.fmt, settings.scales[i], settings.block_size, settings.backend, self._uses_fp8_attention, i,
            recent_tokens=settings.recent_tokens, sink_tokens=settings.sink_tokens, fp8_prefill=settings.fp8_prefill,
            rotate=settings.rotate, outlier_tokens=settings.outlier_tokens, scale_search=settings.scale_search,
            **extra, **kwargs,
        )  # fmt: skip

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not torch.compiler.is_compiling():
            # the attention module calling us runs the attention that will read what we return: a cache built from
            # another config, or used with another model, must hand real tensors to an sdpa/eager module
            self._caller_config = _module_config(sys._getframe(1))
        # stored as codes: no gradient reaches the cached K/V, so a forward pass with gradients on (a notebook's
        # plain `model(...)`) gives no_grad's outputs and the cache holds no autograd graph
        return super().update(key_states.detach(), value_states.detach(), layer_idx, *args, **kwargs)

    def _uses_fp8_attention(self) -> bool:
        caller = None if torch.compiler.is_compiling() else self._caller_config
        config = caller if caller is not None else self.attention_config
        implementation = attention_implementation(config)
        if is_fp8_attention(implementation) and not self._post_processing:
            return True
        if not self._slow_path_warned:
            reason = (
                f"model type {self.attention_config.model_type!r} post-processes K/V"
                if self._post_processing
                else f"it runs {implementation!r}"
                + ("; this cache was built for another model or config: build it with QuantizedFP8Cache(model)"
                   if config is not self.attention_config else "")
            )  # fmt: skip
            warnings.warn(SLOW_PATH_WARNING.format(name=ATTENTION_NAME, reason=reason), stacklevel=4)
            self._slow_path_warned = True
        return False

    # --- what a generate call will ask, checked before its first step ---------------------------------------
    def check_generation(self, max_cache_length: int, batch_size: int, assisted: bool, chunked: bool) -> None:
        """Refuse, before the model runs, a generate call this cache cannot serve: more tokens than a static
        cache holds (`max_cache_length`: prompt + new tokens - 1), a larger batch (rows x beams or returned
        sequences) than its buffers, assisted / prompt-lookup decoding on layers that cannot roll back, or a
        `chunked` prefill onto a filled cache where transformers would write the conversation twice."""
        if chunked and not compat.CHUNKED_PREFILL_CONTINUES and self.get_seq_length():
            raise ValueError(
                f"prefill_chunk_size with a cache that already holds {self.get_seq_length()} tokens: this transformers "
                "restarts a chunked prefill at the first token and would write the conversation twice (transformers "
                "5.24 continues it); continue without prefill_chunk_size, or upgrade transformers"
            )
        static = [layer for layer in self.layers if isinstance(layer, StaticFP8Layer)]
        limit = min((layer.max_cache_len for layer in static), default=None)
        if limit is not None and max_cache_length > limit:
            raise ValueError(
                f"this generate call may hold {max_cache_length} tokens (prompt + max_new_tokens - 1) but this static "
                f"cache holds max_cache_len={limit}: build QuantizedFP8Cache(model, max_cache_len={max_cache_length}) "
                "or lower max_new_tokens"
            )
        rows = [layer.max_batch_size for layer in static if layer.max_batch_size is not None]
        if rows and batch_size > min(rows):
            raise ValueError(
                f"this generate call runs {batch_size} rows (batch x beams or returned sequences) but this static "
                f"cache holds max_batch_size={min(rows)}"
            )
        if assisted and not self.is_croppable:
            layer = next(i for i, layer in enumerate(self.layers) if not layer.is_croppable)
            raise ValueError(
                f"assisted and prompt-lookup decoding roll the cache back after each draft, but layer {layer} cannot "
                "roll back: a static cache's sliding-window layers are rings that overwrite the tokens it would "
                "need (max_cache_len > sliding_window). Use the dynamic cache (no max_cache_len) for assisted decoding"
            )

    # --- generate's batch and rollback operations also keep the token history in step ----------------------
    def reset(self) -> None:
        super().reset()
        self.token_history.clear()

    def crop(self, tokens_to_remove: int) -> None:
        # transformers 5.17's assisted decoding passes a 0-dim tensor (its count of matched tokens): our layers keep
        # positions as Python ints, so it is read once here (a tensor `end` would be advanced in place twice a step)
        super().crop(int(tokens_to_remove))
        self.token_history.crop(self.get_seq_length())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.token_history.map(lambda ids: ids.index_select(0, beam_idx.to(ids.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.token_history.map(lambda ids: ids.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.token_history.map(lambda ids: ids[indices])

    # --- introspection -----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Total bytes held by the cache (codes, per-token scales and skipped layers' tensors)."""
        return sum(_layer_nbytes(layer) for layer in self.layers)

    def summary(self) -> list[dict]:
        """One row per layer: storage, scale granularity and source, K/V scales, bytes held, clipped values."""
        rows = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, FP8Layer):
                scales = layer.scales
                rows.append(
                    {
                        "layer": i,
                        "storage": layer.fmt.name,
                        "granularity": scales.granularity
                        + (f", searched ({layer.scale_search.candidates})" if layer.scale_search.candidates else ""),
                        "source": scales.source,
                        "k_scale": scales.describe("key", layer.key_channel_scale is not None)
                        if isinstance(scales, MeasuredKeyChannels)
                        else scales.describe("key"),
                        "v_scale": scales.describe("value"),
                        "recent+sinks": f"{layer.recent_tokens}+{layer.sink_tokens}"
                        + (f" +{layer.outlier_tokens} outliers" if layer.outlier_tokens else ""),
                        "bytes": layer.nbytes,
                        "clipped": int(layer.clipped.sum().item()),
                        "non-finite": int(layer.nonfinite.sum().item()),
                    }
                )
            else:
                rows.append({"layer": i, "storage": "skipped", "granularity": "-", "source": "-", "k_scale": "-",
                             "v_scale": "-", "recent+sinks": "-", "bytes": _layer_nbytes(layer), "clipped": 0,
                             "non-finite": 0})
        return rows

    def __str__(self) -> str:
        return f"QuantizedFP8Cache({self.fmt.name}, {self.get_seq_length()} tokens, {self.nbytes} bytes)\n" + format_table(
            self.summary()
        )

    def __repr__(self) -> str:
        return f"QuantizedFP8Cache({self.fmt.name}, layers={len(self.layers)}, tokens={self.get_seq_length()})"


def _layer_nbytes(layer) -> int:
    if isinstance(layer, FP8Layer):
        return layer.nbytes
    return sum(t.nbytes for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def _module_config(frame):
    """The config of the module whose method runs in `frame` (None when it is not a module's)."""
    caller = frame.f_locals.get("self")
    return getattr(caller, "config", None) if isinstance(caller, torch.nn.Module) else None
