"""Continuous batching at a fixed page budget: FP8 pages (`hf_fp8kv.continuous_batching`) vs transformers' pages.

One run serves the same requests (SmolLM2-135M-Instruct, prompts of 24 to 96 random tokens, greedy, a fixed
number of new tokens, EOS off) twice through `model.generate_batch`: with transformers' pages in the model dtype, then
with FP8 pages (per-token-head scales), each given the same page memory (`--budget-mib`: `num_blocks` = budget //
bytes of one whole-model block). Reported per variant: blocks and tokens the budget holds, the largest number of
requests in one forward and the mean over decode forwards (the scheduler's admissions), wall time and generated
tokens per second (all tokens / wall time, prefill included).

    python benchmarks/continuous_batching.py --budget-mib 8 --requests 24 --new-tokens 16

`gpu_section(model, device)` runs the same comparison on a GPU (Triton paged kernel) for benchmarks/gpu_check.py.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from hf_fp8kv import continuous_batching
from hf_fp8kv.bundled import load_smollm2
from hf_fp8kv.table import format_table

def prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of random token ids, of mixed lengths (24 to 96 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(24, 97, (count,), generator=generator).tolist()
    return [torch.randint(10, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def native_block_bytes(model, page_size: int) -> int:
    """Bytes of one whole-model block of `page_size` tokens in transformers' pages (the model dtype)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    page = FullAttentionCacheAllocator.get_bytes_per_page(config.num_key_value_heads, head_dim, model.dtype, page_size)
    return config.num_hidden_layers * page


@torch.inference_mode()
def serve(model, inputs: list[list[int]], new_tokens: int, num_blocks: int, page_size: int) -> dict:
    """Serve `inputs` once through `generate_batch`; what the scheduler did and how fast."""
    batch_sizes, decode_sizes = [], []

    def count(module, args, kwargs):
        lengths = kwargs["cu_seq_lens_q"].diff()
        lengths = lengths[lengths > 0]  # padded batches (CUDA graphs) end with empty sequences
        batch_sizes.append(len(lengths))
        if int(lengths.max()) == 1:  # one token per request: a pure decode forward
            decode_sizes.append(len(lengths))

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=512,
                                      allow_block_sharing=False)  # fmt: skip
    greedy = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        start = time.perf_counter()
        outputs = model.generate_batch(inputs, generation_config=greedy, continuous_batching_config=config,
                                       warmup=False)  # fmt: skip
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    failed = sum(o.error is not None for o in outputs.values())
    return {"requests": len(inputs), "failed": failed, "generated": generated, "seconds": seconds,
            "tok/s": generated / seconds, "max concurrent": max(batch_sizes),
            "mean decode batch": sum(decode_sizes) / max(len(decode_sizes), 1)}  # fmt: skip


def compare(model, budget_bytes: int, requests: int, new_tokens: int, page_size: int = 16,
            **enable_kwargs) -> list[dict]:  # fmt: skip
    """Native pages, then FP8 pages, at `budget_bytes` of pages each; one row per variant."""
    inputs = prompts(model.config.vocab_size, requests)
    rows = []
    for variant in ("native", "fp8"):
        fp8 = variant == "fp8"
        if fp8:
            settings = continuous_batching.enable(model, **{"scales": "dynamic", **enable_kwargs})
            block = settings.block_bytes(range(model.config.num_hidden_layers), page_size)
        else:
            block = native_block_bytes(model, page_size)
        num_blocks = budget_bytes // block
        longest = -(-(max(map(len, inputs)) + new_tokens) // page_size)
        try:
            if num_blocks < longest:
                raise ValueError(f"{budget_bytes} bytes hold {num_blocks} {variant} blocks; the longest request "
                                 f"needs {longest}: raise the budget")  # fmt: skip
            serve(model, inputs[:2], 2, num_blocks, page_size)  # warm-up: first-call costs stay out of the figures
            result = serve(model, inputs, new_tokens, num_blocks, page_size)
        finally:
            continuous_batching.disable(model)
        name = f"{variant} ({'fp8_e4m3 + scales' if fp8 else str(model.dtype).removeprefix('torch.')})"
        rows.append({"pages": name, "block bytes": block, "blocks": num_blocks, "tokens": num_blocks * page_size,
                     **result})  # fmt: skip
    for row in rows:
        for key in ("blocks", "max concurrent", "mean decode batch", "tok/s"):
            row[f"{key} x"] = row[key] / rows[0][key]
    return rows


def gpu_section(model, device: torch.device | str, budget_mib: float = 64, requests: int = 64,
                new_tokens: int = 32) -> list[str]:  # fmt: skip
    """Report lines for benchmarks/gpu_check.py: the same comparison on `device` (the Triton paged kernel reads the
    FP8 pages on CUDA). `model` is a causal LM already on `device` (sdpa or eager attention)."""
    rows = compare(model, int(budget_mib * 2**20), requests, new_tokens)
    lines = [f"continuous batching on {device}, {budget_mib} MiB of pages, {requests} requests x {new_tokens} tokens:"]
    lines += format_table(rows).splitlines()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=8.0)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = load_smollm2(dtype=getattr(torch, args.dtype))
    rows = compare(model, int(args.budget_mib * 2**20), args.requests, args.new_tokens)
    print(f"SmolLM2-135M-Instruct {args.dtype}, CPU ({torch.get_num_threads()} threads), {args.budget_mib} MiB of "
          f"pages, {args.requests} requests x {args.new_tokens} new tokens, page_size 16")  # fmt: skip
    print(format_table(rows))


if __name__ == "__main__":
    main()
