"""What a GPU can run: its target (Triton's name for it), the code path each storage format takes there, and its
occupancy limits. Read once per device (`device_target`); `benchmarks/gpu_static.py` builds the same records
for GPUs it does not have (`EXAMPLE_GPUS`).

The code paths, by target:
- FP8 codes are converted to fp16 by the hardware where Triton supports that dtype on that target (NVIDIA
  sm_89+: e4m3fn, e5m2; AMD gfx942: e4m3fnuz; gfx950: e4m3fn, e5m2). Everywhere else they are decoded by exact
  bit operations, the decode the Triton interpreter runs (Triton refuses e4m3fn below sm_89, and converts the
  formats a target lacks in software: slower than the bit decode, which needs no conversion table); on NVIDIA
  (A100, A10G: e4m3fn, e5m2) the same bits by byte permutes in inline PTX, two or four codes per instruction.
- int8 codes: on NVIDIA by byte permutes and a packed fp16 subtraction in inline PTX, 5 instructions per 4
  codes (Triton's conversion took an I2F and 1.75 PRMT per code); on AMD and in the interpreter by Triton's
  conversion. (`triton_common.decode_codes`, `GpuTarget.permutes_codes`.)
- `fp8_prefill`'s dots run on FP8 tensor cores over e4m3fn operands: NVIDIA sm_89+ and gfx950. Elsewhere (A100,
  T4, MI250, MI300, whose FP8 MMA takes e4m3fnuz) a cache asking for it is refused when it is built.
- The kernels' dots take fp16 or fp32 operands, never bf16: every target with tensor cores has those.
- Triton runs where the kernels were compiled for the target's family (`gpu_static --arch all`): NVIDIA sm_80 to
  sm_12x, AMD CDNA 2-4 (gfx90a, gfx942, gfx950). Any other GPU gets the torch path, with a warning
  (`kernels.ops.backend_for`): older NVIDIA ones, T4 (sm_75: Triton gives it no tensor-core dots), AMD's RDNA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Triton's types (`triton.language` names: this module is read without Triton) for the codes the hardware converts
OCP_FP8 = {torch.float8_e4m3fn: "float8e4nv", torch.float8_e5m2: "float8e5"}
FNUZ_FP8 = {torch.float8_e4m3fnuz: "float8e4b8", torch.float8_e5m2fnuz: "float8e5b16"}
PERMUTED_CODES = {torch.int8, torch.float8_e4m3fn, torch.float8_e5m2}  # (`GpuTarget.permutes_codes`)


@dataclass(frozen=True)
class Limits:
    """Per-multiprocessor limits for occupancy (NVIDIA: the CUDA programming guide's per-capability table)."""

    shared: int  # shared memory (LDS on AMD) bytes per SM / CU
    warps: int  # resident warps (waves) per SM / CU
    blocks: int  # resident blocks per SM / CU
    reserved: int = 0  # shared memory bytes CUDA reserves per block (sm_80+: 1 KB)
    registers: int = 65536  # 32-bit registers per SM (NVIDIA)


# NVIDIA by compute capability (major * 10 + minor); sm_88 and sm_121 share a neighbour's limits
NVIDIA_LIMITS = {
    75: Limits(64 * 1024, 32, 16),
    80: Limits(164 * 1024, 64, 32, 1024),
    86: Limits(100 * 1024, 48, 16, 1024),
    87: Limits(164 * 1024, 48, 16, 1024),
    88: Limits(100 * 1024, 48, 16, 1024),
    89: Limits(100 * 1024, 48, 24, 1024),
    90: Limits(228 * 1024, 64, 32, 1024),
    100: Limits(228 * 1024, 64, 32, 1024),
    103: Limits(228 * 1024, 64, 32, 1024),
    110: Limits(228 * 1024, 48, 24, 1024),
    120: Limits(100 * 1024, 48, 24, 1024),
    121: Limits(100 * 1024, 48, 24, 1024),
}
# AMD CDNA by gfx name: 4 SIMDs per CU, 8 waves of 64 lanes per SIMD, 512 VGPRs per lane (arch + accumulation)
AMD_LIMITS = {"gfx90a": Limits(64 * 1024, 32, 32), "gfx942": Limits(64 * 1024, 32, 32), "gfx950": Limits(160 * 1024, 32, 32)}
AMD_SIMDS, AMD_VGPRS, AMD_VGPR_UNIT = 4, 512, 8
SM_BANDWIDTH = 4.8e12 / 132  # an H200's memory bandwidth per SM, bytes per second
# register caps (`maxnreg` by warps per block) for a decode kernel that merges its splits or writes the step's token
# in its launch: ptxas' own spilled 12-36 B with the write on sm_90 (default window, batch 64; head_dim 64) and 8-12 B
# with the merge alone on sm_100 (it settled at 128 registers); with them, none (gpu_static --match decode)
FUSED_CAPS = {2: 128, 4: 168, 8: 168}
# where a split decode's last split may merge the others' results in its own launch (`triton_attention`; each call
# weighs it against a reduce launch, `split_plan`), with the caps a kernel that merges but does not write needs
# there: the targets whose compiled decode kernels kept their spills with the merge (on sm_75, sm_89 and sm_120 all
# 132 attention rows as without it). sm_90's 4-warp cap holds ptxas at 128 registers, 4 blocks per SM: with the
# merge in groups its static-cache and outlier decodes settled there by themselves with 16-28 B spilled, or took
# 136 and 3 blocks; capped, 128 and none (168 would cost them the block). sm_80 spills nothing under caps of 168 (2
# and 4 warps) and 128 (8), for a block per SM at head_dim 64 (7 -> 6) and in the default window (4 -> 3); with the
# choice per call its step model gains up to 7 points of copy bandwidth (3.4 on average at batch 1, 4k tokens) and
# loses none at any point of its 55 decode rows (3 -> 2 launches in 41).
# gfx90a and gfx950 lose a block per CU with it at head_dim 128 (static scales: 3 -> 2, 4 -> 3; no spill: the 36 B
# of scratch gfx950 showed at 64 is a private segment no instruction touches), and AMD has no step model to weigh it
MERGING_TARGETS = {
    "sm_75": {}, "sm_80": {2: 168, 4: 168, 8: 128}, "sm_86": {}, "sm_89": {}, "sm_90": {4: 128}, "sm_100": FUSED_CAPS,
    "sm_120": {}, "gfx942": {},
}  # fmt: skip
# where a split decode under a mask (left padding) merges its splits in its launch too (in one group): not sm_100,
# whose left-padded default-window decode loop took 495 -> 529 SASS instructions merged (134 registers under its
# cap; 501 at 218, 2 blocks per SM), its step model 60% -> 57% of copy bandwidth at batch 16 and 32k tokens
# (gpu_static)
MASKED_MERGE_SKIPPED = frozenset({"sm_100"})
# where a decode step's attention launch writes the step's token itself (`triton_attention.writes_in_launch`), with
# the caps a kernel that writes needs there: the targets whose decode kernels did not spill with it (sm_90 loses a
# block per SM at head_dim 128 with per-token scales, 4 -> 3; on sm_86 the caps spilled 16-48 B); sm_80 spilled 4-8 B
# at head_dim 256 and under a mask with every cap tried; AMD is not compiled with it yet
WRITING_TARGETS = {"sm_86": {}, "sm_89": FUSED_CAPS, "sm_90": FUSED_CAPS, "sm_100": FUSED_CAPS, "sm_120": FUSED_CAPS}
# the caps of a decode over outlier tokens that neither writes nor merges (a mask's): sm_100's settled at 128
# registers with 24 B spilled, 4 blocks per SM; capped, 162 and none, 3 blocks (sm_80's: as uncapped; sm_90's
# merge cap of 128 spilled 32 B there)
OUTLIER_TARGETS = {"sm_80": MERGING_TARGETS["sm_80"], "sm_100": FUSED_CAPS}
# the caps of a decode kernel that searches the step's token's scales in its launch (`scale_search`) and merges its
# splits there: sm_100's head_dim 128 ones went from 123-127 registers (4 blocks per SM) to 140-147 (3) under
# FUSED_CAPS; at 128, 122-128, none spilled, 4 blocks. Unmerged (a mask, one split) they spilled 8 B at 128: those
# keep FUSED_CAPS, 3 blocks as without the search (gpu_static)
SEARCHING_TARGETS = {"sm_100": {4: 128}}
# query rows per iteration where a searched decode step's attention launch adds its queries to the layer's sums
# (`triton_attention.sums_in_launch`): 8, but sm_100's int8 default-window decode spilled 8 B with 8 at its cap of
# 128 (16 B with 16, 12 B with 2), none with 4; 4 on sm_80 spilled 4 B in the default window and took the masked
# one from 4 blocks per SM to 3 (gpu_static)
SUM_ROWS = {"sm_100": 4}


def sum_rows(target: GpuTarget | None) -> int:
    """Query rows per iteration of a decode launch's query sums (`SUM_ROWS`; 8 where no target is known)."""
    return SUM_ROWS.get(target.arch if target is not None else "", 8)


@dataclass(frozen=True)
class GpuTarget:
    """A GPU as the kernels see it. `arch`: "sm_80" (NVIDIA, compute capability 8.0) or "gfx942" (AMD)."""

    arch: str
    name: str  # the device's own name, for messages ("NVIDIA A100-SXM4-80GB")
    sms: int  # multiprocessors (AMD: compute units)
    bandwidth: float = 0.0  # memory bandwidth, bytes per second (0: not known; see `memory_bandwidth`)

    @property
    def memory_bandwidth(self) -> float:
        """`bandwidth`, or where it is not known an H200's per SM (`SM_BANDWIDTH`) times the SMs."""
        return self.bandwidth or SM_BANDWIDTH * self.sms

    @property
    def is_amd(self) -> bool:
        return self.arch.startswith("gfx")

    @property
    def capability(self) -> int:
        """NVIDIA's compute capability as major * 10 + minor (0 on AMD)."""
        return 0 if self.is_amd else int(self.arch.removeprefix("sm_"))

    @property
    def warp_size(self) -> int:
        return 64 if self.is_amd else 32

    @property
    def async_copies(self) -> bool:
        """Whether loads can go to shared memory asynchronously (cp.async: NVIDIA sm_80+), which the kernels'
        pipelined loops need: without, Triton keeps the stages' tiles in registers."""
        return not self.is_amd and self.capability >= 80

    @property
    def pipeline_stages(self) -> int:
        """Tiles a pipelined loop keeps in flight: 3 with cp.async; 1 elsewhere (without it, Triton holds the next
        tiles in registers: 2 stages spilled 20 B of scratch in gfx942's head_dim 128 decode, gpu_static)."""
        return 3 if self.async_copies else 1

    @property
    def warpgroup_dots(self) -> bool:
        """Whether dots take 128-row tiles with operands in shared memory (wgmma: sm_90; tcgen05: sm_100 to sm_11x);
        elsewhere (mma.sync, MFMA) a dot's operands are in registers and prefill tiles are smaller."""
        return not self.is_amd and 90 <= self.capability < 120

    @property
    def fp8_token_values(self) -> bool:
        """Whether `fp8_prefill`'s values' dot runs on FP8 with per-token V scales too (the probabilities times the
        scales in e4m3): where a dot's operands are in registers (mma.sync: sm_89's per-token prefill loop 0.324 ->
        0.288 SASS instructions per KV byte; MFMA: gfx950, 274 -> 282 VGPRs, same occupancy). With wgmma / tcgen05
        it took sm_90's loop from 0.280 to 0.494 with 36-56 B spilled at 255 registers (32-token tiles: no spill,
        0.587) and sm_100's from 1.235 to 2.184 (gpu_static), so there the values' dot stays fp16."""
        return not self.warpgroup_dots

    @property
    def default_fp8(self) -> str:
        """The format "fp8" names here: e4m3fnuz on MI300 (gfx94x), as in vLLM; e4m3fn elsewhere."""
        return "fp8_e4m3fnuz" if self.arch.startswith("gfx94") else "fp8_e4m3"

    @property
    def merges_splits(self) -> bool:
        """Whether the split decode kernel can merge its splits itself (`MERGING_TARGETS`; each call chooses), else a
        reduce launch does."""
        return self.arch in MERGING_TARGETS

    @property
    def merges_masked_splits(self) -> bool:
        """Whether the split decode kernel merges its splits itself under a mask too (`MASKED_MERGE_SKIPPED`)."""
        return self.merges_splits and self.arch not in MASKED_MERGE_SKIPPED

    @property
    def writes_in_attention(self) -> bool:
        """Whether a decode step's attention launch writes the step's token (`WRITING_TARGETS`), else a write
        launch does."""
        return self.arch in WRITING_TARGETS

    def decode_register_cap(
        self, warps: int, writes: bool, merges: bool, outliers: bool, searches: bool = False
    ) -> int | None:
        """`maxnreg` for a decode kernel of `warps` warps that writes the step's token in its launch
        (`WRITING_TARGETS`; searching its scales and merging its splits too: `SEARCHING_TARGETS` first), else
        merges its splits there (`MERGING_TARGETS`), else reads outlier tokens (`OUTLIER_TARGETS`); None: ptxas'
        own choice."""
        searching = SEARCHING_TARGETS.get(self.arch, {}).get(warps) if writes and searches and merges else None
        caps = WRITING_TARGETS if writes else MERGING_TARGETS if merges else OUTLIER_TARGETS if outliers else {}
        return searching or caps.get(self.arch, {}).get(warps)

    @property
    def limits(self) -> Limits | None:
        """The occupancy limits of the target; None for a target the kernels were not compiled for."""
        return AMD_LIMITS.get(self.arch) if self.is_amd else NVIDIA_LIMITS.get(self.capability)

    def unsupported(self) -> str | None:
        """Why the Triton kernels do not run here; None where they do."""
        if self.limits is None:
            known = "gfx90a, gfx942, gfx950 (CDNA 2-4)" if self.is_amd else "sm_80 to sm_121"
            return f"the Triton kernels are compiled for {known}, not {self.arch}"
        if not self.is_amd and self.capability < 80:
            return (
                "Triton compiles dots to FMA instructions on sm_75, not to its tensor cores: the prefill tiles "
                "spilled 25-46 KB per thread (gpu_static), where the torch path's attention uses them"
            )
        return None

    def hardware_code_type(self, dtype: torch.dtype):
        """Triton's type for codes of `dtype` where the hardware converts them to fp16, else None (bit decode)."""
        if self.is_amd:
            native = FNUZ_FP8 if self.arch == "gfx942" else OCP_FP8 if self.arch == "gfx950" else {}
        else:
            native = OCP_FP8 if self.capability >= 89 else {}
        if dtype not in native:
            return None
        import triton.language as tl

        return getattr(tl, native[dtype])

    def permutes_codes(self, dtype: torch.dtype) -> bool:
        """Whether codes of `dtype` go to fp16 by byte permutes in inline PTX (`triton_common.decode_codes`): int8
        codes, and the e4m3fn / e5m2 ones the hardware does not convert, on NVIDIA targets."""
        return not self.is_amd and dtype in PERMUTED_CODES and self.hardware_code_type(dtype) is None

    def fp8_dots(self, dtype: torch.dtype) -> bool:
        """Whether `fp8_prefill`'s FP8 tensor-core dots run here over codes of `dtype` (e4m3fn operands)."""
        return dtype == torch.float8_e4m3fn and self.hardware_code_type(dtype) is not None

    def blocks_per_sm(self, registers: int, warps: int, shared: int) -> int:
        """Blocks of `warps` warps (waves) resident on one SM (CU) for a kernel using `registers` per thread
        (AMD: VGPRs per lane) and `shared` bytes of shared memory per block; 0 if none fits."""
        limits = self.limits
        if limits is None:
            raise ValueError(f"{self.name}: {self.unsupported()}")
        if self.is_amd:  # a block's waves spread over the SIMDs, each holding 512 / VGPRs waves (8 at most)
            per_simd = min(limits.warps // AMD_SIMDS, AMD_VGPRS // max(-(-registers // AMD_VGPR_UNIT) * AMD_VGPR_UNIT, 1))
            by_registers = AMD_SIMDS * per_simd // warps
        else:  # registers allocated per warp in units of 256, from 4 sub-partitions
            warp_registers = -(-registers * 32 // 256) * 256
            by_registers = 4 * (limits.registers // 4 // warp_registers) // warps
        block_shared = -(-(shared + limits.reserved) // 128) * 128
        by_shared = limits.shared // block_shared if block_shared else limits.blocks
        return min(by_registers, by_shared, limits.warps // warps, limits.blocks)


# a real GPU of each kind (its SM count: what `torch.cuda.get_device_properties` reports; its datasheet memory
# bandwidth), for planning without it
EXAMPLE_GPUS = {
    target.arch: target
    for target in (
        GpuTarget("sm_75", "Tesla T4", 40, 0.32e12),
        GpuTarget("sm_80", "NVIDIA A100-SXM4-80GB", 108, 2.04e12),
        GpuTarget("sm_86", "NVIDIA A10G", 80, 0.60e12),
        GpuTarget("sm_89", "NVIDIA L4", 58, 0.30e12),
        GpuTarget("sm_90", "NVIDIA H200", 132, 4.8e12),
        GpuTarget("sm_100", "NVIDIA B200", 148, 8.0e12),
        GpuTarget("sm_120", "NVIDIA GeForce RTX 5090", 170, 1.79e12),
        GpuTarget("gfx90a", "AMD Instinct MI250X (one GCD)", 110, 1.6e12),
        GpuTarget("gfx942", "AMD Instinct MI300X", 304, 5.3e12),
        GpuTarget("gfx950", "AMD Instinct MI355X", 256, 8.0e12),
    )
}


def device_target(device: torch.device) -> GpuTarget:
    """The target of CUDA (or ROCm) `device`, read once per device."""
    return _read_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _read_target(index: int) -> GpuTarget:
    props = torch.cuda.get_device_properties(index)
    arch = props.gcnArchName.split(":")[0] if torch.version.hip else f"sm_{props.major}{props.minor}"
    return GpuTarget(arch, props.name, props.multi_processor_count, memory_bandwidth(props))


def memory_bandwidth(props) -> float:
    """Bytes per second from the memory clock (kHz) and bus width (bits) a device reports (two transfers a clock:
    an H100 SXM's 2.619 GHz x 5120 bits, 3.35 TB/s); 0 where this torch does not report them."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return clock_khz * 1e3 * 2 * bus_bits / 8
