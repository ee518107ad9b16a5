"""benchmarks/gpu_static.py: the compiled-code report at reduced scope for sm_80, sm_90 and gfx942 (a change that
breaks the kernels' compile for A100, H100/H200 or MI300 fails here), its SASS reading checked on small loop
kernels whose loops are known, and its IR check of 32-bit offsets on kernels with and without them. The compiles
run in a subprocess without the interpreter (run as a script, this file writes the report and the known kernels'
readings to the folder it is given)."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_static.py"
BLOCK = 64  # the known kernels: a [64, 64] fp16 tile times each [64, 64] tile of b, 4 dot k-steps of 16 per tile


@triton.jit
def pointer_loop(a_ptr, b_ptr, out_ptr, n, col_stride, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r[:, None] * BLOCK + r[None, :])
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.dot(a, tl.load(b_ptr + (start + r)[:, None] * BLOCK + r[None, :] * col_stride))
    tl.store(out_ptr + r[:, None] * BLOCK + r[None, :], acc)


@triton.jit
def offsets(x_ptr, out_ptr, row_stride, WIDE: tl.constexpr):
    """A row offset `row * row_stride` (two run-time values), 32-bit unless WIDE; the other offsets are safe: a
    tile's range times a stride, a constant product, a select between constants."""
    row = tl.program_id(0) * 16 + tl.arange(0, 16)
    if WIDE:
        row = row.to(tl.int64)
    column = tl.arange(0, 16)
    x = tl.load(x_ptr + row[:, None] * row_stride + column[None, :] * row_stride)
    pick = tl.where(tl.program_id(1) == 0, 1, 16)
    tl.store(out_ptr + tl.program_id(1) * 16 * 16 + column[:, None] * pick + column[None, :], x)


@triton.jit
def descriptor_loop(a_ptr, b_desc, out_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r[:, None] * BLOCK + r[None, :])
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.dot(a, b_desc.load([start, 0]))
    tl.store(out_ptr + r[:, None] * BLOCK + r[None, :], acc)


def gpu_static():
    """The report's module (benchmarks/ is not a package)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("gpu_static")


def known_loops() -> dict:
    """The report's reading of the known kernels' loops, by kernel and `num_stages`."""
    from hf_fp8kv.kernels.triton_launch import Launch
    from triton.tools.tensor_descriptor import TensorDescriptor

    report = gpu_static()
    a = torch.empty(BLOCK * BLOCK + 1, dtype=torch.float16)[1:]  # 2 bytes past an allocation: not 16-aligned
    b = torch.empty(4096, BLOCK, dtype=torch.float16)
    out = torch.empty(BLOCK, BLOCK)
    launches = {
        f"pointer stages={s}": Launch(pointer_loop, (1,), (a, b, out, 4096, 1), dict(BLOCK=BLOCK, num_stages=s))
        for s in (1, 2, 3)
    }
    descriptor = TensorDescriptor.from_tensor(b, [BLOCK, BLOCK])
    launches["descriptor stages=3"] = Launch(
        descriptor_loop, (1,), (a, descriptor, out, 4096), dict(BLOCK=BLOCK, num_stages=3)
    )
    readings = {}
    for name, launch in launches.items():
        compiled = report.compile_launch(launch)
        loop = report.loop_report(compiled, BLOCK * BLOCK * 2, report.EXAMPLE_GPUS["sm_90"])
        readings[name] = dict(loop=loop, constexpr_args=compiled.constexpr_args, aligned_args=compiled.aligned_args)
    return readings


def offset_readings() -> dict:
    """The IR check's reading of `offsets`, with and without its int64 row."""
    report = gpu_static()
    from hf_fp8kv.kernels.triton_launch import Launch

    x = torch.empty(4096, 16)
    readings = {}
    for wide in (False, True):
        compiled = report.compile_launch(Launch(offsets, (4, 2), (x, x, 16), dict(WIDE=wide)))
        readings[f"wide={wide}"] = report.int32_offset_products(compiled.ttir)
    return readings


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    try:
        knobs.nvidia.ptxas_blackwell.path, knobs.nvidia.cuobjdump.path
    except RuntimeError:
        pytest.skip("no ptxas / cuobjdump in this Triton install")
    out = tmp_path_factory.mktemp("gpu_static")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    known = json.loads((out / "known.json").read_text())
    return result.stdout, json.loads((out / "report.json").read_text()), known


