"""Compiled-code report of the Triton kernels for GPU targets (sm_90 by default; `--arch`), no GPU needed.

Each case below (decode, prefill, write, and continuous batching's paged attention and row writer) builds CPU
tensors of a real call's shapes, dtypes and layouts and asks the kernel modules' `plan_*` functions for the `Launch`
records the launcher would run on a real GPU of each target (`kernels/targets.py`: its code path, its SMs and
occupancy limits). Every record is compiled for that target with the specialization a real launch gets: Triton's
own launcher binder is applied to the arguments (16-byte aligned pointers and ints divisible by 16 marked, ints
equal to 1 as constexprs).

NVIDIA: registers and spills (the log of Triton's own `ptxas -v` run), shared memory, blocks per SM, and from the
SASS the main KV loop: instructions per KV byte, tiles in flight; for decode, the split-KV grid's last-wave
efficiency over batch x context and the issue-bound bandwidth ceiling. Exits 1 when a budget is missed: any
spill; a decode loop above 0.18 SASS instructions per KV byte where the hardware converts the codes (0.30 where
they are decoded in bit operations: sm_75, sm_80, sm_86, and e4m3fnuz anywhere), with fewer than 2 tiles in flight
(targets with cp.async: sm_80 and newer), or a last wave below 85% full where another split count would take fewer
tile-times (with whole KV tiles, batch 1 at 4k on 8 KV heads has 512 tiles for 396 slots: 2 tile-times is the
floor, so its 65%-full single wave is not a miss). The paged cases carry the spill budget only. AMD: VGPRs, scratch
and spills, LDS, and occupancy (LLVM's waves per SIMD, blocks per CU), from the AMDGCN assembly; the spill budget
(scratch that instructions read or write: VGPRs spilled into AGPRs and a private segment nothing touches are not).
A target Triton itself cannot compile for gets one row saying why (not a miss).

    python benchmarks/gpu_static.py                 # every case for sm_90 (a few minutes on 2 cores)
    python benchmarks/gpu_static.py --quick         # one decode case, one write, two paged
    python benchmarks/gpu_static.py --arch all --quick --json report.json   # every target (--arch sm_80,gfx942)

How the loop is read (see `main_loop`, `unroll_factor`, `tiles_in_flight`): the loops are the backward branches of
the SASS; the main one holds the most tensor-core instructions (HMMA/HGMMA/...), the innermost on a tie. Its
instruction count, times the warps of a block, divided by the KV bytes of one tile (`BLOCK_N` tokens of K and V
codes plus per-token scales), is the instructions per KV byte; ptxas unrolling is undone by comparing the
loop's dot count with the PTX loop's. Tiles in flight: with cp.async (LDGSTS), 1 + the groups its loop wait
(`DEPBAR.LE SB0, N`) leaves outstanding, in tiles; with TMA (UTMALDG/UBLKCP and mbarrier waits), the tiles the
prologue issues before the loop; with plain loads only, 1.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

if __name__ == "__main__" and os.environ.pop("TRITON_INTERPRET", None):  # before the kernels are decorated
    print("gpu_static: ignoring TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from hf_fp8kv.kernels import ops, paged, triton_attention, triton_outliers, triton_paged, triton_write  # noqa: E402
from hf_fp8kv.kernels.formats import FORMATS, PER_TOKEN_SCALE_DTYPE  # noqa: E402
from hf_fp8kv.kernels.targets import EXAMPLE_GPUS, GpuTarget  # noqa: E402
from hf_fp8kv.kernels.triton_launch import Launch  # noqa: E402
from hf_fp8kv.kernels.view import KVView  # noqa: E402

ARCHES = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx90a", "gfx942", "gfx950")
# boost clock (GHz) of each NVIDIA target's example GPU (`targets.EXAMPLE_GPUS`, which holds its datasheet memory
# bandwidth): the decode loop's issue-bound ceiling, 4 warp-instructions per clock per SM, against the memory's
CLOCKS = {"sm_75": 1.59, "sm_80": 1.41, "sm_86": 1.71, "sm_89": 2.04, "sm_90": 1.98, "sm_100": 1.97, "sm_120": 2.41}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
MAX_INSTR_PER_BYTE, MIN_TILES_IN_FLIGHT, MIN_LAST_WAVE = 0.18, 2, 0.85  # decode budgets
MIN_REDUCE_PROGRAMS = 32  # a batch-1 32k reduce (where the kernel does not merge) over at least this many programs
# head_dim 128 decode (pure, default recent + sinks, padded, static cache), issue 21's targets (sm_90's blocks)
D128_MAX_INSTR_PER_BYTE, D128_MIN_BLOCKS_PER_SM = 0.13, 3
# codes decoded without the hardware's FP8 conversion: Triton's per-code bit operations ran 0.32-0.38 on sm_80 / sm_86;
# byte permutes (`triton_common.E4M3_TO_FP16`, `INT8_TO_FP16`) run 0.19-0.22 there and int8 0.13-0.15 on every NVIDIA
# target (every decode case, 2026-12-07), which this bound holds
BIT_DECODE_MAX_INSTR_PER_BYTE = 0.25
MIN_PAGED_WAVES = 2  # the paged decode of 16 requests x 32k keys: at least this many programs per SM (issue 34)
# head_dim 128 prefill with fp8_prefill: FP8 tensor-core dots (each dot's sum promoted): wgmma, mma.sync, tcgen05
FP8_DOTS = ("QGMMA", "QMMA", "UTCQMMA")
CACHE_BLOCK = 64  # QuantizedFP8Cache's default block_size: code buffers grow 64 tokens at a time
# tensor-core instructions (a tie in counts goes to the first listed)
DOTS = (*FP8_DOTS, "HGMMA", "UTCHMMA", "HMMA", "IGMMA", "UTCIMMA", "IMMA", "DMMA")
FP8_UNPACK = re.compile(r"F2FP\.\w+\.E[45]M[23]\.UNPACK")  # the hardware's FP8 -> fp16 conversion of the codes
ASYNC_COPIES = ("LDGSTS", "UTMALDG", "UBLKCP")  # cp.async, TMA tensor and bulk copies into shared memory


@dataclass(frozen=True)
class Case:
    """One call the launchers meet, described by the tensors it passes: a decode step (`q_len` 1) or a prefill
    over `context` cached tokens, or the write of `q_len` new tokens ending at `context`."""

    kind: str  # "decode", "prefill", "write", "settle" (the outlier tokens') or "paged" (continuous batching)
    batch: int = 1
    kv_heads: int = 8
    group: int = 8  # query heads per KV head
    head_dim: int = 128
    dtype: str = "bfloat16"
    per_token: bool = False  # per-token-head (dynamic) scales, else one static scale per KV head
    q_len: int = 1
    context: int = 8195  # a decode step at an arbitrary length (not a multiple of 16)
    mask: bool = False  # a padding mask (bool [batch, 1, q_len, context]) instead of the causal rule
    fmt: str = "fp8_e4m3"
    recent: int = 0  # newest tokens in full precision
    sinks: int = 0  # first tokens in full precision
    static_cache: int = 0  # max_cache_len of a static cache (device positions, preallocated buffers); 0: dynamic
    fp8_prefill: bool = False  # a prefill's dots on FP8 tensor cores (the cache's opt-in `fp8_prefill`)
    waves: bool = True  # decode: judge the last wave over the batch x context grid
    page_size: int = 256  # paged: tokens per page (transformers' default; not a multiple of 16: read token by token)
    sliding: int = 0  # paged: a sliding layer's window (its ring of slots); 0: a full-attention layer
    rotate: bool = False  # rotated codes (`QuantizedFP8Cache(rotate=True)`)
    outliers: int = 0  # outlier tokens per KV head (`outlier_tokens`; paged: per request), beside the held ones
    scale_search: int = 0  # per-token scales searched among this many candidates (`scale_search`)

    @property
    def name(self) -> str:
        dtype = {"bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        scales = "per-token" if self.per_token else "static"
        scales += "" if self.fmt == "fp8_e4m3" else f" {self.fmt.removeprefix('fp8_').removesuffix('_per_token_head')}"
        scales += " rotated" if self.rotate else ""
        scales += f" searched {self.scale_search}" if self.scale_search else ""
        if self.kind == "write":
            held = f" recent {self.recent}" if self.recent else ""
            held += f" static-cache {self.static_cache}" if self.static_cache else ""
            held += f" outliers {self.outliers}" if self.outliers else ""
            return f"{dtype} d{self.head_dim} {scales}{held} {self.q_len} tok"
        if self.kind == "settle":
            return f"{dtype} d{self.head_dim} {self.outliers} outliers b{self.batch} kvh{self.kv_heads} {self.q_len} tok"
        if self.kind == "paged":
            shape = f"{self.batch} req q{self.q_len} ctx{self.context}"
            held = f" recent {self.recent}+{self.sinks}" if self.recent or self.sinks else ""
            held += f" outliers {self.outliers}" if self.outliers else ""
            held += f" page{self.page_size}" if self.page_size != 256 else ""
            held += f" sliding {self.sliding}" if self.sliding else ""
            return f"{dtype} d{self.head_dim} gqa{self.group} {scales}{held} paged {shape}"
        rule = " mask" if self.mask else (" causal" if self.kind == "prefill" else "")
        rule += f" window {self.recent}+{self.sinks}" if self.recent or self.sinks else ""
        rule += f" static-cache {self.static_cache}" if self.static_cache else ""
        rule += " fp8-dots" if self.fp8_prefill else ""
        rule += f" outliers {self.outliers}" if self.outliers else ""
        shape = f"b{self.batch} kvh{self.kv_heads}" + (f" q{self.q_len}" if self.q_len > 1 else "")
        return f"{dtype} d{self.head_dim} gqa{self.group} {scales}{rule} {shape} ctx{self.context}"


# continuous batching's decode on transformers' 256-token pages (tiles of consecutive slots) and on 24-token ones
# (each token read on its own): the quick report compiles both
PAGED_DECODE = [Case("paged", batch=64, context=4096, waves=False),
                Case("paged", batch=64, context=4096, waves=False, page_size=24)]  # fmt: skip


def cases(quick: bool = False, gpu: GpuTarget = EXAMPLE_GPUS["sm_90"]) -> list[Case]:
    """The report's cases for `gpu`: in the format "fp8" names there (e4m3fnuz on MI300; int8 cases as they are),
    without the FP8-dot prefill where the cache refuses it."""
    fmt = FORMATS[gpu.default_fp8]
    return [
        dataclasses.replace(case, fmt=fmt.name) if case.fmt == "fp8_e4m3" else case
        for case in every_case(quick) if not case.fp8_prefill or gpu.fp8_dots(fmt.dtype)
    ]  # fmt: skip


def every_case(quick: bool = False) -> list[Case]:
    """Every decode variant, hundreds of splits (few KV heads), prefill, writes."""
    if quick:
        return [Case("decode"), Case("write"), *PAGED_DECODE]
    decode = [
        Case("decode", group=group, head_dim=head_dim, dtype=dtype, per_token=per_token)
        for per_token in (False, True)
        for dtype in ("float16", "bfloat16")
        for group in (1, 4, 8)
        for head_dim in (64, 128, 256)
    ]
    no_split = [Case("decode", batch=64, context=1027)]  # 512 programs: one split, no split epilogue
    # one KV head at batch 1: the most splits, the merge's worst case; no wave budget (at 4k context the 64 KV
    # tiles cannot fill 264 slots)
    few_heads = [Case("decode", kv_heads=1, head_dim=d, context=32771, waves=False) for d in (128, 256)]
    prefill = [
        Case("prefill", q_len=500, context=500),
        Case("prefill", batch=2, q_len=500, context=500, mask=True),
        Case("prefill", q_len=256, context=4096),  # a prompt after a past
    ]
    prefill += [dataclasses.replace(case, per_token=True) for case in prefill]  # the default scales
    prefill += [dataclasses.replace(case, fp8_prefill=True) for case in prefill]  # the opt-in FP8 dots
    # what users run: the default recent 128 + sinks 4 (full-precision tiles in the model dtype next to the codes'
    # loop), a left-padded batch (a mask), the static cache of compiled generate; GQA 32/8 at 32k (the merge)
    default = dict(per_token=True, recent=128, sinks=4)
    window = [
        Case("decode", **default),
        Case("decode", batch=16, mask=True, **default),
        Case("decode", static_cache=16384, **default),
        Case("decode", batch=64, context=4099, **default),  # one split: the held tokens after the codes
        Case("decode", group=4, context=32768, per_token=True),
        Case("prefill", q_len=500, context=500, recent=128),
        Case("prefill", q_len=500, context=500, **default),
        Case("prefill", q_len=500, context=500, fp8_prefill=True, **default),
        # int8 per token and head in the same window (with calibrated key channels, the quality configuration of
        # docs/recent.md: the channel scale is one multiply of the query per program)
        Case("decode", fmt="int8_per_token_head", **default),
        Case("decode", batch=16, context=32768, fmt="int8_per_token_head", **default),
        Case("prefill", q_len=500, context=500, fmt="int8_per_token_head", **default),
        # and on pages: a decode batch, few long requests (split over the keys)
        Case("paged", batch=64, context=4096, waves=False, fmt="int8_per_token_head", **default),
        Case("paged", batch=16, context=32768, waves=False, fmt="int8_per_token_head", **default),
    ]
    write = [Case("write", per_token=p, q_len=n) for n in (1, 500) for p in (False, True)]
    write += [Case("write", per_token=True, q_len=n, recent=64) for n in (1, 500)]
    # a static cache's: the positions moved by the launch's last program
    write += [Case("write", per_token=True, q_len=1, recent=128, static_cache=16384)]
    # continuous batching: a decode batch and a chunked prefill on FP8 pages
    paged = [
        Case("paged", batch=64, head_dim=d, per_token=p, context=4096, waves=False)
        for d in (64, 128, 256)
        for p in (False, True)
    ]
    paged += PAGED_DECODE[1:] + [Case("paged", batch=64, per_token=True, context=4096, waves=False, page_size=24)]
    paged += [Case("paged", batch=64, per_token=True, context=4095, waves=False, sliding=4096)]  # a sliding layer
    paged += [Case("paged", batch=4, q_len=256, per_token=True, head_dim=d, context=4096, waves=False) for d in (128, 256)]
    # with each request's recent and sink tokens in the model's dtype beside its pages
    paged += [
        Case("paged", batch=64, head_dim=d, per_token=p, context=4096, waves=False, recent=32, sinks=4)
        for d in (64, 128, 256)
        for p in (False, True)
    ]
    paged += [Case("paged", batch=4, q_len=256, per_token=True, context=4096, waves=False, recent=32, sinks=4)]
    # few long requests (serving's long-context case): split over the keys, then the reduce
    paged += [Case("paged", batch=16, per_token=p, context=32768, waves=False, recent=r, sinks=4 if r else 0)
              for p, r in ((False, 0), (True, 0), (True, 128))]  # fmt: skip
    # rotated codes (issue 35): the query and the codes' output rotated once per program, each write rotated; the
    # paged cases with per-token scales (what rotation takes)
    rotated = [dataclasses.replace(case, rotate=True) for case in (
        *(Case("decode", head_dim=d, per_token=True) for d in (64, 128, 256)), *window[:4], window[6], window[7],
        Case("prefill", q_len=500, context=500, per_token=True), *write[2:],
        *(case for case in paged if case.per_token and not case.sliding),
    )]  # fmt: skip
    # outlier tokens (issue 35): 16 per KV head beside the default window (dense: left out of the codes by their
    # negated key scales; paged: by their positions), whose paged cases without them come too
    outliers = [dataclasses.replace(case, outliers=16) for case in (*window[:4], window[6])]
    outliers += [Case("settle", outliers=16, q_len=n) for n in (1, 500)]
    # a decode step's write that judges the token it gives codes (`triton_outliers.write_and_settle`)
    outliers += [Case("write", per_token=True, q_len=1, recent=128, outliers=16, static_cache=s) for s in (0, 16384)]
    default_paged = [dataclasses.replace(case, recent=128, sinks=4) for case in paged
                     if case.per_token and case.recent and not case.sliding]  # fmt: skip
    outliers += [case for case in default_paged if case not in paged]
    outliers += [dataclasses.replace(case, outliers=16) for case in default_paged]
    sliding_window = Case("paged", batch=64, per_token=True, context=4095, waves=False, sliding=4096, recent=128)
    outliers += [sliding_window, dataclasses.replace(sliding_window, outliers=16)]
    # per-token scales searched among 16 (issue 35): every write kind, the decode steps whose write the attention
    # launch does (the owner program searches the entering token's scales), and the paged row writer
    searched = [dataclasses.replace(case, scale_search=16) for case in (
        *(case for case in write if case.per_token), *(case for case in outliers if case.kind == "write"),
        *window[:4], window[8], *(Case("decode", head_dim=d, per_token=True) for d in (64, 128, 256)),
        default_paged[0],
    )]  # fmt: skip
    # a left-padded batch at the bundled models' head dims (SmolLM2: 64, Gemma 3: 256), merged in one group
    masked = [Case("decode", batch=16, mask=True, head_dim=d, **default) for d in (64, 256)]
    return decode + no_split + few_heads + prefill + window + write + paged + rotated + outliers + searched + masked


def plan(
    case: Case, gpu: GpuTarget, device: str = "cpu", slots: int | None = None, num_splits: int | None = None
) -> list[Launch]:
    """The launches the kernel modules plan for `case` on `gpu` (tensors on `device`: "cpu" to compile, "meta" to
    count), the split count from the launcher's own rule for `slots` resident blocks (SMs x blocks per SM;
    default 2 per SM), or `num_splits`."""
    fmt = FORMATS[case.fmt]
    dtype = getattr(torch, case.dtype)
    if case.kind == "paged":
        return plan_paged(case, gpu, fmt, dtype, device, slots, num_splits)
    if case.kind == "settle":
        return [plan_settle(case, dtype, device)]
    # a static cache's buffers have a spare slot; per-token scale rows are allocated on whole 4-byte words
    capacity = case.static_cache + 1 if case.static_cache else -(-case.context // CACHE_BLOCK) * CACHE_BLOCK
    codes = torch.empty(2, case.batch, case.kv_heads, capacity, case.head_dim, dtype=fmt.dtype, device=device)
    if case.per_token:
        even = capacity + capacity % 2
        scales = torch.empty(2, case.batch, case.kv_heads, even, dtype=PER_TOKEN_SCALE_DTYPE, device=device)[..., :capacity]
    else:
        scales = torch.ones(2, 1, case.kv_heads, 1, device=device)
    end = case.context - (case.q_len if case.kind == "write" else 0)  # a write stores the last q_len tokens
    recent_start = max(end - case.recent, 0)
    positions = torch.tensor([end, recent_start, 0], device=device) if case.static_cache else None
    # no NaN written (what a layer tracks: NaN codes add a select, and masked columns' values zeroed); the value
    # layout the Triton backend's layers allocate
    energy = torch.empty(case.kv_heads, case.head_dim, device=device) if case.scale_search else None
    tickets = torch.zeros(case.kv_heads, dtype=torch.int32, device=device) if case.scale_search else None
    view = KVView(codes=codes, scales=scales, fmt=fmt, per_token=case.per_token, end=end, recent_start=recent_start,
                  positions=positions, has_nan=False, value_tiled=ops.TritonLayerKernels.value_tiled,
                  rotate=case.rotate, scale_search=case.scale_search, search_energy=energy,
                  search_tickets=tickets)  # fmt: skip
    if case.recent:
        view.recent = torch.empty(2, case.batch, case.kv_heads, case.recent, case.head_dim, dtype=dtype, device=device)
    if case.sinks:
        view.sinks = torch.empty(2, case.batch, case.kv_heads, case.sinks, case.head_dim, dtype=dtype, device=device)
        view.sink_start = torch.zeros(case.batch, dtype=torch.int64, device=device)
        view.sink_count = torch.full((case.batch,), case.sinks, dtype=torch.int64, device=device)
    if case.outliers:
        view.outliers = torch.empty(2, case.batch, case.kv_heads, case.outliers, case.head_dim, dtype=dtype, device=device)
        view.outlier_pos = torch.empty(case.batch, case.kv_heads, case.outliers, dtype=torch.int64, device=device)
    # model layout: [batch, tokens, heads, head_dim] projections viewed as [batch, heads, tokens, head_dim]
    heads = case.kv_heads if case.kind == "write" else case.kv_heads * case.group
    shape = (case.batch, case.q_len, heads, case.head_dim)
    if case.kind == "write":
        key, value = (torch.empty(shape, dtype=dtype, device=device).transpose(1, 2) for _ in range(2))
        stats = torch.zeros(2, 2, dtype=torch.int64, device=device)
        if case.outliers:  # a decode step's write that judges the token it gives codes
            shape = (case.batch, case.kv_heads, case.outliers)
            outlier_set = triton_outliers.OutlierSet(
                view.outliers, view.outlier_pos, torch.empty(shape, device=device),
                torch.empty(2, *shape[:2], device=device), scales[0], 0,
            )  # fmt: skip
            first_real = torch.empty(case.batch, dtype=torch.int64, device=device)
            return [triton_outliers.plan_write_settle(key, value, view, stats, outlier_set, first_real,
                                                      case.sliding or None)]  # fmt: skip
        return triton_write.plan_write(key, value, view, stats, advance=view.static)  # (as the layers write)
    query = torch.empty(shape, dtype=dtype, device=device).transpose(1, 2)
    mask = torch.ones(case.batch, 1, case.q_len, case.context, dtype=torch.bool, device=device) if case.mask else None
    new_token = None
    # as the layers' steps run (a static cache's compiled graph too: its attention op): the write in the attention
    # launch
    if case.kind == "decode" and triton_attention.writes_in_launch(view, case.q_len, gpu):
        new_shape = (case.batch, 1, case.kv_heads, case.head_dim)
        key, value = (torch.empty(new_shape, dtype=dtype, device=device).transpose(1, 2) for _ in range(2))
        stats = torch.zeros(2, 2, dtype=torch.int64, device=device)
        new_token = triton_attention.NewToken(key, value, stats, max(end - 1 - case.recent, 0))
    _, launches = triton_attention.plan_attention(
        query, view, scaling=case.head_dim**-0.5, mask=mask, resident_slots=slots or gpu.sms * 2, target=gpu,
        fp8_prefill=case.fp8_prefill, num_splits=num_splits, new_token=new_token,
    )
    return launches


def plan_settle(case: Case, dtype: torch.dtype, device: str) -> Launch:
    """The outlier tokens' selection after an update of `case.q_len` tokens leaving the recent ones (a dynamic
    cache's: consecutive positions)."""
    shape = (case.batch, case.kv_heads, case.outliers)
    outlier_set = triton_outliers.OutlierSet(
        torch.empty(2, *shape, case.head_dim, dtype=dtype, device=device), torch.empty(shape, dtype=torch.int64, device=device),
        torch.empty(shape, device=device), torch.empty(2, *shape[:2], device=device),
        torch.empty(*shape[:2], case.context, dtype=PER_TOKEN_SCALE_DTYPE, device=device), 0,
    )  # fmt: skip
    candidates = torch.empty(2, case.batch, case.kv_heads, case.q_len, case.head_dim, dtype=dtype, device=device)
    first_real = torch.empty(case.batch, dtype=torch.int64, device=device)
    return triton_outliers.plan_settle(outlier_set, case.context - case.q_len, candidates, first_real)


