"""The Triton write kernel against the oracle: bit-identical codes, exact scales, the same recent tokens, clipped
and non-finite counts, for every format, scale kind, recent buffer and position kind."""

import dataclasses
import math
import os

import pytest
import torch
import triton
import triton.language as tl

from hf_fp8kv.kernels import cpu, reference
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.reference import quantize
from hf_fp8kv.kernels.triton_common import to_e4m3, token_scales
from hf_fp8kv.kernels.triton_write import encode, encoding, write_kv
from hf_fp8kv.kernels.view import KVView, token_major
from streams import Stream, empty_view, fill, tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EDGES = [31.6, 125.4, 447.0, 448.0, 449.0, 464.0, 465.0, 1e30, -math.inf, math.inf, 2.0**-10, 2.0**-9 * 1.5,
         -(2.0**-10), 1e-30, -0.0, 0.0, 0.5, 1.5, 2.5, -2.5, 126.5, 240.0, 248.0, 57344.0, 61440.0, 61441.0,
         math.nan]  # fmt: skip


@triton.jit
def _encode_test_kernel(
    x_ptr, out_ptr, n, BLOCK: tl.constexpr,
    IS_FLOAT: tl.constexpr, MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr,
    NORMAL_OFFSET: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr,
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
    expected, _, _ = quantize(x, torch.ones((), device=DEVICE), fmt)
    mismatch = got != expected.view(torch.uint8)
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ, e.g. x={x[mismatch][:4].tolist()}"


@triton.jit
def _token_scales_test_kernel(
    x_ptr, weight_ptr, out_ptr, D: tl.constexpr, BLOCK_T: tl.constexpr, BF16: tl.constexpr, SEARCH: tl.constexpr,
    CLIP: tl.constexpr, IS_FLOAT: tl.constexpr, MAX: tl.constexpr, ROW_MAX: tl.constexpr, ROUND_SHIFT: tl.constexpr,
    NORMAL_OFFSET: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + t[:, None] * D + d[None, :])
    weight = tl.load(weight_ptr + d)[None, :]
    scale = token_scales(x, weight, BF16, SEARCH, CLIP, IS_FLOAT, MAX, ROW_MAX, ROUND_SHIFT, MIN_NORMAL, SUB_MAGIC)
    tl.store(out_ptr + t, scale)


def hard_rows(fmt, rows: int = 256, dim: int = 64) -> torch.Tensor:
    """Rows a search can get wrong: random ones over 12 decades, rows of a candidate scale's exact codes (a
    candidate without error, ties), rows reaching into the codes' subnormals, a zero row, non-finite values."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, dim, generator=generator) * 10.0 ** torch.randint(-6, 6, (rows, 1), generator=generator)
    codes = torch.randint(0, 256, (rows // 4, dim), dtype=torch.uint8, generator=generator).view(fmt.dtype).float()
    codes = codes.nan_to_num(0.0, 0.0, 0.0).clamp(-fmt.row_max, fmt.row_max)
    x[: rows // 4] = codes * (1.0 + torch.randint(0, 16, (rows // 4, 1), generator=generator) / 16)
    x[rows // 4 : rows // 2] *= 2.0 ** -torch.randint(0, 24, (rows // 4, dim), generator=generator)  # subnormals
    x[-1] = 0.0
    x[-2, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    return x


@pytest.mark.parametrize("candidates", [2, 16, 128])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_token_scales_are_the_oracles_search_bit_for_bit(fmt, scale_dtype, candidates):
    """`triton_common.token_scales`, the write kernels' per-token scale, is `reference.searched_scale` to the bit
    on hard rows, under integer channel weights (zeros among them) and under none."""
    x = hard_rows(fmt)
    for weight in (torch.randint(0, 256, (x.shape[1],), generator=torch.Generator().manual_seed(6)),
                   torch.ones(x.shape[1], dtype=torch.int64)):  # fmt: skip
        weight = weight.to(torch.int32).masked_fill(torch.arange(x.shape[1]) % 5 == 0, 0)
        got = torch.empty(x.shape[0], device=DEVICE)
        _token_scales_test_kernel[(x.shape[0] // 64,)](
            x.to(DEVICE), weight.to(DEVICE), got, D=x.shape[1], BLOCK_T=64, BF16=scale_dtype == torch.bfloat16,
            SEARCH=candidates, CLIP=fmt.clip_bound, **encoding(fmt),
        )  # fmt: skip
        expected = reference.searched_scale(x, fmt, scale_dtype, candidates, weight)
        differ = got.cpu() != expected
        assert not differ.any(), f"{int(differ.sum())} rows differ, e.g. {differ.nonzero()[:4, 0].tolist()}"
        assert candidates < 16 or (expected != reference.dynamic_scale(x, fmt, scale_dtype)).any()  # (it searched)


def with_edges(kv: torch.Tensor) -> torch.Tensor:
    """Keys and values with the edge values (NaN, inf, beyond max, ties) written into the first token's row."""
    kv = kv.clone()
    kv[:, 0, 0, 0, : len(EDGES)] = torch.tensor(EDGES, dtype=kv.dtype)
    return kv


WRITE_STREAMS = [
    Stream(fmt=fmt.name, scales=scales, updates=[9, 1, 4], head_dim=80)
    for fmt in FORMATS.values()
    for scales in (["dynamic"] if fmt.per_token_only else ["per-tensor", "per-head", "dynamic"])
] + [
    Stream(dtype=torch.bfloat16, recent=4, updates=[6, 1, 1, 2, 9, 1]),  # fused decode steps and both chunk kinds
    Stream(scale_dtype=torch.float32, recent=4, updates=[6, 1, 9]),
    Stream(fmt="fp8_e5m2", dtype=torch.float16, scales="per-head", recent=3, updates=[2, 1, 1, 1, 5]),
    Stream(static=24, recent=4, updates=[7, 1, 1, 6, 1]),
    Stream(static=8, ring=True, recent=2, updates=[5, 1, 1, 1, 1, 1, 1, 1], fmt="fp8_e4m3fnuz"),
    # tiled values (the Triton backend's layers; the last block narrower in a ring of 70)
    Stream(updates=[70, 1, 9], head_dim=80, tiled=True),
    Stream(dtype=torch.bfloat16, recent=4, updates=[66, 1, 1, 2, 9, 1], tiled=True),
    Stream(static=70, ring=True, recent=2, updates=[69, 1, 1, 1], scales="per-head", tiled=True),
    # rotated codes: every kind of write (straight to the codes, leaving the recent buffer, static, ring)
    Stream(rotate=True, updates=[9, 1, 4], head_dim=80),
    Stream(rotate=True, fmt="fp8_e5m2", scales="per-head", head_dim=64, updates=[9, 1, 4]),
    Stream(rotate=True, dtype=torch.bfloat16, recent=4, updates=[66, 1, 1, 2, 9, 1], tiled=True),
    Stream(rotate=True, static=24, recent=4, updates=[7, 1, 1, 6, 1], head_dim=128),
    Stream(rotate=True, static=8, ring=True, recent=2, updates=[5, 1, 1, 1, 1, 1, 1, 1], fmt="fp8_e4m3fnuz"),
    # searched per-token scales (the keys weighted by `search_energy`): every format, both scale dtypes, every kind
    # of write, 2 to 128 candidates
    Stream(scale_search=16, updates=[9, 1, 4]),
    Stream(scale_search=128, head_dim=64, updates=[9, 1]),
    Stream(scale_search=16, fmt="fp8_e5m2", scale_dtype=torch.float32, recent=4, updates=[6, 1, 9]),
    Stream(scale_search=8, fmt="fp8_e4m3fnuz", rotate=True, dtype=torch.bfloat16, recent=4,
           updates=[66, 1, 1, 2, 9, 1], tiled=True),  # fmt: skip
    Stream(scale_search=4, fmt="int8_per_token_head", dtype=torch.float16, static=24, recent=4,
           updates=[7, 1, 1, 6, 1]),  # fmt: skip
    Stream(scale_search=2, static=8, ring=True, recent=2, updates=[5, 1, 1, 1, 1, 1, 1, 1]),
]


@pytest.mark.parametrize("stream", WRITE_STREAMS, ids=str)
def test_write_is_bit_identical_to_reference(stream):
    def buffers(write):
        generator = torch.Generator().manual_seed(0)
        view, kv, stats = fill(stream, write, generator, DEVICE, edges=with_edges)
        held = int(view.recent_start)  # slots past it are not written yet (still in the window)
        slots = slice(0, view.slots) if view.ring else slice(0, held)  # not the spare slot
        codes = token_major(view.codes, view.value_tiled).view(torch.uint8)[:, :, :, slots]
        if stream.rotate:  # the edges' inf - inf make NaN, whose sign IEEE leaves to the hardware: one NaN code
            nan = codes.view(FORMATS[stream.fmt].dtype).float().isnan()
            codes = codes.masked_fill(nan, encoding(FORMATS[stream.fmt])["NAN_CODE"])
        parts = {"codes": codes, "stats": stats}
        if view.recent is not None:
            parts["recent"] = view.recent
        if stream.scales == "dynamic":
            parts["scales"] = view.scales[:, :, :, slots]
        return parts

    expected, got = buffers(reference.write), buffers(write_kv)
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} differ at {(got[name] != expected[name]).nonzero()[:4].tolist()}"
    assert (expected["stats"][:, 1] > 0).all()  # the edges did count: NaN and inf in keys and values


