"""The code path each GPU gets (`kernels/targets.py`), decided once per device by the backend (`kernels/ops.py`):
hardware or bit decode of the codes, FP8 dots, occupancy, and the torch path with one warning on a GPU the Triton
kernels cannot run on. GPUs are faked through the device properties torch reports."""

import operator
import warnings
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl

from hf_fp8kv.kernels import ops, reference, targets, triton_common
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.targets import EXAMPLE_GPUS, GpuTarget, memory_bandwidth, sum_rows
from hf_fp8kv.kernels.triton_attention import AttentionPlan
from streams import Stream, fill

E4M3, E5M2, FNUZ = (FORMATS[name].dtype for name in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"))


def test_hardware_conversion_only_where_triton_has_the_type():
    """e4m3fn / e5m2 from sm_89 on (Triton refuses e4m3fn below), e4m3fnuz on MI300, the OCP types on MI355."""
    for arch in ("sm_75", "sm_80", "sm_86", "gfx90a"):
        assert all(EXAMPLE_GPUS[arch].hardware_code_type(dtype) is None for dtype in (E4M3, E5M2, FNUZ)), arch
    for arch in ("sm_89", "sm_90", "sm_100", "sm_120", "gfx950"):
        gpu = EXAMPLE_GPUS[arch]
        assert (gpu.hardware_code_type(E4M3), gpu.hardware_code_type(E5M2)) == (tl.float8e4nv, tl.float8e5), arch
        assert gpu.hardware_code_type(FNUZ) is None, arch
    mi300 = EXAMPLE_GPUS["gfx942"]
    assert mi300.hardware_code_type(FNUZ) == tl.float8e4b8 and mi300.hardware_code_type(E4M3) is None
    assert [a for a, gpu in EXAMPLE_GPUS.items() if gpu.fp8_dots(E4M3)] == ["sm_89", "sm_90", "sm_100", "sm_120", "gfx950"]
    assert not mi300.fp8_dots(FNUZ)  # (its FP8 MMA takes e4m3fnuz operands; the FP8 dots are e4m3fn's)
    assert mi300.default_fp8 == "fp8_e4m3fnuz" and EXAMPLE_GPUS["gfx950"].default_fp8 == "fp8_e4m3"
    # byte permutes (inline PTX): int8 codes on every NVIDIA target, e4m3fn / e5m2 ones where it has no conversion
    nvidia = [arch for arch, gpu in EXAMPLE_GPUS.items() if not gpu.is_amd]
    assert [a for a, gpu in EXAMPLE_GPUS.items() if gpu.permutes_codes(torch.int8)] == nvidia
    for dtype in (E4M3, E5M2):
        assert [a for a, gpu in EXAMPLE_GPUS.items() if gpu.permutes_codes(dtype)] == ["sm_75", "sm_80", "sm_86"]
    assert not any(gpu.permutes_codes(FNUZ) for gpu in EXAMPLE_GPUS.values())  # (its NaN is -0's code: bits)


def run_ptx(asm: str, registers: dict[str, int]) -> dict[str, int]:
    """The 32-bit registers after `asm`, run here: the PTX instructions the byte permutes use."""

    def read(operand: str) -> int:
        if operand[0].isdigit():  # (0x... or a decimal)
            return int(operand, 0)
        return registers[operand]

    def halves(word: int) -> torch.Tensor:
        return torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)

    def permute(a: int, b: int, selector: int) -> int:  # byte i: byte (nibble i & 7) of {b, a}, or its sign (& 8)
        chosen = [(a | b << 32) >> 8 * (selector >> 4 * i & 7) & 0xFF for i in range(4)]
        chosen = [(0xFF if byte & 0x80 else 0) if selector >> 4 * i & 8 else byte for i, byte in enumerate(chosen)]
        return sum(byte << 8 * i for i, byte in enumerate(chosen))

    def sub_f16x2(a: int, b: int) -> int:
        bits = (halves(a) - halves(b)).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(bits[0]) | int(bits[1]) << 16

    ops = {"mov.b32": lambda a: a, "xor.b32": operator.xor, "and.b32": operator.and_, "or.b32": operator.or_,
           "add.u32": lambda a, b: (a + b) & 0xFFFFFFFF, "shr.b32": operator.rshift, "prmt.b32": permute,
           "sub.rn.f16x2": sub_f16x2}  # fmt: skip
    for line in asm.splitlines():
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, operands = line.rstrip(";").split(" ", 1)
        out, *args = [operand.strip() for operand in operands.split(",")]
        assert op in ops, f"no emulation of {op}"
        registers[out] = ops[op](*(read(arg) for arg in args))
    return registers