# transformers' continuous batching: a 30-layer model (a page-block stride not a power of 2)
LAYERS = 30


def plan_paged(
    case: Case, gpu: GpuTarget, fmt, dtype: torch.dtype, device: str, slots: int | None, num_splits: int | None
) -> list[Launch]:
    """The launches of `triton_paged.paged_attention` for `case.batch` requests of `case.q_len` new tokens after
    `case.context` cached ones each (a decode step split over the keys by the launcher's rule for `slots`
    resident blocks, default 2 per SM), and of `write_rows` for those new tokens."""
    row_bytes = paged.row_size(case.kv_heads * case.head_dim, case.kv_heads if case.per_token else 0)
    tokens = case.batch * case.q_len
    query = torch.empty(tokens, case.kv_heads * case.group, case.head_dim, dtype=dtype, device=device)
    bytes_per_block = LAYERS * 2 * case.page_size * row_bytes
    pages = torch.empty(16 * bytes_per_block, dtype=torch.uint8, device=device)
    new_rows = torch.empty(tokens, 2, row_bytes, dtype=torch.uint8, device=device)
    read_index = torch.empty(case.batch * case.context, dtype=torch.int64, device=device)
    lengths = [torch.empty(case.batch + n, dtype=torch.int32, device=device) for n in (1, 0, 0)]  # cu_q, k_first, past
    static = None if case.per_token else tuple(torch.ones(case.kv_heads, device=device) for _ in range(2))
    recent = None
    if case.recent or case.sinks:
        rows = torch.empty(case.batch * (case.recent + case.sinks + case.outliers), 2, case.kv_heads, case.head_dim,
                           dtype=dtype, device=device)  # fmt: skip
        requests = torch.empty(4, case.batch, dtype=torch.int32, device=device)
        positions = torch.empty(case.batch, case.kv_heads, case.outliers, dtype=torch.int32, device=device)
        recent = paged.RecentRows(rows, case.recent, case.sinks, requests, ([],) * 4, case.outliers,
                                  positions if case.outliers else None)  # fmt: skip
    geometry = paged.PageGeometry(3 * 2 * case.page_size * row_bytes, bytes_per_block, LAYERS * 2 * case.page_size,
                                  case.page_size)  # fmt: skip
    energy = torch.empty(case.kv_heads, case.head_dim, device=device)
    # a searched layer's query sums, added by the attention launch where it can (as the pages' steps run)
    summed = case.scale_search and triton_paged.sums_in_paged_launch(tokens * case.group, case.rotate)
    _, attend = triton_paged.plan_paged_attention(
        query, pages, new_rows, read_index, *lengths, fmt=fmt, kv_heads=case.kv_heads,
        layer_offset=geometry.layer_offset, bytes_per_block=bytes_per_block, block_stride=geometry.block_stride,
        page_size=case.page_size, scaling=case.head_dim**-0.5, window=case.sliding or None, static_scales=static,
        max_q_len=case.q_len, recent=recent, new_in_pages=not case.sliding, rotate=case.rotate,
        max_k_len=case.context + case.q_len, num_splits=num_splits, resident_slots=slots or gpu.sms * 2, target=gpu,
        search_energy=energy if summed else None,
    )  # fmt: skip
    states = torch.empty(2, case.kv_heads, tokens, case.head_dim, dtype=dtype, device=device)
    stats = torch.zeros(2, 2, dtype=torch.int64, device=device)
    write_index = torch.empty(tokens, dtype=torch.int64, device=device)
    _, write = triton_paged.plan_write_rows(states, fmt, stats, static, pages, geometry, write_index, case.rotate,
                                            case.scale_search, energy)  # fmt: skip
    return [*attend, write]


