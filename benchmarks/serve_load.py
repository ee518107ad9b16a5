"""Serving under load: `hf-fp8kv serve` against plain `transformers serve --continuous-batching` at one KV memory
budget.

Each variant's server is started as a subprocess on 127.0.0.1 (the same model, page size and dtype), then
`--clients` concurrent streaming chat clients (the `openai` package, asyncio, over loopback) send fixed prompts
(`--prompt-tokens` words of the bundled sample text to retell, distinct from their first word, so no prefix is
shared beyond the chat template's) for at most `--max-tokens` greedy tokens each. Plain transformers gets `--cb-num-blocks` = the budget // the
bytes of one whole-model block in the model dtype; hf-fp8kv gets `--kv-memory-mib` = the budget (its FP8 pages
and, with recent and sink tokens, the model-dtype rows of the requests in flight: `--max-requests` of them, by
default the server's own count). Reported per variant: the most
streams generating at once (from the client's timestamps: first token to end), output tokens/s over the wall
time of the load, time to first token and inter-token latency percentiles; the ratios FP8 / plain last.

    python benchmarks/serve_load.py                                   # CPU: bundled SmolLM2, a small budget
    python benchmarks/serve_load.py --model meta-llama/Llama-3.1-8B-Instruct --dtype bfloat16 --page-size 16 \\
        --kv-memory-mib 8192 --clients 256 --prompt-tokens 2000 --max-tokens 256   # the same on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from importlib.resources import files

import torch
from openai import AsyncOpenAI
from transformers import AutoConfig
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from hf_fp8kv.table import format_table

STARTUP_TIMEOUT_S = 600


@dataclass
class Stream:
    """One client's timestamps (seconds from the load's start) and its output tokens."""

    start: float
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)


def native_block_bytes(model: str, dtype: str, page_size: int) -> int:
    """Bytes of one whole-model block of `page_size` tokens in transformers' pages of `dtype` ("auto": the
    checkpoint's)."""
    config = AutoConfig.from_pretrained(model).get_text_config(decoder=True)
    torch_dtype = getattr(config, "dtype", None) if dtype == "auto" else getattr(torch, dtype)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    page = FullAttentionCacheAllocator.get_bytes_per_page(config.num_key_value_heads, head_dim,
                                                          torch_dtype or torch.float32, page_size)  # fmt: skip
    return config.num_hidden_layers * page


def server_command(variant: str, args: argparse.Namespace, port: int) -> list[str]:
    common = [args.model, "--host", "127.0.0.1", "--port", str(port), "--cb-block-size", str(args.page_size),
              "--dtype", args.dtype]  # fmt: skip
    if variant == "plain":
        blocks = int(args.kv_memory_mib * 2**20) // native_block_bytes(args.model, args.dtype, args.page_size)
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", *common, "--continuous-batching",
                "--cb-num-blocks", str(blocks)]  # fmt: skip
    command = [sys.executable, "-m", "hf_fp8kv", "serve", *common, "--kv-memory-mib", str(args.kv_memory_mib)]
    if variant == "fp8-pure":
        return command + ["--recent-tokens", "0", "--sink-tokens", "0"]
    return command + (["--max-requests", str(args.max_requests)] if args.max_requests else [])


def wait_for_health(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before answering /health")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no /health answer in {STARTUP_TIMEOUT_S} s")


async def one_stream(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, t0: float) -> Stream:
    stream = Stream(time.perf_counter() - t0)
    last = None
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in response:
        now = time.perf_counter() - t0
        if chunk.usage is not None:
            stream.tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            if stream.first is None:
                stream.first = now
            else:
                stream.gaps.append(now - last)
            last = now
    stream.end = time.perf_counter() - t0
    return stream


def passage_prompt(i: int, words: int) -> str:
    """Client i's prompt: `words` words of the bundled sample text from word 37 * i on (wrapping), to retell (a
    prompt of one repeated word makes SmolLM2 end its answer at once)."""
    text = files("hf_fp8kv").joinpath("data/sample_text.txt").read_text().split()
    passage = " ".join(text[(37 * i + k) % len(text)] for k in range(words))
    return f"Passage {i}: {passage}\n\nRetell the passage above in your own words, in detail."


async def load(port: int, args: argparse.Namespace) -> tuple[list[Stream], float]:
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600, max_retries=0)
    model = (await client.models.list()).data[0].id
    await one_stream(client, model, "Hi", 2, time.perf_counter())  # warm-up
    prompts = [passage_prompt(i, args.prompt_tokens) for i in range(args.clients)]
    t0 = time.perf_counter()
    streams = await asyncio.gather(*(one_stream(client, model, p, args.max_tokens, t0) for p in prompts))
    return streams, time.perf_counter() - t0


def most_at_once(streams: list[Stream]) -> int:
    """The most streams between their first token and their end at one time."""
    events = sorted([(s.first, 1) for s in streams if s.first is not None] + [(s.end, -1) for s in streams],
                    key=lambda e: (e[0], e[1]))  # fmt: skip
    held = most = 0
    for _, step in events:
        held += step
        most = max(most, held)
    return most


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))] if values else float("nan")


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    port = args.port
    command = server_command(variant, args, port)
    print(f"[{variant}] {' '.join(command)}", flush=True)
    log = open(f"{args.log_prefix}{variant}.log", "w") if args.log_prefix else subprocess.DEVNULL
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_health(port, server)
        streams, wall = asyncio.run(load(port, args))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    ttft = [s.first - s.start for s in streams if s.first is not None]
    gaps = [g for s in streams for g in s.gaps]
    tokens = sum(s.tokens for s in streams)
    return {
        "variant": variant,
        "held at once": most_at_once(streams),
        "tokens": tokens,
        "wall s": round(wall, 1),
        "tok/s": round(tokens / wall, 2),
        **{f"TTFT p{q} s": round(percentile(ttft, q), 2) for q in (50, 90, 99)},
        **{f"ITL p{q} ms": round(1000 * percentile(gaps, q), 1) for q in (50, 90, 99)},
    }


def main() -> None:
    from hf_fp8kv.bundled import smollm2_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model id or directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="the servers' --dtype (auto: the checkpoint's)")
    parser.add_argument("--kv-memory-mib", type=float, default=16.0, help="KV memory of each server")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-requests", type=int,
                        help="hf-fp8kv's --max-requests with recent and sink tokens (their rows come out of the budget; "
                             "default: the server's, an eighth of the budget)")  # fmt: skip
    parser.add_argument("--variants", default="plain,fp8,fp8-pure",
                        help="plain (transformers), fp8 (recent and sink tokens), fp8-pure")  # fmt: skip
    parser.add_argument("--port", type=int, default=8950)
    parser.add_argument("--log-prefix", default="", help="write each server's log to PREFIX<variant>.log")
    args = parser.parse_args()
    args.model = args.model or str(smollm2_dir())
    rows = [run_variant(variant, args) for variant in args.variants.split(",")]
    print(format_table(rows))
    plain = next((r for r in rows if r["variant"] == "plain"), None)
    for row in rows:
        if plain is not None and row is not plain and plain["held at once"] and plain["tok/s"]:
            print(f"{row['variant']} / plain at {args.kv_memory_mib} MiB: held at once "
                  f"{row['held at once'] / plain['held at once']:.2f}x, output tokens/s "
                  f"{row['tok/s'] / plain['tok/s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
