"""The one seam between the cache and its kernels: a backend, resolved once for a device, owns every kernel entry.

`backend_for(requested, device)` gives the torch backend (`cpu.py`, `paged.py`) or the Triton one
(`triton_*.py`; on CPU only under TRITON_INTERPRET=1, where bf16 models run right too: the kernels' dots take
fp16 operands, never the interpreter's broken bf16 dot). `requested`: "torch", "triton" or "auto" (Triton on
CUDA, torch elsewhere); `None` reads the environment variable HF_FP8KV_BACKEND (default "auto"). A GPU the
Triton kernels cannot run on (an architecture they are not compiled for, no Triton, a Triton without a driver
for it) gets the torch path with one warning naming the device and the reason, whatever was requested; the
kernels' code path on each GPU (hardware or bit decode of the codes, FP8 dots) is `targets.GpuTarget`'s.

A backend gives each layer a `LayerKernels` handle: `write` and `attend` over the layer's `KVView`, and the
layer's kernel state (launch plans, the launch arguments derived from its buffers, split buffers, the split
count of a compiled decode step), which no one resets by hand: plans are keyed by the view's layout, derived
arguments by its buffers' identity. Continuous batching's pages go through the backend too (`write_rows`,
`paged_attend`). Inside a `torch.compile` graph the Triton kernels run as custom ops (`triton_ops`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from . import cpu, outliers, paged, reference
from .formats import StorageFormat, get_format
from .targets import GpuTarget, device_target
from .view import KVView, NewToken

BACKENDS = ("auto", "triton", "torch")
SETTLE_KERNEL_TOKENS = 64  # updates up to this many tokens leaving the recent ones have their outliers chosen by
# the Triton kernel (decode steps, assisted decoding's candidates), longer ones by the torch version


def check_backend(requested: str | None) -> str:
    """The backend name asked for (argument, else HF_FP8KV_BACKEND, else "auto"), validated."""
    name = requested if requested is not None else os.environ.get("HF_FP8KV_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS} (argument or HF_FP8KV_BACKEND)")
    return name


def backend_for(requested: str | None, device: torch.device) -> "TorchBackend":
    """The backend that serves tensors on `device`."""
    name = check_backend(requested)
    if device.type == "cuda" and name != "torch":
        return TORCH if gpu_problem(device) else TRITON
    if name == "triton" and importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            f"backend='triton' needs the triton package, which is not installed here (it is installed with hf-fp8kv "
            f"on Linux x86_64 and aarch64, where its wheels are); backend='torch' runs on {device.type}"
        )
    if name == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"backend='triton' on {device.type} needs TRITON_INTERPRET=1 (the Triton interpreter)")
    return TRITON if name == "triton" else TORCH


class UnsupportedGPUWarning(UserWarning):
    """A GPU the Triton kernels cannot run on: the cache runs on the torch path there."""


def gpu_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on CUDA (or ROCm) `device`, warned once per device; None where they can."""
    return _gpu_problem(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gpu_problem(index: int) -> str | None:
    target = device_target(torch.device("cuda", index))
    problem = target.unsupported() or triton_problem(target)
    if problem:
        warnings.warn(
            f"{target.name} ({target.arch}, cuda:{index}): {problem}; the FP8 cache runs on the torch path there "
            "(the same results, slower: past tokens are decoded every step)", UnsupportedGPUWarning, stacklevel=4,
        )  # fmt: skip
    return problem


def triton_problem(target: GpuTarget) -> str | None:
    """Why the installed Triton cannot compile for `target`'s kind of GPU; None where it can."""
    try:
        from triton.runtime import driver

        active = driver.active.get_current_target().backend
    except Exception as error:  # no Triton, or none of its drivers finds this GPU
        return f"Triton cannot run here ({type(error).__name__}: {error})"
    wanted = "hip" if target.is_amd else "cuda"
    return None if active == wanted else f"Triton's active driver is {active!r}, not {wanted!r}"


def check_fp8_prefill(requested: str | None, device: torch.device, fmt: StorageFormat) -> None:
    """Refuse `fp8_prefill=True` for `fmt`'s codes on `device` where its FP8 tensor-core dots cannot run, naming
    the GPU."""
    if device.type != "cuda":
        return  # (the torch path's attention is exact; the Triton interpreter runs the FP8 dots)
    target = device_target(device)
    if backend_for(requested, device) is not TRITON:
        raise ValueError(f"fp8_prefill=True needs the Triton backend: {target.name} ({target.arch}) runs the torch path")
    if not target.fp8_dots(fmt.dtype):
        raise ValueError(
            f"fp8_prefill=True needs e4m3fn FP8 tensor cores (NVIDIA sm_89 and newer: L4, RTX 4090, H100, B200; AMD "
            f"gfx950): {target.name} ({target.arch}) has none; leave fp8_prefill off there"
        )


# --- torch ---------------------------------------------------------------------------------------------------------
class TorchLayerKernels:
    """A layer's kernels on the torch path: `write(key, value, view, stats)` stores the new tokens `[end, end + n)`
    in `view`'s buffers and returns whether NaN codes may have been written (`reference.write`); `attend(query,
    view, *, scaling, mask, window, softcap, sink_logits)` is the attention of `query` `[batch, q_heads, q_len,
    head_dim]` over the tokens of `view`, in the query's dtype (`reference.attend`)."""

    write = staticmethod(cpu.write)  # (the functions themselves: a decode step is op-dispatch bound on the CPU)
    attend = staticmethod(cpu.attend)
    settle_outliers = staticmethod(outliers.settle)  # judge the tokens that got codes (`outliers.settle`)
    value_tiled = False  # the value codes' layout of the buffers a layer allocates (`KVView.value_tiled`)
    advances_positions = False  # whether `write` moves a static view's device positions past the new tokens
    # whether a decode step's write judges the outlier token it gives codes too (`write_and_settle(key, value, view,
    # stats, buffers, ring, first_real, window)`: `buffers` the layer's outlier buffers, `hf_fp8kv/outliers.py`;
    # the rest `triton_outliers.write_and_settle`'s)
    settles_in_write = False

    def writes_in_attention(self, view: KVView, new_tokens: int) -> bool:
        """Whether an update's write is left to the attention that reads it (`attend(new_token=...)`)."""
        return False

    def sums_in_attention(self, view: KVView, q_len: int) -> bool:
        """Whether `attend` adds its queries to a searched view's sums itself (`ScaleSearch`; else the layer
        does, after it)."""
        return False

    def __init__(self) -> None:
        self.memo: dict = {}  # views of the buffers, for the views built over them (`KVView.derived`)


class TorchBackend:
    name = "torch"

    def __reduce__(self):  # one instance per backend: a pickled layer comes back with it
        return (_backend_named, (self.name,))

    def layer_kernels(self, fp8_prefill: bool = False) -> TorchLayerKernels:
        """A layer's handle; `fp8_prefill`: a prefill's dots on FP8 tensor cores (the Triton kernels alone have
        them; the torch path's attention is exact)."""
        return TorchLayerKernels()

    def write_rows(
        self, states: torch.Tensor, layout: paged.RowLayout, stats: torch.Tensor | None, static_scales,
        pages: torch.Tensor, geometry: paged.PageGeometry, index: torch.Tensor,
        search_energy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, bool]:  # fmt: skip
        """Page rows of `states`, also stored in `pages` at physical indices `index`, and whether an input was
        non-finite (see `paged.encode_rows`)."""
        rows, nonfinite = paged.encode_rows(states, layout, stats, static_scales, search_energy)
        geometry.write(pages, layout, index, rows)
        return rows, nonfinite

    def add_query_energy(self, energy: torch.Tensor, query: torch.Tensor, key_channel_scale: torch.Tensor | None,
                         rotate: bool) -> None:  # fmt: skip
        """`energy += reference.query_energy(query, ...)`, in place (a compiled graph's buffer stays the same): a
        searched layer's sums of its queries' squares (`hf_fp8kv/scale_search.py`)."""
        energy += reference.query_energy(query, energy.shape[0], key_channel_scale, rotate)

    def paged_attend(
        self, query: torch.Tensor, *pages_args, max_q_len: int | None = None, max_k_len: int | None = None,
        new_in_pages: bool = False, **kwargs,
    ) -> torch.Tensor:  # fmt: skip
        """Attention over paged rows read in place (see `paged.attend` for the arguments; `max_q_len`, the longest
        request's queries, sizes the Triton kernel's grid, `max_k_len`, at least its keys, its KV splits;
        `new_in_pages`: the read indices list this step's tokens too, already written, and the Triton kernel reads
        them there, the torch path from `new_rows`, the same bytes)."""
        return paged.attend(query, *pages_args, **kwargs)

    def paged_sums_in_attention(self, layout: paged.RowLayout, rows: int, softcap=None, sink_logits=None) -> bool:
        """Whether `paged_attend(..., search_energy=...)` adds a step's queries (`rows` per KV head) to a searched
        layer's sums itself (`hf_fp8kv/scale_search.py`; else the caller does, after it)."""
        return False


# --- Triton --------------------------------------------------------------------------------------------------------
class TritonLayerKernels(TorchLayerKernels):
    """A layer's Triton kernels and their state: launch plans per kind of call, derived launch arguments, and
    the split count of a compiled decode step (computed outside the graph, for a full static buffer). Values are
    stored tiled, the layout the attention's PV dot reads without a byte-wise transpose."""

    value_tiled = True
    advances_positions = True  # (the write kernel's last program: no launch of their own)
    settles_in_write = True  # one launch where three were (the staging copy, the write, the selection)

    def __init__(self, fp8_prefill: bool = False) -> None:
        from .triton_attention import attention, sums_in_launch, writes_in_launch
        from .triton_common import query_target
        from .triton_outliers import settle, write_and_settle
        from .triton_write import write_kv

        super().__init__()
        self.fp8_prefill = fp8_prefill
        self.plans: dict = {}
        self.decode_splits: dict[tuple, tuple[int, torch.Tensor | None]] = {}  # and the merge's tickets
        # (an import per call costs a decode step ~1 us)
        self._write_kv, self._attention, self._settle_outliers = write_kv, attention, settle
        self._write_and_settle = write_and_settle
        self._writes_in_launch, self._target = writes_in_launch, query_target
        self.sums_in_attention = sums_in_launch  # a decode step's: one launch where two were
        # registered before any graph is traced (a compiled step that registered them met `torch.library.triton_op`,
        # which dynamo refuses to trace: reached through `functools.cache`, the registration runs again)
        self._ops = triton_ops()

    def settle_outliers(self, outlier_set, positions: torch.Tensor | int, candidates: torch.Tensor, first_real,
                        first_visible=None) -> None:  # fmt: skip
        # the torch version in a compiled graph (the compiler fuses its ops) and for a prompt (its parallel top-k,
        # some 30 ops once a prompt: the kernel walks the candidates one after the other, a 500-token update 500
        # dependent steps in one warp per row and head, gpu_static)
        if torch.compiler.is_compiling() or candidates.shape[3] > SETTLE_KERNEL_TOKENS:
            outliers.settle(outlier_set, positions, candidates, first_real, first_visible)
            return
        self._settle_outliers(outlier_set, positions, candidates, first_real, first_visible)

    def write(self, key: torch.Tensor, value: torch.Tensor, view: KVView, stats: torch.Tensor) -> bool:
        if torch.compiler.is_compiling():  # an opaque op in the graph (static views only: compileable caches)
            self._ops.write(key, value, view.codes, view.scales, view.recent, stats, view.positions, view.fmt.name,
                            view.per_token, view.ring, view.rotate, view.search_energy, view.scale_search)  # fmt: skip
            return True
        self._write_kv(key, value, view, stats, self.plans, advance=view.static)
        return True

    def writes_in_attention(self, view: KVView, new_tokens: int) -> bool:
        # a decode step: one launch where two were (in a compiled graph, its attention op's)
        return self._writes_in_launch(view, new_tokens, self._target(view.codes))

    def write_and_settle(self, key, value, view: KVView, stats, buffers: tuple, ring: int, first_real, window) -> None:
        if torch.compiler.is_compiling():  # an opaque op in the graph (static views only: compileable caches)
            self._ops.write_settle(key, value, view.codes, view.scales, view.recent, stats, view.positions, *buffers,
                                   first_real, view.fmt.name, view.ring, view.rotate, ring, window or 0,
                                   view.search_energy, view.scale_search)  # fmt: skip
            return
        outlier_set = outliers.OutlierSet.of_buffers(buffers, view.scales[0], view.offset, ring)
        self._write_and_settle(key, value, view, stats, outlier_set, first_real, window)

    def attend(
        self, query: torch.Tensor, view: KVView, *, scaling: float, mask=None, window=None, softcap=None,
        sink_logits=None, new_token: NewToken | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if torch.compiler.is_compiling():  # an opaque op in the graph (static views only: compileable caches)
            splits, tickets = self.decode_splits.get((query.shape[:2], view.layout()), (1, None))
            new = (None, None, None) if new_token is None else new_token[:3]
            return self._ops.attend(
                query, view.codes, view.scales, view.recent, view.sinks, view.sink_start, view.sink_count,
                view.positions, mask, sink_logits, view.key_channel_scale, view.outliers, view.outlier_pos, tickets,
                *new, view.fmt.name, view.per_token, view.ring, view.rotate, scaling, window or 0, softcap or 0.0,
                splits, self.fp8_prefill, view.search_energy, view.search_tickets, view.scale_search,
            )  # fmt: skip
        if view.static:
            splits_key = (query.shape[:2], view.layout())
            if splits_key not in self.decode_splits:
                self.decode_splits[splits_key] = _decode_splits(query, view)
        return self._attention(query, view, scaling=scaling, mask=mask, window=window, softcap=softcap,
                               sink_logits=sink_logits, fp8_prefill=self.fp8_prefill, plans=self.plans,
                               new_token=new_token)  # fmt: skip


class TritonBackend(TorchBackend):
    name = "triton"

    def layer_kernels(self, fp8_prefill: bool = False) -> TritonLayerKernels:
        return TritonLayerKernels(fp8_prefill)

    def write_rows(self, states, layout, stats, static_scales, pages, geometry, index,
                   search_energy=None) -> tuple[torch.Tensor, bool]:  # fmt: skip
        if layout.fmt is None:
            return super().write_rows(states, layout, stats, static_scales, pages, geometry, index)
        from .triton_paged import write_rows

        pair = None if static_scales is None else (static_scales[0], static_scales[1])
        rows = write_rows(states, layout.fmt, stats, pair, pages, geometry, index, layout.rotate, layout.scale_search,
                          search_energy)  # fmt: skip
        return rows, True  # (non-finite inputs: not known without a sync)

    def add_query_energy(self, energy, query, key_channel_scale, rotate) -> None:
        from .triton_search import KERNEL_ROWS, add_query_energy

        rows = query.shape[0] * query.shape[1] // energy.shape[0] * query.shape[2]
        if torch.compiler.is_compiling() or rows > KERNEL_ROWS:  # (a compiled graph fuses the ops)
            super().add_query_energy(energy, query, key_channel_scale, rotate)
            return
        add_query_energy(energy, query, key_channel_scale, rotate)

    @staticmethod
    def _paged_kernel_serves(layout: paged.RowLayout, softcap, sink_logits) -> bool:
        """Whether the paged kernel has what a call needs (else the torch path serves it)."""
        return layout.fmt is not None and softcap is None and sink_logits is None and layout.key_channel is None

    def paged_sums_in_attention(self, layout, rows, softcap=None, sink_logits=None) -> bool:
        from .triton_paged import sums_in_paged_launch

        return self._paged_kernel_serves(layout, softcap, sink_logits) and sums_in_paged_launch(rows, layout.rotate)

    def paged_attend(
        self, query, pages, new_rows, read_index, cu_seq_lens_q, k_first, past, *, layout: paged.RowLayout,
        geometry: paged.PageGeometry, scaling: float, window=None, softcap=None, sink_logits=None, static_scales=None,
        has_nan: bool = True, max_q_len: int | None = None, max_k_len: int | None = None,
        recent: paged.RecentRows | None = None, new_in_pages: bool = False, search_energy=None,
    ) -> torch.Tensor:  # fmt: skip
        if not self._paged_kernel_serves(layout, softcap, sink_logits):
            if search_energy is not None:
                raise ValueError("search_energy is for the paged kernel's calls (`paged_sums_in_attention`)")
            return super().paged_attend(
                query, pages, new_rows, read_index, cu_seq_lens_q, k_first, past, layout=layout, geometry=geometry,
                scaling=scaling, window=window, softcap=softcap, sink_logits=sink_logits, static_scales=static_scales,
                has_nan=has_nan, recent=recent,
            )  # fmt: skip  (features the paged kernel does not have)
        from .triton_paged import paged_attention

        pair = None if static_scales is None else (static_scales[0], static_scales[1])
        out = paged_attention(
            query, pages, new_rows, read_index, cu_seq_lens_q, k_first, past, fmt=layout.fmt, kv_heads=layout.kv_heads,
            layer_offset=geometry.layer_offset, bytes_per_block=geometry.bytes_per_block,
            block_stride=geometry.block_stride, page_size=geometry.page_size, scaling=scaling, window=window,
            static_scales=pair, max_q_len=max_q_len, recent=recent, new_in_pages=new_in_pages, rotate=layout.rotate,
            max_k_len=max_k_len, search_energy=search_energy,
        )  # fmt: skip
        return out.to(query.dtype)


TORCH, TRITON = TorchBackend(), TritonBackend()


def _backend_named(name: str) -> TorchBackend:
    return TRITON if name == "triton" else TORCH


def _decode_splits(query: torch.Tensor, view: KVView) -> tuple[int, torch.Tensor | None]:
    """The Triton kernel's KV splits for a decode step over a static view (from the GPU's occupancy of the kernel
    its compiled graph runs: the one that writes the step's token where it can), and the counters their merge in
    the attention launch takes (a buffer of fixed address, for CUDA graphs; None: a reduce launch merges them),
    made outside the compiled graph that will use them."""
    from .triton_attention import AttentionPlan, writes_in_launch
    from .triton_common import query_target

    step = query[:, :, -1:]
    new_token = None
    if writes_in_launch(view, 1, query_target(query)):
        _, batch, kv_heads, _, head_dim = view.codes.shape
        token = torch.zeros(batch, kv_heads, 1, head_dim, dtype=query.dtype, device=query.device)
        new_token = NewToken(token, token, torch.zeros(2, 2, dtype=torch.int64, device=query.device))
    plan = AttentionPlan(step, view, None, None, 1.0, new_token=new_token)
    splits, merged = plan.splits(step, view)
    if not merged:
        return splits, None
    tickets = plan.new_tickets(query.device, splits)
    torch._dynamo.mark_static_address(tickets)
    return splits, tickets


# --- the same operations as custom ops, for torch.compile graphs --------------------------------------------------
@functools.cache
def triton_ops():
    """`torch.ops.hf_fp8kv`: `write`, `write_settle` and `attend` registered with `torch.library.triton_op`, over
    a static view's flat tensors, so that `torch.compile` puts the Triton kernels in its graph (and CUDA graphs
    capture them) without tracing the launchers' Python.

    Capture safety: the views are static (positions read on the device by the kernels, never by the host), the
    grid is fixed (the split count of a full buffer, passed in, merged in the attention launch where the merge's
    counters are passed, else by a reduce launch; empty splits write an empty partial result),
    every buffer keeps its address (marked static), and nothing syncs with the host.
    """
    from .triton_attention import AttentionPlan
    from .triton_outliers import plan_write_settle
    from .triton_write import WritePlan

    written = {"codes", "scales", "recent", "stats", "positions"}  # (the attention op's too, where it writes)
    outlier_buffers = {"outlier_kv", "outlier_pos", "outlier_score", "outlier_norms"}

    @torch.library.triton_op("hf_fp8kv::write", mutates_args=written)
    def write_op(
        key: torch.Tensor, value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
        recent: torch.Tensor | None, stats: torch.Tensor, positions: torch.Tensor, fmt: str, per_token: bool,
        ring: bool, rotate: bool, search_energy: torch.Tensor | None, scale_search: int,
    ) -> None:  # fmt: skip
        view = _static_view(codes, scales, positions, fmt, per_token, ring, rotate, recent, search_energy, scale_search)
        for launch in WritePlan(key, value, view, stats, advance=True).launches(key, value, view, stats):
            launch.run(traced=True)

    @torch.library.triton_op("hf_fp8kv::write_settle", mutates_args={*written, *outlier_buffers})
    def write_settle_op(
        key: torch.Tensor, value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
        recent: torch.Tensor | None, stats: torch.Tensor, positions: torch.Tensor, outlier_kv: torch.Tensor,
        outlier_pos: torch.Tensor, outlier_score: torch.Tensor, outlier_norms: torch.Tensor, first_real: torch.Tensor,
        fmt: str, ring: bool, rotate: bool, set_ring: int, window: int, search_energy: torch.Tensor | None,
        scale_search: int,
    ) -> None:  # fmt: skip
        """A decode step's write that judges the outlier token it gives codes (`triton_outliers.write_and_settle`;
        the outlier buffers as a layer holds them, `hf_fp8kv/outliers.py`; `set_ring` the set's ring)."""
        view = _static_view(codes, scales, positions, fmt, True, ring, rotate, recent, search_energy, scale_search)
        buffers = (outlier_kv, outlier_pos, outlier_score, outlier_norms)
        outlier_set = outliers.OutlierSet.of_buffers(buffers, scales[0], 0, set_ring)
        plan_write_settle(key, value, view, stats, outlier_set, first_real, window or None).run(traced=True)

    searched = {"search_energy", "search_tickets"}  # (a decode step's queries added: `sums_in_launch`)

    @torch.library.triton_op("hf_fp8kv::attend", mutates_args={"tickets", *searched, *written})
    def attend_op(
        query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, recent: torch.Tensor | None,
        sinks: torch.Tensor | None, sink_start: torch.Tensor | None, sink_count: torch.Tensor | None,
        positions: torch.Tensor, mask: torch.Tensor | None, sink_logits: torch.Tensor | None,
        channel: torch.Tensor | None, outliers: torch.Tensor | None, outlier_pos: torch.Tensor | None,
        tickets: torch.Tensor | None, new_key: torch.Tensor | None, new_value: torch.Tensor | None,
        stats: torch.Tensor | None, fmt: str, per_token: bool, ring: bool, rotate: bool, scaling: float, window: int,
        softcap: float, num_splits: int, fp8_prefill: bool, search_energy: torch.Tensor | None,
        search_tickets: torch.Tensor | None, scale_search: int,
    ) -> torch.Tensor:  # fmt: skip
        """`new_key` / `new_value` (with the write's `stats`): the decode step's token, written by this launch
        (the view's device positions are the ones before it, and move past it; its scales searched with
        `scale_search`); `search_tickets`: the step's queries added to `search_energy` by it too."""
        view = _static_view(codes, scales, positions, fmt, per_token, ring, rotate, recent, search_energy, scale_search)
        view.search_tickets = search_tickets
        view.sinks, view.sink_start, view.sink_count, view.key_channel_scale = sinks, sink_start, sink_count, channel
        view.outliers, view.outlier_pos = outliers, outlier_pos
        settings = (scaling, window or None, softcap or None, num_splits)
        new_token = None if new_key is None else NewToken(new_key, new_value, stats)
        plan = AttentionPlan(query, view, mask, sink_logits, *settings, fp8_prefill=fp8_prefill,
                             merge=tickets is not None, new_token=new_token)  # fmt: skip
        out, launches = plan.launches(query, view, mask, sink_logits, tickets, new_token)
        for launch in launches:
            launch.run(traced=True)
        return out

    return torch.ops.hf_fp8kv


def _static_view(codes, scales, positions, fmt: str, per_token: bool, ring: bool, rotate: bool, recent,
                 search_energy: torch.Tensor | None = None, scale_search: int = 0) -> KVView:  # fmt: skip
    return KVView(codes=codes, scales=scales, fmt=get_format(fmt), end=positions[0], recent_start=positions[1],
                  per_token=per_token, ring=ring, rotate=rotate, recent=recent, positions=positions,
                  value_tiled=TritonLayerKernels.value_tiled, search_energy=search_energy,
                  scale_search=scale_search)  # fmt: skip
