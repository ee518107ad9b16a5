"""transformers' `Serve` on FP8 pages: between building its FastAPI app and starting uvicorn, the pinned model's
continuous batching is put on FP8 pages (`continuous_batching.enable`), the page budget is set and reported, the
continuous-batching manager is started, and requests that could never complete get a 400 (`requests.py`).

Everything else is transformers' server: its routes, streaming, scheduler and cancellation on disconnect. Its
internals are not public API: `check_transformers_serve` checks the names relied on when a server starts.
"""

from __future__ import annotations

import logging
import numbers
import time
from dataclasses import dataclass

import torch
import transformers
from transformers.cli.serve import Serve

from hf_fp8kv import continuous_batching
from hf_fp8kv.continuous_batching import check_transformers_version, dense_default
from hf_fp8kv.serving import requests

TESTED_SERVE = "5.24"  # the transformers whose server this module was tested with
CPU_KV_MEMORY_MIB = 256  # on the CPU transformers sizes the pages from the host's RAM: a default budget instead
STARTUP_TIMEOUT_S = 300  # for the manager's thread to build the pages
# tokens per page without --cb-block-size (transformers' default, 256, gives 128 recent tokens no whole page of
# their own to leave out of the blocks; 16 is vLLM's default)
DEFAULT_PAGE_SIZE = 16
MAX_KV_MEMORY_MIB = 2**40  # 1 EiB: a bound that keeps `kv_memory_mib * 2**20` a finite count of bytes
logger = logging.getLogger("uvicorn.error")  # configured by the time the server is set up: lines in uvicorn's format

__all__ = ["FP8Options", "FP8Serve", "dense_default", "serve_model"]


@dataclass(frozen=True)
class FP8Options:
    """The FP8 cache's options of a server (`QuantizedFP8Cache`'s arguments, and the KV memory)."""

    kv_cache_dtype: str = "fp8"
    scales: float | str = "dynamic"
    skip_layers: str = ""
    backend: str | None = None
    recent_tokens: int | None = None  # None: QuantizedFP8Cache's default
    sink_tokens: int | None = None
    rotate: bool = False
    max_requests: int | None = None
    kv_memory_mib: float | None = None  # pages and recent/sink tokens; None: transformers' sizing (CPU: 256)
    outlier_tokens: int | None = None  # None: QuantizedFP8Cache's default
    scale_search: int | None = None  # None: QuantizedFP8Cache's default

    def __post_init__(self) -> None:
        """The KV memory refused by name (the other options are checked by `continuous_batching.enable`)."""
        mib = self.kv_memory_mib
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, numbers.Real)
                                or not 0 < mib <= MAX_KV_MEMORY_MIB):  # fmt: skip
            raise ValueError(f"kv_memory_mib={mib!r} must be a number of MiB above 0 and at most {MAX_KV_MEMORY_MIB}")