@pytest.mark.parametrize("new_tokens", [1, 9], ids=["decode step", "chunk"])
@pytest.mark.parametrize("write", [reference.write, cpu.write, write_kv], ids=["reference", "cpu", "triton"])
def test_tokens_leaving_the_recent_buffer_before_the_first_slot_are_not_written(write, new_tokens):
    """A sliding layer holding more recent tokens than its window moves its first slot past them (offset 10,
    recent tokens from 4): the ones that leave before it have no slot and must not be written anywhere, the
    guards around the codes included; the rest land where the oracle puts them."""
    generator = torch.Generator().manual_seed(0)
    fmt = FORMATS["fp8_e4m3"]
    guarded = torch.full((2, 1, 2, 8 + 6 + 3, 16), 0x55, dtype=torch.uint8, device=DEVICE).view(fmt.dtype)
    scales = torch.full((2, 1, 2, 17), -1.0, device=DEVICE)
    recent = torch.randn(2, 1, 2, 8, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, new_tokens, 16, generator=generator)
    view = KVView(codes=guarded[:, :, :, 8:14], scales=scales[..., 8:14], fmt=fmt, per_token=True, end=12,
                  recent_start=4, offset=10, recent=recent.to(DEVICE, copy=True), start=10)  # fmt: skip
    write(key.to(DEVICE), value.to(DEVICE), view, torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))
    codes = guarded.view(torch.uint8).cpu()
    assert (codes[:, :, :, :8] == 0x55).all() and (codes[:, :, :, 14:] == 0x55).all(), "a guard was written"
    written = (codes[:, :, :, 8:14] != 0x55).any(-1).any(0).any(0).any(0).nonzero().flatten().tolist()
    # a decode step: token 4 leaves (before the first slot); a chunk of 9: tokens 10 and 11 leave (slots 0, 1)
    # and the new token 12 goes straight to the codes (slot 2), tokens 13-20 to the recent buffer
    assert written == ([] if new_tokens == 1 else [0, 1, 2])
    if new_tokens > 1:
        token = recent[:, :, :, 10 % 8]
        expected, _, _ = reference.quantize(token, reference.dynamic_scale(token, fmt)[..., None], fmt)
        assert torch.equal(view.codes[:, :, :, 0].view(torch.uint8).cpu(), expected.view(torch.uint8))