@pytest.mark.parametrize("name", ["int8_per_token_head", "fp8_e4m3", "fp8_e5m2"])
def test_codes_become_their_fp16_values_through_the_byte_permutes(name):
    """The inline PTX of `decode_codes`' byte permutes (no GPU here to run it, nor the interpreter) run
    instruction by instruction on every code in each byte of a word: the fp16 halves of its two outputs are the
    four codes' values (int8) or the bit decode's value / fp16_factor (FP8, NaN codes NaN), exactly, in Triton's
    packing order (element 0 in the input's low byte and the first output's low half)."""
    fmt = FORMATS[name]
    asm = {"int8_per_token_head": triton_common.INT8_TO_FP16, "fp8_e4m3": triton_common.E4M3_TO_FP16,
           "fp8_e5m2": triton_common.E5M2_TO_FP16}[name]  # fmt: skip
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(fmt.dtype).float() / fmt.fp16_factor  # (int8: factor 1)
    for word in range(256):
        four = [(word + 67 * i) % 256 for i in range(4)]
        out = run_ptx(str(asm.value), {"$2": sum(code << 8 * i for i, code in enumerate(four))})
        values = [out["$0"] & 0xFFFF, out["$0"] >> 16, out["$1"] & 0xFFFF, out["$1"] >> 16]
        got = torch.tensor(values, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        torch.testing.assert_close(got, want[four], rtol=0, atol=0, equal_nan=True, msg=f"codes {four}")


def plan_on(
    gpu: GpuTarget | None, q_len: int = 1, dtype=torch.float16, fmt: str = "fp8_e4m3", variant=(False, False),
    **kwargs,
) -> dict:
    """The constexprs and options of a launch (`variant`: split, merged in the launch) of a plan on `gpu`."""
    stream = Stream(fmt=fmt, updates=[140], tiled=True)
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), "cpu")
    query = torch.randn(2, 2, q_len, 80, dtype=dtype)
    plan = AttentionPlan(query, view, None, None, 0.1, resident_slots=264, target=gpu, **kwargs)
    return plan.launch_options[(*variant, False)]


def test_the_plan_follows_the_target():
    """The launch's constexprs: the decode path, the FP8 dots, the pipeline, the tile size per target; None is the
    interpreter's (bit decode, every path the oracle checks)."""
    assert not plan_on(None)["HW_CONVERT"] and plan_on(EXAMPLE_GPUS["sm_90"])["HW_CONVERT"]
    assert not plan_on(EXAMPLE_GPUS["sm_80"])["HW_CONVERT"] and not plan_on(EXAMPLE_GPUS["sm_86"])["HW_CONVERT"]
    assert plan_on(EXAMPLE_GPUS["gfx942"], fmt="fp8_e4m3fnuz")["HW_CONVERT"]
    assert not plan_on(EXAMPLE_GPUS["gfx942"])["HW_CONVERT"]  # OCP e4m3 on MI300: bit decode
    prefill = dict(q_len=140, fp8_prefill=True)
    assert plan_on(EXAMPLE_GPUS["sm_90"], **prefill)["FP8_QK"] and plan_on(None, **prefill)["FP8_QK"]
    assert not plan_on(EXAMPLE_GPUS["sm_80"], **prefill)["FP8_QK"]
    assert plan_on(EXAMPLE_GPUS["sm_80"])["STAGES"] == 3 and plan_on(EXAMPLE_GPUS["gfx942"])["STAGES"] == 1
    mma_sync, wgmma = (plan_on(EXAMPLE_GPUS[arch], q_len=140) for arch in ("sm_89", "sm_90"))
    assert (mma_sync["BLOCK_M"], mma_sync["STAGES"], wgmma["BLOCK_M"], wgmma["STAGES"]) == (64, 2, 128, 3)


