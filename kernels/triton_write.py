"""Triton write kernel: quantize the new keys and values into the cache's code buffers, both in one launch.

The codes are produced by integer arithmetic on the fp32 bits, not by a float -> fp8 cast: Triton 3.9's
interpreter mis-rounds that cast (carries into the exponent, ties, no saturation) and the GPU's plain fp32
division is approximate, so `x / scale` is `div_rn` and the rounding is done here. The result is
bit-identical to `reference.quantize` (torch's cast) on every input, NaN included (see its docstring).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .formats import StorageFormat
from .triton_launch import Launch

FP32_ONE_BITS = 0x3F800000
MAX_TILE = 4096  # elements of one program's [tokens, head_dim] tile


@functools.cache
def encoding(fmt: StorageFormat) -> dict:
    """The constexprs of `encode` for `fmt`, read off torch's own description of the dtype."""
    if not fmt.is_float:
        return dict(IS_FLOAT=False, MAX=fmt.max, ROUND_SHIFT=1, NORMAL_OFFSET=0, MIN_NORMAL=0.0, SUB_MAGIC=0.0,
                    SUB_MAGIC_BITS=0, NAN_CODE=0, SIGNED_ZERO=True)
    info = torch.finfo(fmt.dtype)
    mantissa = round(-math.log2(info.eps))
    bias = 1 - round(math.log2(info.smallest_normal))
    # Adding 2^(emin - mantissa + 23) puts a subnormal's code in the low mantissa bits, rounded to nearest even.
    sub_magic = 2.0 ** (1 - bias - mantissa + 23)
    return dict(
        IS_FLOAT=True,
        MAX=fmt.max,
        ROUND_SHIFT=23 - mantissa,
        NORMAL_OFFSET=(127 - bias) << mantissa,
        MIN_NORMAL=info.smallest_normal,
        SUB_MAGIC=sub_magic,
        SUB_MAGIC_BITS=FP32_ONE_BITS + (round(math.log2(sub_magic)) << 23),
        NAN_CODE=torch.tensor(math.nan).to(fmt.dtype).view(torch.uint8).item(),
        SIGNED_ZERO=torch.tensor(-0.0).to(fmt.dtype).view(torch.uint8).item() != 0,
    )


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


@triton.jit
def _write_kernel(
    key_ptr, value_ptr, key_codes_ptr, value_codes_ptr, key_scale_ptr, value_scale_ptr, clipped_ptr,
    k_sb, k_sh, k_st, k_sd,
    v_sb, v_sh, v_st, v_sd,
    c_sb, c_sh, c_st, c_sd,
    s_sb, s_sh, s_st,
    heads, new_tokens, start, head_dim,
    DYNAMIC: tl.constexpr, CLIP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FLOAT: tl.constexpr, MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr, NORMAL_OFFSET: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
):  # fmt: skip
    """Program (token block, batch * head, 0 = keys / 1 = values)."""
    pid_t = tl.program_id(0)
    b = (tl.program_id(1) // heads).to(tl.int64)  # int64 bases: a cache can exceed 2^31 elements
    h = (tl.program_id(1) % heads).to(tl.int64)
    which = tl.program_id(2)
    if which == 0:
        src, codes_ptr, scale_ptr, sb, sh, st, sd = key_ptr, key_codes_ptr, key_scale_ptr, k_sb, k_sh, k_st, k_sd
    else:
        src, codes_ptr, scale_ptr, sb, sh, st, sd = value_ptr, value_codes_ptr, value_scale_ptr, v_sb, v_sh, v_st, v_sd
    src += b * sb + h * sh
    codes_ptr += b * c_sb + h * c_sh
    scale_ptr += b * s_sb + h * s_sh
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    row_ok = t < new_tokens
    valid = row_ok[:, None] & (d < head_dim)[None, :]
    x = tl.load(src + t[:, None] * st + d[None, :] * sd, mask=valid, other=0.0).to(tl.float32)
    if DYNAMIC:
        magnitude = tl.abs(x)
        amax = tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, MAX), 1.0)
        tl.store(scale_ptr + (start + t) * s_st, scale, mask=row_ok)
        y = tl.math.div_rn(x, scale[:, None])
    else:
        scale = tl.load(scale_ptr)
        y = tl.math.div_rn(x, scale)
    n_clipped = tl.sum(tl.where(valid & (tl.abs(y) > CLIP), 1, 0))
    tl.atomic_add(clipped_ptr + which, n_clipped.to(tl.int64), mask=n_clipped > 0)
    code = encode(y, IS_FLOAT, MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE,
                  SIGNED_ZERO)
    offsets = (start + t)[:, None] * c_st + d[None, :] * c_sd
    tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=valid)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    start: int,
    fmt: StorageFormat,
    dynamic: bool,
    clipped: torch.Tensor,
) -> None:
    """Quantize `key`/`value` `[batch, kv_heads, new, head_dim]` into the code buffers at `start` (see `ops.write`)."""
    launch = plan_write(key, value, key_codes, value_codes, key_scale, value_scale, start, fmt, dynamic, clipped)
    if launch is not None:
        launch.run()