# --- compiling --------------------------------------------------------------------------------------------------
@dataclass
class Compiled:
    """What one launch compiles to for a target."""

    name: str
    registers: int  # per thread (AMD: VGPRs per lane, accumulation registers included)
    spill_stores: int  # bytes per thread (AMD: scratch bytes per lane)
    spill_loads: int
    stack: int  # stack frame bytes per thread
    shared: int  # dynamic shared memory bytes per block (Triton's request)
    warps: int
    sass: str  # NVIDIA's SASS, "" on AMD
    ptx: str
    ttir: str  # Triton's IR of the kernel as specialized (`int64_offsets` reads it)
    constexpr_args: list[str]  # runtime arguments the launch turned into constexprs (ints equal to 1)
    aligned_args: list[str]  # arguments marked divisible by 16 (pointers and ints)
    amd: dict | None = None  # AMD: the AMDGCN figures (VGPRs, AGPRs, SGPRs, spills, LLVM's waves per SIMD)


def triton_target(gpu: GpuTarget) -> GPUTarget:
    return GPUTarget("hip", gpu.arch, 64) if gpu.is_amd else GPUTarget("cuda", gpu.capability, 32)


def compile_launch(launch: Launch, gpu: GpuTarget = EXAMPLE_GPUS["sm_90"]) -> Compiled:
    """Compile `launch` for `gpu` as `JITFunction.run` would on it: the same binder (argument specialization),
    option parsing and `triton.compile` call, with the target fixed instead of read off a driver."""
    kernel = launch.kernel
    target = triton_target(gpu)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)  # the three options `JITFunction.run` adds before binding
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # prints the log of the `ptxas -v` run Triton makes anyway
        knobs.compilation.always_compile = True  # a cache hit would skip ptxas, and its log
        source = ASTSource(kernel, signature, constexprs, attrs)
        compiled = triton.compile(source, target=target, options=options.__dict__)
    names = kernel.arg_names
    params = [p for p in kernel.params if not p.is_constexpr]
    common = dict(
        name=kernel.__name__, shared=compiled.metadata.shared, warps=compiled.metadata.num_warps,
        ttir=compiled.asm["ttir"], constexpr_args=[p.name for p in params if signature[p.name] == "constexpr"],
        aligned_args=[names[i] for (i,), a in attrs.items() if ["tt.divisibility", 16] in a],
    )  # fmt: skip
    if gpu.is_amd:
        amd = amdgcn_figures(compiled.asm["amdgcn"])
        spilled = amd["scratch"] if amd["scratch_accesses"] else 0  # (a private segment no instruction touches:
        # reserved by LLVM beside SGPR spills into VGPR lanes, 36 B in gfx942's head_dim 64 fp16 decode)
        return Compiled(registers=amd["vgprs"], spill_stores=spilled, spill_loads=spilled, stack=0, sass="", ptx="",
                        amd=amd, **common)  # fmt: skip
    used = re.search(r"Used (\d+) registers", log.getvalue())
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    if not used or not frame:
        raise RuntimeError(f"{kernel.__name__}: no `ptxas -v` figures in Triton's ptxas log:\n{log.getvalue()}")
    return Compiled(
        registers=int(used[1]), stack=int(frame[1]), spill_stores=int(frame[2]), spill_loads=int(frame[3]),
        sass=disassemble(compiled.asm["cubin"]), ptx=compiled.asm["ptx"], **common,
    )  # fmt: skip


