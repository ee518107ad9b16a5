"""What `scale_search` costs the write kernels in compiled code (gpu_static's compile, no GPU): each write gpu_static
reports with per-token scales (a decode step's token, a 500-token prompt, beside a recent buffer, a static
cache's, write-and-settle, the paged row writer), compiled without and with N candidates. Figures per kernel:
registers, spill, blocks per SM, SASS instructions in the binary, and about those one program runs (the binary's,
plus the candidate loops' bodies once more for each further candidate: the loops the searched binary has and the
plain one has not). Then the kernel that adds a step's squared queries to a searched layer's sums. AMD targets give
registers and spill only (no SASS).

    python benchmarks/scale_search_cost.py --arch sm_90,sm_80 --candidates 16
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from gpu_static import EXAMPLE_GPUS, Case, cases, compile_launch, loops, parse_sass, plan
from hf_fp8kv.kernels.triton_search import ROWS, plan_query_energy
from hf_fp8kv.table import format_table


def write_cases(gpu) -> list[Case]:
    """gpu_static's writes with per-token scales, and its first paged case with the default window (its row
    writer), unsearched."""
    chosen = [case for case in cases(gpu=gpu) if case.kind == "write" and case.per_token and not case.rotate
              and not case.scale_search]  # fmt: skip
    paged = [case for case in cases(gpu=gpu) if case.kind == "paged" and case.per_token and case.recent]
    return chosen + paged[:1]


def figures(case: Case, gpu) -> dict[str, dict]:
    """Per write kernel of `case` (by name and mode): its compiled figures and instruction addresses' loops."""
    out = {}
    for launch in plan(case, gpu):
        name = launch.kernel.__name__
        if "write" not in name:
            continue
        compiled = compile_launch(launch, gpu)
        instrs = parse_sass(compiled.sass)
        key = f"{name} mode {launch.kwargs['MODE']}" if "MODE" in launch.kwargs else name
        out[key] = dict(compiled=compiled, instrs=len(instrs), loops=sorted(len(body) for body in loops(instrs)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", help=f"{','.join(EXAMPLE_GPUS)}, a list, or 'all'")
    parser.add_argument("--candidates", type=int, default=16)
    args = parser.parse_args()
    archs = list(EXAMPLE_GPUS) if args.arch == "all" else args.arch.split(",")
    rows = []
    for arch in archs:
        gpu = EXAMPLE_GPUS[arch]
        for case in write_cases(gpu):
            plain = figures(case, gpu)
            searched = figures(dataclasses.replace(case, scale_search=args.candidates), gpu)
            for kernel, after in searched.items():
                before = plain[kernel]
                row = {"arch": arch, "case": case.name, "kernel": kernel}
                for label, got in (("plain", before), (f"searched {args.candidates}", after)):
                    compiled = got["compiled"]
                    row[f"{label}: regs"] = compiled.registers
                    row[f"{label}: spill B"] = compiled.spill_stores
                    row[f"{label}: blk/SM"] = gpu.blocks_per_sm(compiled.registers, compiled.warps, compiled.shared)
                if not gpu.is_amd:
                    added = list(after["loops"])
                    for length in before["loops"]:
                        if length in added:
                            added.remove(length)
                    body = sum(added)  # (every candidate loop runs, masked or not: `_write_kernel` has two)
                    row["SASS plain"] = before["instrs"]
                    row["SASS searched"] = after["instrs"]
                    row["run per program: plain"] = before["instrs"]
                    row["run per program: searched"] = after["instrs"] + (args.candidates - 1) * body
                rows.append(row)
    print(f"write kernels, per-token scales, plain and searched among {args.candidates} (`scale_search`)")
    print(format_table(rows))
    print("\nthe queries' sums of a searched layer's step (`triton_search`: one program per KV head)")
    print(format_table([energy_figures(arch, batch, q_len, rotate) for arch in archs
                        for batch, q_len in ((1, 1), (64, 1), (1, 64)) for rotate in (False, True)]))  # fmt: skip


def energy_figures(arch: str, batch: int, q_len: int, rotate: bool) -> dict:
    """The query-energy kernel of a step of `batch` x `q_len` queries (8 KV heads x 8, head_dim 128, bf16)."""
    gpu = EXAMPLE_GPUS[arch]
    query = torch.empty(batch, q_len, 64, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    launch = plan_query_energy(torch.empty(8, 128, device="meta"), query, None, rotate)
    compiled = compile_launch(launch, gpu)
    row = {"arch": arch, "step": f"b{batch} q{q_len}" + (" rotated" if rotate else ""), "regs": compiled.registers,
           "spill B": compiled.spill_stores}  # fmt: skip
    if not gpu.is_amd:
        instrs = parse_sass(compiled.sass)
        body = sum(len(loop) for loop in loops(instrs))
        iterations = -(-batch * q_len * 8 // ROWS)
        row["SASS"] = len(instrs)
        row["run per program"] = len(instrs) + (iterations - 1) * body
    return row


if __name__ == "__main__":
    main()
