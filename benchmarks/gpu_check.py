"""GPU check of the Triton kernels: the kernel tests on CUDA (bf16 included), then speed figures.

(a) device copy bandwidth; (b) decode attention over FP8 codes, achieved GB/s as a fraction of (a), contexts
4k..128k, batch 1..64, GQA 8:1, head_dim 128; (c) the same for transformers' SDPA over a BF16 cache and for
transformers' `QuantizedCache(fp8)`; (d) decode step time vs context of a random-weight Llama-3-8B-shaped
model (bf16), `DynamicCache` against ours, with the fitted slopes; (e) causal prefill attention against SDPA,
with and without a padding mask; (f) compiled + CUDA-graph decode steps, our static cache against StaticCache +
SDPA at 4k and 32k; (g) continuous batching (`generate_batch`) on FP8 pages against native pages at one page
budget, a random Llama-3-8B-shaped model cut to `compiled_layers` layers; (h) each launch of one layer's decode
step timed alone (the attention kernel, its split reduce, the write kernel), 32:8 heads, head_dim 128, batch 1
and 16, contexts 4k and 32k: pure FP8 against the default window (recent 128 + sinks 4), STAGES 3 against 4, a
left-padded batch-16 step (its splits merged in the attention launch against a reduce launch), and at batch 1 the
default window with 16 outlier tokens (their selection's launch too), each launch's bytes read as GB/s and as a
fraction of (a); it runs right after (b, c);
(i) the paged decode (continuous batching's kernel) of few long and many short requests, split over the keys as
its rule plans it against one program per request and KV head, the same tensors, as GB/s and a fraction of (a).
Every section runs even if one before it fails (one call yields every figure). Timing: `triton.testing.do_bench`
medians (CUDA events) after warm-up, inputs rotated over copies that together exceed the L2 cache ((h): do_bench's
own cache flush between runs). Everything printed is also written to `--out`.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check-<date>-<device>.txt
    python benchmarks/gpu_check.py --dry-run   # CPU: the same code path on the Triton interpreter, toy sizes

The kernel tests (a reduced set) compile each kernel specialization they use; `--tests-only` and `--skip-tests`
split the check into two runs if needed. Budget: one call within 8 minutes on an H200 from a cold start.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (hf_fp8kv is imported once the Triton interpreter is chosen)
    from hf_fp8kv.kernels.triton_launch import Launch
    from hf_fp8kv.kernels.view import KVView
    from hf_fp8kv.layer import FP8Layer

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/kernels/test_triton_write.py", "tests/kernels/test_triton_attention.py",
                "tests/kernels/test_outlier_selection.py"]


@dataclass
class Sizes:
    """What each section measures; `FULL` on the GPU, `TOY` for the interpreter."""

    q_heads: int
    kv_heads: int
    head_dim: int
    contexts: list[int]
    batches: list[int]
    max_tokens: int  # batch * context cap of (b), (c)
    max_tokens_dequantizing: int  # the same for QuantizedCache(fp8), which dequantizes everything per step
    model: dict
    model_contexts: list[int]
    prefill_lengths: list[int]
    compiled_layers: int  # layers of the compiled model (compile time grows with them)
    compiled_contexts: list[int]
    continuous_batching: dict  # pages budget (MiB), requests, new tokens of (g)
    copy_bytes: int
    step_contexts: list[int]  # of (h)
    step_batches: list[int]  # of (h); the largest also takes a left-padded step
    resident_slots: int | None  # (h)'s split rule off a GPU (None: the device's own resident blocks)
    paged_steps: list[tuple[int, int]]  # (i): (requests, cached tokens each)
    paged_page_size: int  # (i)
    test_filter: str | None
    dtype: torch.dtype  # of queries, K/V and the model (bf16 on the GPU; the interpreter's bf16 dot is broken)


FULL = Sizes(
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    contexts=[4096, 16384, 32768, 65536, 131072],
    batches=[1, 8, 64],
    max_tokens=4 * 2**20,
    max_tokens_dequantizing=2**20,
    model=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072),
    model_contexts=[2048, 8192, 16384, 32768, 65536],
    prefill_lengths=[1024, 4096, 16384],
    compiled_layers=8,
    compiled_contexts=[4096, 32768],
    continuous_batching=dict(budget_mib=256, requests=64, new_tokens=32),
    copy_bytes=2 * 2**30,
    step_contexts=[4096, 32768],
    step_batches=[1, 16],
    resident_slots=None,
    paged_steps=[(16, 32768), (64, 4096)],
    paged_page_size=256,
    test_filter="test_attention_matches_reference or test_write_is_bit_identical or test_splits or nan",
    dtype=torch.bfloat16,
)  # fmt: skip
TOY = Sizes(
    q_heads=4,
    kv_heads=2,
    head_dim=64,
    contexts=[130],
    batches=[1, 2],
    max_tokens=512,
    max_tokens_dequantizing=256,
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512),
    model_contexts=[16, 40],
    prefill_lengths=[40],
    compiled_layers=2,
    compiled_contexts=[16],
    continuous_batching=dict(budget_mib=0.1, requests=4, new_tokens=3),
    copy_bytes=2**20,
    step_contexts=[300],
    step_batches=[1, 2],
    resident_slots=8,  # splits, hence the reduce launch, at toy sizes
    paged_steps=[(2, 300)],
    paged_page_size=16,
    test_filter="test_bad",
    dtype=torch.float32,
)  # fmt: skip


class Report:
    """Prints each line and appends it to the output file at once (a timeout keeps what was measured)."""

    def __init__(self, path: Path | None):
        self.file = path.open("w") if path else None

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.file:
            self.file.write(text + "\n")
            self.file.flush()

    def table(self, rows: list[dict]) -> None:
        from hf_fp8kv.table import format_table

        self(format_table(rows))


def bench(fn, dry_run: bool) -> float:
    """Median milliseconds of `fn` (do_bench on the GPU; one perf_counter run on the interpreter, whose figures
    mean nothing)."""
    if dry_run:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


class Rotation:
    """Calls `fn(copy)` on the next of enough copies of the inputs that together they exceed the L2 cache."""

    def __init__(self, make_copy, bytes_per_copy: int, device: torch.device):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
        count = max(1, min(16, math.ceil(4 * l2 / max(bytes_per_copy, 1))))
        self.copies = [make_copy() for _ in range(count)]
        self.next = 0

    def __call__(self, fn):
        def step():
            fn(self.copies[self.next])
            self.next = (self.next + 1) % len(self.copies)

        return step


def host_ms(step, device: torch.device, repeats: int) -> float:
    """Median milliseconds `step` keeps the CPU busy, each call starting with the GPU's queue empty (what the
    GPU time hides as long as it is the larger: Python, dispatch and kernel launches, Triton's own included)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times) * 1e3