KERNELS = {"_attention_kernel", "_reduce_kernel", "_write_kernel", "_paged_attention_kernel", "_write_rows_kernel"}


def test_quick_report_prints_the_table_and_judges_the_budgets(compiled):
    stdout, report, known = compiled
    assert all(column in stdout for column in gpu_static().COLUMNS + gpu_static().AMD_COLUMNS)
    assert set(report["targets"]) == {"sm_80", "sm_90", "gfx942"} and not any(t["refused"] for t in report["targets"].values())
    by_arch = {arch: [row for row in report["rows"] if row["arch"] == arch] for arch in report["targets"]}
    for arch, rows in by_arch.items():
        assert {row["kernel"] for row in rows} == KERNELS, arch
        assert all(row["spill_stores"] == 0 and row["int32_offsets"] == [] for row in rows), arch
        assert f"\n{arch} (" in stdout
    assert all(f"\n{kernel} " in stdout for kernel in KERNELS)
    # exit status 1 exactly when a budget is missed, and every miss is printed
    assert known["exit_status"] == (1 if report["failures"] else 0)
    assert all(f"FAIL {failure}" in stdout for failure in report["failures"])

    rows = {row["kernel"]: row for row in by_arch["sm_90"]}
    attention = rows["_attention_kernel"]
    loop = attention["loop"]
    assert attention["hardware_decode"] and known["sm_90 fp8 conversions"] > 0
    assert loop["instructions"] == (loop["end"] - loop["start"]) // 16 + 1  # every SASS line of the loop parsed
    assert loop["dots"] > 0 and loop["tiles_in_flight"] >= 1 and 0 < loop["instr_per_byte"] < 10
    assert 1 <= attention["blocks_per_sm"] <= 32 and attention["registers"] > 0
    assert attention["mma"]["kind"] in ("HMMA", "HGMMA") and attention["mma"]["count"] >= loop["dots"]
    assert attention["case"]["recent"] == 0 and attention["case"]["static_cache"] == 0
    assert len(attention["waves"]["grid"]) == 7 * 6 and attention["waves"]["slots"] == 132 * attention["blocks_per_sm"]
    # launch-like specialization: unit strides became constexprs, pointers and the 8195-token length did not
    assert {"q_sd", "c_sd"} <= set(attention["constexpr_args"])
    assert {"q_ptr", "k_ptr", "v_ptr", "out_ptr"} <= set(attention["aligned_args"])
    assert "length" not in attention["aligned_args"] + attention["constexpr_args"]
    assert rows["_write_kernel"]["loop"] is None and rows["_reduce_kernel"]["loop"] is None
    # the decode layer step: the attention, which writes the step's token (split at batch 1, merged in its launch),
    # modelled per point
    step = attention["step"]
    assert attention["grid"][2] > 1 and step["launches"] == 1
    assert set(step["copy_fraction"]) == {"b1_4k", "b1_32k", "b16_4k", "b16_32k"}
    for point, fraction in step["copy_fraction"].items():
        low, high = step["ends"][point]
        assert 0 < low <= fraction <= high < 1, point
    assert step["copy_fraction"]["b1_4k"] < step["copy_fraction"]["b1_32k"] < step["copy_fraction"]["b16_32k"]
    assert rows["_write_rows_kernel"]["loop"] is None
    # GQA-packed rows: programs per request and KV head (as many as the split rule's KV splits, then the reduce);
    # pages read in tiles of slots, or token by token
    paged = {row["case"]["page_size"]: row for row in by_arch["sm_90"] if row["kernel"] == "_paged_attention_kernel"}
    assert set(paged) == {256, 24}
    for row in paged.values():
        assert row["grid"][:2] == [64, 8] and row["loop"]["dots"] > 0
        reduces = [r for r in by_arch["sm_90"] if r["kernel"] == "_reduce_kernel" and r["case"] == row["case"]]
        assert len(reduces) == (row["grid"][2] > 1)

    # A100: the codes decoded in bit operations (Triton has no e4m3fn there), its 108 SMs in the split rule
    a100 = {row["kernel"]: row for row in by_arch["sm_80"]}["_attention_kernel"]
    assert not a100["hardware_decode"] and a100["loop"]["dots"] > 0 and known["sm_80 fp8 conversions"] == 0
    assert a100["waves"]["slots"] == 108 * a100["blocks_per_sm"] and a100["mma"]["kind"] == "HMMA"
    # MI300: e4m3fnuz (what "fp8" is there), converted by the hardware; AMDGCN's figures
    mi300 = {row["kernel"]: row for row in by_arch["gfx942"]}["_attention_kernel"]
    assert mi300["case"]["fmt"] == "fp8_e4m3fnuz" and mi300["hardware_decode"] and mi300["loop"] is None
    assert mi300["amd"]["vgprs"] == mi300["registers"] > 0 and 1 <= mi300["amd"]["waves_per_simd"] <= 8
    assert mi300["blocks_per_sm"] >= 1 and mi300["amd"]["scratch"] == 0


