"""Where a decode loop's register moves come from: a minimal online-softmax loop (one query block of 16 rows, head_dim
128, K/V tiles of `--block-n` tokens) compiled for a GPU target without a GPU, its KV loop's SASS counted.

Triton leaves a loop-invariant dot operand (the query) in shared memory and loads it again in every iteration. With
fp16 K/V its operand layout takes `ldmatrix` straight into the MMA's registers; with 8-bit codes converted in
registers the operands take 4 elements per thread (`kWidth` 4), and the query is reloaded by 8-byte loads whose
registers are then moved into the MMA's operand quads, one `IMAD.MOV` or `MOV` each. Variants:

- `fp16`: fp16 K/V (the layout Triton is built around);
- `e4m3`: e4m3 codes, K read `[head_dim, tokens]` and V from head_dim-major tiles, as the cache's decode kernel
  reads them (`_codes_tile`), converted by the hardware;
- `e4m3 transposed`: the same codes with the products turned around (scores^T = K Q^T, out^T = V^T P^T), so that
  the codes are the A operand and the query the B one.

    python benchmarks/operand_reload_probe.py --arch sm_90
    python benchmarks/operand_reload_probe.py --arch sm_90 --block-n 32
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import gpu_static
from hf_fp8kv.kernels.targets import EXAMPLE_GPUS
from hf_fp8kv.kernels.triton_launch import Launch

VARIANTS = {"fp16": 0, "e4m3": 1, "e4m3 transposed": 2}


@triton.jit
def _loop_kernel(q_ptr, k_ptr, v_ptr, o_ptr, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                 MODE: tl.constexpr):  # fmt: skip
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :]).to(tl.float16)
    m = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    if MODE == 2:
        q_t = tl.trans(q)
        acc_t = tl.zeros((D, BLOCK_M), tl.float32)
        for first in tl.range(0, n, BLOCK_N, num_stages=3):
            k = tl.load(k_ptr + (first + j)[:, None] * D + d[None, :]).to(tl.float16)
            v_t = tl.load(v_ptr + first * D + d[:, None] * BLOCK_N + j[None, :]).to(tl.float16)
            s = tl.dot(k, q_t)
            m_new = tl.maximum(m, tl.max(s, 0))
            p = tl.exp2(s - m_new[None, :])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 0)
            acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p.to(tl.float16))
            m = m_new
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for first in tl.range(0, n, BLOCK_N, num_stages=3):
            k = tl.load(k_ptr + (first + j)[None, :] * D + d[:, None]).to(tl.float16)
            v = tl.trans(tl.load(v_ptr + first * D + d[:, None] * BLOCK_N + j[None, :])).to(tl.float16)
            s = tl.dot(q, k)
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            m = m_new
    tl.store(o_ptr + rows[:, None] * D + d[None, :], acc / l[:, None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", help="an NVIDIA target with e4m3 (sm_89, sm_90, sm_100, sm_120)")
    parser.add_argument("--block-n", type=int, default=64, help="tokens per K/V tile")
    args = parser.parse_args()
    gpu = EXAMPLE_GPUS[args.arch]
    for name, mode in VARIANTS.items():
        codes = torch.float16 if mode == 0 else torch.float8_e4m3fn
        q, out = torch.empty(16, 128, dtype=torch.float16), torch.empty(16, 128)
        kv = torch.empty(4096, 128, dtype=codes)
        launch = Launch(_loop_kernel, (1,), (q, kv, kv, out, 4096),
                        dict(BLOCK_M=16, BLOCK_N=args.block_n, D=128, MODE=mode, num_warps=4))  # fmt: skip
        loop = gpu_static.main_loop(gpu_static.parse_sass(gpu_static.compile_launch(launch, gpu).sass))
        kinds = {
            "register moves": gpu_static.register_moves(loop),
            "shared-memory loads": sum(i.is_("LDS", "LDSM") for i in loop),
            "conversions": sum(i.is_("F2FP") for i in loop),
            "dots": sum(i.is_(*gpu_static.DOTS) for i in loop),
        }
        kinds["other"] = len(loop) - sum(kinds.values())
        print(f"{name:16} {len(loop):4} instructions per {args.block_n}-token tile ({len(loop) / args.block_n:.1f} a "
              f"token): " + ", ".join(f"{count} {kind}" for kind, count in kinds.items()))  # fmt: skip


if __name__ == "__main__":
    main()