def short_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_kernel_tests(report: Report, sizes: Sizes) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS]
    if sizes.test_filter:
        command += ["-k", sizes.test_filter]
    report("## kernel tests: " + " ".join(command[3:]))
    try:  # each kernel specialization compiles on first use: a few minutes on the GPU
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as timeout:
        output = timeout.stdout or ""
        output = output.decode() if isinstance(output, bytes) else output
        report(f"timed out after {timeout.timeout} s:\n{output[-2000:]}")
        return
    report("\n".join(result.stdout.strip().splitlines()[-6:]))
    report(f"exit status {result.returncode}")


def copy_bandwidth(report: Report, sizes: Sizes, device: torch.device, dry_run: bool) -> float:
    source = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = bench(lambda: target.copy_(source), dry_run)
    gbps = 2 * sizes.copy_bytes / ms / 1e6
    report(f"## (a) copy bandwidth: {gbps:.0f} GB/s ({sizes.copy_bytes / 2**30:.2f} GiB read + written, {ms:.3f} ms)")
    return gbps


def filled_layer(batch: int, kv_heads: int, head_dim: int, context: int, dtype, device,
                 padding: torch.Tensor | None = None, **cache_kwargs) -> FP8Layer:  # fmt: skip
    """One FP8 cache layer holding `context` random tokens (written by the Triton write kernel), its sink tokens
    captured as the attention of a model's update captures them: each row's first real token, from `padding` (a
    bool `[batch, context]` of the real tokens), else token 0."""
    from transformers import LlamaConfig

    from hf_fp8kv import QuantizedFP8Cache

    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=kv_heads, num_key_value_heads=kv_heads,
                         hidden_size=kv_heads * head_dim, head_dim=head_dim)  # fmt: skip
    layer = QuantizedFP8Cache(config=config, backend="triton", **cache_kwargs).layers[0]
    for first in range(0, context, 16384):  # in chunks: the write's temporaries stay small
        tokens = min(16384, context - first)
        kv = torch.randn(2, batch, kv_heads, tokens, head_dim, device=device, dtype=dtype)
        stored, _ = layer.update(kv[0], kv[1])
        mask = None if padding is None else padding[:, None, None, : first + tokens]
        layer.sink_tracker.capture(layer, kv[0], kv[1], mask, stored.view)
    return layer


