"""Triton pieces shared by the write, dense attention and paged attention kernels: the exact encoder of fp32
values into codes, the code decoder, the Hadamard rotation, the online-softmax tile, and the tile sizes and decode settings the two
attention kernels plan with."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import view
from .formats import FORMATS, TINY_SCALE, StorageFormat
from .reference import SEARCH_ERROR_BITS, SEARCH_WEIGHT_MAX
from .rotation import hadamard_norm, hadamard_stages
from .targets import GpuTarget, device_target
from .triton_launch import interpreting, next_power_of_2

LOG2E = tl.constexpr(math.log2(math.e))  # softmax runs on exp2
FP16_MAX = tl.constexpr(65504.0)
MIN_ROWS = 16  # tl.dot needs 16 rows
PREFILL_ROWS = 128  # rows per program once a step has that many: one 64-row wgmma per warpgroup of 8 warps
FP32_ONE_BITS = 0x3F800000
MIN_TOKEN_SCALE = tl.constexpr(TINY_SCALE)  # formats.TINY_SCALE, as the kernels read it
P_SCALE = tl.constexpr(256.0)  # FP8 probabilities times this: [0, 256] in e4m3, down to 2^-17 (subnormals)
P_SCALE_LOG2 = tl.constexpr(math.log2(P_SCALE.value))
# per-token V scales on FP8 PV count as at least this (an all-zero row's scale, 2^-126, would otherwise let a
# probability reach 2^134 and overflow)
MIN_PV_SCALE = tl.constexpr(2.0**-64)
VALUE_TILE = tl.constexpr(view.VALUE_TILE)
SEARCH_ERROR_SCALE = tl.constexpr(2.0**SEARCH_ERROR_BITS)  # `reference.searched_scale`'s, over CLIP - MAX
SEARCH_WEIGHT_TOP = tl.constexpr(float(SEARCH_WEIGHT_MAX))


@functools.cache
def encoding(fmt: StorageFormat) -> dict:
    """The constexprs of `encode` for `fmt`, read off torch's own description of the dtype."""
    if not fmt.is_float:
        return dict(IS_FLOAT=False, MAX=fmt.max, ROW_MAX=fmt.row_max, ROUND_SHIFT=1, NORMAL_OFFSET=0, MIN_NORMAL=0.0, SUB_MAGIC=0.0,
                    SUB_MAGIC_BITS=0, NAN_CODE=0, SIGNED_ZERO=True)
    info = torch.finfo(fmt.dtype)
    mantissa = round(-math.log2(info.eps))
    bias = 1 - round(math.log2(info.smallest_normal))
    # Adding 2^(emin - mantissa + 23) puts a subnormal's code in the low mantissa bits, rounded to nearest even.
    sub_magic = 2.0 ** (1 - bias - mantissa + 23)
    return dict(
        IS_FLOAT=True,
        MAX=fmt.max,
        ROW_MAX=fmt.row_max,
        ROUND_SHIFT=23 - mantissa,
        NORMAL_OFFSET=(127 - bias) << mantissa,
        MIN_NORMAL=info.smallest_normal,
        SUB_MAGIC=sub_magic,
        SUB_MAGIC_BITS=FP32_ONE_BITS + (round(math.log2(sub_magic)) << 23),
        NAN_CODE=torch.tensor(math.nan).to(fmt.dtype).view(torch.uint8).item(),
        SIGNED_ZERO=torch.tensor(-0.0).to(fmt.dtype).view(torch.uint8).item() != 0,
    )


E4M3_MAX = tl.constexpr(FORMATS["fp8_e4m3"].max)


@triton.jit
def hadamard(x, STAGES: tl.constexpr, NORM: tl.constexpr):
    """`x` `[rows, D]` (fp32) times the block-diagonal Hadamard matrix of `rotation.hadamard` (`STAGES`
    butterflies, then `NORM`), in its order of operations: the same bits."""
    ROWS: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    for stage in tl.static_range(STAGES):  # channels h = 2^stage apart: (c, c + h) last
        pairs = tl.permute(tl.reshape(x, [ROWS, D >> (stage + 1), 2, 1 << stage]), [0, 1, 3, 2])
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])
    return x * NORM


def rotation(view_rotate: bool, head_dim: int) -> dict:
    """The constexprs of `hadamard` for a view (`ROTATE_STAGES` 0: no rotation)."""
    return dict(ROTATE_STAGES=hadamard_stages(head_dim) if view_rotate else 0, ROTATE_NORM=hadamard_norm(head_dim))