def test_bad_buffers_are_named():
    stream = Stream(scales="per-tensor", updates=[4])
    view, _, stats = fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)
    key = torch.randn(2, 2, 4, 80, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit the code buffers"):
        write_kv(key[:, :1], key[:, :1], view, stats)
    with pytest.raises(ValueError, match="overflow the code buffers' 7 slots"):
        view.end = 5
        write_kv(key, key, view, stats)
    view.end = 0
    with pytest.raises(ValueError, match="scales must be fp32"):
        view.per_token = True
        write_kv(key, key, view, stats)
    view.per_token = False
    with pytest.raises(ValueError, match="stats must be an int64"):
        write_kv(key, key, view, stats.int())
    with pytest.raises(ValueError, match="scale_search=16 searches per-token scales"):
        write_kv(key, key, dataclasses.replace(view, scale_search=16), stats)
    searched, _, _ = fill(Stream(updates=[4]), reference.write, torch.Generator().manual_seed(0), DEVICE)
    searched.scale_search = 16
    for energy in (None, torch.ones(2, 40, device=DEVICE), torch.ones(80, 2, device=DEVICE).t()):
        with pytest.raises(ValueError, match=r"scale_search=16 needs search_energy as contiguous fp32 \[2, 80\]"):
            write_kv(key[:, :, :1], key[:, :, :1], dataclasses.replace(searched, search_energy=energy), stats)


def _static_stream_view(scale_search: int = 0):
    stream = Stream(static=24, recent=4, updates=[7, 1], tiled=True, rotate=True,  # the Triton layers' layout
                    scale_search=scale_search)  # fmt: skip
    return stream, *fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)