AMDGCN_FIGURES = {  # LLVM's comments and metadata in the AMDGCN assembly
    "vgprs": r"; TotalNumVgprs: (\d+)", "agprs": r"; NumAgprs: (\d+)", "sgprs": r"\.sgpr_count:\s+(\d+)",
    "scratch": r"; ScratchSize: (\d+)", "vgpr_spills": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spills": r"\.sgpr_spill_count:\s+(\d+)", "waves_per_simd": r"; Occupancy: (\d+)",
}  # fmt: skip


# instructions that read or write scratch: flat scratch (gfx942, gfx950), or the buffer stores and loads LLVM marks as
# spills and reloads (gfx90a; Triton's own buffer loads and stores of tensors are neither)
SCRATCH_ACCESS = re.compile(r"^\s*(scratch_(load|store)|[a-z_0-9]+ .*; \d+-byte Folded (Spill|Reload))", re.M)


def amdgcn_figures(asm: str) -> dict:
    """Registers, scratch (bytes per lane; `scratch_accesses`: the instructions that touch it), spilled registers
    and occupancy of one kernel's AMDGCN assembly."""
    figures = {}
    for name, pattern in AMDGCN_FIGURES.items():
        found = re.search(pattern, asm)
        if not found:
            raise RuntimeError(f"no {name} ({pattern!r}) in the AMDGCN assembly")
        figures[name] = int(found[1])
    figures["scratch_accesses"] = len(SCRATCH_ACCESS.findall(asm))
    return figures


@triton.jit
def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2.0, mask=offsets < n)


def triton_refusal(gpu: GpuTarget) -> str | None:
    """Why this Triton cannot compile for `gpu`'s target at all (a trivial kernel fails); None where it can."""
    try:
        compile_launch(Launch(_probe_kernel, (1,), (torch.empty(64), 64), dict(BLOCK=64)), gpu)
    except Exception as error:  # the target itself refused: whatever Triton raises
        return f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"
    return None


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin (`cuobjdump -sass`, shipped with Triton)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", f.name], check=True, capture_output=True, text=True
        ).stdout


