"""The Triton write kernel against the torch reference: bit-identical codes, exact scales and clipped counts."""

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from hf_fp8kv.kernels import ops
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.reference import quantize
from hf_fp8kv.kernels.triton_write import encode, encoding, write_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRACE_CHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")  # what torch.compile needs of a custom op
EDGES = [31.6, 125.4, 447.0, 448.0, 449.0, 464.0, 465.0, 1e30, -math.inf, math.inf, 2.0**-10, 2.0**-9 * 1.5,
         -(2.0**-10), 1e-30, -0.0, 0.0, 0.5, 1.5, 2.5, -2.5, 126.5, 240.0, 248.0, 57344.0, 61440.0, 61441.0,
         math.nan]  # fmt: skip


@triton.jit
def _encode_test_kernel(
    x_ptr, out_ptr, n, BLOCK: tl.constexpr,
    IS_FLOAT: tl.constexpr, MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr, NORMAL_OFFSET: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    code = encode(x, IS_FLOAT, MAX, ROUND_SHIFT, NORMAL_OFFSET, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS, NAN_CODE,
                  SIGNED_ZERO)  # fmt: skip
    tl.store(out_ptr + offsets, code.to(tl.uint8), mask=offsets < n)


def hard_values(fmt) -> torch.Tensor:
    """Every code's value, every midpoint between neighbours (the ties), 3 fp32 ulps around each, the edges,
    all negated, and random fp32 bit patterns (NaN payloads and infinities included)."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    values = values[torch.isfinite(values)].abs().unique().double()
    midpoints = (values[1:] + values[:-1]) / 2
    base = torch.cat([values, midpoints, torch.tensor(EDGES, dtype=torch.float64)]).float()
    bits = base.view(torch.int32)
    near = torch.cat([(bits + step).view(torch.float32) for step in range(-3, 4)])
    generator = torch.Generator().manual_seed(0)
    randoms = torch.randint(-(2**31), 2**31 - 1, (100_000,), dtype=torch.int64, generator=generator)
    return torch.cat([near, -near, randoms.to(torch.int32).view(torch.float32)])


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_encode_is_the_reference_cast_on_hard_values(fmt):
    x = hard_values(fmt).to(DEVICE)
    got = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    block = 1 << 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1024
    _encode_test_kernel[(triton.cdiv(x.numel(), block),)](x, got, x.numel(), BLOCK=block, **encoding(fmt))
    expected, _ = quantize(x, torch.ones((), device=DEVICE), fmt)
    mismatch = got != expected.view(torch.uint8)
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ, e.g. x={x[mismatch][:4].tolist()}"


def with_edges(x: torch.Tensor) -> torch.Tensor:
    """`x` with the edge values written into its first row."""
    x[0, 0, 0, : len(EDGES)] = torch.tensor(EDGES)
    return x


def run_write(backend, key, value, fmt, scales, capacity, start):
    batch, heads, _, head_dim = key.shape
    key_codes = torch.full((batch, heads, capacity, head_dim), 0x55, dtype=torch.uint8, device=DEVICE).view(fmt.dtype)
    value_codes = key_codes.clone()
    if scales == "dynamic":
        key_scale = torch.full((batch, heads, capacity), -1.0, device=DEVICE)
        value_scale = key_scale.clone()
    else:
        per_head = torch.tensor([0.5, 1.25, 3.0], device=DEVICE)[:heads]
        key_scale = (per_head if scales == "per-head" else per_head[:1].expand(heads)).reshape(1, heads, 1).clone()
        value_scale = key_scale * 0.25
    clipped = torch.tensor([3, 5], device=DEVICE)
    ops.write(key, value, key_codes, value_codes, key_scale, value_scale, start, fmt, scales == "dynamic", clipped,
              backend=backend)  # fmt: skip
    return [key_codes.view(torch.uint8), value_codes.view(torch.uint8), key_scale, value_scale, clipped]


WRITE_CASES = [
    (fmt, scales, torch.float32)
    for fmt in FORMATS.values()
    for scales in (["dynamic"] if fmt.per_token_only else ["per-tensor", "per-head", "dynamic"])
] + [(fmt, "dynamic", dtype) for fmt in FORMATS.values() for dtype in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("fmt,scales,dtype", WRITE_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_write_is_bit_identical_to_reference(fmt, scales, dtype):
    torch.manual_seed(0)
    batch, heads, new, head_dim, capacity, start = 2, 3, 5, 80, 16, 7
    # keys as the model hands them over: a transposed (non-contiguous) view
    key = (torch.randn(batch, new, heads, head_dim, device=DEVICE) * 60).transpose(1, 2)
    value = torch.randn(batch, heads, new, head_dim, device=DEVICE) * fmt.max
    key, value = with_edges(key).to(dtype), with_edges(value).to(dtype)
    expected = run_write("torch", key, value, fmt, scales, capacity, start)
    got = run_write("triton", key, value, fmt, scales, capacity, start)
    names = ["key codes", "value codes", "key scale", "value scale", "clipped"]
    for name, g, e in zip(names, got, expected):
        assert torch.equal(g, e), f"{name} differ at {(g != e).nonzero()[:4].tolist()}"  # scales too: exact
    assert (got[-1] > torch.tensor([3, 5], device=DEVICE)).any()  # the edges did clip


def test_decode_step_writes_one_token():
    fmt = FORMATS["fp8_e4m3"]
    key = torch.randn(1, 2, 1, 64, device=DEVICE) * 100
    expected = run_write("torch", key, -key, fmt, "dynamic", 8, 5)
    got = run_write("triton", key, -key, fmt, "dynamic", 8, 5)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake-tensor tracing needs compiled kernels (GPU)")
def test_registered_op_traces_for_torch_compile():
    fmt = FORMATS["fp8_e4m3"]
    key = torch.randn(1, 2, 3, 64, device=DEVICE)
    codes = [torch.zeros(1, 2, 8, 64, dtype=fmt.dtype, device=DEVICE) for _ in range(2)]
    scales = [torch.zeros(1, 2, 8, device=DEVICE) for _ in range(2)]
    clipped = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    args = (key, -key, *codes, *scales, 2, fmt.name, True, clipped)
    torch.library.opcheck(ops.triton_ops().write.default, args, test_utils=TRACE_CHECKS)


def test_bad_buffers_are_named():
    fmt = FORMATS["fp8_e4m3"]
    key = torch.randn(1, 2, 4, 64, device=DEVICE)
    codes = torch.zeros(1, 2, 8, 64, dtype=fmt.dtype, device=DEVICE)
    scale = torch.ones(1, 2, 1, device=DEVICE)
    clipped = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="value_codes has dtype"):
        write_kv(key, key, codes, codes.view(torch.uint8), scale, scale, 0, fmt, False, clipped)
    with pytest.raises(ValueError, match="overflow the buffers' capacity 8"):
        write_kv(key, key, codes, codes.clone(), scale, scale, 6, fmt, False, clipped)
    with pytest.raises(ValueError, match="key_scale must be fp32"):
        write_kv(key, key, codes, codes.clone(), scale.double(), scale, 0, fmt, False, clipped)