@triton.jit
def rotated_query(q, scratch, ok, STAGES: tl.constexpr, NORM: tl.constexpr):
    """`q` `[ROWS, D]` rotated, read back from `scratch` (fp32 pointers `[ROWS, D]`, those of `ok` this program's
    alone): computed in registers, the rotated query stayed there through the loop as the dot's operand
    (`_attention_kernel`, head_dim 128 per-token decode: 141 -> 190 registers, 3 -> 2 blocks per SM); read from
    memory it is staged in shared memory as the plain query is (gpu_static)."""
    tl.store(scratch, hadamard(q, STAGES, NORM), mask=ok)
    tl.debug_barrier()  # every thread's rows written before any is read
    return tl.load(scratch, mask=ok, other=0.0)


@triton.jit
def program_scratch(scratch_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    """This program's `[ROWS, D]` pointers in a scratch of `ROWS * D` fp32 per program of the grid."""
    program = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    return scratch_ptr + program.to(tl.int64) * (ROWS * D) + tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]


@triton.jit
def round_up_to_bf16(x):
    """Positive finite fp32 `x` rounded up to a bf16 value (kept in fp32): the bits past bf16's carried, then
    dropped (a per-token scale held in 2 bytes, `formats.PER_TOKEN_SCALE_DTYPE`)."""
    return ((x.to(tl.int32, bitcast=True) + 0xFFFF) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def token_scales(x, weight, BF16: tl.constexpr, SEARCH: tl.constexpr, CLIP: tl.constexpr, IS_FLOAT: tl.constexpr,
                 MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr, MIN_NORMAL: tl.constexpr,
                 SUB_MAGIC: tl.constexpr):  # fmt: skip
    """The per-token scales `[T]` (fp32) of rows `x` `[T, D]` (fp32): `reference.dynamic_scale`'s (BF16: rounded up
    to a bf16 value), searched among SEARCH candidates (> 1) under the channels' integer `weight` (`[1, D]`, or 1)
    as `reference.searched_scale` does, to the same bits."""
    magnitude = tl.abs(x)
    finite = magnitude < float("inf")  # (NaN: False)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.where(finite, magnitude, 0.0), axis=1), ROW_MAX), MIN_TOKEN_SCALE)
    if BF16:
        scale = round_up_to_bf16(scale)
    if SEARCH > 1:
        x = tl.where(finite, x, 0.0)
        base_bits = scale.to(tl.int32, bitcast=True)
        least = tl.full(scale.shape, 1 << 62, tl.int64)  # above any error: the first candidate's replaces it
        for i in range(SEARCH):
            bits = base_bits + i * ((1 << 23) // SEARCH)
            candidate = bits.to(tl.float32, bitcast=True)
            y = tl.abs(tl.math.div_rn(x, candidate[:, None]))  # (in range: no saturation)
            error_units = y - code_value(y, IS_FLOAT, ROUND_SHIFT, MIN_NORMAL, SUB_MAGIC)
            step = (error_units * (SEARCH_ERROR_SCALE / (CLIP - MAX))).to(tl.int32)  # (truncated)
            error = tl.sum((step * step * weight).to(tl.int64), axis=1)
            significand = (((bits >> 16) & 0x7F) | 0x80).to(tl.int64)
            error *= significand * significand * tl.where((bits >> 23) > (base_bits >> 23), 4, 1)
            better = error < least
            least = tl.where(better, error, least)
            scale = tl.where(better, candidate, scale)
    return scale


@triton.jit
def code_value(magnitude, IS_FLOAT: tl.constexpr, ROUND_SHIFT: tl.constexpr, MIN_NORMAL: tl.constexpr,
               SUB_MAGIC: tl.constexpr):  # fmt: skip
    """The value of the code nearest fp32 `magnitude` (>= 0, within the format's range), ties to even: `encode`'s
    rounding, kept in fp32."""
    if IS_FLOAT:
        bits = magnitude.to(tl.int32, bitcast=True)
        odd = (bits >> ROUND_SHIFT) & 1
        normal = ((bits + ((1 << (ROUND_SHIFT - 1)) - 1) + odd) & -(1 << ROUND_SHIFT)).to(tl.float32, bitcast=True)
        return tl.where(magnitude < MIN_NORMAL, (magnitude + SUB_MAGIC) - SUB_MAGIC, normal)
    return (magnitude + 8388608.0) - 8388608.0  # int8: adding 2^23 rounds to an integer, half to even


@triton.jit
def search_weights(energy_ptr, d, d_ok):
    """`reference.search_weights`' key weights of one KV head (int32 `[1, D]`) from its queries' energy at
    `energy_ptr` (fp32 `[head_dim]`) for channels `d` `[D]`: each channel's over the largest times
    SEARCH_WEIGHT_MAX, rounded (1 while the head has none)."""
    energy = tl.load(energy_ptr + d[None, :], mask=d_ok[None, :], other=0.0)
    largest = tl.max(energy, axis=1)[:, None]
    # (the min keeps the product's rounding from fusing into the add: the same value, as the product is <= 255.x)
    weight = tl.minimum(energy * tl.math.div_rn(SEARCH_WEIGHT_TOP, tl.where(largest > 0, largest, 1.0)),
                        SEARCH_WEIGHT_TOP)  # fmt: skip
    return tl.where(largest > 0, ((weight + 8388608.0) - 8388608.0).to(tl.int32), 1)


def check_search_energy(energy: torch.Tensor | None, kv_heads: int, head_dim: int, owner: str) -> None:
    """Refuse, naming `owner`, query sums a searched write or the sums' kernel cannot address: they must be
    contiguous fp32 `[kv_heads, head_dim]` (the kernels step `head_dim` from one KV head's row to the next)."""
    fits = energy is not None and energy.dtype == torch.float32 and energy.shape == (kv_heads, head_dim)
    if not fits or not energy.is_contiguous():
        found = None if energy is None else (energy.dtype, tuple(energy.shape), energy.stride())
        raise ValueError(f"{owner} needs search_energy as contiguous fp32 [{kv_heads}, {head_dim}], got {found}")


@triton.jit
def load_token_scales(ptr, slot, stride, ok, WORDS: tl.constexpr):
    """Per-token scales of `slot`s (a row of a `[slots]` buffer at `ptr`, `stride` apart) as fp32, 0 where not `ok`.
    WORDS: bf16 scales (stride 1) read as the 4-byte word holding each (the row starts on a word): a 2-byte load
    cannot go through cp.async, and the plain loads held in registers across the pipeline's stages took the
    head_dim 128 decode kernel from 146 to 174 registers, 3 to 2 blocks per SM (gpu_static)."""
    if WORDS:
        word = tl.load(ptr.to(tl.pointer_type(tl.int32)) + (slot >> 1), mask=ok, other=0)
        bits = tl.where((slot & 1) == 1, word & -65536, word << 16)  # little-endian: the odd slot is the high half
        return bits.to(tl.float32, bitcast=True)
    return tl.load(ptr + slot * stride, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def code_offsets(slot, d, c_st, c_sd, capacity, tiled):
    """Offsets `[T, D]` of the codes of `slot`s, channels `d`, in a (batch, head) plane of `capacity` slots:
    token-major (slot and channel strides `c_st`, `c_sd`) or, where `tiled`, tiled values (`KVView.value_tiled`:
    head_dim-major blocks of VALUE_TILE slots, the last as wide as the slots left; the plane contiguous). The
    choice is made per row, then broadcast: selecting between two `[T, D]` offset tiles took the 500-token write
    from 117 to 197 registers (170 now; gpu_static)."""
    first = slot - slot % VALUE_TILE
    row = tl.where(tiled, first * c_st + slot - first, slot * c_st)
    channel = tl.where(tiled, tl.minimum(capacity - first, VALUE_TILE), c_sd)
    return row[:, None] + d[None, :] * channel[:, None]


@triton.jit
def encode(
    y,
    IS_FLOAT: tl.constexpr,
    MAX: tl.constexpr,
    ROUND_SHIFT: tl.constexpr,
    NORMAL_OFFSET: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    SUB_MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
):
    """The int32 whose low byte is the code of fp32 `y`: saturated at +-MAX, rounded to nearest even."""
    magnitude = tl.minimum(tl.abs(y), MAX)
    if IS_FLOAT:
        bits = magnitude.to(tl.int32, bitcast=True)
        odd = (bits >> ROUND_SHIFT) & 1
        normal = ((bits + ((1 << (ROUND_SHIFT - 1)) - 1) + odd) >> ROUND_SHIFT) - NORMAL_OFFSET
        subnormal = (magnitude + SUB_MAGIC).to(tl.int32, bitcast=True) - SUB_MAGIC_BITS
        code = tl.where(magnitude < MIN_NORMAL, subnormal, normal)
        sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
        if SIGNED_ZERO:
            code = tl.where(y != y, NAN_CODE | sign, code | sign)
        else:  # fnuz: 0x80 is NaN, so -0.0 and tiny negatives are +0
            code = tl.where(y != y, NAN_CODE, tl.where(code == 0, 0, code | sign))
    else:  # int8: adding 2^23 rounds to an integer, half to even
        rounded = (magnitude + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(y != y, 0, tl.where(y < 0, -rounded, rounded))
    return code


# Codes by byte permutes (inline PTX on NVIDIA, `GpuTarget.permutes_codes`): four codes, one 32-bit word
# (Triton's `pack=4`), as four fp16 values, two per output register, each exact.
# int8: each byte's sign bit flipped (code + 128) and put under 0x64 (the fp16 1024 + code + 128), then 1152
# subtracted. 5 instructions per 4 codes where Triton's conversion took 11: sm_90's int8 decode loop 0.197 -> 0.148
# SASS instructions per KV byte, the paged one 0.179 -> 0.136 (gpu_static)
INT8_TO_FP16 = tl.constexpr("""{
.reg .b32 biased, offset;
xor.b32 biased, $2, 0x80808080;
mov.b32 offset, 0x64806480;
prmt.b32 $0, biased, 0x64646464, 0x4140;
prmt.b32 $1, biased, 0x64646464, 0x4342;
sub.rn.f16x2 $0, $0, offset;
sub.rn.f16x2 $1, $1, offset;
}""")
# e5m2: the code is the fp16's high byte
E5M2_TO_FP16 = tl.constexpr("""{
prmt.b32 $0, $2, 0, 0x1404;
prmt.b32 $1, $2, 0, 0x3424;
}""")
# e4m3fn: the bit decode's fp16 (the sign on bit 15, the other 7 bits on 7-13: value / 256), and NaN where the low 7
# bits are all set (their + 1 carries into bit 7, whose sign-replicating permute gives the NaN's exponent mask)
E4M3_TO_FP16 = tl.constexpr("""{
.reg .b32 nan, lo, hi, part;
and.b32 nan, $2, 0x7f7f7f7f;
add.u32 nan, nan, 0x01010101;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 part, lo, 1;
and.b32 part, part, 0x3f803f80;
and.b32 lo, lo, 0x80008000;
or.b32 lo, lo, part;
shr.b32 part, hi, 1;
and.b32 part, part, 0x3f803f80;
and.b32 hi, hi, 0x80008000;
or.b32 hi, hi, part;
prmt.b32 part, nan, 0, 0x9988;
and.b32 part, part, 0x7e007e00;
or.b32 $0, lo, part;
prmt.b32 part, nan, 0, 0xbbaa;
and.b32 part, part, 0x7e007e00;
or.b32 $1, hi, part;
}""")


@triton.jit
def decode_codes(codes, IS_FLOAT: tl.constexpr, HW_CONVERT: tl.constexpr, FP16_SHIFT: tl.constexpr,
                 NAN_MASK: tl.constexpr, NAN_CODE: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """A tile of codes as DOT values: by the hardware (fp8 dtype in, exact); uint8-viewed ones by byte permutes
    (`DecodeSettings.permutes`: int8's values, the FP8 bit decode's otherwise); int8-viewed FP8 codes by exact
    bit operations giving value / fp16_factor (NaN codes read as NaN); int8 codes by Triton's conversion."""
    if codes.dtype == tl.uint8:  # (one return: Triton compiles the statements after a constexpr `if` anyway)
        permutes: tl.constexpr = (E5M2_TO_FP16 if FP16_SHIFT == 8 else E4M3_TO_FP16) if IS_FLOAT else INT8_TO_FP16
        values = tl.inline_asm_elementwise(permutes, "=r,=r,r", [codes], tl.float16, is_pure=True, pack=4)
    elif IS_FLOAT and not HW_CONVERT:
        bits = codes.to(tl.int16) << FP16_SHIFT  # sign-extended: the sign lands on bit 15
        if FP16_SHIFT == 7:  # e4m3: it landed on bit 14 too
            bits = bits & -0x4001  # ~0x4000 as int16
        values = bits.to(tl.float16, bitcast=True)
        if NAN_CODE >= 0:
            values = tl.where((codes.to(tl.int32) & NAN_MASK) == NAN_CODE, float("nan"), values)
    else:
        values = codes
    return values.to(DOT)


@triton.jit
def as_dot(x, DOT: tl.constexpr):
    """Full-precision K/V as dot operands (clamped into fp16's range when the dot runs in fp16)."""
    x = x.to(tl.float32)
    if DOT == tl.float16:
        x = clamp_fp16(x)
    return x.to(DOT)


@triton.jit
def clamp_fp16(x):
    """`x` clamped into fp16's finite range, NaN kept (the GPU's min/max would replace it)."""
    return tl.where(x > FP16_MAX, FP16_MAX, tl.where(x < -FP16_MAX, -FP16_MAX, x))


@triton.jit
def tanh(x):
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def to_e4m3(x, HW_CONVERT: tl.constexpr):
    """fp32 `x` as e4m3fn (rounded to nearest even, saturated at 448): the hardware's conversion on CUDA; else
    `encode`'s bits (the interpreter's fp32 -> fp8 cast is wrong at binade carries), with `encoding`'s numbers for
    e4m3fn written out (module constants reach the interpreter as constexpr objects, which `encode`'s shifts
    reject; tests/kernels/test_triton_write.py holds the result to torch's cast)."""
    if HW_CONVERT:
        return x.to(tl.float8e4nv)
    code = encode(x, True, 448.0, 20, 960, 0.015625, 16384.0, 1182793728, 127, True)
    return code.to(tl.int8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def as_e4m3(codes):
    """e4m3fn codes as the dot's FP8 operand: already typed (the hardware path), or int8 bits."""
    if codes.dtype == tl.float8e4nv:
        return codes
    return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def tile_tokens(first, n, lo, hi, ALL_IN: tl.constexpr):
    """The tokens `first + n` of a tile and which of them lie in `[lo, hi)` (ALL_IN: all of them, a constant the
    loads' masks fold away)."""
    t = first + n
    if ALL_IN:
        t_ok = tl.full(t.shape, 1, tl.int1)
    else:
        t_ok = (t >= lo) & (t < hi)
    return t, t_ok


@triton.jit
def zero_columns(x, keep):
    """`x` `[N, D]` (values or codes, fp8-typed ones included) with the rows (tokens) not in `keep` `[N]` +0."""
    if x.dtype.is_fp8():
        return tl.where(keep[:, None], x.to(tl.int8, bitcast=True), 0).to(x.dtype, bitcast=True)
    return tl.where(keep[:, None], x, 0)


@triton.jit
def attend_tile(
    q, acc, m_i, l_i, k, v, scores_scale, v_scale, visible, softcap,
    PER_TOKEN_K: tl.constexpr, PER_TOKEN_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    DROP_UNSEEN: tl.constexpr, q_row=1.0, FP8_QK: tl.constexpr = False, FP8_PV: tl.constexpr = False,
    HW_CONVERT: tl.constexpr = False, OUTLIERS: tl.constexpr = False,
):  # fmt: skip
    """One tile of the online softmax: `k` `[D, N]` and `v` `[N, D]` already in the dot dtype; `scores_scale` /
    `v_scale` `[N]` per-token factors (used with PER_TOKEN_K / PER_TOKEN_V); `visible` `[M, N]` (None: every row
    sees every token). DROP_UNSEEN:
    the values of columns no row sees are zeroed (a masked NaN would otherwise reach every row: 0 x NaN); without
    it the caller never loads such a column (its load mask leaves them 0).

    FP8_QK: `q` and `k` are e4m3, the scores times `q_row` `[M]` (the query's row scales); FP8_PV: `v` is e4m3 and
    the probabilities times P_SCALE go to e4m3 (the caller divides P_SCALE out; HW_CONVERT: by the hardware's
    conversion). With PER_TOKEN_V the operand is the probabilities times the tokens' V scales, which may be far
    below 1: the running max `m_i` is then the largest `score + log2(v_scale) - log2(P_SCALE)`, so that the
    operand `p * v_scale` is at most P_SCALE and exactly P_SCALE for the row's largest (as the per-head case's
    largest probability is: taking the tile's largest scale instead rounded a peaked row's one dominant token and
    cost 5x the per-head case's PV error on the tests' random stream, emulated). `acc` and `l_i` share that
    reference, so it cancels in `acc / l` and in the splits' merge; no extra `[M, D]` multiply per tile. The
    full-precision tiles after the codes keep `p <= 1` by the max.

    Each FP8 dot sums its K products on the tensor cores, then adds in fp32: Hopper's FP8
    accumulation is less than fp32 (vLLM's 128k-token needle accuracy fell from 91% to 13% when it ran over the
    whole context). OUTLIERS: a negative per-token K scale marks a token read from the outlier buffer instead
    (`KVView.outliers`): its score is -inf."""
    if DROP_UNSEEN:
        seen = tl.max(visible.to(tl.int32), axis=0) > 0
        v = zero_columns(v, seen)
        if PER_TOKEN_V:
            v_scale = tl.where(seen, v_scale, 0.0)
    if FP8_QK:
        scores = tl.dot(q, k, max_num_imprecise_acc=k.shape[0]) * q_row[:, None]
    else:
        scores = tl.dot(q, k, input_precision=PRECISION)
    if PER_TOKEN_K:
        scores = scores * scores_scale[None, :]
        if OUTLIERS:
            scores = tl.where(scores_scale[None, :] < 0, float("-inf"), scores)
    if HAS_SOFTCAP:  # the query holds log2(e) only without softcap
        scores = softcap * tanh(scores / softcap) * LOG2E
    if visible is not None:
        scores = tl.where(visible, scores, float("-inf"))
    if FP8_PV and PER_TOKEN_V:  # a row's largest probability times V scale becomes P_SCALE
        row_max = tl.max(scores + (tl.log2(tl.maximum(v_scale, MIN_PV_SCALE)) - P_SCALE_LOG2)[None, :], axis=1)
    else:
        row_max = tl.max(scores, axis=1)
    m_new = tl.maximum(m_i, row_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if PER_TOKEN_V:
        p = p * v_scale[None, :]
    if FP8_PV:
        pv = tl.dot(to_e4m3(p if PER_TOKEN_V else p * P_SCALE, HW_CONVERT), v, max_num_imprecise_acc=v.shape[0])
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def outside(t, lo, hi):
    """`t < lo or t >= hi` (`lo <= hi`), as one unsigned compare: with two, the loop of a left-padded decode kernel
    (which leaves its sink tokens' codes out tile by tile) ran 546 instructions instead of 515 (gpu_static)."""
    return (t - lo).to(tl.uint32) >= (hi - lo).to(tl.uint32)


@triton.constexpr_function
def rows_alike(HAS_MASK: bool, MASK_ROW: bool, ONE_POSITION: bool) -> bool:
    """Whether every row of a program sees the same tokens: one mask row for all, or one query position (a decode
    step) without a mask."""
    return (HAS_MASK and MASK_ROW) or (ONE_POSITION and not HAS_MASK)


@triton.jit
def token_visibility(t, t_ok, q_last, mask_ptr, mask_start, m_st, window, sink_lo, sink_hi, HAS_MASK: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, EXCLUDE_SINKS: tl.constexpr):  # fmt: skip
    """`[N]`: which of tokens `t` the rows see where they all see the same (`rows_alike`): the mask row, or the
    window of the one query position `q_last` (no token passed here follows it)."""
    ok = t_ok
    if HAS_SINK_TOKENS and EXCLUDE_SINKS:
        ok = ok & outside(t, sink_lo, sink_hi)
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + (t - mask_start) * m_st, mask=ok, other=0) != 0)
    elif HAS_WINDOW:
        ok = ok & (t > q_last - window)
    return ok


@triton.jit
def visibility(t, t_ok, q_pos, row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window,
                sink_lo, sink_hi, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
                EXCLUDE_SINKS: tl.constexpr, MASK_ROW: tl.constexpr, ONE_POSITION: tl.constexpr):  # fmt: skip
    """Which (row, token) pairs attend: the mask (its column = position - mask_start) or the causal and window
    rules; sink tokens are excluded where another segment holds them. MASK_ROW: every row of the program reads
    the same mask row (a decode step's mask, broadcast over the heads), loaded once as a vector: the [rows, tokens]
    load took a left-padded decode kernel at head_dim 128 to 234 registers (gpu_static). ONE_POSITION: every row
    has the one query position, which no token passed here follows (a decode step): no causal rule (head_dim 128
    decode, static scale: 144 -> 136 registers, 0.158 -> 0.153 instructions per KV byte, gpu_static)."""
    if rows_alike(HAS_MASK, MASK_ROW, ONE_POSITION):  # rows past the last: never stored
        ok = token_visibility(t, t_ok, q_pos, mask_ptr, mask_start, m_st, window, sink_lo, sink_hi, HAS_MASK,
                              HAS_WINDOW, HAS_SINK_TOKENS, EXCLUDE_SINKS)  # fmt: skip
        visible = tl.broadcast_to(ok[None, :], (row_ok.shape[0], ok.shape[0]))
    else:
        ok = t_ok
        if HAS_SINK_TOKENS and EXCLUDE_SINKS:
            ok = ok & outside(t, sink_lo, sink_hi)
        if HAS_MASK:
            allowed = tl.load(
                mask_ptr + head[:, None] * m_sh + pos.to(tl.int64)[:, None] * m_sl + (t - mask_start)[None, :] * m_st,
                mask=row_ok[:, None] & ok[None, :],
                other=0,
            )
            visible = (allowed != 0) & ok[None, :] & row_ok[:, None]
        else:
            visible = (t[None, :] <= q_pos[:, None]) & ok[None, :] & row_ok[:, None]
            if HAS_WINDOW:
                visible = visible & (t[None, :] > q_pos[:, None] - window)
    return visible


@triton.jit
def attend_full_precision(
    q, acc, m_i, l_i, k_ptr, v_ptr, slot, t, t_ok, st, sd, d, d_ok, fp_weight,
    q_pos, row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window, sink_lo, sink_hi, softcap,
    HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, EXCLUDE_SINKS: tl.constexpr,
    MASK_ROW: tl.constexpr, ONE_POSITION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """One tile of full-precision tokens (`slot`s of a recent or sink buffer, tokens `t`) into the softmax. Where
    the rows see the same tokens (`rows_alike`), those they do not see are not loaded, so no reduction over the
    rows drops them after the dot (with it, a left-padded decode kernel held 189 registers instead of 162,
    gpu_static)."""
    alike = rows_alike(HAS_MASK, MASK_ROW, ONE_POSITION)
    if alike:
        t_ok = token_visibility(t, t_ok, q_pos, mask_ptr, mask_start, m_st, window, sink_lo, sink_hi, HAS_MASK,
                                HAS_WINDOW, HAS_SINK_TOKENS, EXCLUDE_SINKS)  # fmt: skip
    k = tl.load(k_ptr + slot[None, :] * st + d[:, None] * sd, mask=t_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(v_ptr + slot[:, None] * st + d[None, :] * sd, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    if alike:
        visible = tl.broadcast_to(t_ok[None, :], (row_ok.shape[0], t_ok.shape[0]))
    else:
        visible = visibility(t, t_ok, q_pos, row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window,
                              sink_lo, sink_hi, HAS_MASK, HAS_WINDOW, HAS_SINK_TOKENS, EXCLUDE_SINKS, MASK_ROW,
                              ONE_POSITION)  # fmt: skip
    return attend_tile(q, acc, m_i, l_i, as_dot(k, DOT), as_dot(v, DOT), fp_weight, 1.0, visible, softcap,
                        True, False, HAS_SOFTCAP, PRECISION, not alike)  # fmt: skip


def block_sizes(
    rows: int, head_dim: int, masked: bool = False, target: GpuTarget | None = None, per_token_crowded: bool = False
) -> tuple[int, int, int, dict]:
    """`(BLOCK_M, BLOCK_N, BLOCK_D, launch options)` for `rows` query rows per KV head on `target` (None: the
    interpreter, sm_90's sizes); `per_token_crowded`: per-token scales, with recent or sink tokens in full precision
    or rotated codes (more values live in a prefill)."""
    block_d = next_power_of_2(head_dim)
    stages = 3 if target is None else target.pipeline_stages
    if target is not None and target.is_amd:  # one wave per SIMD (4 warps) may hold 512 VGPRs, two 256 each: 8
        # warps spilled 28-104 B in a 64-row prefill and 84 B in the head_dim 256 decode on gfx90a (gpu_static)
        block_m = 64 if rows > 64 else max(MIN_ROWS, next_power_of_2(rows))
        return block_m, 32 if rows > 64 or block_d > 128 else 64, block_d, dict(num_warps=2 if block_d == 64 else 4, STAGES=1)
    if rows > 64 and (target is None or target.warpgroup_dots):
        # prefill: 128 rows, a distinct 64-row half per warpgroup; K/V decoded once per 128 rows
        # a [128, 64] mask tile spilled; so did the per-token prefill with recent 128 + sinks 4, at 255 registers,
        # 72 B of values live across its loops (32 tokens: 243 registers, no spill, 0.277 -> 0.375 instructions
        # per KV byte); so did the rotated per-token prefill, 56 B at 255 registers (gpu_static)
        block_n = 32 if masked or block_d > 128 or per_token_crowded else 64
        return PREFILL_ROWS, block_n, block_d, dict(num_warps=8, STAGES=stages)
    if rows > 64:  # with mma.sync's operands in registers, 128-row tiles spilled 956-5648 B on sm_80 / sm_86; 64
        # rows of 8 warps at 2 stages: none on sm_80, sm_86, sm_89, sm_120, 1 block per SM (gpu_static)
        return 64, 32 if block_d > 128 else 64, block_d, dict(num_warps=8, STAGES=min(stages, 2))
    block_m = max(MIN_ROWS, next_power_of_2(rows))
    # warps by head_dim, from gpu_static: 4 warps at head_dim 64 ran 0.198-0.210 instructions per KV byte (2 warps:
    # 0.168-0.177); at 256, 4 warps spilled and 8 warps x 32 tokens ran 0.221-0.229 (8 x 64 tokens: 0.157-0.164)
    return block_m, 64, block_d, register_room(dict(num_warps={64: 2, 256: 8}.get(block_d, 4), STAGES=stages), target)


def register_room(options: dict, target: GpuTarget | None) -> dict:
    """`options` with Triton's `maxnreg` at 255 for 4-warp decode blocks on 100 KB SMs (sm_86, sm_89, sm_120): their
    shared memory holds 2 such blocks whatever the registers, and ptxas' own caps of 128 or 168 spilled 4 B in
    sm_89's head_dim 128 decode and sm_120's paged head_dim 256 one (gpu_static: 189 and 182 registers under 255,
    still 2 blocks per SM)."""
    if target is not None and not target.is_amd and target.limits.shared <= 100 * 1024 and options["num_warps"] == 4:
        return dict(options, maxnreg=255)
    return options


class DecodeSettings(NamedTuple):
    code_type: object  # Triton's type of codes the hardware converts (`GpuTarget.hardware_code_type`); None: bits
    code_factor: float  # the bit decode gives value / code_factor (1.0 for the hardware and int8)
    dot: object  # the dots' operand type: fp32 for fp32 queries, else fp16
    value_boost: float  # per-token V scales times this before the probabilities go to fp16
    permutes: bool = False  # by byte permutes (`GpuTarget.permutes_codes`): the codes read as uint8

    @property
    def hw_convert(self) -> bool:
        return self.code_type is not None

    @property
    def code_view(self) -> object:
        """Triton's type of the codes as the kernels read them (`decode_codes` goes by it)."""
        return self.code_type or (tl.uint8 if self.permutes else tl.int8)

    @property
    def code_dtype(self) -> torch.dtype | None:
        """The torch view of the codes the kernels take (None: as stored, for the hardware conversion)."""
        return None if self.hw_convert else torch.uint8 if self.permutes else torch.int8

    @property
    def precision(self) -> str:
        return "ieee"


def query_target(query: torch.Tensor) -> GpuTarget | None:
    """The GPU the kernels compile for on `query`'s device; None on the CPU (the Triton interpreter)."""
    return device_target(query.device) if query.is_cuda and not interpreting() else None


def decode_settings(fmt: StorageFormat, query: torch.Tensor, per_token: bool, target: GpuTarget | None) -> DecodeSettings:
    """How an attention kernel on `target` (None: the interpreter) decodes `fmt`'s codes and runs its dots for
    `query`. Per-token V scales (~amax / max) are boosted by a power of two near max before the probabilities go
    to fp16, or e5m2's (max 57344) would leave them subnormal; the output divides it out."""
    code_type = target.hardware_code_type(fmt.dtype) if target is not None else None
    code_factor = 1.0 if code_type is not None or not fmt.is_float else fmt.fp16_factor
    dot = tl.float32 if query.dtype == torch.float32 else tl.float16
    value_boost = 2.0 ** math.floor(math.log2(fmt.max)) if per_token else 1.0
    permutes = target is not None and target.permutes_codes(fmt.dtype)
    return DecodeSettings(code_type, code_factor, dot, value_boost, permutes)