def plan_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    start: int,
    fmt: StorageFormat,
    dynamic: bool,
    clipped: torch.Tensor,
) -> Launch | None:
    """The launch of `write_kv` (None when there is nothing to write)."""
    _check_write(key, value, key_codes, value_codes, key_scale, value_scale, start, fmt, dynamic, clipped)
    batch, heads, new_tokens, head_dim = key.shape
    if new_tokens == 0:
        return None
    block_d = triton.next_power_of_2(head_dim)
    block_t = min(triton.next_power_of_2(new_tokens), max(1, MAX_TILE // block_d))
    # a static [1, kv_heads, 1] scale is read at batch stride 0
    scale_strides = key_scale.expand(batch, heads, key_scale.shape[-1]).stride()
    grid = (triton.cdiv(new_tokens, block_t), batch * heads, 2)
    return Launch(_write_kernel, grid, (
        key, value, key_codes.view(torch.uint8), value_codes.view(torch.uint8), key_scale, value_scale, clipped,
        *key.stride(), *value.stride(), *key_codes.stride(), *scale_strides,
        heads, new_tokens, start, head_dim,
    ), dict(DYNAMIC=dynamic, CLIP=fmt.clip_bound, BLOCK_T=block_t, BLOCK_D=block_d, **encoding(fmt)))  # fmt: skip


def _check_write(key, value, key_codes, value_codes, key_scale, value_scale, start, fmt, dynamic, clipped) -> None:
    if key.shape != value.shape or key.dtype != value.dtype:
        raise ValueError(f"key {tuple(key.shape)} {key.dtype} and value {tuple(value.shape)} {value.dtype} differ")
    check_codes(key_codes, value_codes, fmt)
    batch, heads, new_tokens, head_dim = key.shape
    if key_codes.shape[:2] != (batch, heads) or key_codes.shape[3] != head_dim:
        raise ValueError(f"new keys {tuple(key.shape)} do not fit the code buffers {tuple(key_codes.shape)}")
    if not 0 <= start <= key_codes.shape[2] - new_tokens:
        raise ValueError(f"{new_tokens} new tokens at {start} overflow the buffers' capacity {key_codes.shape[2]}")
    expected = (batch, heads, key_codes.shape[2]) if dynamic else (1, heads, 1)
    for name, scale in (("key_scale", key_scale), ("value_scale", value_scale)):
        if scale.dtype != torch.float32 or tuple(scale.shape) != expected or scale.stride() != key_scale.stride():
            raise ValueError(f"{name} must be fp32 {expected} like key_scale, got {scale.dtype} {tuple(scale.shape)}")
    if clipped.dtype != torch.int64 or clipped.shape != (2,):
        raise ValueError(f"clipped must be an int64 [2] counter, got {clipped.dtype} {tuple(clipped.shape)}")
    devices = {t.device for t in (key, value, key_codes, value_codes, key_scale, value_scale, clipped)}
    if len(devices) > 1:
        raise ValueError(f"write tensors are on several devices: {sorted(map(str, devices))}")


def check_codes(key_codes: torch.Tensor, value_codes: torch.Tensor, fmt: StorageFormat) -> None:
    """Both code buffers hold `fmt` codes in one layout (the kernels share their strides)."""
    for name, codes in (("key_codes", key_codes), ("value_codes", value_codes)):
        if codes.dtype != fmt.dtype:
            raise ValueError(f"{name} has dtype {codes.dtype}, format {fmt.name} stores {fmt.dtype}")
        if codes.shape != key_codes.shape or codes.stride() != key_codes.stride():
            raise ValueError(f"{name} {tuple(codes.shape)} does not have the layout of key_codes")