# --- reading Triton's IR: 32-bit offsets ----------------------------------------------------------------------------
TTIR_OP = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = ([\w.]+)(.*?)(?: loc\((#loc\d*)\))?$")
TTIR_LOC = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.M)
# ops whose result carries its operands' kind of value (an offset's arithmetic); a widening (extsi) stops the walk:
# what is computed before it is a position or index in 32 bits by design (contexts below 2^31 tokens)
# kernel arguments whose products are bounded by construction: the token strides of the recent, sink and outlier
# buffers, whose slots number at most the window (slot x stride < recent_tokens x head_dim); widening those slots
# cost the batch-64 default-window decode 25 registers and a block per SM
BOUNDED_ARGUMENTS = ("%r_st", "%x_st", "%u_st")
OFFSET_ARITHMETIC = ("arith.addi", "arith.subi", "arith.muli", "tt.splat", "tt.broadcast", "tt.expand_dims",
                     "tt.reshape", "arith.select", "arith.maxsi", "arith.minsi")  # fmt: skip


def int32_offset_products(ttir: str) -> list[str]:
    """The 32-bit products of two run-time values (arguments, program ids, loads, loop variables; not constants or
    tile ranges) that reach a pointer offset: each wraps once the product passes 2^31 (a 262k-token prefill's row
    offset at Llama-3-70B's 64 query heads x 128 channels), where an int64 one would not. One line each, with its
    source location."""
    # a name may be defined again in another region: an operand is its closest definition above its use
    ops, definitions = {}, {}
    for number, line in enumerate(ttir.splitlines()):
        m = TTIR_OP.match(line)
        if m:
            operands = re.findall(r"%[\w.]+", m[3].split(" : ")[0])
            ops[(m[1], number)] = (m[2], operands, m[3], m[4], number)
            definitions.setdefault(m[1], []).append(number)
    locations = dict(TTIR_LOC.findall(ttir))

    def resolve(name: str, use: int) -> tuple[str, int]:
        above = [n for n in definitions.get(name, ()) if n < use]
        return (name, max(above)) if above else (name, -1)

    def source(loc: str | None, depth: int = 0) -> str:
        text = locations.get(loc or "", "")
        found = re.search(r'"([^"]+\.py)":(\d+)', text)
        if found:
            return f"{os.path.basename(found[1])}:{found[2]}"
        inner = re.search(r"#loc\d*", text)
        return source(inner[0], depth + 1) if inner and depth < 8 else "?"

    kinds: dict[tuple[str, int], str] = {}

    def kind(value: tuple[str, int]) -> str:  # "const", "range" (a tile's indices), "bounded" or "runtime"
        if value not in kinds:
            op = ops.get(value)
            operands = [resolve(name, value[1]) for name in op[1]] if op else []
            if op is None:  # a block argument: a kernel argument or a loop's variable
                kinds[value] = "bounded" if value[0] in BOUNDED_ARGUMENTS else "runtime"
            elif op[0] == "arith.constant":
                kinds[value] = "const"
            elif op[0] == "tt.make_range" or op[0] == "arith.remsi" and kind(operands[1]) == "const":
                kinds[value] = "range"  # (a remainder by a constant is below it)
            elif op[0] in ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape") and kind(operands[0]) == "bounded":
                kinds[value] = "bounded"
            elif op[0] in OFFSET_ARITHMETIC or op[0] == "arith.extsi":
                found = {kind(operand) for operand in (operands[1:] if op[0] == "arith.select" else operands)}
                kinds[value] = "runtime" if "runtime" in found else "range" if "range" in found else "const"
            else:
                kinds[value] = "runtime"
        return kinds[value]

    flagged, seen = [], set()

    def walk(value: tuple[str, int]) -> None:
        if value in seen or value not in ops:
            return
        seen.add(value)
        op, names, rest, loc, number = ops[value]
        if op not in OFFSET_ARITHMETIC:
            return
        operands = [resolve(name, number) for name in names]
        if op == "arith.muli" and re.search(r"\bi32\b|xi32>", rest.split(" : ")[-1]) and all(
            kind(operand) == "runtime" for operand in operands
        ):
            flagged.append(f"{source(loc)}: {value[0]} = {op} {', '.join(names)} (i32)")
        for operand in operands[1:] if op == "arith.select" else operands:  # (not a select's condition)
            walk(operand)

    for op, names, _, _, number in list(ops.values()):
        if op == "tt.addptr":
            walk(resolve(names[1], number))
    return sorted(set(flagged))


# --- reading the SASS -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instr:
    address: int
    opcode: str  # with its modifiers: "DEPBAR.LE", "HMMA.16816.F32.BF16"
    operands: str

    def is_(self, *names: str) -> bool:
        return self.opcode.split(".")[0] in names


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def parse_sass(sass: str) -> list[Instr]:
    """The instructions of `cuobjdump -sass` output, in address order (one kernel per cubin)."""
    return [Instr(int(m[1], 16), m[2], m[3].strip()) for m in SASS_LINE.finditer(sass)]


def loops(instrs: list[Instr]) -> list[list[Instr]]:
    """The bodies of the loops: each backward branch with the instructions from its target to itself."""
    bodies = []
    for branch in instrs:
        target = re.search(r"0x([0-9a-f]+)", branch.operands) if branch.is_("BRA") else None
        if target and int(target[1], 16) < branch.address:
            bodies.append([i for i in instrs if int(target[1], 16) <= i.address <= branch.address])
    return bodies


def main_loop(instrs: list[Instr]) -> list[Instr] | None:
    """The hot loop of a matrix kernel: among the loops with tensor-core instructions, the one that converts FP8
    codes in hardware or feeds them to FP8 dots (the KV loop; the loops over full-precision tokens do neither),
    then the one with the most tensor-core instructions, then the one that streams its tiles (asynchronous
    copies), then the innermost (fewest instructions); None when no loop holds any."""
    with_dots = [body for body in loops(instrs) if any(i.is_(*DOTS) for i in body)]
    return max(with_dots, key=lambda body: (
        any(FP8_UNPACK.match(i.opcode) or i.is_(*FP8_DOTS) for i in body), sum(i.is_(*DOTS) for i in body),
        any(i.is_(*ASYNC_COPIES) for i in body), -len(body),
    ), default=None)  # fmt: skip


PTX_LABEL = re.compile(r"^(\$L__BB\d+_\d+):", re.M)
PTX_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
PTX_DOT = re.compile(r"\b(?:mma\.sync|wgmma\.mma_async)\.")


def unroll_factor(loop: list[Instr], ptx: str) -> int:
    """Tiles one iteration of the SASS `loop` processes: its dots over those of the PTX loop with the most (each
    PTX mma is one SASS instruction, so a ratio above 1 is ptxas unrolling)."""
    labels = {m[1]: m.start() for m in PTX_LABEL.finditer(ptx)}
    ptx_dots = [
        len(PTX_DOT.findall(ptx, labels[m[1]], m.end()))
        for m in PTX_BRANCH.finditer(ptx)
        if labels.get(m[1], math.inf) < m.start()
    ]
    sass_dots = sum(i.is_(*DOTS) for i in loop)
    return max(1, round(sass_dots / max(ptx_dots))) if ptx_dots and max(ptx_dots) else 1


def tiles_in_flight(instrs: list[Instr], loop: list[Instr], unroll: int) -> tuple[int, str]:
    """Tiles whose loads are in flight when the loop waits for the oldest, and the evidence read for it."""
    copies = [i for i in loop if i.is_(*ASYNC_COPIES)]
    if not copies:
        loads = sum(i.is_("LDG") for i in loop)
        return 1, f"no asynchronous copies in the loop ({loads} plain global loads, waited for in the iteration)"
    dots = [i.address for i in loop if i.is_(*DOTS)]
    issued = f"the loop's first copy follows {sum(a < copies[0].address for a in dots)} of its {len(dots)} dots"
    commits = sum(i.opcode == "LDGDEPBAR" for i in loop)
    waits = [re.match(r"SB0, 0x([0-9a-f]+)", i.operands) for i in loop if i.opcode == "DEPBAR.LE"]
    waits = [int(m[1], 16) for m in waits if m]
    if copies[0].is_("LDGSTS") and commits and waits:  # cp.async: DEPBAR.LE SB0, N leaves N commit groups pending
        wait = min(waits)
        return 1 + wait * unroll // commits, (
            f"cp.async: the loop waits with DEPBAR.LE SB0, {wait} ({'partial' if wait else 'all loads'}), "
            f"{commits} commit groups per {unroll} tile(s); {issued}"
        )
    prologue = sum(i.is_(*ASYNC_COPIES) for i in instrs if i.address < loop[0].address)
    per_tile = len(copies) / unroll
    evidence = f"{prologue} copies issued before the loop, {per_tile:g} per tile; {issued}"
    return max(1, int(prologue // per_tile)), evidence


def wave_efficiency(blocks: int, slots: int) -> float:
    """Mean fullness of the waves of `blocks` blocks on `slots` resident slots (the last wave's emptiness)."""
    return blocks / (-(-blocks // slots) * slots)


def tile_bytes(case: Case, tokens: int) -> int:
    """KV bytes of a tile of `tokens` tokens: K and V codes and their per-token scales (a K and a V scale per
    token: 2 bytes each in the dense cache, 4 in pages)."""
    scale_bytes = (8 if case.kind == "paged" else 2 * PER_TOKEN_SCALE_DTYPE.itemsize) if case.per_token else 0
    return tokens * (2 * case.head_dim * FORMATS[case.fmt].dtype.itemsize + scale_bytes)


def split_tiles(case: Case, block_n: int) -> tuple[int, int]:
    """The tiles of codes of a decode step of `case`, and its recent and sink tokens' in codes' bytes, as the split
    rule counts them."""
    held = -(-(case.recent + case.sinks + case.outliers) * getattr(torch, case.dtype).itemsize // block_n)
    return -(-(case.context - case.recent) // block_n), held


def last_waves(case: Case, gpu: GpuTarget, kernel, slots: int) -> list[dict]:
    """Blocks of `kernel`'s launches and their wave efficiency over the batch x context grid of `case`."""
    grid = []
    for batch in BATCHES:
        for context in CONTEXTS:
            launches = plan(dataclasses.replace(case, batch=batch, context=context), gpu, device="meta", slots=slots)
            (launch,) = [launch for launch in launches if launch.kernel is kernel]
            merge = merge_per_split(launch, gpu, slots, case.head_dim)  # (where the launch merges its splits)
            blocks = math.prod(launch.grid)
            programs, splits = launch.grid[0] * launch.grid[1], launch.grid[2]
            tiles, held = split_tiles(dataclasses.replace(case, context=context), launch.kwargs["BLOCK_N"])
            # the split rule's own cost (waves x (the longest split + each program's own reads and writes), then the
            # merge), against the cheapest of every split count up to 8 per slot's share (whole KV tiles: no plan
            # beats ceil(all tiles / slots) tile-times, whatever its waves' fullness)
            counts = range(1, min(tiles + held, 8 * -(-slots // programs) + 8) + 1)
            grid.append(dict(
                batch=batch, context=context, blocks=blocks, efficiency=wave_efficiency(blocks, slots),
                tile_times=triton_attention.split_cost(programs, tiles, slots, held, splits, merge),
                fewest_tile_times=min(
                    triton_attention.split_cost(programs, tiles, slots, held, n, merge) for n in counts
                ),
            ))  # fmt: skip
    return grid


def merge_per_split(launch: Launch, gpu: GpuTarget, slots: int, head_dim: int) -> float:
    """The split rule's cost of merging one split of a dense decode launch on `gpu` with `slots` resident blocks, in
    tile-times (`triton_attention.TileTime.merge`; none where a reduce launch merges them)."""
    tile = triton_attention.TileTime(launch.kwargs["BLOCK_N"], head_dim, slots, gpu.memory_bandwidth)
    return tile.merge(merge_rows(launch))


def merge_rows(launch: Launch) -> int:
    """The rows of each split's partial results the last split of a dense decode launch reads to merge them (a
    program's; none where a reduce launch merges them)."""
    return min(launch.kwargs["GROUP"], launch.kwargs["BLOCK_M"]) if launch.kwargs["MERGE"] else 0


def mma(compiled: Compiled) -> dict | None:
    """The kernel's tensor-core instructions (`dot_kinds` of the whole kernel)."""
    return dot_kinds(parse_sass(compiled.sass))


def dot_kinds(instrs: list[Instr]) -> dict | None:
    """The tensor-core instructions among `instrs`: the most frequent kind (HMMA / QMMA: fp16 / FP8 mma.sync;
    HGMMA / QGMMA: wgmma; UTCHMMA / UTCQMMA: tcgen05; a tie to the first in DOTS), how many there are, and the
    count of each kind; None without any."""
    kinds = collections.Counter(i.opcode.split(".")[0] for i in instrs if i.is_(*DOTS))
    if not kinds:
        return None
    kind = min(kinds, key=lambda k: (-kinds[k], DOTS.index(k)))
    return dict(kind=kind, count=sum(kinds.values()), kinds=dict(sorted(kinds.items())))


def spill_accesses(instrs: list[Instr]) -> int:
    """Local-memory loads and stores among `instrs` (a Triton kernel's local memory holds only spilled registers)."""
    return sum(i.is_("LDL", "STL") for i in instrs)


def register_moves(instrs: list[Instr]) -> int:
    """Register-to-register moves among `instrs` (`MOV`, and `IMAD.MOV` that ptxas issues for many of them): in a
    decode loop, mostly dot operands gathered into the MMA's registers (`benchmarks/operand_reload_probe.py`)."""
    return sum(i.is_("MOV") or i.opcode.startswith("IMAD.MOV") for i in instrs)


def loop_report(compiled: Compiled, tile_bytes: int, gpu: GpuTarget) -> dict | None:
    """The main loop's figures, for a loop that loads `tile_bytes` of KV per tile; None without such a loop."""
    instrs = parse_sass(compiled.sass)
    loop = main_loop(instrs)
    if loop is None:
        return None
    unroll = unroll_factor(loop, compiled.ptx)
    in_flight, evidence = tiles_in_flight(instrs, loop, unroll)
    per_byte = len(loop) * compiled.warps / (unroll * tile_bytes)
    return dict(
        start=loop[0].address, end=loop[-1].address, instructions=len(loop), unroll=unroll,
        dots=sum(i.is_(*DOTS) for i in loop), mma=dot_kinds(loop), tile_bytes=tile_bytes, instr_per_byte=per_byte,
        tiles_in_flight=in_flight, evidence=evidence, ceiling_tbps=issue_rate(gpu) / per_byte / 1e12,
        spill_accesses=spill_accesses(loop), moves=register_moves(loop),
    )  # fmt: skip


def issue_rate(gpu: GpuTarget) -> float:
    """Warp-instructions per second: 4 per clock per SM at the example GPU's boost clock."""
    return 4 * CLOCKS[gpu.arch] * 1e9 * gpu.sms


# --- a decode layer step on the example GPU, modelled from the compiled code ---------------------------------------
@dataclass(frozen=True)
class StepModel:
    """What the step model assumes (docs/benchmarks.md, "Decode layer step model"): the ranges of issue 34. One
    end of each range is `low`, the other `high`; `middle` is the mean."""

    copy_share: float  # of the datasheet bandwidth a copy kernel reaches (H200: 4.3-4.8 of 4.8 TB/s)
    issue_share: float  # of the 4 warp-instructions per clock per SM the KV loop issues
    attention_launch_us: float  # fixed cost of an attention launch (launch, prologue, tail)
    other_launch_us: float  # of any other launch in the step (the write, a split reduce)
    gap_us: float  # between two launches


STEP_RANGES = (StepModel(0.90, 0.45, 3.0, 3.0, 1.0), StepModel(1.0, 0.65, 1.5, 2.0, 0.3))  # (low, high)
STEP_POINTS = {"b1_4k": (1, 4096), "b1_32k": (1, 32768), "b16_4k": (16, 4096), "b16_32k": (16, 32768)}
MAX_STEP_LAUNCHES = 2
MIN_COPY_FRACTION = {"b1_32k": 0.80, "b1_4k": 0.35}  # modelled at the middle of the ranges (sm_90)


def middle(ranges: tuple[StepModel, StepModel]) -> StepModel:
    low, high = (dataclasses.astuple(r) for r in ranges)
    return StepModel(*((a + b) / 2 for a, b in zip(low, high)))


def step_time(case: Case, gpu: GpuTarget, row: dict, model: StepModel) -> tuple[float, float, int]:
    """`(modelled step time, copy time, launches)` (microseconds) of one decode layer step of `case` (its batch and
    context), the attention's split plan from the kernel's occupancy in `row`: fixed launch costs + gaps +
    max(copy, issue) x the split plan's loss (its waves against every tile spread evenly over the slots it uses) +
    the merge's serial reads from L2 (`triton_attention.merge_seconds` per partial result, `merge_reads` of them,
    one after another). The launches: the attention's (which writes the new token itself, a static cache's
    compiled graph's included; with outlier tokens or rotated codes, and on targets that do not compile it, a write
    launch of its own, which with outlier tokens judges the token it gives codes too), its reduce where the kernel
    does not merge its splits, with searched scales the queries' sums where the attention launch does not add them
    (`triton_attention.sums_in_launch`)."""
    slots = gpu.sms * row["blocks_per_sm"]
    attention = plan(case, gpu, device="meta", slots=slots)
    (launch,) = [x for x in attention if x.kernel is triton_attention._attention_kernel]
    write = [] if launch.kwargs["WRITE"] else plan(dataclasses.replace(case, kind="write", q_len=1), gpu, device="meta")
    sums = case.scale_search and not launch.kwargs["SUMS"]  # the queries' sums in a launch of their own
    launches = len(write) + len(attention) + sums
    clock, bandwidth = CLOCKS[gpu.arch], gpu.bandwidth
    fp_bytes = (case.recent + case.sinks) * 2 * case.head_dim * getattr(torch, case.dtype).itemsize
    codes_bytes = tile_bytes(case, case.context - case.recent)
    kv_bytes = case.batch * case.kv_heads * (codes_bytes + fp_bytes)
    copy_us = kv_bytes / (bandwidth * model.copy_share) * 1e6
    issue_us = kv_bytes * row["loop"]["instr_per_byte"] / (4 * clock * 1e9 * gpu.sms * model.issue_share) * 1e6
    splits = launch.grid[2]
    tiles, held = split_tiles(case, launch.kwargs["BLOCK_N"])
    programs = launch.grid[0] * launch.grid[1]
    ideal = programs * (tiles + held) / min(slots, programs * splits)  # tile-times if every used slot were even
    waves = -(-programs * splits // slots)
    loss = waves * triton_attention.longest_split(tiles, held, splits) / ideal
    reads = triton_attention.merge_reads(splits, launch.kwargs["GROUPED_MERGE"])
    merge_us = triton_attention.merge_seconds(merge_rows(launch), case.head_dim) * reads * 1e6
    fixed_us = model.attention_launch_us + (launches - 1) * (model.other_launch_us + model.gap_us)
    return fixed_us + max(copy_us, issue_us) * max(loss, 1.0) + merge_us, copy_us, launches


def step_record(case: Case, gpu: GpuTarget, row: dict) -> dict:
    """The `step` record of a decode row: its launches (the most at any of STEP_POINTS), and the modelled copy
    fraction (copy time / step time) at each point, at the middle of STEP_RANGES, with both ends and the middle's
    times (us)."""
    record = dict(launches=0, copy_fraction={}, ends={}, step_us={})
    for name, (batch, context) in STEP_POINTS.items():
        point = dataclasses.replace(case, batch=batch, context=context)
        figures = [step_time(point, gpu, row, model) for model in (*STEP_RANGES, middle(STEP_RANGES))]
        record["launches"] = max(record["launches"], figures[0][2])
        fractions = [copy / step for step, copy, _ in figures]
        record["copy_fraction"][name] = round(fractions[2], 3)
        record["ends"][name] = [round(min(fractions[:2]), 3), round(max(fractions[:2]), 3)]
        record["step_us"][name] = round(figures[2][0], 2)
    return record


# --- the report ----------------------------------------------------------------------------------------------------
def analyze_case(job: tuple[Case, str]) -> list[dict]:
    """One row per launch of a case on a target (`(case, arch)`): the compiled figures and the budgets it misses."""
    case, arch = job
    gpu = EXAMPLE_GPUS[arch]
    rows = []
    launches, known = plan(case, gpu), {}
    if case.kind == "paged" and case.q_len == 1:  # split as `paged_attention` splits it on that GPU: by the
        # occupancy of its split kernel
        split = plan(case, gpu, num_splits=2)[0]
        known[_launch_key(split)] = compiled = compile_launch(split, gpu)
        launches = plan(case, gpu, slots=gpu.sms * max(1, gpu.blocks_per_sm(compiled.registers, compiled.warps,
                                                                          compiled.shared)))  # fmt: skip
    for launch in launches:
        compiled = known.get(_launch_key(launch)) or compile_launch(launch, gpu)
        fits = gpu.blocks_per_sm(compiled.registers, compiled.warps, compiled.shared)
        tile_tokens = launch.kwargs.get("BLOCK_N")  # tokens of K and V one iteration of the KV loop loads
        loaded = tile_tokens and tile_bytes(case, tile_tokens)
        row = dict(
            arch=arch, kind=case.kind, case=dataclasses.asdict(case), kernel=compiled.name, grid=list(launch.grid),
            variant=f"{case.name} grid {'x'.join(map(str, launch.grid))}",
            registers=compiled.registers, spill_stores=compiled.spill_stores, spill_loads=compiled.spill_loads,
            stack=compiled.stack, shared=compiled.shared, warps=compiled.warps, blocks_per_sm=fits,
            hardware_decode=launch.kwargs.get("HW_CONVERT"), constexpr_args=compiled.constexpr_args,
            aligned_args=compiled.aligned_args, mma=mma(compiled), amd=compiled.amd,
            int32_offsets=int32_offset_products(compiled.ttir),
            loop=loop_report(compiled, loaded, gpu) if loaded and not gpu.is_amd else None, failures=[],
        )  # fmt: skip
        if row["loop"] is not None and case.kind == "decode" and case.waves and fits:
            grid = last_waves(case, gpu, launch.kernel, gpu.sms * fits)  # the split rule fed this kernel's occupancy
            row["waves"] = dict(slots=gpu.sms * fits, worst=min(grid, key=lambda g: g["efficiency"]), grid=grid)
        if row["loop"] is not None and case.kind == "decode" and fits and gpu.arch in CLOCKS:
            row["step"] = step_record(case, gpu, row)
        row["failures"] = budget_failures(row)
        rows.append(row)
    if case.kind == "decode" and not gpu.is_amd and not any(row["loop"] for row in rows):
        rows[0]["failures"].append(
            "no KV loop found: no launch has both a BLOCK_N constexpr (tokens per KV tile) and a SASS loop with "
            "tensor-core instructions"
        )
    return rows


def _launch_key(launch: Launch) -> tuple:
    """What a launch's compiled code depends on here (the grid aside)."""
    return launch.kernel, tuple(sorted(launch.kwargs.items()))


def budget_failures(row: dict) -> list[str]:
    """The budgets `row` misses, each with its reason."""
    failures = []
    if not row["blocks_per_sm"]:
        failures.append(f"no block fits: {row['registers']} registers x {row['warps']} warps, {row['shared']} B shared")
    if row["spill_stores"] or row["spill_loads"]:
        where = ""
        if row["loop"] is not None:  # (a spill outside the KV loop costs a step a few L1 accesses, one inside it
            # every tile: the budget counts both, the message tells them apart)
            inside = row["loop"]["spill_accesses"]
            where = f" ({inside} local loads / stores in the KV loop)" if inside else " (none in the KV loop)"
        failures.append(f"spills {row['spill_stores']} B stores / {row['spill_loads']} B loads per thread{where}")
    if row["int32_offsets"]:
        failures.append(f"32-bit products of run-time sizes in pointer offsets: {'; '.join(row['int32_offsets'])}")
    if row["amd"] is not None:  # (SGPRs spill into VGPR lanes and, without scratch, VGPRs into AGPRs, not memory:
        # reported, no miss; scratch read or written is a spill above)
        return failures
    case, loop = row["case"], row["loop"]
    fp8_dots = case["head_dim"] == 128 and case.get("fp8_prefill")  # (the default prefill keeps fp16 dots: quality)
    # the KV loop's dots: a kernel's full-precision tokens (recent, sinks) take fp16 dots by design, and outnumber
    # the loop's in a window's kernel (sm_89: 96 HMMA in its other loops, 64 QMMA the whole KV loop's)
    dots = (loop or {}).get("mma") or row["mma"] or {}
    # per-token V scales keep the values' dot in fp16 where FP8 cost more (`GpuTarget.fp8_token_values`): there
    # the scores' FP8 dots share the loop with it, and outnumber it or not by the instruction shapes
    fp8_values = not case.get("per_token") or EXAMPLE_GPUS[row["arch"]].fp8_token_values
    if row["kind"] == "prefill" and fp8_dots:
        if fp8_values and dots.get("kind") not in FP8_DOTS:
            failures.append(f"prefill KV loop's dots are {dots.get('kind')}, not FP8 ({'/'.join(FP8_DOTS)})")
        elif not fp8_values and not set(dots.get("kinds", {})) & set(FP8_DOTS):
            failures.append(f"prefill KV loop's scores are not on FP8 dots ({'/'.join(FP8_DOTS)}): {dots.get('kinds')}")
    if row["kernel"] == "_reduce_kernel" and case["batch"] == 1 and case["context"] >= 32768:
        programs = math.prod(row["grid"])
        if programs < MIN_REDUCE_PROGRAMS:
            failures.append(f"reduce on {programs} programs < {MIN_REDUCE_PROGRAMS} at batch 1, {case['context']} tokens")
    if row["kernel"] == "_paged_attention_kernel" and case["q_len"] == 1 and case["batch"] <= 16 \
            and case["context"] >= 32768:  # fmt: skip
        least = MIN_PAGED_WAVES * EXAMPLE_GPUS[row["arch"]].sms
        if math.prod(row["grid"]) < least:
            failures.append(f"paged decode of {case['batch']} requests x {case['context']} keys on "
                            f"{math.prod(row['grid'])} programs < {least}")  # fmt: skip
    if row["kind"] != "decode" or loop is None:
        return failures
    step = row.get("step")
    if step and step["launches"] > MAX_STEP_LAUNCHES:
        failures.append(f"a decode layer step takes {step['launches']} launches > {MAX_STEP_LAUNCHES}")
    for point, least in MIN_COPY_FRACTION.items():
        if step and row["arch"] == "sm_90" and step["copy_fraction"][point] < least:
            failures.append(
                f"modelled layer step at {step['copy_fraction'][point]:.0%} of copy bandwidth < {least:.0%} at "
                f"{point} ({step['step_us'][point]} us)"
            )
    d128 = case["head_dim"] == 128
    if d128 and row["arch"] == "sm_90" and row["blocks_per_sm"] < D128_MIN_BLOCKS_PER_SM:
        failures.append(f"head_dim 128 decode at {row['blocks_per_sm']} blocks per SM < {D128_MIN_BLOCKS_PER_SM}")
    limit = (D128_MAX_INSTR_PER_BYTE if d128 else MAX_INSTR_PER_BYTE) if row["hardware_decode"] else BIT_DECODE_MAX_INSTR_PER_BYTE
    if loop["instr_per_byte"] > limit:
        failures.append(
            f"decode loop {loop['instr_per_byte']:.3f} SASS instructions per KV byte > {limit} "
            f"({loop['instructions']} instructions x {row['warps']} warps / {loop['unroll']} x {loop['tile_bytes']} B)"
        )
    if loop["tiles_in_flight"] < MIN_TILES_IN_FLIGHT and EXAMPLE_GPUS[row["arch"]].async_copies:
        failures.append(f"decode not pipelined, {loop['tiles_in_flight']} tile in flight: {loop['evidence']}")
    # a grid point misses when its last wave is under-full and another split count would have been faster (judged
    # on sm_90, where the split rule was tuned; other targets report their worst wave)
    low = row["arch"] == "sm_90" and [
        g for g in row.get("waves", {}).get("grid", [])
        if g["efficiency"] < MIN_LAST_WAVE and g["tile_times"] > g["fewest_tile_times"]
    ]  # fmt: skip
    if low:
        worst = min(low, key=lambda g: g["efficiency"])
        failures.append(
            f"last wave {worst['efficiency']:.0%} < {MIN_LAST_WAVE:.0%} at batch {worst['batch']} context "
            f"{worst['context']} ({worst['blocks']} blocks on {row['waves']['slots']} slots, {worst['tile_times']} "
            f"tile-times where {worst['fewest_tile_times']} would do); {len(low)} of {len(row['waves']['grid'])} "
            "grid points"
        )
    return failures


COLUMNS = ("kernel", "variant", "regs", "spill B", "smem KB", "blk/SM", "instr/KV B", "in flight", "last wave",
           "ceiling TB/s")  # fmt: skip
AMD_COLUMNS = ("kernel", "variant", "VGPRs", "AGPRs", "SGPRs", "scratch B", "scratch ops", "LDS KB", "waves/SIMD",
               "blk/CU")  # fmt: skip


def table_row(row: dict) -> tuple[str, ...]:
    if row["amd"] is not None:
        amd = row["amd"]
        return (
            row["kernel"], row["variant"], str(amd["vgprs"]), str(amd["agprs"]), str(amd["sgprs"]), str(amd["scratch"]),
            str(amd["scratch_accesses"]), f"{row['shared'] / 1024:.1f}", str(amd["waves_per_simd"]),
            str(row["blocks_per_sm"]),
        )  # fmt: skip
    loop, waves = row["loop"], row.get("waves")
    worst = waves["worst"] if waves else None
    return (
        row["kernel"],
        row["variant"],
        str(row["registers"]),
        str(max(row["spill_stores"], row["spill_loads"])),
        f"{row['shared'] / 1024:.1f}",
        str(row["blocks_per_sm"]),
        f"{loop['instr_per_byte']:.3f}" if loop else "-",
        str(loop["tiles_in_flight"]) if loop else "-",
        f"{worst['efficiency']:.0%} b{worst['batch']} {worst['context'] // 1024}k" if worst else "-",
        f"{loop['ceiling_tbps']:.2f}" if loop else "-",
    )


def format_table(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    cells = [columns] + [table_row(row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def target_header(gpu: GpuTarget) -> str:
    """The line above a target's table: the GPU its figures are for, and how its codes are decoded."""
    fmt = FORMATS[gpu.default_fp8]
    decode = "hardware" if gpu.hardware_code_type(fmt.dtype) is not None else "bit operations"
    line = f"{gpu.arch} ({gpu.name}: {gpu.sms} {'CUs' if gpu.is_amd else 'SMs'}), {fmt.name} codes decoded by {decode}"
    if gpu.is_amd:
        return line + "; blk/CU from the VGPRs (512 per SIMD lane, 8 waves per SIMD, 4 SIMDs) and the LDS"
    return line + (
        f"; ceiling = issue-bound decode bandwidth (4 warp-instructions/clock/SM at {CLOCKS[gpu.arch]} GHz) against "
        f"{gpu.bandwidth / 1e12:g} TB/s; last wave = worst over batch {'/'.join(map(str, BATCHES))} x context "
        f"{'/'.join(f'{c // 1024}k' for c in CONTEXTS)}"
    )


def run(jobs: list[tuple[Case, str]], processes: int) -> list[dict]:
    """The rows of every `(case, arch)`, compiled `processes` at a time."""
    if processes <= 1 or len(jobs) == 1:
        return [row for job in jobs for row in analyze_case(job)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [row for rows in pool.map(analyze_case, jobs) for row in rows]


def parse_arches(text: str) -> list[str]:
    """`--arch`'s targets: a comma list of ARCHES, or "all"."""
    arches = list(ARCHES) if text == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arches if a not in ARCHES]
    if unknown or not arches:
        raise argparse.ArgumentTypeError(f"unknown targets {unknown}: choose among {', '.join(ARCHES)}, or 'all'")
    return arches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one decode case, one write, two paged"
    )
    parser.add_argument("--arch", type=parse_arches, default=["sm_90"], help=f"{','.join(ARCHES)}, a list, or 'all'")
    parser.add_argument("--no-budget", action="store_true", help="exit 0 even when a budget is missed")
    parser.add_argument("--json", metavar="PATH", help="also write every figure (and the loop evidence) as JSON")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel compiles")
    parser.add_argument("--match", metavar="TEXT", help="only the cases whose kind and name contain TEXT")
    args = parser.parse_args(argv)

    # a target the cache gives the torch path (T4), or one this Triton cannot compile for, gets a line saying why
    refused = {arch: EXAMPLE_GPUS[arch].unsupported() or triton_refusal(EXAMPLE_GPUS[arch]) for arch in args.arch}
    jobs = [
        (case, arch) for arch in args.arch if not refused[arch]
        for case in cases(args.quick, EXAMPLE_GPUS[arch]) if not args.match or args.match in f"{case.kind} {case.name}"
    ]  # fmt: skip
    rows = run(jobs, args.jobs)
    print(f"Triton {triton.__version__}")
    for arch in args.arch:
        gpu = EXAMPLE_GPUS[arch]
        print(f"\n{target_header(gpu)}")
        if refused[arch]:
            print(f"not compiled: {refused[arch]}")
            continue
        print(format_table([row for row in rows if row["arch"] == arch], AMD_COLUMNS if gpu.is_amd else COLUMNS))
    failures = [f"{row['arch']} {row['kernel']} [{row['variant']}]: {why}" for row in rows for why in row["failures"]]
    print(f"\nbudgets missed: {len(failures)}" if failures else "\nbudgets: all met")
    for failure in failures:
        print(f"  FAIL {failure}")
    if args.json:
        targets = {arch: dict(name=EXAMPLE_GPUS[arch].name, sms=EXAMPLE_GPUS[arch].sms, refused=refused[arch])
                   for arch in args.arch}  # fmt: skip
        rows += [dict(arch=arch, refused=why) for arch, why in refused.items() if why]
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, targets=targets, rows=rows, failures=failures), f)
    return 1 if failures and not args.no_budget else 0


if __name__ == "__main__":
    sys.exit(main())
