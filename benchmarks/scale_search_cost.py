"""What a per-token scale searched within one octave (`scale_search_probe.py`) would cost a write kernel, in
compiled code (gpu_static's compile, no GPU): a stand-in kernel that quantizes `[tokens, head_dim]` rows to e4m3
as the write kernels do (the amax scale rounded up to bf16, `div_rn`, `encode`), with `--steps` candidate scales
tried first, each row's error summed (weighted per channel, or not) and the least kept. Not the write kernel: its
figures differ from `_write_kernel`'s; the difference between steps 1 and more is the search's.

    python benchmarks/scale_search_cost.py --arch sm_90
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
import triton.language as tl

from gpu_static import EXAMPLE_GPUS, compile_launch
from hf_fp8kv.kernels.triton_common import encode, encoding, round_up_to_bf16
from hf_fp8kv.kernels.formats import get_format
from hf_fp8kv.kernels.triton_launch import Launch
from hf_fp8kv.table import format_table


@triton.jit
def _searched_rows(x_ptr, weight_ptr, codes_ptr, scale_ptr, tokens, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                   STEPS: tl.constexpr, WEIGHTED: tl.constexpr, IS_FLOAT: tl.constexpr, MAX: tl.constexpr,
                   ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr, NORMAL_OFFSET: tl.constexpr,
                   MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
                   NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HEAD_DIM)
    ok = (t < tokens)[:, None]
    x = tl.load(x_ptr + t[:, None] * HEAD_DIM + d[None, :], mask=ok, other=0.0).to(tl.float32)
    amax_scale = round_up_to_bf16(tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), ROW_MAX), 1e-30))
    scale = amax_scale
    if STEPS > 1:
        weight = tl.load(weight_ptr + d)
        least = tl.full([BLOCK_T], float("inf"), tl.float32)
        for i in tl.static_range(STEPS):
            candidate = round_up_to_bf16(amax_scale * (2.0 ** (i / STEPS)))
            y = tl.math.div_rn(x, candidate[:, None])
            # y rounded to e4m3's grid in fp32 (normal numbers: enough for the count)
            bits = tl.abs(y).to(tl.int32, bitcast=True)
            half_up = (1 << (ROUND_SHIFT - 1)) - 1 + ((bits >> ROUND_SHIFT) & 1)
            rounded = (((bits + half_up) >> ROUND_SHIFT) << ROUND_SHIFT).to(tl.float32, bitcast=True)
            error = tl.abs(x) - rounded * candidate[:, None]
            error *= error
            if WEIGHTED:
                error *= weight[None, :]
            error_sum = tl.sum(error, axis=1)
            better = error_sum < least
            scale = tl.where(better, candidate, scale)
            least = tl.where(better, error_sum, least)
    code = encode(tl.math.div_rn(x, scale[:, None]), IS_FLOAT, MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL,
                  SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE, SIGNED_ZERO)  # fmt: skip
    tl.store(codes_ptr + t[:, None] * HEAD_DIM + d[None, :], code.to(tl.uint8), mask=ok)
    tl.store(scale_ptr + t, scale, mask=t < tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", choices=sorted(EXAMPLE_GPUS))
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    gpu, tokens, head_dim = EXAMPLE_GPUS[args.arch], 4096, args.head_dim
    meta = dict(device="meta")
    rows_in, codes = torch.empty(tokens, head_dim, dtype=torch.bfloat16, **meta), torch.empty(tokens, head_dim, **meta)
    buffers = (rows_in, torch.empty(head_dim, **meta), codes.to(torch.uint8), torch.empty(tokens, **meta), tokens)
    rows = []
    # a prefill's write (16 tokens per program) and a decode step's (one token of one KV head per program)
    for block_t in (16, 1):
        for steps, weighted in ((1, False), (8, False), (8, True), (16, True)):
            kwargs = dict(HEAD_DIM=head_dim, BLOCK_T=block_t, STEPS=steps, WEIGHTED=weighted, num_warps=4)
            launch = Launch(_searched_rows, (triton.cdiv(tokens, block_t),), buffers,
                            kwargs | encoding(get_format("fp8_e4m3")))  # fmt: skip
            compiled = compile_launch(launch, gpu)
            sass = [line for line in compiled.sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
            rows.append({
                "tokens per program": block_t, "candidates": steps, "weighted": "yes" if weighted else "no",
                "registers": compiled.registers, "spill B": compiled.spill_stores, "SASS instructions": len(sass),
                "branches": sum(" BRA" in line for line in sass),
            })  # fmt: skip
    print(f"{args.arch}, head_dim {head_dim}, bf16 rows to e4m3, 4 warps per program")
    print(format_table(rows))


if __name__ == "__main__":
    main()