@pytest.mark.parametrize("scale_search", [0, 16])
def test_registered_op_is_the_launcher_on_a_static_view(scale_search):
    """`torch.ops.hf_fp8kv.write`, what a compiled graph calls, writes what the launcher writes."""
    from hf_fp8kv.kernels import ops

    buffers = []
    for use_op in (False, True):
        stream, view, _, stats = _static_stream_view(scale_search)
        key = torch.randn(2, 2, 1, 80, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        if use_op:
            ops.triton_ops().write(key, -key, view.codes, view.scales, view.recent, stats, view.positions,
                                   view.fmt.name, True, False, True, view.search_energy, scale_search)  # fmt: skip
        else:
            write_kv(key, -key, view, stats, advance=True)
        buffers.append((view.codes.view(torch.uint8)[:, :, :, :8], view.scales[..., :8], view.recent, stats,
                        view.positions))  # fmt: skip
    for a, b in zip(*buffers):
        assert torch.equal(a, b)
    assert view.positions.tolist() == [9, 5, 0]  # moved past the new token by the op too


@pytest.mark.parametrize("stream", [
    Stream(static=24, recent=4, updates=[7, 1, 1, 6, 1]),
    Stream(static=8, ring=True, recent=2, updates=[5, 1, 1, 1, 1, 1, 1, 1], tiled=True),
    Stream(static=24, updates=[7, 1, 9]),
], ids=str)  # fmt: skip
def test_a_static_write_moves_the_positions_as_the_layers_do(stream):
    """`write_kv(advance=True)`, a static layer's write: the launch's last program moves the device positions past
    the new tokens as the layers' rule does (`streams.advance`), and leaves its ticket at 0 for the next write; the
    buffers are those of a write followed by that rule (a prompt longer than the recent buffer: two launches, the
    second moves them)."""
    expected, kv, _ = fill(stream, write_kv, torch.Generator().manual_seed(0), DEVICE)
    generator = torch.Generator().manual_seed(0)
    tokens(stream, generator)  # (the generator's state fill's view was made in)
    view = empty_view(stream, generator, DEVICE)
    stats = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    end = recent_start = first = 0
    for new in stream.updates:
        chunk = kv[:, :, :, first : first + new].to(DEVICE)
        write_kv(chunk[0], chunk[1], view, stats, advance=True)
        first, end = first + new, end + new
        recent_start = max(recent_start, end - stream.recent)
        assert view.positions.tolist() == [end, recent_start, 0]
    assert torch.equal(view.codes.view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(view.scales, expected.scales)
    assert view.recent is None or torch.equal(view.recent, expected.recent)
    with pytest.raises(ValueError, match=r"int64 \[3\] device positions"):
        write_kv(chunk[0], chunk[1], dataclasses.replace(view, positions=view.positions[:2]), stats, advance=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake-tensor tracing of Triton kernels needs a GPU")
def test_registered_op_traces_for_torch_compile():
    from hf_fp8kv.kernels import ops

    _, view, _, stats = _static_stream_view(16)
    key = torch.randn(2, 2, 1, 80, device=DEVICE)
    args = (key, -key, view.codes, view.scales, view.recent, stats, view.positions, view.fmt.name, True, False,
            True, view.search_energy, 16)
    torch.library.opcheck(ops.triton_ops().write.default, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))



@triton.jit
def _to_e4m3_test_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, HW_CONVERT: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, to_e4m3(x, HW_CONVERT).to(tl.uint8, bitcast=True), mask=offsets < n)


def test_the_fp8_dots_operands_are_the_reference_cast_on_hard_values():
    """`to_e4m3` (the FP8 prefill's query and probabilities): torch's e4m3fn cast, bit for bit, NaN and
    saturation included (by the hardware on CUDA, by `encode` with the format's numbers elsewhere)."""
    fmt = FORMATS["fp8_e4m3"]
    x = hard_values(fmt).to(DEVICE)
    x = x[~x.isnan()] if DEVICE == "cuda" else x  # (the hardware's NaN keeps no sign)
    got = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    block = 1 << 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1024
    _to_e4m3_test_kernel[(triton.cdiv(x.numel(), block),)](x, got, x.numel(), BLOCK=block, HW_CONVERT=DEVICE == "cuda")
    expected, _, _ = quantize(x, torch.ones((), device=DEVICE), fmt)
    mismatch = got != expected.view(torch.uint8)
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ, e.g. x={x[mismatch][:4].tolist()}"
