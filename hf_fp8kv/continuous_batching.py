"""Continuous batching (`model.generate_batch`, `model.init_continuous_batching`) over FP8 pages.

`enable(model, ...)` makes the model's continuous batching store each layer's K/V pages as FP8 codes plus
scales: the same paged cache, scheduler and allocators as transformers (their sectors, blocks, read and write
indices, sliding-window rings), with pages about half as large, so about twice the tokens fit in the same memory.
New tokens are quantized by our write path (`write_stacked`, the bits `QuantizedFP8Cache` writes) and every layer
is read by our attention through each request's read indices: the Triton paged kernel reads the rows in place
(`kernels/triton_paged.py`, CUDA), the torch path decodes one request's rows at a time (CPU); never a
full-precision copy of the cache.

A page row is one token's keys (or values) of one layer: `[codes of every KV head | fp32 scale per head]`
(per-token-head scales), `[codes]` (static scales) or the model-dtype values (layers in `skip_layers`). A block
is one page per layer of its attention group, laid out inside the block's bytes, so transformers' sectors,
block copies (forks, CPU offloading) and index arithmetic stay as they are. With recent and sink tokens (the
dense cache's default), each request in flight also holds its newest and first tokens in the model's dtype
beside its pages (`paged_recent.py`; a request over a prefix from the prefix cache gets its first tokens from an
earlier request with the same ones). Its full-attention pages then store each token once: a token's page row is
written when it leaves the recent ones, and a block whose tokens are all recent is `VIRTUAL_BLOCK`, which takes
nothing from the pool (`FP8FullAttentionAllocator`): a request holds `recent_tokens // page_size` fewer blocks.
With `outlier_tokens`, each request also keeps, per layer and KV head, that many of its coded tokens exact beside
them (`paged_recent.SlotOutliers`), chosen as `QuantizedFP8Cache` chooses them (a sliding layer's among those its
window still shows).

These are transformers internals, not public API: `enable` compares the source of each one it relies on with the
sources it was verified with (`VERIFIED_INTERNALS`) and refuses any other, naming it. Before transformers 5.24 the
paged cache reaches the attention function as `cache=` (which then writes the new tokens: `compat`), from 5.24 the
attention module writes them; the pages, allocators and indices are the same. From 5.25 the paged cache builds its
allocators in `_create_allocator`, rebound like `__init__`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import types
import warnings
from dataclasses import dataclass, replace
from typing import Iterable

import torch
import transformers
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import (
    PagedAttentionCache,
    PagedAttentionMemoryHandler,
    group_layers_by_attn_type,
)

try:
    from transformers.generation.continuous_batching.cache_allocators import (
        FULL_ATTENTION,
        SLIDING_ATTENTION,
        FullAttentionCacheAllocator,
        SlidingAttentionCacheAllocator,
    )
except ImportError as error:  # an import that moved: the allocators are a package from transformers 5.18 on
    raise ImportError(
        f"hf_fp8kv.continuous_batching needs transformers 5.20 or later (its paged-cache allocators); transformers "
        f"{transformers.__version__} is installed. QuantizedFP8Cache with model.generate works with it."
    ) from error
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager, ContinuousMixin
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.utils import find_num_key_value_heads

from hf_fp8kv.attention import ATTENTION_NAME, FP8KeyStates, use_fp8_attention
from hf_fp8kv.cache import QuantizedFP8Cache
from hf_fp8kv.kernels.formats import StorageFormat
from hf_fp8kv.kernels.ops import backend_for
from hf_fp8kv.kernels.paged import PageGeometry, RecentRows, RowLayout
from hf_fp8kv.paged_recent import LayerRows, RequestSlots
from hf_fp8kv.scale_search import ScaleSearch
from hf_fp8kv.scales import CALIBRATE_KEY_CHANNELS, MeasuredKeyChannels, ScalesArg
from hf_fp8kv.settings import check_count, resolve_settings

# The sources (`_source_digest`) of the internals `enable` relies on (`_internals`), in the transformers releases
# where the tests passed; `enable` refuses any other.
VERIFIED_TRANSFORMERS = "5.20-5.25"
# 5.20; where 5.21 (manager), 5.24 (cache, memory handler) and 5.25 (the cache's allocators built by
# `_create_allocator`, the memory handler's sizing of MLA models) differ
VERIFIED_INTERNALS: dict[str, set[str]] = {
    "CacheAllocator": {"eca946b9427f2982"},
    "FullAttentionCacheAllocator": {"0645997145453be8"},
    "SlidingAttentionCacheAllocator": {"e387230391ff13bf"},
    "PagedAttentionCache.__init__": {"0f37a4fe830b387f", "90db8dad79880e11", "e9813fb3ec941bd7"},
    "PagedAttentionCache._create_allocator": {"4e12cf279364291c"},  # (5.25 on)
    "PagedAttentionCache.update": {"4ba112795f0ef346"},
    # (the request slots of the recent and sink tokens follow these: the same source in 5.20 to 5.25)
    "PagedAttentionCache.can_store_request_tokens": {"021cc19cbe54a87d"},
    "PagedAttentionCache.free_blocks": {"b966bf16f435357b"},
    "PagedAttentionCache.free_all_requests": {"5bdb053392d5ddf4"},
    "PagedAttentionCache.extend_read_and_write_indices": {"c15b991842218c78"},
    "PagedAttentionCache.prepare_fork_request": {"fba1d9d1d3f45a5b"},
    "PagedAttentionCache.mark_complete_blocks": {"89dbb22a02678218"},  # (hashing waits for a block's codes)
    "PagedAttentionMemoryHandler": {"6a160b0b71c22e89", "0c9933b0fad2ae95", "f8593c6083ed1bdf"},
    "group_layers_by_attn_type": {"2f38000fc6f10bfc"},
    "ContinuousBatchingManager.__init__": {"d04c8e6c28c29311", "3037dc8d5ae04c5e"},
    "ContinuousBatchingManager._create_batch_processor": {"a606593698427df1"},
    "ContinuousMixin.init_continuous_batching": {"142ab58ebeef6c1c"},
    "ContinuousBatchingIOs.get_model_kwargs": {"9fed47790bcfa2da"},
    "find_num_key_value_heads": {"7c33dcea9979a2f7"},
    "RequestState": {"5a790292c4732592"},  # (its first tokens: the kept sink rows' key; the same in 5.20 to 5.25)
}  # fmt: skip
SUPPORTED_ATTENTION = ("sdpa", "eager", ATTENTION_NAME)
SETTINGS_ATTRIBUTE = "_fp8kv_paged_settings"
# The block of a request's table whose tokens are all among its recent ones: no page row of it is written or read
# (they are read from the request's rows), so it is given no memory. Block 0 lies in transformers' read-trash
# sector, which the pool never hands out and nothing writes.
VIRTUAL_BLOCK = 0
# Without `max_requests`, the recent and sink tokens of the requests in flight get an eighth of the KV memory:
# FP8 pages in the other seven eighths still hold 1.7x the blocks of bf16 pages (1.96x x 7/8)
RECENT_SHARE = 8
logger = logging.getLogger(__name__)


def dense_default(name: str) -> int:
    """`QuantizedFP8Cache`'s default for its argument `name`: continuous batching follows the dense cache's."""
    return inspect.signature(QuantizedFP8Cache.__init__).parameters[name].default


@dataclass
class PagedSettings:
    """What `enable` resolved: one row layout per layer, the recent and sink tokens, and the attention
    implementation it replaced."""

    fmt: StorageFormat
    layouts: dict[int, RowLayout]
    fixed_scales: dict[int, torch.Tensor]  # layers with one scale per KV head: fp32 [2 (K, V), kv_heads]
    backend: str
    previous_attention: str
    recent_tokens: int = 0
    sink_tokens: int = 0
    sliding_layers: frozenset[int] = frozenset()
    max_requests: int | None = None  # requests in flight at once (None: from the memory, see `requests_in`)
    outlier_tokens: int = 0  # per KV head, coded tokens kept exact too (`paged_recent.SlotOutliers`)

    def block_bytes(self, layers: Iterable[int], page_size: int) -> int:
        """Bytes of one block of `layers`: one page of K and V per layer."""
        return sum(2 * page_size * self.layouts[i].nbytes for i in layers)

    def sink_rows(self, layer: int) -> int:
        """Sink tokens a request holds in `layer` (none on sliding layers or a layer kept in the model dtype)."""
        return 0 if self.layouts[layer].fmt is None or layer in self.sliding_layers else self.sink_tokens

    def outlier_rows(self, layer: int) -> int:
        """Outlier tokens a request holds in `layer`: every layer stored as codes, with recent tokens (the
        candidates are those that leave them; a sliding layer's leave its set a window behind, as on the dense
        cache)."""
        return self.outlier_tokens if self.layouts[layer].fmt is not None and self.recent_tokens else 0

    def held_rows(self, layer: int) -> int:
        """Rows a request holds in `layer` for its recent, sink and outlier tokens (none on a layer kept in the
        model dtype)."""
        if self.layouts[layer].fmt is None:
            return 0
        return self.recent_tokens + self.sink_rows(layer) + self.outlier_rows(layer)

    def stores_once(self) -> bool:
        """Whether the full-attention pages store each token once (recent tokens held, and no full-attention layer
        kept in the model's dtype: such a layer has no rows, its pages hold its every token)."""
        full = [i for i in self.layouts if i not in self.sliding_layers]
        return self.recent_tokens > 0 and bool(full) and all(self.layouts[i].fmt is not None for i in full)

    def request_bytes(self) -> int:
        """Bytes of one request's recent, sink and outlier tokens, every layer, with one prompt's kept sink tokens
        (a request slot's share of `paged_recent.RequestSlots.kept`) and its outlier sets' positions, scores and
        norm sums (4 bytes each)."""
        rows = sum(2 * (self.held_rows(i) + self.sink_rows(i)) * layout.kv_heads * layout.head_dim
                   * layout.dtype.itemsize for i, layout in self.layouts.items())  # fmt: skip
        sets = sum(4 * layout.kv_heads * (2 * self.outlier_rows(i) + 2) for i, layout in self.layouts.items()
                   if self.outlier_rows(i))  # fmt: skip
        return rows + sets

    def requests_in(self, memory: int) -> int:
        """Requests in flight at once under a KV memory setting of `memory` bytes: `max_requests`, else as many
        as `1 / RECENT_SHARE` of it holds (at least one); 0 without recent or sink tokens."""
        per_request = self.request_bytes()
        if not per_request:
            return 0
        return self.max_requests or max(1, memory // RECENT_SHARE // per_request)


# --- enable / disable ------------------------------------------------------------------------------------------
def enable(
    model: torch.nn.Module,
    *,
    kv_cache_dtype: str = "fp8",
    scales: ScalesArg = "auto",
    skip_layers: str | Iterable[int | str] = (),
    backend: str | None = None,
    recent_tokens: int | None = None,
    sink_tokens: int | None = None,
    max_requests: int | None = None,
    rotate: bool = False,
    outlier_tokens: int | None = None,
    scale_search: int | None = None,
) -> PagedSettings:
    """Make `model.generate_batch(...)` and `model.init_continuous_batching(...)` store K/V pages in FP8.

    The arguments are `QuantizedFP8Cache`'s (`kv_cache_dtype`, `scales`, `skip_layers`, `backend`,
    `recent_tokens`, `sink_tokens`, `rotate`, `outlier_tokens`, `scale_search`; None: its default): each request
    keeps its newest and first tokens in the model's dtype beside its pages; `recent_tokens=0, sink_tokens=0` is
    pure FP8, as vLLM serves it; `rotate`: the pages' codes hold the keys and values times a Hadamard matrix
    (rotated codes); `outlier_tokens`: per layer and KV head, that many coded tokens of each request kept exact too
    (`kernels/outliers.py`'s rule, as `QuantizedFP8Cache`'s; per-token scales and recent tokens); `scale_search`:
    each coded token's per-token scale searched among that many, the keys weighted by the queries every request
    of the layer has sent so far (one sum per layer, `hf_fp8kv/scale_search.py`).
    `max_requests`: requests in flight at once, each holding its recent and sink tokens (default: as many as an
    eighth of the KV memory holds; others wait, as for pages). Calling `enable` again replaces the settings;
    `disable(model)` restores transformers' own pages. Returns the resolved settings.
    """
    check_transformers_version()
    recent_tokens = dense_default("recent_tokens") if recent_tokens is None else recent_tokens
    sink_tokens = dense_default("sink_tokens") if sink_tokens is None else sink_tokens
    outlier_tokens = dense_default("outlier_tokens") if outlier_tokens is None else outlier_tokens
    scale_search = dense_default("scale_search") if scale_search is None else scale_search
    if max_requests is not None:
        max_requests = check_count("max_requests", max_requests, minimum=1)
    disable(model)  # enabling again starts from transformers' own state
    implementation = model.config._attn_implementation
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} is not supported by FP8 continuous batching: load the model with "
            "attn_implementation='sdpa' or 'eager' (our attention replaces it for every layer)"
        )
    config = model.config.get_text_config(decoder=True)
    groups = group_layers_by_attn_type(config)  # raises on layer types transformers' allocators do not have
    resolved = resolve_settings(model.config, kv_cache_dtype=kv_cache_dtype, scales=scales, skip_layers=skip_layers,
                                backend=backend, recent_tokens=recent_tokens, sink_tokens=sink_tokens,
                                rotate=rotate, outlier_tokens=outlier_tokens, scale_search=scale_search)  # fmt: skip
    if any(isinstance(s, MeasuredKeyChannels) for s in resolved.scales.values()):
        raise ValueError(
            "scales='dynamic_key_channels' on FP8 pages: the pages' key channel scales are shared by every request, "
            f"so one request's keys cannot set them; {CALIBRATE_KEY_CHANNELS}"
        )
    if resolved.outlier_tokens and not resolved.recent_tokens:
        raise ValueError(
            f"outlier_tokens={outlier_tokens} on FP8 pages needs recent_tokens > 0: a request's outlier tokens are "
            "chosen as its tokens leave the recent ones, which pure FP8 pages do not hold"
        )
    per_token = {i: resolved.stored(i) and resolved.scales[i].per_token for i in range(config.num_hidden_layers)}
    layouts = {
        i: RowLayout(resolved.fmt if resolved.stored(i) else None, per_token[i], resolved.kv_heads, resolved.head_dim,
                     model.dtype, getattr(resolved.scales.get(i), "key_channel", None), resolved.rotate,
                     resolved.scale_search if per_token[i] else 0)
        for i in range(config.num_hidden_layers)
    }  # fmt: skip
    fixed = {i: torch.stack((scheme.key, scheme.value)) for i, scheme in resolved.scales.items() if not scheme.per_token}
    settings = PagedSettings(resolved.fmt, layouts, fixed, resolved.backend, implementation, resolved.recent_tokens,
                             resolved.sink_tokens, frozenset(groups.get(SLIDING_ATTENTION, ())), max_requests,
                             resolved.outlier_tokens)  # fmt: skip
    if not use_fp8_attention(model):
        raise ValueError(f"a sub-model of {type(model).__name__} runs an attention that FP8 pages cannot replace")
    setattr(model, SETTINGS_ATTRIBUTE, settings)
    model.init_continuous_batching = FP8InitContinuousBatching(model)
    return settings