def decode_attention(report: Report, sizes: Sizes, device: torch.device, dry_run: bool, copy_gbps: float) -> None:
    from transformers import LlamaConfig, QuantizedCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward


    group = sizes.q_heads // sizes.kv_heads
    module = SimpleNamespace(num_key_value_groups=group, is_causal=True, training=False)
    one_layer = LlamaConfig(num_hidden_layers=1, num_attention_heads=sizes.q_heads, num_key_value_heads=sizes.kv_heads,
                            hidden_size=sizes.q_heads * sizes.head_dim)  # fmt: skip
    scaling = sizes.head_dim**-0.5
    rows = []
    for context in sizes.contexts:
        for batch in sizes.batches:
            if batch * context > sizes.max_tokens:
                continue
            kv_shape = (batch, sizes.kv_heads, context, sizes.head_dim)
            query = torch.randn(batch, sizes.q_heads, 1, sizes.head_dim, device=device, dtype=sizes.dtype)
            elements = 2 * math.prod(kv_shape)
            figures = {}

            def ours(**cache_kwargs):
                def make():
                    return filled_layer(batch, sizes.kv_heads, sizes.head_dim, context, sizes.dtype, device,
                                        **cache_kwargs)  # fmt: skip

                layer = make()
                nbytes = layer.nbytes
                rotation = Rotation(make, nbytes, device)
                step = rotation(lambda l: l.kernels.attend(query, l.view(), scaling=scaling))
                return bench(step, dry_run), nbytes

            figures["ours e4m3 static scale"] = ours(scales=1.0)
            figures["ours e4m3 per-token-head"] = ours(scales="dynamic")
            figures["ours e4m3 per-token-head, recent 64 + sinks 4"] = ours(scales="dynamic", recent_tokens=64, sink_tokens=4)

            def sdpa():
                def make():
                    return [torch.randn(kv_shape, device=device, dtype=sizes.dtype) for _ in range(2)]

                rotation = Rotation(make, 2 * elements, device)
                step = rotation(lambda kv: sdpa_attention_forward(module, query, *kv, None, scaling=scaling))
                return bench(step, dry_run), 2 * elements * sizes.dtype.itemsize

            figures[f"SDPA {short_name(sizes.dtype)}"] = sdpa()

            if batch * context <= sizes.max_tokens_dequantizing:

                def transformers_fp8():
                    def make():
                        cache = QuantizedCache(backend="fp8", config=one_layer)
                        kv = [torch.randn(kv_shape, device=device, dtype=sizes.dtype) for _ in range(2)]
                        cache.update(*kv, 0)
                        return cache

                    new = [torch.randn(batch, sizes.kv_heads, 1, sizes.head_dim, device=device, dtype=sizes.dtype)
                           for _ in range(2)]  # fmt: skip

                    def step(cache):  # what one layer of a decode step does: append, dequantize all, attend
                        keys, values = cache.update(*new, 0)
                        sdpa_attention_forward(module, query, keys, values, None, scaling=scaling)

                    rotation = Rotation(make, elements, device)
                    return bench(rotation(step), dry_run), elements

                figures["transformers QuantizedCache(fp8)"] = transformers_fp8()

            for name, (ms, nbytes) in figures.items():
                gbps = nbytes / ms / 1e6
                rows.append({"context": context, "batch": batch, "method": name, "ms": f"{ms:.4f}",
                             "KV MB": f"{nbytes / 1e6:.1f}", "GB/s": f"{gbps:.0f}",
                             "of copy": f"{gbps / copy_gbps:.0%}"})  # fmt: skip
            del figures
            free_memory()
    report(f"## (b, c) decode attention, {sizes.q_heads}:{sizes.kv_heads} heads, head_dim {sizes.head_dim}, "
           f"{sizes.dtype} query (GB/s = bytes the cache holds / time; target >= 80% of copy at >= 16k)")  # fmt: skip
    report.table(rows)


