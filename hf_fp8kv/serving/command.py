"""The `hf-fp8kv serve` command: transformers' own `transformers serve` command, with continuous batching on by
default, the bundled SmolLM2 as the default model and the FP8 cache's options added. Every `transformers serve`
option passes through as it is (the command is transformers', copied with its parameters)."""

from __future__ import annotations

import copy
import functools
import math
import sys
from typing import Sequence

import click

from hf_fp8kv.scale_search import CANDIDATES
from hf_fp8kv.serving.server import (
    DEFAULT_PAGE_SIZE,
    MAX_KV_MEMORY_MIB,
    FP8Options,
    FP8Serve,
    check_transformers_serve,
    dense_default,
)

NAME = "hf-fp8kv serve"


class FiniteRange(click.FloatRange):
    """click's `FloatRange`, which lets nan (and inf, without a maximum) through, for finite numbers only."""

    def convert(self, value, param, ctx) -> float:
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return value


# transformers serve's numeric options are typed but not ranged: a 0, a negative number or a nan reached the
# server and failed there, unnamed
PASSED_THROUGH_RANGES = {
    "model_timeout": click.IntRange(min=-1),  # seconds; -1: never unload
    "cb_block_size": click.IntRange(min=1),
    "cb_num_blocks": click.IntRange(min=1),
    "cb_max_batch_tokens": click.IntRange(min=1),
    "cb_max_memory_percent": FiniteRange(0, 1, min_open=True),  # a fraction, as transformers reads it
    "port": click.IntRange(0, 65535),
    "default_seed": click.IntRange(-(2**63), 2**64 - 1),  # what torch.manual_seed takes
}


def serve_command() -> click.Command:
    """transformers' `serve` click command with our options appended and two defaults changed."""
    from transformers.cli.transformers import app

    base = app.commands.get("serve")
    if base is None or not isinstance(base, click.Command):
        raise RuntimeError("this transformers has no `transformers serve` command: install hf-fp8kv[serve]")
    params = []
    for param in base.params:
        param = copy.copy(param)
        if param.name == "continuous_batching":
            param.default = True  # FP8 pages are continuous batching's
        elif param.name == "force_model":
            param.help = f"{param.help} Default: the bundled SmolLM2-135M-Instruct (offline)."
        elif param.name in PASSED_THROUGH_RANGES:
            param.type = PASSED_THROUGH_RANGES[param.name]
        if param.name == "cb_block_size":
            param.help = f"{param.help} Default: {DEFAULT_PAGE_SIZE}."
        params.append(param)
    command = copy.copy(base)
    command.params = params + [
        click.Option(["--kv-cache-dtype"], default="fp8", show_default=True,
                     help="Page format: fp8 (= fp8_e4m3), fp8_e5m2, fp8_e4m3fnuz, int8_per_token_head."),
        click.Option(["--scales"], default="dynamic", show_default=True, callback=_scales,
                     help="dynamic (per token and KV head), auto (the checkpoint's), a float, or a scales file."),
        click.Option(["--skip-layers"], default="", help="Layers kept in the model dtype: indices and/or sliding_window."),
        click.Option(["--backend"], default=None, help="auto (Triton on CUDA, torch elsewhere), triton or torch."),
        click.Option(["--recent-tokens"], type=click.IntRange(min=0), default=dense_default("recent_tokens"), show_default=True,
                     help="Newest tokens of each request kept in the model dtype (0 with --sink-tokens 0: pure FP8)."),
        click.Option(["--sink-tokens"], type=click.IntRange(min=0), default=dense_default("sink_tokens"), show_default=True,
                     help="First tokens of each request kept in the model dtype."),
        click.Option(["--outlier-tokens"], type=click.IntRange(min=0), default=dense_default("outlier_tokens"),
                     show_default=True, help="Per layer and KV head, coded tokens of each request kept in the model "
                     "dtype too, by Outlier Tokens Tracing's rule (per-token --scales dynamic)."),
        click.Option(["--scale-search"], type=click.Choice(["0", *map(str, CANDIDATES)]),
                     default=str(dense_default("scale_search")), show_default=True,
                     help="Each coded token's per-token scale searched among this many in the octave above its amax "
                          "scale, the keys weighted by the queries seen (per-token --scales dynamic; 0: off)."),
        click.Option(["--rotate"], is_flag=True, default=False,
                     help="Rotated codes: keys and values times a Hadamard matrix before FP8 (per-token --scales dynamic)."),
        click.Option(["--max-requests"], type=click.IntRange(min=1), default=None,
                     help="Requests in flight at once, each holding its recent and sink tokens (default: as many "
                          "as an eighth of the KV memory holds; the others wait)."),
        click.Option(["--kv-memory-mib"], type=FiniteRange(0, MAX_KV_MEMORY_MIB, min_open=True), default=None,
                     help="KV memory in MiB: pages plus the requests' recent and sink tokens (sets --cb-num-blocks). "
                          "On the CPU without it or --cb-num-blocks: 256 (transformers would size from the RAM)."),
    ]  # fmt: skip
    command.callback = functools.partial(_run, base.callback)
    command.help = "`transformers serve` with continuous batching on FP8 KV pages.\n\n" + (base.help or "")
    return command


def _run(serve_class, *, kv_cache_dtype, scales, skip_layers, backend, recent_tokens, sink_tokens, outlier_tokens,
         scale_search, rotate, max_requests, kv_memory_mib, force_model, continuous_batching, non_blocking,
         **serve_kwargs) -> FP8Serve:  # fmt: skip
    """Build the options, default the model to the bundled SmolLM2, and run transformers' server on FP8 pages."""
    if not continuous_batching:
        raise click.UsageError("FP8 pages are continuous batching's: drop --no-continuous-batching")
    if force_model is None:
        from hf_fp8kv.bundled import smollm2_dir

        force_model = str(smollm2_dir())
    options = FP8Options(kv_cache_dtype, scales, skip_layers, backend, recent_tokens, sink_tokens, rotate,
                         max_requests, kv_memory_mib, outlier_tokens, int(scale_search))  # fmt: skip
    return FP8Serve(options, force_model=force_model, continuous_batching=True, blocking=not non_blocking,
                    **serve_kwargs)  # fmt: skip


def _scales(ctx, param, text: str) -> float | str:
    """`--scales`: a number is a scale, refused unless positive and finite (anything else names scales)."""
    try:
        scale = float(text)
    except ValueError:
        return text
    if not (math.isfinite(scale) and scale > 0):
        raise click.BadParameter(f"a scale must be a positive finite number, got {text!r}", ctx, param)
    return scale


def main(argv: Sequence[str] | None = None) -> int:
    """`hf-fp8kv serve ...` (`argv`: the arguments after `serve`); returns the exit status."""
    try:  # before transformers' command is copied: its options are its release's
        check_transformers_serve()
    except (ImportError, RuntimeError) as error:
        print(f"{NAME}: error: {error}", file=sys.stderr)
        return 2
    return serve_command().main(args=list(argv) if argv is not None else None, prog_name=NAME, standalone_mode=True)