def test_register_caps_only_where_a_decode_kernel_merges_or_writes_in_its_launch():
    """`maxnreg` from `MERGING_TARGETS` for a decode launch that merges its splits (sm_100 caps it at 168, sm_90 at
    128: 4 blocks per SM; under a mask sm_90 merges, in one group, and sm_100 does not), never for one that does
    not (one split, or a reduce launch merging them) nor a prefill of many row blocks (they are not split), but over
    outlier tokens where `OUTLIER_TARGETS` says (sm_100, not sm_90; under a mask the reduce launch merges); the
    4-warp blocks of SMs of 100 KB or less keep `register_room`'s 255."""
    merged = (True, True)
    merging = {a: plan_on(gpu, variant=merged).get("maxnreg") for a, gpu in EXAMPLE_GPUS.items() if gpu.merges_splits}
    assert merging == {"sm_75": 255, "sm_80": 168, "sm_86": 255, "sm_89": 255, "sm_90": 128, "sm_100": 168,
                       "sm_120": 255, "gfx942": None}  # fmt: skip
    for arch in ("sm_80", "sm_100"):  # without the merge in the launch: ptxas' own choice
        for variant in ((False, False), (True, False)):
            assert "maxnreg" not in plan_on(EXAMPLE_GPUS[arch], variant=variant), (arch, variant)
    for arch in ("sm_90", "sm_100"):
        assert "maxnreg" not in plan_on(EXAMPLE_GPUS[arch], q_len=140, variant=merged), arch
        stream = Stream(updates=[140], tiled=True)
        view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), "cpu")
        query, mask = torch.randn(2, 2, 1, 80, dtype=torch.float16), torch.zeros(2, 1, 1, 140, dtype=torch.bool)
        masked = AttentionPlan(query, view, mask, None, 0.1, num_splits=2, target=EXAMPLE_GPUS[arch])
        assert masked.merge == (arch == "sm_90") and not masked.grouped_merge, arch
        assert "maxnreg" not in masked.launch_options[True, False, False], arch
        if masked.merge:
            assert masked.launch_options[True, True, False]["maxnreg"] == 128 and masked.splits(query, view)[1]
        stream = Stream(updates=[140], tiled=True, recent=4, outliers=3)
        view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), "cpu")
        masked = AttentionPlan(query, view, mask, None, 0.1, num_splits=2, target=EXAMPLE_GPUS[arch])
        assert not masked.merge, arch
        assert masked.launch_options[True, False, False].get("maxnreg") == {"sm_90": None, "sm_100": 168}[arch]


def test_a_searched_write_in_a_merging_launch_takes_sm_100s_own_cap():
    """A decode launch that writes the step's token with searched scales (`SEARCHING_TARGETS`): 128 registers on
    sm_100 where it merges its splits (4 blocks per SM, no spill), FUSED_CAPS' 168 where it does not (one split,
    or a mask); the writing cap elsewhere."""
    sm_100, sm_90 = EXAMPLE_GPUS["sm_100"], EXAMPLE_GPUS["sm_90"]
    assert sm_100.decode_register_cap(4, True, True, False, searches=True) == 128
    assert sm_100.decode_register_cap(4, True, False, False, searches=True) == 168
    assert sm_100.decode_register_cap(4, True, True, False) == 168
    assert sm_90.decode_register_cap(4, True, True, False, True) == sm_90.decode_register_cap(4, True, True, False)
    # the query sums the launch adds: 4 rows at a time on sm_100 (8 spilled there), 8 elsewhere (`SUM_ROWS`)
    assert (sum_rows(sm_100), sum_rows(sm_90), sum_rows(EXAMPLE_GPUS["sm_80"]), sum_rows(None)) == (4, 8, 8, 8)


def test_occupancy():
    h200, mi300 = EXAMPLE_GPUS["sm_90"], EXAMPLE_GPUS["gfx942"]
    assert h200.blocks_per_sm(98, 8, 22528) == 2  # 104 x 32 registers per warp: 4 warps per sub-partition
    assert h200.blocks_per_sm(150, 8, 0) == 1  # 152 x 32: 3 warps per sub-partition, 12 per SM
    assert h200.blocks_per_sm(16, 1, 0) == 32  # the block limit
    assert h200.blocks_per_sm(32, 2, 0) == 32 and h200.blocks_per_sm(32, 4, 0) == 16  # the warp limit
    assert h200.blocks_per_sm(32, 4, 100 * 1024) == 2  # 101 KB per block with the reserved 1 KB, of 228 KB
    assert EXAMPLE_GPUS["sm_86"].blocks_per_sm(32, 4, 0) == 12  # 48 warps per SM
    assert mi300.blocks_per_sm(249, 4, 32768) == 2  # 256 VGPRs: 2 waves per SIMD, one wave of a block on each
    assert mi300.blocks_per_sm(128, 4, 0) == 4 and mi300.blocks_per_sm(64, 8, 0) == 4  # 8 waves per SIMD at most
    assert mi300.blocks_per_sm(64, 4, 40 * 1024) == 1  # 64 KB of LDS
    with pytest.raises(ValueError, match="Tesla V100.*sm_80 to sm_121, not sm_70"):
        GpuTarget("sm_70", "Tesla V100-SXM2-16GB", 80).blocks_per_sm(32, 4, 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """`fake_gpu(name, arch)`: torch reports that GPU as cuda:0 (NVIDIA "sm_XY" or AMD "gfxNNN")."""

    def fake(name: str, arch: str, triton_problem: str | None = None):
        amd = arch.startswith("gfx")
        major, minor = (0, 0) if amd else divmod(int(arch[3:]), 10)
        props = SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=108,
                                gcnArchName=f"{arch}:sramecc+:xnack-")  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.version, "hip", "6.4" if amd else None)
        monkeypatch.setattr(ops, "triton_problem", lambda target: triton_problem)
        targets._read_target.cache_clear()
        ops._gpu_problem.cache_clear()
        return torch.device("cuda", 0)

    yield fake
    targets._read_target.cache_clear()
    ops._gpu_problem.cache_clear()