def left_padding(batch: int, columns: int, device: torch.device) -> torch.Tensor:
    """Bool `[batch, columns]` of the real tokens of a left-padded batch: row b's first at b / (2 batch) of them."""
    starts = torch.arange(batch, device=device) * (columns // (2 * batch))
    return torch.arange(columns, device=device) >= starts[:, None]


def decode_write(layer: FP8Layer) -> tuple[KVView, list[Launch]]:
    """One decode step's write on `layer`: a random new token, stored by the layer's own update, whose launches
    `plan_write` plans again over the view that update wrote through (its buffers, room made; the positions
    before it; with outlier tokens, `plan_write_settle`: the write that judges them too). Returns the view the
    step's attention reads, and those launches."""
    from hf_fp8kv.kernels.triton_outliers import plan_write_settle
    from hf_fp8kv.kernels.triton_write import plan_write

    _, batch, heads, _, head_dim = layer.codes.shape
    before = layer.view()
    new = torch.randn(2, batch, heads, 1, head_dim, device=layer.codes.device, dtype=layer.dtype)
    stored, _ = layer.update(new[0], new[1])
    written = replace(layer.view(), end=before.end, recent_start=before.recent_start)
    if layer.outlier_tokens:
        first_real, window = layer.sink_start + layer.sink_tokens, layer.sliding_window if layer.is_sliding else None
        outlier_set = layer.outlier_tracker.outlier_set(layer)
        return stored.view, [plan_write_settle(new[0], new[1], written, layer.stats, outlier_set, first_real, window)]
    return stored.view, plan_write(new[0], new[1], written, layer.stats)


def kv_bytes(view: KVView) -> int:
    """KV bytes an attention over `view` reads: the codes (and per-token scales) of its coded tokens, and the
    full-precision recent and sink buffers."""
    _, batch, heads, _, head_dim = view.codes.shape
    per_token = head_dim * view.codes.element_size() + (view.scales.element_size() if view.per_token else 0)
    full_precision = sum(buffer.nbytes for buffer in (view.recent, view.sinks) if buffer is not None)
    return 2 * batch * heads * (view.recent_start - view.start) * per_token + full_precision


def decode_launches(report: Report, sizes: Sizes, device: torch.device, dry_run: bool, copy_gbps: float) -> None:
    """Each launch of one layer's decode step timed alone, as the layer's update and the launchers plan them."""
    pure, default = dict(recent_tokens=0, sink_tokens=0), {}
    rows = []
    for context in sizes.step_contexts:
        for batch in sizes.step_batches:
            cases = [(pure, False), (default, False)]
            if batch == 1:  # the default window with 16 outlier tokens per KV head (the write judges them)
                cases.append((dict(outlier_tokens=16), False))
            if batch == max(sizes.step_batches) > 1:  # a left-padded batch: its rows' first real tokens differ
                cases.append((default, True))
            for cache_kwargs, padded in cases:
                rows += step_rows(sizes, context, batch, cache_kwargs, padded, device, dry_run, copy_gbps)
                free_memory()
    timer = "perf_counter" if dry_run else "do_bench (CUDA events)"
    report(f"## (h) decode step launches, one layer, {sizes.q_heads}:{sizes.kv_heads} heads, head_dim "
           f"{sizes.head_dim}, {sizes.dtype} query, per-token-head scales; each launch timed alone, {timer} median; "
           f"copy bandwidth (a) {copy_gbps:.0f} GB/s")  # fmt: skip
    report("(reads: the attention's KV bytes (codes and scales of the coded tokens, recent and sink buffers; padding "
           "included), the reduce's partial results, the write's new token (and the token leaving the recent "
           "buffer); grid: the attention's third axis is its split count)")  # fmt: skip
    report.table(rows)


def step_rows(sizes: Sizes, context: int, batch: int, cache_kwargs: dict, padded: bool, device: torch.device,
              dry_run: bool, copy_gbps: float) -> list[dict]:  # fmt: skip
    """One row per launch of a decode step after `context` tokens: the write, then the attention and its split
    reduce at STAGES 3 and 4 (a left-padded batch: and at 3 with its splits merged by a reduce launch, where the
    attention launch would merge them), each with its time, the bytes it reads, GB/s and the fraction of copy
    bandwidth."""
    from hf_fp8kv.kernels.triton_attention import plan_attention

    padding = left_padding(batch, context + 1, device) if padded else None
    layer = filled_layer(batch, sizes.kv_heads, sizes.head_dim, context, sizes.dtype, device,
                         padding=None if padding is None else padding[:, :context], scales="dynamic",
                         **cache_kwargs)  # fmt: skip
    view, write = decode_write(layer)
    query = torch.randn(batch, sizes.q_heads, 1, sizes.head_dim, device=device, dtype=sizes.dtype)
    mask = None if padding is None else padding[:, None, None, :]
    tokens = 2 if view.recent is not None else 1  # the write reads the token leaving the recent buffer
    written = tokens * 2 * batch * sizes.kv_heads * sizes.head_dim * sizes.dtype.itemsize
    launches = [("-", launch, written) for launch in write]  # the write: the same whatever the stages
    plans = [(3, True), (4, True)] + [(3, False)] * padded  # (the merge under a mask against its reduce launch)
    for stages, merge in plans:
        _, attention = plan_attention(query, view, scaling=sizes.head_dim**-0.5, mask=mask, stages=stages,
                                      resident_slots=sizes.resident_slots, merge=merge)  # fmt: skip
        if not merge and len(attention) == 1:
            continue  # one split: nothing to merge
        partials = batch * sizes.q_heads * attention[0].grid[2] * (sizes.head_dim + 2) * 4
        reads = (kv_bytes(view), partials)  # of the attention, then its reduce (where a split launch does not merge)
        label = stages if merge else f"{stages}, reduce launch"
        launches += [(label, launch, nbytes) for launch, nbytes in zip(attention, reads)]
    window = (f"recent {layer.recent_tokens} + sinks {layer.sink_tokens}"
              if layer.recent_tokens or layer.sink_tokens else "pure FP8")  # fmt: skip
    window += f" + outliers {layer.outlier_tokens}" if layer.outlier_tokens else ""
    rows = []
    for stages, launch, nbytes in launches:
        us = bench(launch.run, dry_run) * 1e3
        gbps = nbytes / us / 1e3
        rows.append({"context": context, "batch": batch, "cache": window, "mask": "left-padded" if padded else "none",
                     "stages": stages, "launch": launch.kernel.__name__.strip("_").removesuffix("_kernel"),
                     "grid": "x".join(map(str, launch.grid)), "us": f"{us:.1f}", "reads MB": f"{nbytes / 1e6:.3f}",
                     "GB/s": f"{gbps:.0f}", "of copy": f"{gbps / copy_gbps:.0%}"})  # fmt: skip
    return rows


def paged_decode(report: Report, sizes: Sizes, device: torch.device, dry_run: bool, copy_gbps: float) -> None:
    """A decode step of the paged kernel over full-attention pages (per-token-head e4m3 rows, each request's new
    token in its pages), split as the launcher's rule plans it (3 ways on the interpreter, which has no
    occupancy) against one program per request and KV head."""
    from hf_fp8kv.kernels import paged
    from hf_fp8kv.kernels.formats import get_format
    from hf_fp8kv.kernels.triton_paged import plan_paged_attention

    kv_heads, head_dim, page_size = sizes.kv_heads, sizes.head_dim, sizes.paged_page_size
    row_bytes = paged.row_size(kv_heads * head_dim, kv_heads)
    rows = []
    for requests, context in sizes.paged_steps:
        keys = context + 1  # each request's past and this step's token, in its pages
        per_request = -(-keys // page_size)
        # one layer's pages; bytes of e4m3 1.0 (0x38), which as fp32 scale words are a small positive scale
        pages = torch.full((requests * per_request * 2 * page_size * row_bytes,), 0x38, dtype=torch.uint8,
                           device=device)  # fmt: skip
        slot = torch.arange(keys, device=device)
        blocks = torch.arange(requests, device=device)[:, None] * per_request + slot // page_size
        read_index = (blocks * 2 * page_size + slot % page_size).flatten()
        query = torch.randn(requests, sizes.q_heads, head_dim, device=device, dtype=sizes.dtype)
        new_rows = torch.full((requests, 2, row_bytes), 0x38, dtype=torch.uint8, device=device)
        cu_q = torch.arange(requests + 1, dtype=torch.int32, device=device)
        k_first = torch.arange(requests, dtype=torch.int32, device=device) * keys
        past = torch.full((requests,), context, dtype=torch.int32, device=device)
        nbytes = requests * kv_heads * keys * 2 * (head_dim + 4)  # codes and fp32 scales, K and V
        for plan, splits in (("one program per request", 1), ("split rule", 3 if dry_run else None)):
            _, launches = plan_paged_attention(
                query, pages, new_rows, read_index, cu_q, k_first, past, fmt=get_format("fp8_e4m3"),
                kv_heads=kv_heads, layer_offset=0, bytes_per_block=2 * page_size * row_bytes,
                block_stride=2 * page_size, page_size=page_size, scaling=head_dim**-0.5, max_q_len=1,
                new_in_pages=True, max_k_len=keys, num_splits=splits,
            )  # fmt: skip
            us = bench(lambda: [launch.run() for launch in launches], dry_run) * 1e3
            gbps = nbytes / us / 1e3
            rows.append({"requests": requests, "context": context, "plan": plan,
                         "grid": "x".join(map(str, launches[0].grid)), "launches": len(launches), "us": f"{us:.1f}",
                         "KV MB": f"{nbytes / 1e6:.1f}", "GB/s": f"{gbps:.0f}", "of copy": f"{gbps / copy_gbps:.0%}"})  # fmt: skip
        del pages, read_index
        free_memory()
    report(f"## (i) paged decode, {sizes.q_heads}:{sizes.kv_heads} heads, head_dim {head_dim}, {sizes.dtype} query, "
           f"per-token-head e4m3 rows, {page_size}-token pages; split over the keys (then the reduce) or not")  # fmt: skip
    report.table(rows)


def decode_steps(report: Report, sizes: Sizes, device: torch.device, dry_run: bool) -> None:
    import numpy
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from hf_fp8kv import QuantizedFP8Cache

    config = LlamaConfig(**sizes.model, attn_implementation="sdpa")
    dtype = sizes.dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(previous)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    variants = {
        f"DynamicCache {short_name(dtype)}": lambda: DynamicCache(config=config),
        "ours e4m3 per-token-head": lambda: QuantizedFP8Cache(model, scales="dynamic", backend="triton"),
    }
    times = {name: [] for name in variants}
    rows = []
    for context in sizes.model_contexts:
        token = torch.tensor([[7]], device=device)
        position = torch.tensor([[context]], device=device)
        row = {"context": context}
        for name, make in variants.items():
            cache = make()
            for layer in range(layers):
                kv = torch.randn(2, 1, kv_heads, context, head_dim, device=device, dtype=dtype)
                cache.update(kv[0], kv[1], layer)

            def step():
                model(input_ids=token, position_ids=position, cache=cache)
                cache.crop(-1)

            with torch.inference_mode():
                ms = bench(step, dry_run)
                host = host_ms(step, device, repeats=2 if dry_run else 20)
            times[name].append(ms)
            row[f"{name} ms"] = f"{ms:.3f}"
            row[f"{name} host us/layer"] = f"{host * 1e3 / layers:.1f}"
            cache = None  # released (not `del`: the step's closure names it)
            free_memory()
        rows.append(row)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    report(f"## (d) decode step of a random {layers}-layer Llama ({params:.2f} B params, {dtype}), batch 1")
    report("(host us/layer: the CPU time of a step, Python and launches, from an empty queue to the return of the "
           "forward, GPU not awaited, per layer; a step whose host time reaches its ms is host-bound)")
    report.table(rows)
    slopes = {name: numpy.polyfit(sizes.model_contexts, ms, 1)[0] * 1e3 for name, ms in times.items()}
    for name, slope in slopes.items():
        report(f"slope {name}: {slope:.5f} ms per 1k tokens of context")
    base, ours = slopes.values()
    report(f"slope ratio ours / DynamicCache: {ours / base:.3f} (target <= 0.50)")
    model = None  # released (not `del`: the variants' closures name it)
    free_memory()


def prefill(report: Report, sizes: Sizes, device: torch.device, dry_run: bool) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_fp8kv.kernels.triton_attention import attention

    group = sizes.q_heads // sizes.kv_heads
    module = SimpleNamespace(num_key_value_groups=group, is_causal=True, training=False)
    scaling = sizes.head_dim**-0.5
    rows = []
    for length in sizes.prefill_lengths:
        q = torch.randn(1, sizes.q_heads, length, sizes.head_dim, device=device, dtype=sizes.dtype)
        k, v = (torch.randn(1, sizes.kv_heads, length, sizes.head_dim, device=device, dtype=sizes.dtype)
                for _ in range(2))  # fmt: skip
        layer = filled_layer(1, sizes.kv_heads, sizes.head_dim, length, sizes.dtype, device, scales="dynamic")
        view = layer.view()
        # the opt-in FP8 dots (QK and PV on e4m3 with per-head scales) against fp16 dots over the same layer
        static_layer = filled_layer(1, sizes.kv_heads, sizes.head_dim, length, sizes.dtype, device, scales=0.05)
        static_view = static_layer.view()
        padding = torch.ones(1, 1, length, length, dtype=torch.bool, device=device).tril()
        padding[..., : length // 8] = False  # a left-padded row: its masked tiles are skipped

        def write():
            layer.crop(-length)
            layer.update(k, v)

        sdpa_ms = bench(lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scaling), dry_run)
        attend_ms = bench(lambda: layer.kernels.attend(q, view, scaling=scaling), dry_run)
        masked_ms = bench(lambda: layer.kernels.attend(q, view, scaling=scaling, mask=padding), dry_run)
        write_ms = bench(write, dry_run)
        fp16_dots_ms, fp8_dots_ms = (
            bench(lambda: attention(q, static_view, scaling=scaling, fp8_prefill=fp8), dry_run) for fp8 in (False, True)
        )  # fmt: skip
        rows.append({"length": length, f"SDPA {short_name(sizes.dtype)} ms": f"{sdpa_ms:.3f}",
                     "ours attend ms": f"{attend_ms:.3f}", "ours attend, padded mask ms": f"{masked_ms:.3f}",
                     "ours write ms": f"{write_ms:.3f}", "attend / SDPA": f"{attend_ms / sdpa_ms:.2f}",
                     "(attend + write) / SDPA": f"{(attend_ms + write_ms) / sdpa_ms:.2f}",
                     "per-head scales: fp16 dots ms": f"{fp16_dots_ms:.3f}",
                     "fp8_prefill ms": f"{fp8_dots_ms:.3f}"})  # fmt: skip
    report(f"## (e) causal prefill attention, batch 1, {sizes.q_heads}:{sizes.kv_heads} heads, head_dim "
           f"{sizes.head_dim}, {sizes.dtype} (target <= 1.15x SDPA at 4k-16k)")  # fmt: skip
    report.table(rows)


def compiled_decode(report: Report, sizes: Sizes, device: torch.device, dry_run: bool) -> None:
    """Compiled decode steps: `torch.compile(mode="reduce-overhead")` (CUDA graphs) of a Llama-3-8B-shaped model
    with fewer layers (compile time), our static FP8 cache against transformers' StaticCache + SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from hf_fp8kv import QuantizedFP8Cache

    config = LlamaConfig(**{**sizes.model, "num_hidden_layers": sizes.compiled_layers}, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(sizes.dtype)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(previous)
    head_dim = config.hidden_size // config.num_attention_heads
    backend = "torch" if dry_run else "triton"
    # the GPU: inductor with CUDA graphs; the dry run traces only (inductor's CPU compile takes minutes)
    options = dict(backend="eager") if dry_run else dict(mode="reduce-overhead")
    rows = []
    torch._dynamo.reset()  # no code object left at its recompile limit by an earlier compile in this process
    for context in sizes.compiled_contexts:
        row = {"context": context}
        variants = {
            "StaticCache + SDPA": lambda: StaticCache(config=config, max_cache_len=context + 64),
            "ours static e4m3 per-token-head": lambda: QuantizedFP8Cache(
                model, scales="dynamic", backend=backend, max_cache_len=context + 64
            ),
        }
        for name, make in variants.items():
            cache = make()
            for layer in range(config.num_hidden_layers):
                kv = torch.randn(2, 1, config.num_key_value_heads, context, head_dim, device=device, dtype=sizes.dtype)
                cache.update(kv[0], kv[1], layer)
            forward = torch.compile(model.forward, fullgraph=True, **options)
            token = torch.tensor([[7]], device=device)
            position = torch.tensor([[context]], device=device)
            mask = torch.ones(1, context + 1, dtype=torch.long, device=device)

            def step():
                forward(input_ids=token, position_ids=position, attention_mask=mask, cache=cache)
                cache.crop(-1)

            with torch.inference_mode():
                started = time.perf_counter()
                for _ in range(3):
                    step()
                row[f"{name} compile s"] = f"{time.perf_counter() - started:.0f}"
                row[f"{name} ms"] = f"{bench(step, dry_run):.3f}"
            cache = forward = None  # released (not `del`: the step's closure names them)
            torch._dynamo.reset()
            free_memory()
        base, ours = (float(row[f"{name} ms"]) for name in variants)
        row["ours / StaticCache"] = f"{ours / base:.2f}"
        rows.append(row)
    report(f"## (f) compiled decode step (torch.compile {options}, fullgraph), {config.num_hidden_layers}-layer "
           f"Llama-3-8B-shaped model, {sizes.dtype}, batch 1")  # fmt: skip
    report.table(rows)
    model = None  # released (not `del`: the variants' closures name it)
    free_memory()


def continuous_batching(report: Report, sizes: Sizes, device: torch.device, dry_run: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from continuous_batching import gpu_section

    config = LlamaConfig(**{**sizes.model, "num_hidden_layers": sizes.compiled_layers}, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(sizes.dtype).eval()
    report(f"## (g) continuous batching, {config.num_hidden_layers}-layer Llama-3-8B-shaped model, {sizes.dtype}")
    for line in gpu_section(model, device, **sizes.continuous_batching):
        report(line)
    del model
    free_memory()


def guarded(report: Report, name: str, section, *args) -> None:
    """Run one section; a failure is reported and the next section still runs (one GPU call yields every number)."""
    started = time.perf_counter()
    try:
        section(report, *args)
    except Exception as error:  # noqa: BLE001 - report and go on
        import traceback

        report(f"## {name} FAILED: {type(error).__name__}: {error}")
        report(traceback.format_exc()[-3000:])
    report(f"({name}: {time.perf_counter() - started:.0f} s)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, toy sizes")
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--skip-tests", action="store_true", help="skip the kernel tests")
    parser.add_argument("--tests-only", action="store_true", help="only the kernel tests")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        device, sizes = torch.device("cpu"), TOY
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), FULL
    else:
        raise SystemExit("no CUDA device: run with --dry-run to exercise the code path on the Triton interpreter")
    report = Report(args.out)
    import triton
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter, dry run)"
    report(f"# hf-fp8kv gpu_check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {name}")
    report(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    if not args.skip_tests:
        run_kernel_tests(report, sizes)
    if args.tests_only:
        return
    copy_gbps = copy_bandwidth(report, sizes, device, args.dry_run)
    guarded(report, "decode attention", decode_attention, sizes, device, args.dry_run, copy_gbps)
    guarded(report, "decode step launches", decode_launches, sizes, device, args.dry_run, copy_gbps)
    guarded(report, "paged decode", paged_decode, sizes, device, args.dry_run, copy_gbps)
    guarded(report, "decode steps", decode_steps, sizes, device, args.dry_run)
    guarded(report, "prefill", prefill, sizes, device, args.dry_run)
    guarded(report, "compiled decode", compiled_decode, sizes, device, args.dry_run)
    guarded(report, "continuous batching", continuous_batching, sizes, device, args.dry_run)


if __name__ == "__main__":
    main()