def disable(model: torch.nn.Module) -> None:
    """Restore transformers' own continuous batching (model-dtype pages, the attention used before `enable`)."""
    settings = model.__dict__.pop(SETTINGS_ATTRIBUTE, None)
    if settings is None:
        return
    model.__dict__.pop("init_continuous_batching", None)
    model.destroy_cached_continuous_batching_manager()
    if settings.previous_attention != ATTENTION_NAME:
        model.set_attn_implementation(settings.previous_attention)


def check_transformers_version() -> None:
    """Raise unless every continuous-batching internal `enable` relies on has a source it was verified with."""
    for name, piece in _internals().items():
        try:
            digest = _source_digest(piece)
        except (OSError, TypeError):  # no source to compare
            digest = None
        if digest not in VERIFIED_INTERNALS.get(name, ()):
            raise RuntimeError(
                f"transformers {transformers.__version__} is installed: its continuous-batching {name} differs from "
                f"the ones hf_fp8kv.continuous_batching was verified with (transformers {VERIFIED_TRANSFORMERS}). "
                f"Install transformers {VERIFIED_TRANSFORMERS} or use QuantizedFP8Cache with model.generate"
            )


def _internals() -> dict[str, object]:
    """What `enable` subclasses, rebinds or calls in transformers' continuous batching, by name."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    classes = {c for a in (FullAttentionCacheAllocator, SlidingAttentionCacheAllocator) for c in a.__mro__}
    pieces = {c.__qualname__: c for c in classes if c.__module__.startswith("transformers.")}
    for function in (
        PagedAttentionCache.__init__, PagedAttentionCache.update, PagedAttentionCache.can_store_request_tokens,
        PagedAttentionCache.free_blocks, PagedAttentionCache.free_all_requests,
        PagedAttentionCache.extend_read_and_write_indices, PagedAttentionCache.prepare_fork_request,
        PagedAttentionCache.mark_complete_blocks,
        group_layers_by_attn_type,
        ContinuousBatchingManager.__init__, ContinuousBatchingManager._create_batch_processor,
        ContinuousMixin.init_continuous_batching, ContinuousBatchingIOs.get_model_kwargs, find_num_key_value_heads,
    ):  # fmt: skip
        pieces[_unwrap(function).__qualname__] = function
    if hasattr(PagedAttentionCache, "_create_allocator"):
        pieces["PagedAttentionCache._create_allocator"] = PagedAttentionCache._create_allocator
    pieces["PagedAttentionMemoryHandler"] = PagedAttentionMemoryHandler
    pieces["RequestState"] = RequestState
    return pieces


def _source_digest(piece) -> str:
    """A digest of the source of `piece`, without its comment and blank lines."""
    lines = inspect.getsource(_unwrap(piece)).splitlines()
    kept = [line.rstrip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def _unwrap(function):
    return getattr(function, "__wrapped__", function)


def _rebind(function, **names):
    """`function` with some of its module globals replaced (transformers builds these objects by name inside long
    methods; replacing the names for our call only reuses its code unchanged and touches no module state)."""
    function = _unwrap(function)
    rebound = types.FunctionType(
        function.__code__, {**function.__globals__, **names}, function.__name__, function.__defaults__,
        function.__closure__,
    )  # fmt: skip
    rebound.__kwdefaults__ = function.__kwdefaults__
    return rebound


class FP8InitContinuousBatching:
    """`model.init_continuous_batching` after `enable`: transformers' own, building an
    `FP8ContinuousBatchingManager`. A plain object (not a bound function), so the model still pickles."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.no_grad()
    def __call__(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        init = _rebind(ContinuousMixin.init_continuous_batching, ContinuousBatchingManager=FP8ContinuousBatchingManager)
        return init(self.model, generation_config, continuous_batching_config, workload_hints)


# --- the manager and the cache ---------------------------------------------------------------------------------
class FP8ContinuousBatchingManager(ContinuousBatchingManager):
    """transformers' manager over an `FP8PagedAttentionCache`, with our attention on every layer.

    The flash decode fast path (block tables), CUDA graphs and asynchronous batching are turned off: our attention
    reads pages through the read indices and takes its per-request lengths on the host, and the cache learns each
    step's requests as the host prepares it, right before its forward. A cancelled request is settled as an ended
    one (`_settle_cancellations`).
    """

    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None):
        config = replace(continuous_batching_config or ContinuousBatchingConfig())
        config.max_blocks_per_request = 0
        config.use_cuda_graph = False
        config.use_async_batching = False
        settings = getattr(model, SETTINGS_ATTRIBUTE, None)
        if settings is not None and settings.stores_once() and (config.cpu_offload_space or 0) > 0:
            warnings.warn(
                f"cpu_offload_space={config.cpu_offload_space} is turned off: FP8 pages with recent tokens store "
                "each token once, a request's newest tokens in its rows only, which a CPU swap of its pages would "
                "lose; preempted requests are computed again (recent_tokens=0, sink_tokens=0 keeps the swap)",
                stacklevel=3,
            )
            config.cpu_offload_space = 0.0
        super().__init__(model, generation_config, config, workload_hints)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        use_fp8_attention(model)

    def _create_batch_processor(self):
        settings = getattr(self.model, SETTINGS_ATTRIBUTE, None)
        if settings is None:
            raise RuntimeError("FP8 continuous batching was disabled on this model: create a new manager")
        cache_class = functools.partial(FP8PagedAttentionCache, settings)
        existing = getattr(self, "batch_processor", None)  # (reset and returned again by transformers)
        processor = _rebind(ContinuousBatchingManager._create_batch_processor, PagedAttentionCache=cache_class)(self)
        if processor is not existing:
            _settle_cancellations(processor.scheduler, processor.output_router)
        return processor


