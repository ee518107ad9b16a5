"""The CPU path (`kernels/cpu.py`) against the oracle: its few-op decode exact for every code, its write
bit-identical to the oracle's, the tokens it serves and its attention, over host and device positions."""

import math

import pytest
import torch

from hf_fp8kv.kernels import cpu, reference
from hf_fp8kv.kernels.cpu import dequantize_stacked, write_stacked
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.reference import decode, dynamic_scale, quantize
from streams import Stream, expected_kv, fill
from test_reference import STREAMS


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_decode_is_exact_for_every_code_nan_included(fmt, scale_dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype) if fmt.is_float else torch.arange(-128, 128).to(torch.int8)
    scale = torch.full((256,), 0.7578125, dtype=scale_dtype)  # a bf16 value whose products need fp32
    got = dequantize_stacked(codes, scale, fmt, has_nan=True)
    expected = decode(codes, fmt) * scale.float()
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite])


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_nan_is_written_as_nan_and_read_back_as_nan(fmt):
    x = torch.tensor([math.nan, 1.0])
    codes, clipped, nonfinite = quantize(x, torch.tensor(1.0), fmt)
    assert clipped.item() == 0 and nonfinite.item() == 1
    values = dequantize_stacked(codes, torch.tensor(1.0), fmt, has_nan=True)
    if fmt.is_float:
        assert values[0].isnan() and values[1] == 1.0
    else:  # int8 has no NaN code: 0
        assert values.tolist() == [0.0, 1.0]


WRITE_VALUES = [0.0, 1e-30, 1.0, 447.0, 449.0, 465.0, 1e30, -1e30, math.inf, -math.inf, math.nan, 57344.0, 61441.0]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_stacked_is_the_oracle_bit_for_bit(fmt, per_token, special, scale_dtype):
    if fmt.per_token_only and not per_token:
        pytest.skip("per-token format")
    torch.manual_seed(1)
    states = torch.randn(2, 2, 3, 4, 16) * fmt.max / 8
    if special:
        states[0, 0, 0, 0, : len(WRITE_VALUES)] = torch.tensor(WRITE_VALUES)
        states[1, 1, 2, 3, :3] = torch.tensor([math.nan, -math.inf, 2.0])
    codes = torch.zeros(states.shape, dtype=torch.uint8).view(fmt.dtype)
    stats = torch.zeros(2, 2, dtype=torch.int64)
    if per_token:
        scale = torch.zeros(*states.shape[:-1], 1, dtype=scale_dtype)
        expected_scale = dynamic_scale(states, fmt, scale_dtype)[..., None]
    else:
        scale = expected_scale = torch.tensor([0.5, 2.0]).reshape(2, 1, 1, 1, 1)
    nonfinite = write_stacked(states, codes, scale, fmt, per_token, stats)
    expected, clipped, bad = quantize(states, expected_scale, fmt, count_per_row=True)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale.float(), expected_scale)
    assert stats[:, 0].tolist() == clipped.tolist() and stats[:, 1].tolist() == bad.tolist()
    assert nonfinite == special


@pytest.mark.parametrize("stream", STREAMS, ids=str)
def test_write_serve_and_attend_as_the_oracle(stream):
    """Over every position kind, recent buffer and sink layout: the buffers the CPU path writes are the oracle's
    bit for bit, the tokens it serves are each token quantized once, and its attention is the oracle's."""
    views = {}
    for name, write in (("oracle", reference.write), ("cpu", cpu.write)):
        views[name], kv, stats = fill(stream, write, torch.Generator().manual_seed(0))
        views[name + " stats"] = stats
    oracle, ours = views["oracle"], views["cpu"]
    written = slice(0, oracle.slots)  # not the spare slot
    assert torch.equal(ours.codes.view(torch.uint8)[:, :, :, written], oracle.codes.view(torch.uint8)[:, :, :, written])
    if oracle.per_token:
        assert torch.equal(ours.scales[..., written], oracle.scales[..., written])
    if oracle.recent is not None:
        assert torch.equal(ours.recent, oracle.recent)
    assert torch.equal(views["cpu stats"], views["oracle stats"])

    keys, values = cpu.materialize(ours)
    expected = expected_kv(stream, kv, ours)
    if ours.static:
        positions, held = cpu.slot_positions(ours)
        assert held.sum() == min(stream.length, ours.columns)
        expected = expected[:, :, :, positions[held]]
        keys, values = keys[:, :, held], values[:, :, held]
    else:
        expected = expected[:, :, :, reference.visible_positions(ours)]
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])

    generator = torch.Generator().manual_seed(2)
    query = torch.randn(stream.batch, 3 * stream.kv_heads, 4, stream.head_dim, generator=generator).to(stream.dtype)
    padding = torch.ones(stream.batch, 1, 1, stream.length, dtype=torch.bool)
    padding[1, ..., :3] = False
    mask = padding & reference.causal_mask(4, stream.length)
    if ours.static:  # the mask of a static cache covers [0, max_cache_len) (a ring's is longer than the ring)
        columns = stream.length + 4 if ours.ring else ours.columns
        mask = torch.cat([mask, torch.zeros(*mask.shape[:3], columns - stream.length, dtype=torch.bool)], -1)
    # rotated codes: the torch path attends in the rotated space (the query and the output rotated, not the codes),
    # the same attention up to the fp32 rounding of the rotations, which these outlier keys' peaked scores amplify,
    # and an ulp of the output's dtype where that rounding crosses one
    rotated = dict(rtol=max(1e-4, torch.finfo(stream.dtype).eps), atol=5e-4)
    tolerance = rotated if stream.rotate else dict(rtol=1e-6, atol=1e-6)
    for kwargs in (dict(mask=mask), {}):
        got = cpu.attend(query, ours, scaling=0.3, **kwargs)
        want = reference.attend(query, oracle, scaling=0.3, **kwargs)
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.parametrize("recent", [0, 5])
def test_rotated_codes_with_per_channel_key_scales_attend_as_the_oracle(recent):
    """Per-channel key scales apply to the keys rotated back: the torch path does not attend those in the rotated
    space."""
    generator = torch.Generator().manual_seed(3)
    view, _, _ = fill(Stream(rotate=True, recent=recent, scales="per-head"), cpu.write, generator)
    view.key_channel_scale = torch.rand(view.codes.shape[2], view.codes.shape[4], generator=generator) + 0.5
    query = torch.randn(2, 6, 3, 80, generator=generator)
    torch.testing.assert_close(cpu.attend(query, view, scaling=0.3), reference.attend(query, view, scaling=0.3),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_materialize_is_fp32_whatever_the_default_dtype():
    """The K/V built for the attention are fp32 even when a user made bf16 torch's default dtype."""
    view, _, _ = fill(Stream(recent=6, sinks=3, updates=[60, 1]), cpu.write, torch.Generator().manual_seed(0))
    want = cpu.materialize(view)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = cpu.materialize(view)
    finally:
        torch.set_default_dtype(previous)
    assert all(torch.equal(g, w) and g.dtype == torch.float32 for g, w in zip(got, want))