def test_a_gpu_the_kernels_cannot_run_on_gets_the_torch_path_with_one_warning(fake_gpu):
    device = fake_gpu("Tesla V100-SXM2-16GB", "sm_70")
    with pytest.warns(ops.UnsupportedGPUWarning, match=r"Tesla V100-SXM2-16GB \(sm_70, cuda:0\): the Triton kernels"):
        assert ops.backend_for("auto", device) is ops.TORCH
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device
        assert ops.backend_for("triton", device) is ops.TORCH  # whatever was asked for
        assert ops.backend_for("auto", torch.device("cuda")) is ops.TORCH  # the current device, the same one
    with pytest.warns(ops.UnsupportedGPUWarning, match=r"Tesla T4 \(sm_75, cuda:0\): Triton compiles dots to FMA"):
        assert ops.backend_for("auto", fake_gpu("Tesla T4", "sm_75")) is ops.TORCH
    device = fake_gpu("AMD Radeon RX 7900 XTX", "gfx1100")
    with pytest.warns(ops.UnsupportedGPUWarning, match=r"gfx1100.*gfx90a, gfx942, gfx950"):
        assert ops.backend_for(None, device) is ops.TORCH


def test_a_triton_without_that_gpu_gets_the_torch_path(fake_gpu):
    device = fake_gpu("NVIDIA H100 80GB HBM3", "sm_90", triton_problem="Triton cannot run here (RuntimeError: 0 active drivers)")
    with pytest.warns(ops.UnsupportedGPUWarning, match="H100 80GB HBM3 .sm_90, cuda:0.: Triton cannot run here"):
        assert ops.backend_for("auto", device) is ops.TORCH
    for name, arch in [("NVIDIA A100-SXM4-80GB", "sm_80"), ("NVIDIA H100 80GB HBM3", "sm_90"), ("AMD Instinct MI300X", "gfx942")]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ops.backend_for("auto", fake_gpu(name, arch)) is ops.TRITON, arch
    assert ops.backend_for("torch", fake_gpu("NVIDIA H100 80GB HBM3", "sm_90")) is ops.TORCH


def test_the_real_triton_has_no_driver_on_this_cpu_machine():
    """What `triton_problem` reads off the installed Triton: no GPU here, so no active driver for either kind."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert "Triton cannot run here" in ops.triton_problem(EXAMPLE_GPUS["sm_90"])


def test_fp8_prefill_is_refused_where_there_are_no_e4m3fn_tensor_cores(fake_gpu):
    e4m3 = FORMATS["fp8_e4m3"]
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB \(sm_80\) has none"):
        ops.check_fp8_prefill("auto", fake_gpu("NVIDIA A100-SXM4-80GB", "sm_80"), e4m3)
    with pytest.raises(ValueError, match=r"AMD Instinct MI300X \(gfx942\) has none"):
        ops.check_fp8_prefill(None, fake_gpu("AMD Instinct MI300X", "gfx942"), e4m3)
    with pytest.raises(ValueError, match=r"needs the Triton backend: NVIDIA H100 80GB HBM3 \(sm_90\) runs the torch"):
        ops.check_fp8_prefill("torch", fake_gpu("NVIDIA H100 80GB HBM3", "sm_90"), e4m3)
    for name, arch in [("NVIDIA L4", "sm_89"), ("NVIDIA H100 80GB HBM3", "sm_90"), ("AMD Instinct MI355X", "gfx950")]:
        ops.check_fp8_prefill("auto", fake_gpu(name, arch), e4m3)
    ops.check_fp8_prefill("auto", torch.device("cpu"), e4m3)  # exact attention on the CPU; the interpreter's FP8 dots


def test_memory_bandwidth_from_the_devices_clock_and_bus():
    """Two transfers a clock over the bus (an H100 SXM: 3.35 TB/s); where torch reports neither, an H200's
    bandwidth per SM times the SMs."""
    h100 = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)
    assert memory_bandwidth(h100) == pytest.approx(3.352e12, rel=1e-3)
    assert memory_bandwidth(SimpleNamespace()) == 0
    assert GpuTarget("sm_90", "H100", 132).memory_bandwidth == pytest.approx(4.8e12)
    assert EXAMPLE_GPUS["sm_89"].memory_bandwidth == 0.3e12