def test_the_ir_check_finds_32_bit_offset_products(compiled):
    """`row * row_stride` in 32 bits is found (with its source line), and nothing once `row` is int64."""
    narrow, wide = (compiled[2]["offsets"][f"wide={w}"] for w in (False, True))
    assert len(narrow) == 1 and narrow[0].startswith("test_gpu_static.py:") and "(i32)" in narrow[0]
    assert wide == []


def test_known_loops_are_read_right(compiled):
    readings = compiled[2]["loops"]
    for name, reading in readings.items():
        loop = reading["loop"]
        assert loop["dots"] / loop["unroll"] == 4, name  # 4 HGMMA k-steps per tile, whatever ptxas unrolls
        assert loop["instructions"] == (loop["end"] - loop["start"]) // 16 + 1, name
    # num_stages=1: plain loads; 2: one cp.async buffer, waited for in full; 3: one tile ahead (cp.async or TMA)
    assert readings["pointer stages=1"]["loop"]["tiles_in_flight"] == 1
    assert "no asynchronous copies" in readings["pointer stages=1"]["loop"]["evidence"]
    assert readings["pointer stages=2"]["loop"]["tiles_in_flight"] == 1
    assert "DEPBAR.LE SB0, 0 (all loads)" in readings["pointer stages=2"]["loop"]["evidence"]
    assert readings["pointer stages=3"]["loop"]["tiles_in_flight"] == 2
    assert readings["descriptor stages=3"]["loop"]["tiles_in_flight"] == 2
    assert "copies issued before the loop" in readings["descriptor stages=3"]["loop"]["evidence"]
    # the launcher's specialization: col_stride=1 a constexpr; b, out and n=4096 divisible by 16, a (offset) not
    pointer = readings["pointer stages=3"]
    assert pointer["constexpr_args"] == ["col_stride"]
    assert {"b_ptr", "out_ptr", "n"} <= set(pointer["aligned_args"]) and "a_ptr" not in pointer["aligned_args"]


def test_waves():  # (occupancy: tests/kernels/test_targets.py)
    report = gpu_static()
    assert report.wave_efficiency(272, 264) == pytest.approx(272 / 528)
    assert report.wave_efficiency(264, 264) == 1.0 and report.wave_efficiency(1, 264) == pytest.approx(1 / 264)