def _settle_cancellations(scheduler, router) -> None:
    """Finish what transformers (5.20-5.25) leaves undone when the scheduler drops cancelled requests, as it does
    for a request that ends: one that held pages lifts the block on new requests that a preemption sets (else,
    once every running request is cancelled, no request is ever admitted again), and their result handlers are
    removed (the step in flight when the cancel came has delivered its output by then: no output is left
    without a handler)."""
    clear = scheduler.clear_cancelled_requests

    def clear_cancelled_requests() -> list:
        cancelled = clear()
        if any(state.status != RequestStatus.PENDING for state in cancelled):  # it was running
            scheduler.block_new_requests = False
        with router._lock:
            for state in cancelled:
                router.result_handlers.pop(state.request_id, None)
        return cancelled

    scheduler.clear_cancelled_requests = clear_cancelled_requests


class FP8MemoryHandler(PagedAttentionMemoryHandler):
    """transformers' sizing with FP8 pages: our attention makes no batch-wide full-precision copy of the pages it
    reads (transformers' sdpa path charges one per cache token), only one request's keys and values of one
    layer at a time, in fp32, which is charged once, for the longest request the model takes; the requests'
    recent and sink tokens (`held_bytes`) are charged once too."""

    def __init__(self, settings: PagedSettings, held_bytes: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layout = next(iter(settings.layouts.values()))
        longest = getattr(self.config, "max_position_embeddings", None) or 8192
        self.request_read_bytes = 2 * layout.kv_heads * layout.head_dim * 4 * longest
        self.held_bytes = held_bytes

    @property
    def bytes_per_cache_token(self) -> int:
        return self.io_multiplier * self.num_groups * 8  # its share of the read indices

    @property
    def fixed_overhead_bytes(self) -> int:
        return super().fixed_overhead_bytes + self.request_read_bytes + self.held_bytes


def _native_sectors(config, cb_config, dtype, native_block_bytes, model_supports_logits_to_keep) -> tuple[int, int, int]:
    """Sectors (and bytes per sector) that transformers' own pages get from a memory setting, as it sizes them,
    and the memory it sizes from."""
    groups = group_layers_by_attn_type(config)
    page_bytes = native_block_bytes // config.num_hidden_layers
    block_sizes = [page_bytes * len(indices) for indices in groups.values()]
    bytes_per_sector = math.lcm(*block_sizes, 128)
    tokens_per_sector = max((bytes_per_sector // size) * cb_config.page_size for size in block_sizes)
    handler = PagedAttentionMemoryHandler(
        config=config, cb_config=cb_config, dtype=dtype, bytes_per_sector=bytes_per_sector,
        tokens_per_sector=tokens_per_sector, bytes_per_block=native_block_bytes, attn_types=list(groups),
        model_supports_logits_to_keep=model_supports_logits_to_keep,
    )  # fmt: skip
    _, num_sectors = handler.infer_max_batch_tokens_and_num_sectors()
    return num_sectors, bytes_per_sector, handler.available_memory


class FP8PagedAttentionCache(PagedAttentionCache):
    """transformers' `PagedAttentionCache` whose pages hold FP8 codes and scales (see the module docstring).

    Attributes beyond transformers': `num_blocks` counts FP8 blocks; `native_num_blocks` is what pages in the
    model dtype would give under the same memory setting; `stored_once_blocks` the whole-model blocks' worth of
    recent tokens the requests in flight hold in their rows and in no block; `capacity_ratio` the tokens held, blocks
    and rows together, against the native blocks'; `every_group_stores_once` whether no layer group writes its
    recent tokens' page rows (sliding ones do); `request_tokens_limit` the longest request the pages take;
    `block_bytes` / `native_block_bytes` the bytes of one whole-model block of `page_size` tokens; `request_slots`
    the requests' recent and sink tokens and the kept sink tokens (`held_bytes` in all; None for pure FP8).
    """

    def __init__(self, settings: PagedSettings, config, continuous_batching_config, device, distributed_helper,
                 dtype=torch.float16, model_supports_logits_to_keep=False):  # fmt: skip
        if distributed_helper.tp_size > 1:
            raise NotImplementedError("FP8 pages under tensor parallelism are not supported: run on one device")
        self.settings = settings
        page_size = continuous_batching_config.page_size
        num_layers = config.num_hidden_layers
        layout = settings.layouts[0]
        self.block_bytes = settings.block_bytes(range(num_layers), page_size)
        self.native_block_bytes = num_layers * FullAttentionCacheAllocator.get_bytes_per_page(
            find_num_key_value_heads(config), layout.head_dim, dtype, page_size
        )
        # before our pages are allocated: on the CPU the free memory transformers sees is the process's
        native_sectors = None
        if continuous_batching_config.num_blocks is None:
            native_sectors, native_sector_bytes, memory = _native_sectors(
                config, continuous_batching_config, dtype, self.native_block_bytes, model_supports_logits_to_keep
            )
        else:
            memory = continuous_batching_config.num_blocks * self.block_bytes
        slots = settings.requests_in(memory)
        self.held_bytes = slots * settings.request_bytes()
        self.request_slots = RequestSlots(settings.recent_tokens, settings.sink_tokens, slots) if slots else None
        per_layer_page = types.SimpleNamespace(get_bytes_per_page=lambda *_: math.ceil(self.block_bytes / num_layers))
        allocators = {
            FULL_ATTENTION: functools.partial(FP8FullAttentionAllocator, settings, self.request_slots),
            SLIDING_ATTENTION: functools.partial(FP8SlidingAttentionAllocator, settings, self.request_slots),
        }
        if hasattr(PagedAttentionCache, "_create_allocator"):  # (where transformers >= 5.25 builds the allocators)
            rebound = _rebind(PagedAttentionCache._create_allocator, ATTN_TYPE_TO_ALLOCATOR=allocators)
            self._create_allocator = types.MethodType(rebound, self)
        init = _rebind(
            PagedAttentionCache.__init__, ATTN_TYPE_TO_ALLOCATOR=allocators,
            FullAttentionCacheAllocator=per_layer_page,
            PagedAttentionMemoryHandler=functools.partial(FP8MemoryHandler, settings, self.held_bytes),
        )  # fmt: skip
        init(self, config, continuous_batching_config, device, distributed_helper, dtype,
             model_supports_logits_to_keep)  # fmt: skip
        if native_sectors is None:  # a capacity target (num_blocks): compare in the bytes these pages (and rows) hold
            held = self.num_sectors * self.bytes_per_sector + self.held_bytes
            self.native_num_blocks = held // self.native_block_bytes
        else:
            self.native_num_blocks = native_sectors * native_sector_bytes // self.native_block_bytes
        # what the requests in flight hold beside the blocks, each token once: their recent tokens' whole pages,
        # which their tables leave virtual (in whole-model blocks: the groups storing each token once are a share)
        once = [a.layer_indices for a in self.cache_allocators.values() if a.store_once]
        recent_pages = settings.recent_tokens // page_size
        self.stored_once_blocks = slots * recent_pages * sum(settings.block_bytes(i, page_size) for i in once) \
            / self.block_bytes  # fmt: skip
        self.capacity_ratio = (self.num_blocks + self.stored_once_blocks) / max(self.native_num_blocks, 1)
        # the longest request the pages take (where every group stores each token once, its recent pages are none)
        self.every_group_stores_once = bool(once) and len(once) == len(self.cache_allocators)
        self.request_tokens_limit = (self.num_blocks + recent_pages * self.every_group_stores_once) * page_size
        recent = (
            f"; recent {settings.recent_tokens} + sinks {settings.sink_tokens} tokens in {dtype} for up to {slots} "
            f"requests at once and {slots} prompts' sinks ({self.held_bytes / 2**20:.1f} MiB), "
            + (f"each token stored once (the requests' {recent_pages} recent pages each are in no block)" if once
               else "the recent tokens in the pages too")
            if slots else "; pure FP8"
        )  # fmt: skip
        logger.info(
            f"FP8 pages ({settings.fmt.name}): {self.num_blocks} blocks of {page_size} tokens, "
            f"{self.block_bytes} bytes per block; pages in {dtype} would give {self.native_num_blocks} blocks "
            f"({self.native_block_bytes} bytes per block) under the same memory setting: "
            f"{self.capacity_ratio:.2f}x the tokens{recent}"
        )

    # the requests' slots for their recent and sink tokens follow their blocks
    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """transformers' check, and (recent or sink tokens) a slot for a request that holds none yet: with none
        free, the request waits as when the pages are full."""
        slots = self.request_slots
        if slots is None or state.request_id in slots.held:
            return super().can_store_request_tokens(state, request_len, dry_run)
        if not slots.free:
            return False
        stored = super().can_store_request_tokens(state, request_len, dry_run)
        if stored and not dry_run:
            first = state.initial_tokens[: slots.sinks] + state.generated_tokens[: slots.sinks]
            slots.admit(state.request_id, first, state.current_len())
        return stored

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache)
        if self.request_slots is not None:
            self.request_slots.release(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        if self.request_slots is not None:
            self.request_slots.release_all()

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)
        if self.request_slots is not None:
            self.request_slots.schedule(request_id, past_length, query_length, write_index)

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst) -> list[str]:
        """transformers' fork, for as many children as there are free slots (they get a copy of the parent's
        recent and sink tokens; the others are prefilled anew by transformers)."""
        slots = self.request_slots
        if slots is None:
            return super().prepare_fork_request(src_state, dst_req_ids, copy_src_and_dst)
        forked = super().prepare_fork_request(src_state, dst_req_ids[: len(slots.free)], copy_src_and_dst)
        slots.fork(src_state.request_id, forked)
        return forked

    @torch.compiler.disable
    def update(self, key_states, value_states, layer_idx, kwargs):
        """Quantize the new tokens into their pages and hand our attention a `PagedKV` for this layer."""
        allocator = self.layer_to_allocator[layer_idx]
        if kwargs.get("block_table") is not None:
            raise RuntimeError("FP8 pages are read through read indices: the block-table decode path must be off")
        if self.request_slots is not None:
            self.request_slots.start_step()
        max_length_k = kwargs.get("max_length_k")  # per layer type (an int in older transformers)
        if isinstance(max_length_k, dict):
            max_length_k = max_length_k.get(allocator.layer_type)
        paged = allocator.write_and_view(
            key_states, value_states, layer_idx, kwargs["read_index"][allocator.index],
            kwargs["write_index"][allocator.index], kwargs["cu_seq_lens_q"],
            kwargs["cu_seq_lens_k"][allocator.layer_type], kwargs["max_length_q"], max_length_k,
        )  # fmt: skip
        return paged, paged

    def layer_summary(self) -> list[dict]:
        """Per layer: storage, scale kind, page row bytes, clipped and non-finite counts so far."""
        stats = {i: counts for allocator in self.cache_allocators.values() for i, counts in allocator.stats.items()}
        rows = []
        for i, layout in self.settings.layouts.items():
            counts = stats.get(i)
            rows.append({
                "layer": i,
                "storage": layout.fmt.name if layout.fmt else f"skipped ({layout.dtype})",
                "scales": ("per-token-head" if layout.per_token else "per-head") if layout.fmt else "-",
                "row_bytes": layout.nbytes,
                "recent+sinks": self.settings.held_rows(i) - self.settings.outlier_rows(i),
                "outliers": self.settings.outlier_rows(i),
                "clipped": int(counts[:, 0].sum()) if counts is not None else 0,
                "non-finite": int(counts[:, 1].sum()) if counts is not None else 0,
            })  # fmt: skip
        return rows


class FP8PagesMixin:
    """Pages of mixed row layouts inside each block; reads and writes by transformers' physical indices
    (`block * block_physical_stride + slot`)."""

    store_once = False  # (see FP8FullAttentionAllocator)

    def __init__(self, settings: PagedSettings, slots: RequestSlots | None, *args, layer_indices: list[int], **kwargs):
        self.settings, self.slots = settings, slots
        self.layouts = [settings.layouts[i] for i in layer_indices]
        self.has_nan = dict.fromkeys(layer_indices, False)
        super().__init__(*args, layer_indices=layer_indices, **kwargs)

    def get_bytes_per_page(self, num_key_value_heads, head_dim, cache_dtype, page_size) -> int:
        block = sum(2 * page_size * layout.nbytes for layout in self.layouts)
        return math.ceil(block / len(self.layouts))

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)
        self.geometry: dict[int, PageGeometry] = {}  # layer -> where its rows lie in the page bytes
        offset = 0
        for layer_idx, layout in zip(self.layer_indices, self.layouts):
            self.geometry[layer_idx] = PageGeometry(offset, self.bytes_per_block, self.block_physical_stride,
                                                    self.tokens_per_page)  # fmt: skip
            offset += 2 * self.tokens_per_page * layout.nbytes
        device = cache_tensor.device
        self.backend = backend_for(self.settings.backend, device)
        quantized = [i for i, layout in zip(self.layer_indices, self.layouts) if layout.fmt is not None]
        # per layer: int64 [2 (K, V), 2 (clipped, non-finite)], summed over every write
        self.stats = {i: torch.zeros(2, 2, dtype=torch.int64, device=device) for i in quantized}
        self.fixed_scales = {i: self.settings.fixed_scales[i].to(device) for i in quantized if i in self.settings.fixed_scales}
        # per layer with per-channel key scales: them on this device, fp32 (as a dense layer holds them), once
        self.key_channels = {i: layout.key_channel.to(device, torch.float32).contiguous()
                             for i, layout in zip(self.layer_indices, self.layouts) if layout.key_channel is not None}
        # per layer with searched scales: the queries' energy every request adds to (`hf_fp8kv/scale_search.py`)
        self.searches: dict[int, ScaleSearch] = {}
        for i, layout in zip(self.layer_indices, self.layouts):
            if layout.scale_search:
                self.searches[i] = ScaleSearch(layout.scale_search)
                self.searches[i].allocate(layout.kv_heads, layout.head_dim, device)
        # per layer: each slot's recent, sink and outlier tokens, [slots * held rows, 2 (K, V), kv_heads, head_dim]
        self.slot_rows: dict[int, LayerRows] = {}
        for i, layout in zip(self.layer_indices, self.layouts):
            if self.slots is not None and self.settings.held_rows(i):
                shape = (self.slots.slots * self.settings.held_rows(i), 2, layout.kv_heads, layout.head_dim)
                rows = torch.zeros(shape, dtype=layout.dtype, device=device)
                self.slot_rows[i] = self.slots.add_layer(rows, self.settings.sink_rows(i),
                                                           self.settings.outlier_rows(i))  # fmt: skip

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError("FP8 pages have no block-table view: they are read through read indices")

    def write_and_view(self, key, value, layer_idx, read_index, write_index, cu_seq_lens_q, cu_seq_lens_k,
                       max_length_q, max_length_k=None):  # fmt: skip
        """Encode the new tokens (`[1, kv_heads, q, head_dim]`) into page rows at `write_index` (storing each token
        once: the tokens leaving the recent ones and the new ones already older) and return what the attention
        reads: per request, its past rows (by `read_index`) and its new rows (`max_length_k`: an upper bound of a
        request's keys, which the Triton kernel's split rule reads)."""
        states = torch.stack((key[0], value[0]))  # [2, kv_heads, q, head_dim]
        recent = None
        if layer_idx in self.slot_rows:
            recent, step, leaving = self._write_recent(states, layer_idx)
        if self.store_once:
            rows = self._encode_once(states, leaving, step, layer_idx)
        else:
            if recent is not None and self.slot_rows[layer_idx].outliers is not None:
                self._judge_outliers(torch.cat((leaving, states.index_select(2, step.coded)), dim=2), step, layer_idx)
            rows = self._encode(states, layer_idx, write_index)
        return PagedKV(self, layer_idx, rows, read_index, write_index, cu_seq_lens_q, cu_seq_lens_k, max_length_q,
                       recent, max_length_k)  # fmt: skip

    def _encode(self, states: torch.Tensor, layer_idx: int, index: torch.Tensor) -> torch.Tensor:
        """Encode `states` (`[2, kv_heads, tokens, head_dim]`, in the model's dtype) into the page rows at physical
        indices `index`; returns the rows."""
        layout = self.settings.layouts[layer_idx]
        channel = self.key_channels.get(layer_idx)
        if channel is not None:  # (in the model's dtype, as the dense layers store them)
            keys = (states[0] / channel[:, None, :]).to(states.dtype)
            states = torch.stack((keys, states[1]))
        search = self.searches.get(layer_idx)
        rows, nonfinite = self.backend.write_rows(
            states, layout, self.stats.get(layer_idx), self.fixed_scales.get(layer_idx), self.cache_tensor,
            self.geometry[layer_idx], index, None if search is None else search.energy,
        )  # fmt: skip
        self.has_nan[layer_idx] |= nonfinite
        return rows

    def _encode_once(self, states: torch.Tensor, leaving: torch.Tensor, step, layer_idx: int) -> torch.Tensor:
        """Encode the tokens leaving the recent ones (`leaving`) and the step's new tokens already older than them
        (of `states`); the new rows of the step's tokens: those encoded now, zeros for the recent ones (read from
        the slot rows)."""
        new_rows = torch.zeros(states.shape[2], 2, self.settings.layouts[layer_idx].nbytes, dtype=torch.uint8,
                               device=states.device)  # fmt: skip
        if step.code_targets.numel():
            encoded = torch.cat((leaving, states.index_select(2, step.coded)), dim=2)
            self._judge_outliers(encoded, step, layer_idx)
            rows = self._encode(encoded, layer_idx, step.code_targets)
            new_rows.index_copy_(0, step.coded, rows[step.evicted.numel() :])
        return new_rows

    def _judge_outliers(self, leaving_and_coded: torch.Tensor, step, layer_idx: int) -> None:
        """Judge the step's outlier candidates (`leaving_and_coded`: the exact K/V of the tokens leaving the recent
        ones, then of the new ones already older), before the attention reads the sets, as on the dense cache."""
        outliers = self.slot_rows[layer_idx].outliers
        if outliers is not None and step.candidates is not None:
            outliers.judge(step.candidates, leaving_and_coded, self.settings.sink_rows(layer_idx))

    def _write_recent(self, states: torch.Tensor, layer_idx: int) -> tuple[RecentRows, object, torch.Tensor | None]:
        """Copy this step's recent and sink tokens (`states` `[2, kv_heads, q, head_dim]`) into the layer's rows;
        what the attention reads there, the step, and (storing each token once) the tokens leaving the recent ones,
        read before their rows are reused, `[2, kv_heads, tokens, head_dim]`."""
        sinks = self.settings.sink_rows(layer_idx)
        step = self.slots.group(self.index, sinks, lambda past, new: self.get_seqlen_k(past, new) - new,
                                states.device, self.place if self.store_once else None,
                                self.settings.outlier_rows(layer_idx))  # fmt: skip
        layer = self.slot_rows[layer_idx]
        rows = layer.rows
        keep = self.store_once or layer.outliers is not None  # (outlier candidates: read before the rows are reused)
        leaving = rows.index_select(0, step.evicted).permute(1, 2, 0, 3) if keep else None
        if step.sources.numel():
            new = states.permute(2, 0, 1, 3)  # [q, 2, kv_heads, head_dim]
            rows.index_copy_(0, step.targets, new.index_select(0, step.sources).to(rows.dtype))
        return self.slots.rows_of(step, layer, sinks), step, leaving