def check_transformers_serve() -> None:
    """Raise unless the serving extra is installed and transformers' server has the internals this module relies
    on (and continuous batching's)."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError("hf-fp8kv serve needs the serving extra: pip install 'hf-fp8kv[serve]'")
    check_transformers_version()
    from transformers.cli.serving import model_manager, utils
    from transformers.generation.continuous_batching import continuous_api

    modules = {"ModelManager": model_manager, "GenerationState": utils, "CBGenerateManager": utils,
               "BaseHandler": utils, "CBStreamer": utils, "OutputRouter": continuous_api}  # fmt: skip
    owners = {"Serve": Serve, **{name: getattr(module, name, None) for name, module in modules.items()}}
    methods = {
        "Serve": ("start_server", "kill_server"),
        "ModelManager": ("load_model_and_processor", "process_model_name", "list_models"),
        "GenerationState": ("get_manager",),
        "CBGenerateManager": ("init_cb", "generate_streaming", "generate_non_streaming", "is_alive"),
        "BaseHandler": ("_build_generation_config", "_validate_request", "_valid_params_class", "_unused_fields"),
        "CBStreamer": ("cancel", "put"),
    }
    attributes = {  # set in __init__
        "Serve": ("_model_manager", "_generation_state", "_chat_handler", "_completion_handler", "_response_handler",
                  "server"),
        "ModelManager": ("loaded_models", "force_model"),
        "GenerationState": ("_cb_config",),
        "CBGenerateManager": ("_cb",),
        "CBStreamer": ("_queue",),
        "OutputRouter": ("_lock", "result_handlers", "output_queue"),
    }  # fmt: skip
    missing = [name for name, owner in owners.items() if owner is None]
    missing += [f"{owner}.{name}" for owner, names in methods.items() if owners[owner] is not None for name in names
                if not hasattr(owners[owner], name)]  # fmt: skip
    missing += [f"{owner}.{name}" for owner, names in attributes.items() if owners[owner] is not None
                for name in names if name not in owners[owner].__init__.__code__.co_names]  # fmt: skip
    if missing:
        raise RuntimeError(
            f"hf-fp8kv serve runs transformers serve as of transformers {TESTED_SERVE}.x, which pip install "
            f"'hf-fp8kv[serve]' installs; transformers {transformers.__version__} lacks {missing}"
        )


class FP8Serve(Serve):
    """transformers' `Serve`, set up for FP8 pages once its app is built (`start_server`, which `Serve` calls
    last), then run blocking (the command) or in a thread (`blocking=False`: in-process, `kill_server()`)."""

    def __init__(self, options: FP8Options, preloaded: tuple | None = None, blocking: bool = True, **kwargs):
        check_transformers_serve()
        self.options, self.preloaded, self.blocking = options, preloaded, blocking
        self.manager = self.pages = None
        self.default_page_size = kwargs.get("cb_block_size") is None  # (set in `_set_page_budget`)
        super().__init__(**kwargs, non_blocking=True)  # (Serve then calls start_server)

    def start_server(self) -> None:
        self._set_up()
        if self.blocking:
            self.server.run()
        else:
            super().start_server()

    def _set_up(self) -> None:
        model_id, model = self._pinned_model()
        settings = continuous_batching.enable(
            model, kv_cache_dtype=self.options.kv_cache_dtype, scales=self.options.scales,
            skip_layers=self.options.skip_layers, backend=self.options.backend,
            recent_tokens=self.options.recent_tokens, sink_tokens=self.options.sink_tokens,
            rotate=self.options.rotate, max_requests=self.options.max_requests,
            outlier_tokens=self.options.outlier_tokens, scale_search=self.options.scale_search,
        )  # fmt: skip
        self._set_page_budget(model, settings)
        for endpoint, handler in self.handlers().items():
            handler._build_generation_config = requests.checked_generation_config(handler._build_generation_config)
            handler._validate_request = requests.logging_ignored(handler._validate_request, endpoint,
                                                                 requests.ignored_fields(handler, endpoint))  # fmt: skip
        self._chat_handler._validate_request = requests.checked_messages(self._chat_handler._validate_request)
        # the manager now, with the server's default generation config (transformers makes it at the first
        # request, with that request's: continuous batching has one generation config per manager)
        generation = self._chat_handler._build_generation_config({}, model.generation_config, use_cb=True)
        self.manager = self._generation_state.get_manager(model_id, use_cb=True)
        self.manager.init_cb(model, generation)
        self.pages = _wait_for_pages(self.manager)
        requests.wrap_generation(self.manager, model, self.pages.request_tokens_limit)
        self.server.config.app.get("/fp8kv/pages")(self.page_state)
        logger.info(f"[hf-fp8kv] {describe(self.pages, settings)}")

    def handlers(self) -> dict:
        """transformers' handlers of the OpenAI endpoints, by path."""
        return {"/v1/chat/completions": self._chat_handler, "/v1/completions": self._completion_handler,
                "/v1/responses": self._response_handler}  # fmt: skip

    def _pinned_model(self) -> tuple[str, torch.nn.Module]:
        """The model this server is pinned to, and the id its handlers know it by."""
        from transformers.cli.serving.model_manager import TimedModel
        from transformers.cli.serving.utils import split_model_id

        manager = self._model_manager
        if self.preloaded is not None:  # an in-memory model, cached under the name requests will name it by
            name, model, processor = self.preloaded
            manager.loaded_models[manager.process_model_name(name)] = TimedModel(model, -1, processor)
            manager.force_model = name
        if manager.force_model is None:
            raise ValueError("hf-fp8kv serve serves one model: name it (MODEL)")
        repo, gguf_file = split_model_id(manager.force_model)
        model_id = manager.process_model_name(repo)
        return model_id, manager.load_model_and_processor(model_id, gguf_file=gguf_file)[0]

    def _set_page_budget(self, model, settings: continuous_batching.PagedSettings) -> None:
        """The page size (without `--cb-block-size`: DEFAULT_PAGE_SIZE), and `--kv-memory-mib` (on the CPU without
        a size: 256) as FP8 blocks beside the requests' recent and sink tokens."""
        from transformers import ContinuousBatchingConfig

        config = self._generation_state._cb_config or ContinuousBatchingConfig()
        if self.default_page_size:
            config.page_size = DEFAULT_PAGE_SIZE
        mib = self.options.kv_memory_mib
        if mib is None and model.device.type == "cpu" and config.num_blocks is None \
                and config.max_memory_percent is None:  # fmt: skip
            mib = CPU_KV_MEMORY_MIB
        if mib is not None:
            memory = int(mib * 2**20)
            settings.max_requests = settings.requests_in(memory)  # the split decided here, before the cache
            layers = range(model.config.get_text_config(decoder=True).num_hidden_layers)
            pages = memory - settings.max_requests * settings.request_bytes()
            config.num_blocks = pages // settings.block_bytes(layers, config.page_size)
            if config.num_blocks < 1:
                raise ValueError(f"--kv-memory-mib {mib} holds no block of {config.page_size} tokens beside "
                                 f"{settings.max_requests} requests' recent and sink tokens")  # fmt: skip
        self._generation_state._cb_config = config

    def page_state(self) -> dict:
        """`GET /fp8kv/pages`: the page budget and what is held now (a snapshot of the generation thread's
        objects, exact when the server is idle)."""
        return page_state(self.manager)