def test_cp_async_wait_rule_on_written_sass():
    """Two commit groups per tile and a wait leaving two pending: one tile ahead; the wgmma wait is not a load
    wait; predicated and uniform-predicated instructions parse."""
    report = gpu_static()
    sass = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   LDGSTS.E.BYPASS.128 [R7], desc[UR16][R2.64], P0 ;
        /*0120*/                   LDGDEPBAR ;
        /*0130*/                   DEPBAR.LE SB0, 0x2 ;
        /*0140*/                   HGMMA.64x64x16.F32 R24, gdesc[UR8].tnspB, R24, gsb0 ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0160*/              @!UP0 LDGSTS.E.BYPASS.128 [R19], desc[UR16][R8.64], !P1 ;
        /*0170*/                   LDGDEPBAR ;
        /*0180*/              @!P0 BRA 0x110 ;
        /*0190*/                   EXIT ;
    """
    instrs = report.parse_sass(sass)
    assert len(instrs) == 10 and instrs[6].opcode == "LDGSTS.E.BYPASS.128"
    loop = report.main_loop(instrs)
    assert [i.address for i in (loop[0], loop[-1])] == [0x110, 0x180]
    in_flight, evidence = report.tiles_in_flight(instrs, loop, unroll=1)
    assert in_flight == 2 and "DEPBAR.LE SB0, 2 (partial)" in evidence and "follows 0 of its 1 dots" in evidence


def test_spills_are_told_apart_inside_and_outside_the_kv_loop():
    report = gpu_static()
    sass = """
        /*0100*/                   STL [R1], R4 ;
        /*0110*/                   LDGSTS.E.BYPASS.128 [R7], desc[UR16][R2.64], P0 ;
        /*0120*/                   LDL R5, [R1+0x4] ;
        /*0130*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0140*/              @!P0 BRA 0x110 ;
        /*0150*/                   LDL R4, [R1] ;
        /*0160*/                   EXIT ;
    """
    instrs = report.parse_sass(sass)
    assert report.spill_accesses(instrs) == 3 and report.spill_accesses(report.main_loop(instrs)) == 1


def test_register_moves_count_both_spellings_and_nothing_else():
    report = gpu_static()
    sass = """
        /*0100*/                   IMAD.MOV.U32 R16, RZ, RZ, R36 ;
        /*0110*/                   MOV R17, R58 ;
        /*0120*/                   IMAD R64, R85, 0x40, R86 ;
        /*0130*/                   IMAD.WIDE.U32 R10, R13, R8, R10 ;
        /*0140*/                   UMOV UR4, URZ ;
        /*0150*/                   HMMA.16816.F32 R16, R16, R20, RZ ;
    """
    assert report.register_moves(report.parse_sass(sass)) == 2


def test_main_loop_is_the_codes_loop_when_fp8_dots_take_the_codes_unconverted():
    """A prefill with both dots on FP8 converts no codes: its KV loop is the one with FP8 dots, not the loop over
    full-precision tokens with more (fp16) dots."""
    report = gpu_static()
    sass = """
        /*0100*/                   QMMA.16816.F32.E4M3.E4M3 R4, R8, R12, R4 ;
        /*0110*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB R8, R5, R4 ;
        /*0120*/                   QMMA.16816.F32.E4M3.E4M3 R4, R8, R12, R4 ;
        /*0130*/              @!P0 BRA 0x100 ;
        /*0140*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0150*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0160*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0170*/              @!P1 BRA 0x140 ;
        /*0180*/                   EXIT ;
    """
    loop = report.main_loop(report.parse_sass(sass))
    assert [i.address for i in (loop[0], loop[-1])] == [0x100, 0x130]


def test_mma_kind_ties_are_decided_by_the_table_not_the_hash_seed():
    """Per-token fp8_prefill runs QK on FP8 wgmma and PV on fp16: 2 and 2 here; FP8 comes first in DOTS."""
    report = gpu_static()
    lines = [f"/*{16 * i:04x}*/ {op}.64x64x32.F32 R24, gdesc[UR8], R24 ;" for i, op in enumerate(["HGMMA", "QGMMA"] * 2)]
    found = report.mma(SimpleNamespace(sass="\n".join(lines)))
    assert found == dict(kind="QGMMA", count=4, kinds={"HGMMA": 2, "QGMMA": 2})


def test_budgets():
    report = gpu_static()
    loop = dict(instr_per_byte=0.2, instructions=400, unroll=1, tile_bytes=16384, tiles_in_flight=1, evidence="why",
                spill_accesses=0)  # fmt: skip
    worst = dict(efficiency=0.5, batch=2, context=32768, blocks=272, tile_times=8, fewest_tile_times=5)
    at_floor = dict(worst, efficiency=0.65, batch=1, context=4096, tile_times=2, fewest_tile_times=2)
    waves = dict(slots=264, worst=worst, grid=[worst, at_floor])
    case = dict(head_dim=64, batch=1, context=8195)
    decode = dict(arch="sm_90", kind="decode", kernel="_attention_kernel", case=case, registers=98, warps=8,
                  shared=22528, blocks_per_sm=2, spill_stores=0, spill_loads=0, loop=loop, waves=waves, mma=None,
                  hardware_decode=True, amd=None, int32_offsets=[])  # fmt: skip
    failures = report.budget_failures(decode)
    assert len(failures) == 3 and "0.200 SASS instructions per KV byte > 0.18" in failures[0]
    assert "not pipelined, 1 tile in flight: why" in failures[1] and "last wave 50% < 85% at batch 2" in failures[2]
    assert "1 of 2 grid points" in failures[2]  # an under-full wave at the tile-time floor is no miss
    full = dict(worst, efficiency=0.9)
    good = dict(
        decode, loop=dict(loop, instr_per_byte=0.15, tiles_in_flight=2), waves=dict(slots=264, worst=full, grid=[full])
    )
    assert report.budget_failures(good) == []
    assert report.budget_failures(dict(good, kind="prefill", loop=loop)) == []  # decode budgets are decode's
    assert report.budget_failures(dict(good, spill_stores=8)) == [
        "spills 8 B stores / 0 B loads per thread (none in the KV loop)"
    ]
    in_loop = dict(good, spill_stores=8, loop=dict(good["loop"], spill_accesses=3))
    assert report.budget_failures(in_loop) == [
        "spills 8 B stores / 0 B loads per thread (3 local loads / stores in the KV loop)"
    ]
    assert report.budget_failures(dict(good, int32_offsets=["k.py:3: %x = arith.muli %a, %b (i32)"])) == [
        "32-bit products of run-time sizes in pointer offsets: k.py:3: %x = arith.muli %a, %b (i32)"
    ]
    # the codes decoded in bit operations (A100): a looser loop bound; sm_75 has no cp.async to pipeline with
    bits = dict(good, arch="sm_80", hardware_decode=False, loop=dict(good["loop"], instr_per_byte=0.22))
    assert report.budget_failures(bits) == [] and report.budget_failures(dict(good, loop=bits["loop"]))
    assert report.budget_failures(dict(bits, loop=dict(bits["loop"], instr_per_byte=0.3)))  # Triton's bit operations
    turing = dict(bits, arch="sm_75", loop=dict(bits["loop"], tiles_in_flight=1))
    assert report.budget_failures(turing) == [] and report.budget_failures(dict(turing, arch="sm_80"))
    # AMD: spills (scratch, or registers spilled), nothing of the SASS loop's
    amd = dict(arch="gfx942", spill_stores=0, spill_loads=0, vgpr_spills=0, sgpr_spills=3, waves_per_simd=2)
    mi300 = dict(good, arch="gfx942", loop=None, amd=amd)
    assert report.budget_failures(mi300) == []  # SGPRs spill to VGPR lanes, not memory
    assert report.budget_failures(dict(mi300, amd=dict(amd, vgpr_spills=2))) == []  # into AGPRs: no scratch
    spilled = dict(mi300, spill_stores=8, spill_loads=8)  # (scratch that instructions touch)
    assert report.budget_failures(spilled) == ["spills 8 B stores / 8 B loads per thread"]
    assert report.budget_failures(dict(good, kind="write", blocks_per_sm=0)) == [
        "no block fits: 98 registers x 8 warps, 22528 B shared"
    ]
    # head_dim 128: the tighter loop and occupancy budgets; its opt-in FP8 prefill on FP8 tensor cores (the default
    # prefill keeps fp16 dots); a 32k reduce spread (on targets whose kernel does not merge its splits)
    d128 = dict(case, head_dim=128)
    assert report.budget_failures(dict(good, case=d128, arch="sm_100")) == [
        "decode loop 0.150 SASS instructions per KV byte > 0.13 (400 instructions x 8 warps / 1 x 16384 B)",
    ]  # (the blocks per SM budget is sm_90's)
    assert report.budget_failures(dict(good, case=d128)) == [
        "head_dim 128 decode at 2 blocks per SM < 3",
        "decode loop 0.150 SASS instructions per KV byte > 0.13 (400 instructions x 8 warps / 1 x 16384 B)",
    ]
    assert report.budget_failures(dict(good, case=d128, blocks_per_sm=3, loop=dict(good["loop"], instr_per_byte=0.12))) == []
    prefill = dict(good, kind="prefill", case=dict(d128, fp8_prefill=True), mma=dict(kind="HGMMA", count=64))
    assert report.budget_failures(prefill) == ["prefill KV loop's dots are HGMMA, not FP8 (QGMMA/QMMA/UTCQMMA)"]
    fp8_loop = dict(good["loop"], mma=dict(kind="QMMA", count=32))  # the KV loop's dots decide, not the kernel's
    assert report.budget_failures(dict(prefill, arch="sm_89", loop=fp8_loop, mma=dict(kind="HMMA", count=96))) == []
    assert report.budget_failures(dict(prefill, arch="sm_89", mma=dict(kind="QMMA", count=64))) == []
    assert report.budget_failures(dict(prefill, mma=dict(kind="QGMMA", count=64))) == []
    assert report.budget_failures(dict(prefill, case=d128)) == []  # the default prefill: fp16 dots
    # per-token V scales: the values' dot stays fp16 on sm_90 / sm_100 (more of them than the scores' FP8 dots in a
    # window's loop), FP8 on sm_89
    per_token = dict(prefill, case=dict(d128, fp8_prefill=True, per_token=True))
    mixed = dict(good["loop"], mma=dict(kind="UTCHMMA", count=38, kinds=dict(UTCHMMA=26, UTCQMMA=12)))
    assert report.budget_failures(dict(per_token, arch="sm_100", loop=mixed)) == []
    fp16 = dict(good["loop"], mma=dict(kind="HGMMA", count=8, kinds=dict(HGMMA=8)))
    assert report.budget_failures(dict(per_token, loop=fp16)) == [
        "prefill KV loop's scores are not on FP8 dots (QGMMA/QMMA/UTCQMMA): {'HGMMA': 8}"
    ]
    sm89 = dict(good["loop"], mma=dict(kind="HMMA", count=38, kinds=dict(HMMA=26, QMMA=12)))
    assert report.budget_failures(dict(per_token, arch="sm_89", loop=sm89)) == [
        "prefill KV loop's dots are HMMA, not FP8 (QGMMA/QMMA/UTCQMMA)"
    ]
    reduce = dict(good, kind="decode", kernel="_reduce_kernel", loop=None, case=dict(d128, context=32768), grid=[2])
    assert report.budget_failures(reduce) == ["reduce on 2 programs < 32 at batch 1, 32768 tokens"]
    assert report.budget_failures(dict(reduce, grid=[32, 4])) == []
    # the decode layer step: launches anywhere, the copy fractions on sm_90
    fractions = {"b1_4k": 0.3, "b1_32k": 0.81, "b16_4k": 0.9, "b16_32k": 0.97}
    step = dict(launches=3, copy_fraction=fractions, step_us=dict.fromkeys(fractions, 5.0))
    fast = dict(good, case=d128, blocks_per_sm=3, loop=dict(good["loop"], instr_per_byte=0.12))
    assert report.budget_failures(dict(fast, step=step)) == [
        "a decode layer step takes 3 launches > 2",
        "modelled layer step at 30% of copy bandwidth < 35% at b1_4k (5.0 us)",
    ]
    assert report.budget_failures(dict(fast, step=dict(step, launches=2), arch="sm_100")) == []


def test_amd_scratch_counts_only_where_instructions_touch_it():
    """LLVM may reserve a private segment no instruction reads or writes (36 B beside SGPR spills into VGPR lanes in
    gfx942's head_dim 64 fp16 decode): not a spill. Flat scratch accesses (gfx942, gfx950) and the buffer stores and
    loads LLVM marks as spills (gfx90a) are; Triton's buffer loads of tensors are not."""
    report = gpu_static()
    metadata = "; TotalNumVgprs: 222\n; NumAgprs: 0\n; ScratchSize: 36\n; Occupancy: 2\n    .sgpr_count: 106\n"
    metadata += "    .sgpr_spill_count: 70\n    .vgpr_spill_count: 0\n"
    tensor_loads = "\tbuffer_load_dwordx4 v[2:5], v2, s[56:59], 0 offen\n"
    tensor_loads += "\tbuffer_store_dword v10, v3, s[16:19], 0 offen\n"
    lanes = "\t; implicit-def: $vgpr221 : SGPR spill to VGPR lane\n\tv_writelane_b32 v221, s4, 0\n"
    assert report.amdgcn_figures(metadata + tensor_loads + lanes)["scratch_accesses"] == 0
    spills = "\tbuffer_store_dword v2, off, s[20:23], s0 ; 4-byte Folded Spill\n\tscratch_load_dword v3, off, s33\n"
    assert report.amdgcn_figures(metadata + tensor_loads + spills)["scratch_accesses"] == 2


def test_the_step_model_is_the_sum_of_its_parts():
    """A decode layer step by hand: batch 64 x 4096 tokens at head_dim 128 on 8 KV heads (static scales: 256 bytes
    a token and head), at the middle of the ranges: 536.9 MB at 0.95 x 4.8 TB/s is 117.7 us of copy, over the
    issue-bound 93.4 us (0.1 instructions per byte at 0.55 x 4 x 1.98 GHz x 132 SMs). The split rule gives 512
    programs 3 splits on 396 slots: 4 waves of 22 tiles where 512 x 64 / 396 = 82.7 would do, then the last
    split's merge of 3 x 8 rows x 128 channels of fp32 partial results from L2 at 127 GB/s (0.097 us); one
    attention launch (2.25 us), which writes the step's token (a static cache's compiled step's too). With outlier
    tokens the write is a launch of its own, which judges the token it gives codes (2.5 us + 0.65 us before the
    attention), compiled or not."""
    report = gpu_static()
    case = report.Case("decode", batch=64, context=4096)
    gpu = report.EXAMPLE_GPUS["sm_90"]
    row = dict(blocks_per_sm=3, loop=dict(instr_per_byte=0.1))
    (attention,) = report.plan(case, gpu, device="meta", slots=396)
    assert attention.grid == (1, 512, 3) and attention.kwargs["MERGE"] and attention.kwargs["WRITE"]
    middle = report.middle(report.STEP_RANGES)
    step_us, copy_us, launches = report.step_time(case, gpu, row, middle)
    assert launches == 1 and copy_us == pytest.approx(64 * 8 * 4096 * 256 / 4.56e12 * 1e6)
    merge_us = 3 * 8 * 128 * 4 / 127e9 * 1e6
    assert step_us == pytest.approx(2.25 + copy_us * 88 / (512 * 64 / 396) + merge_us)
    static = dataclasses.replace(case, static_cache=8192)
    assert report.plan(static, gpu, device="meta", slots=396)[0].kwargs["WRITE"]
    assert report.step_time(static, gpu, row, middle)[2] == 1
    judged = dataclasses.replace(case, per_token=True, recent=128, outliers=16)
    launches = report.step_time(judged, gpu, row, middle)[2]
    (write,) = report.plan(dataclasses.replace(judged, kind="write", q_len=1), gpu, device="meta")
    assert launches == 2 and write.kernel.fn.__name__ == "_write_settle_kernel"
    assert report.step_time(dataclasses.replace(judged, static_cache=8192), gpu, row, middle)[2] == 2
    # batch 1 at 32k: 8 programs x 47 splits, one wave of 11 tiles where 8 x 512 / 376 would do; merged in groups of
    # 7: a group's 7 partial results read, its merged one written, then the 7 groups' read (15 in a row)
    alone = report.Case("decode", batch=1, context=32768)
    (attention,) = report.plan(alone, gpu, device="meta", slots=396)
    assert attention.grid == (1, 8, 47) and report.triton_attention.merge_reads(47) == 7 + 1 + 7
    step_us, copy_us, _ = report.step_time(alone, gpu, row, middle)
    assert step_us == pytest.approx(2.25 + copy_us * 11 / (8 * 512 / 376) + 15 * 8 * 128 * 4 / 127e9 * 1e6)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    status = gpu_static().main(["--quick", "--arch", "sm_80,sm_90,gfx942", "--jobs", "2", "--json", str(out / "report.json")])
    report = gpu_static()
    opcodes = {}
    for arch in ("sm_80", "sm_90"):
        launch = report.plan(report.Case("decode"), report.EXAMPLE_GPUS[arch])[0]
        sass = report.compile_launch(launch, report.EXAMPLE_GPUS[arch]).sass
        opcodes[f"{arch} fp8 conversions"] = sum(bool(report.FP8_UNPACK.match(i.opcode)) for i in report.parse_sass(sass))
    known = dict(exit_status=status, loops=known_loops(), offsets=offset_readings(), **opcodes)
    (out / "known.json").write_text(json.dumps(known))