class FP8FullAttentionAllocator(FP8PagesMixin, FullAttentionCacheAllocator):
    """Full-attention layers on FP8 pages. Storing each token once (`store_once`, see `paged_recent`), a
    request's table holds `VIRTUAL_BLOCK` for each block whose tokens are all among its recent ones, and a
    block from the pool once one of its tokens leaves them (`needs_new_blocks` counts those, so that the
    scheduler admits and preempts by the blocks really taken); a block is offered to the prefix cache once all its
    tokens are encoded (`mark_complete_blocks`), and forks share the blocks holding codes."""

    window = None

    def __init__(self, settings: PagedSettings, slots: RequestSlots | None, *args, **kwargs):
        super().__init__(settings, slots, *args, **kwargs)
        self.store_once = slots is not None and settings.stores_once()
        self.encoded: dict[str, int] = {}  # request -> its tokens encoded once the step scheduled has run
        self.tokens: dict[str, list[int]] = {}  # request -> its token ids, as transformers last gave them

    def place(self, request_id: str, positions: range) -> list[int]:
        """The page rows (physical indices) of a request's `positions`, all in blocks from the pool."""
        table, size = self.block_table[request_id], self.tokens_per_page
        return [table[p // size] * self.block_physical_stride + p % size for p in positions]

    def _coded_blocks(self, request_id: str, past_length: int, query_length: int) -> tuple[int, int]:
        """The tokens encoded once this step has run (all but the recent ones), and the blocks holding them."""
        end = past_length + query_length
        encoded = max(self.slots.first_position(request_id, past_length), end - self.settings.recent_tokens)
        return encoded, -(-encoded // self.tokens_per_page)

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        if not self.store_once:
            return super().needs_new_blocks(request_id, past_length, query_length)
        table = self.block_table.get(request_id, [])
        _, coded = self._coded_blocks(request_id, past_length, query_length)
        return table[:coded].count(VIRTUAL_BLOCK) + max(0, coded - len(table))

    def allocate_cache_to_request(self, request_id: str, past_length: int, query_length: int) -> None:
        if not self.store_once:
            return super().allocate_cache_to_request(request_id, past_length, query_length)
        table = self.block_table.setdefault(request_id, [])
        encoded, coded = self._coded_blocks(request_id, past_length, query_length)
        table.extend([VIRTUAL_BLOCK] * (-(-(past_length + query_length) // self.tokens_per_page) - len(table)))
        virtual = [i for i in range(coded) if table[i] == VIRTUAL_BLOCK]
        for i, block in zip(virtual, self.pool.get_free_blocks(self.index, len(virtual))):
            table[i] = block
        self.encoded[request_id] = encoded

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """transformers' release; a request ending (not preempted: `no_cache`) first encodes its recent tokens of
        whole blocks where the pool has the blocks, so that the prefix cache keeps them (a next turn of a chat)."""
        if request_id in self.encoded:  # (virtual blocks: a suffix of the table, none from the pool)
            if not no_cache and request_id in self.slots.held:
                self._encode_recent_pages(request_id)
            del self.encoded[request_id]
            self.block_table[request_id] = [b for b in self.block_table.get(request_id, []) if b != VIRTUAL_BLOCK]
        self.tokens.pop(request_id, None)
        super().free_blocks(request_id, no_cache)

    def _encode_recent_pages(self, request_id: str) -> None:
        """Encode a request's recent tokens of whole pages into blocks from the pool (as many as are free), from
        its rows, and offer them to the prefix cache."""
        table, size, encoded = self.block_table[request_id], self.tokens_per_page, self.encoded[request_id]
        whole = min(self.slots.held[request_id].end, len(self.tokens.get(request_id, ()))) // size
        virtual = [i for i in range(-(-encoded // size), whole) if table[i] == VIRTUAL_BLOCK]
        while self.pool.count_free_blocks(self.index) < len(virtual) and self.pool.num_free_sectors:
            self.pool.allocate_sector(self.index)
        blocks = self.pool.get_free_blocks(self.index, min(len(virtual), self.pool.count_free_blocks(self.index)))
        if not blocks:
            return
        for i, block in zip(virtual, blocks):
            table[i] = block
        positions = range(encoded, (virtual[0] + len(blocks)) * size)
        index = torch.tensor(self.place(request_id, positions), dtype=torch.int64).to(self.cache_tensor.device)
        for layer_idx in self.layer_indices:
            rows = self.slot_rows[layer_idx].rows
            ring = self.slots.ring_rows(request_id, positions, self.settings.held_rows(layer_idx))
            states = rows[torch.tensor(ring, device=rows.device)].permute(1, 2, 0, 3).contiguous()
            self._encode(states, layer_idx, index)
        self.encoded[request_id] = positions.stop
        self.mark_complete_blocks(request_id, self.tokens[request_id], len(blocks))

    def mark_complete_blocks(self, request_id: str, token_ids: list[int], new_new_blocks: int) -> None:
        """transformers' hashing for the prefix cache, of the blocks whose every token is encoded (whole blocks of
        `token_ids` that are not yet hashed, whatever the step completed)."""
        if not self.store_once:
            return super().mark_complete_blocks(request_id, token_ids, new_new_blocks)
        self.tokens[request_id] = token_ids  # (the request's tokens so far, for `_encode_recent_pages`)
        encoded = self.encoded.get(request_id, 0) // self.tokens_per_page * self.tokens_per_page
        super().mark_complete_blocks(request_id, token_ids[:encoded], len(self.block_table[request_id]))

    def count_shareable_blocks(self, source_request_id: str, past_length: int) -> int:
        """A fork shares the source's whole blocks holding codes (the tokens yet to be encoded there are the
        same in both: older than the fork)."""
        if not self.store_once:
            return super().count_shareable_blocks(source_request_id, past_length)
        coded = len(self.block_table[source_request_id]) - self.block_table[source_request_id].count(VIRTUAL_BLOCK)
        return min(coded, past_length // self.tokens_per_page) if self.use_block_sharing else 0

    def count_non_shareable_blocks(self, source_request_id: str, past_length: int) -> int:
        if not self.store_once:
            return super().count_non_shareable_blocks(source_request_id, past_length)
        table = self.block_table[source_request_id]
        return len(table) - table.count(VIRTUAL_BLOCK) - self.count_shareable_blocks(source_request_id, past_length)

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int) -> tuple[list, list]:
        """transformers' fork over the source's blocks holding codes; its virtual blocks stay virtual."""
        if not self.store_once:
            return super().fork_blocks(source_request_id, dest_request_id, past_length)
        table = self.block_table[source_request_id]
        coded = [block for block in table if block != VIRTUAL_BLOCK]
        shared = coded[: self.count_shareable_blocks(source_request_id, past_length)]
        for block in shared:
            self.ledger.acquire(block)
        copied = coded[len(shared) :]
        fresh = self.pool.get_free_blocks(self.index, len(copied))
        self.block_table[dest_request_id] = shared + fresh + [VIRTUAL_BLOCK] * (len(table) - len(coded))
        self.encoded[dest_request_id] = self.encoded.get(source_request_id, 0)
        return copied, fresh


class FP8SlidingAttentionAllocator(FP8PagesMixin, SlidingAttentionCacheAllocator):
    """Sliding-window layers on FP8 pages (a ring of `sliding_window` slots per request, as transformers)."""

    @property
    def window(self) -> int:
        return self.sliding_window


# --- what the attention reads ----------------------------------------------------------------------------------
class PagedKV(FP8KeyStates):
    """One layer's pages for this step of a continuous batch: the FP8 attention function (`fp8kv`) calls
    `attend`, which reads each request's past rows through its read indices and its new rows."""

    def __init__(self, allocator, layer_idx, new_rows, read_index, write_index, cu_seq_lens_q, cu_seq_lens_k,
                 max_length_q, recent, max_length_k=None):  # fmt: skip
        self.allocator, self.layer_idx, self.new_rows = allocator, layer_idx, new_rows
        self.read_index, self.write_index = read_index, write_index
        self.cu_seq_lens_q, self.cu_seq_lens_k = cu_seq_lens_q, cu_seq_lens_k
        self.max_length_q, self.max_length_k, self.recent = max_length_q, max_length_k, recent

    @property
    def shape(self) -> tuple[int, int, int, int]:
        layout = self.allocator.settings.layouts[self.layer_idx]
        return (1, layout.kv_heads, int(self.cu_seq_lens_k[-1]), layout.head_dim)

    def attend(self, query, *, scaling, mask=None, window=None, softcap=None, sink_logits=None) -> torch.Tensor:
        """`[1, q_heads, q_tokens, head_dim]`: each request's queries over its own tokens (causal, and the
        sliding window of a sliding layer), from the pages. The window is the layer group's, as transformers'
        allocator keeps it (the model's `sliding_window` argument names the same one)."""
        cu_q = self.cu_seq_lens_q.to(torch.int32)
        q_lens = cu_q[1:] - cu_q[:-1]
        allocator, read_index = self.allocator, self.read_index
        # a full-attention layer's new tokens are in the pages already (written above) and listed in its read
        # indices after each request's past ones; with no past keys in the batch transformers lists none, and the
        # write indices say where they are (a sliding layer's ring may have overwritten some: read from new_rows)
        full = allocator.window is None
        if read_index.numel():
            cu_k = self.cu_seq_lens_k.to(torch.int32)
            k_first, past = cu_k[:-1], cu_k[1:] - cu_k[:-1] - q_lens
        else:
            k_first, past = cu_q[:-1], torch.zeros_like(q_lens)
            read_index = self.write_index if full else read_index
        layout, search = allocator.settings.layouts[self.layer_idx], allocator.searches.get(self.layer_idx)
        # the queries' sums of a searched layer: added by the attention launch where it can, else after it (as on
        # the dense cache: see scale_search.py)
        rows = query.shape[1] // layout.kv_heads * query.shape[2]
        summed = search is not None and allocator.backend.paged_sums_in_attention(layout, rows, softcap, sink_logits)
        out = allocator.backend.paged_attend(
            query[0].transpose(0, 1), allocator.cache_tensor, self.new_rows, read_index, cu_q, k_first, past,
            layout=layout, geometry=allocator.geometry[self.layer_idx], scaling=scaling, window=allocator.window,
            softcap=softcap, sink_logits=sink_logits, static_scales=allocator.fixed_scales.get(self.layer_idx),
            has_nan=allocator.has_nan[self.layer_idx], max_q_len=self.max_length_q, max_k_len=self.max_length_k,
            recent=self.recent, new_in_pages=full, **({"search_energy": search.energy} if summed else {}),
        )  # fmt: skip
        if search is not None and not summed:
            search.observe(query, allocator.key_channels.get(self.layer_idx), layout.rotate, allocator.backend)
        return out.transpose(0, 1)[None]

    def dequantized(self):
        raise RuntimeError("FP8 continuous batching pages are read by the fp8kv attention only")