def _wait_for_pages(manager):
    """The paged cache the manager's generation thread builds when it starts."""
    cb = manager._cb
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while cb.batch_processor is None:
        error = cb.background_thread_status.fatal_error
        if error is not None:
            raise RuntimeError(f"continuous batching failed to start: {error}") from error
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching built no pages in {STARTUP_TIMEOUT_S} s")
        time.sleep(0.05)
    cache = cb.batch_processor.cache
    cache.page_size = cb.continuous_batching_config.page_size
    return cache


def describe(cache, settings: continuous_batching.PagedSettings) -> str:
    """The startup line: KV format, page budget, the tokens the memory holds (blocks and the requests' rows, each
    token once) against model-dtype pages of the same memory."""
    layout = next(iter(settings.layouts.values()))
    scales = "per-token-head scales" if layout.per_token else "per-head scales"
    scales += ", rotated codes" if layout.rotate else ""
    scales += f", searched among {layout.scale_search}" if layout.scale_search else ""
    held = "pure FP8"
    if cache.request_slots is not None:
        outliers = f" + outliers {settings.outlier_tokens} per KV head" if settings.outlier_tokens else ""
        held = (f"recent {settings.recent_tokens} + sinks {settings.sink_tokens}{outliers} tokens in {layout.dtype} "
                f"for up to {cache.request_slots.slots} requests at once and {cache.request_slots.slots} prompts' sinks "
                f"({cache.held_bytes / 2**20:.1f} MiB)")  # fmt: skip
    pages = cache.num_blocks * cache.block_bytes
    beside = ""
    if cache.stored_once_blocks and cache.every_group_stores_once:
        beside = f" + {round(cache.stored_once_blocks * cache.page_size)} recent tokens in the requests' rows, " \
                 "each token stored once"  # fmt: skip
    elif cache.stored_once_blocks:  # (sliding layers keep every token's page row: a share of the blocks' bytes)
        worth = f"{cache.stored_once_blocks:.1f} blocks' worth"
        beside = f" + the requests' recent pages of full-attention layers in their rows ({worth}), each token " \
                 "stored once there"  # fmt: skip
    return (
        f"KV pages {settings.fmt.name} ({scales}, {held}): {cache.num_blocks} blocks of {cache.page_size} tokens "
        f"({cache.num_blocks * cache.page_size} tokens, {pages / 2**20:.1f} MiB){beside}; {layout.dtype} pages would "
        f"hold {cache.native_num_blocks} blocks in the same memory: {cache.capacity_ratio:.2f}x the tokens"
    )


def page_state(manager) -> dict:
    """The page budget and what requests hold now; idle: no block, slot, request, stream handler or unclaimed
    output held, and new requests admitted."""
    cb = manager._cb
    processor = cb.batch_processor
    cache, scheduler = processor.cache, processor.scheduler
    owned = {(a.index, block) for a in cache.cache_allocators.values() for blocks in list(a.block_table.values())
             for block in blocks if not (a.store_once and block == continuous_batching.VIRTUAL_BLOCK)}  # fmt: skip
    return {
        "kv_format": cache.settings.fmt.name,
        "page_size": cache.page_size,
        "num_blocks": cache.num_blocks,
        "native_num_blocks": cache.native_num_blocks,
        "capacity_ratio": round(cache.capacity_ratio, 3),
        "request_slots": 0 if cache.request_slots is None else cache.request_slots.slots,
        "blocks_in_use": len(owned),  # held by requests (blocks kept only by the prefix cache are not)
        "slots_in_use": 0 if cache.request_slots is None else len(cache.request_slots.held),
        "free_slots": 0 if cache.request_slots is None else len(cache.request_slots.free),
        "free_sectors": cache.pool.num_free_sectors,  # (a request waits when neither its blocks nor a slot fit)
        "active_requests": len(scheduler.active_requests),
        "waiting_requests": len(scheduler.waiting_requests) + cb.input_queue.qsize(),
        "stream_handlers": len(cb.output_router.result_handlers),
        "unclaimed_outputs": cb.output_router.output_queue.qsize(),  # outputs no handler took (none in a server)
        "block_new_requests": scheduler.block_new_requests,  # set by a preemption, lifted when a request ends
        "worker_alive": manager.is_alive(),
    }


def serve_model(model: torch.nn.Module, processor, name: str, options: FP8Options = FP8Options(), **serve_kwargs):
    """Serve an already-loaded `model` under `name` on FP8 pages, in a thread (tests, notebooks): returns the
    server; `server.kill_server()` stops it and `continuous_batching.disable(model)` restores the model."""
    serve_kwargs = {"host": "127.0.0.1", **serve_kwargs, "continuous_batching": True, "force_model": None}
    return FP8Serve(options, preloaded=(name, model, processor), blocking=False, **serve_kwargs)
