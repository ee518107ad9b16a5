"""The value codes' tiled layout (`KVView.value_tiled`): where the Triton write kernel puts each byte, and the torch
helpers that read, write and move tiled codes."""

import pytest
import torch

from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.triton_write import write_kv
from hf_fp8kv.kernels.view import VALUE_TILE, copy_slots, slot_codes, store_token_major, token_major
from streams import Stream, fill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_codes(slots: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (2, 2, 3, slots, 8), dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("ring", [False, True], ids=["linear", "ring of 70"])
def test_write_kernel_lays_values_out_head_dim_major_per_block(ring):
    """Slot s, channel d of a (batch, head) plane at `first * head_dim + d * width + s - first` (`first` the first
    slot of s's block of VALUE_TILE, `width` its slots): computed here from the token-major buffers the same
    stream gets, byte for byte; keys stay token-major."""
    stream = Stream(updates=[69, 1, 1, 9], head_dim=24, static=70 if ring else 0, ring=ring)
    tiled_stream = Stream(**{**vars(stream), "tiled": True})
    plain, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)
    tiled, _, _ = fill(tiled_stream, write_kv, torch.Generator().manual_seed(0), DEVICE)
    held = min(stream.length, 70) if ring else stream.length
    expected = plain.codes.view(torch.uint8)[:, :, :, :held].cpu()
    codes = tiled.codes.view(torch.uint8).cpu()
    assert torch.equal(codes[0, :, :, :held], expected[0])
    slots, head_dim = codes.shape[3], codes.shape[4]
    planes = codes[1].flatten(2)  # [batch, kv_heads, slots * head_dim]
    for s in range(held):
        first = s - s % VALUE_TILE
        width = min(VALUE_TILE, slots - first)
        at = first * head_dim + torch.arange(head_dim) * width + s - first
        assert torch.equal(planes[:, :, at], expected[1, :, :, s]), f"slot {s}"


@pytest.mark.parametrize("slots", [5, 64, 100, 130])
def test_token_major_round_trip_and_slot_views(slots):
    generator = torch.Generator().manual_seed(slots)
    tokens = random_codes(slots, generator)
    tiled = torch.empty_like(tokens)
    store_token_major(tiled, tokens, True)
    assert torch.equal(token_major(tiled, True).view(torch.uint8), tokens.view(torch.uint8))
    for slot in range(slots):
        for stored, expected in zip(slot_codes(tiled, slot, True), tokens[:, :, :, slot]):
            assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    key, value = slot_codes(tiled, slots - 1, True)  # writable: the slot's bytes and no other
    value.view(torch.uint8).fill_(0x7F)
    tokens.view(torch.uint8)[1, :, :, slots - 1] = 0x7F
    assert torch.equal(token_major(tiled, True).view(torch.uint8), tokens.view(torch.uint8))
    assert token_major(tokens, False) is tokens


@pytest.mark.parametrize("first, count", [(0, 128), (0, 70), (64, 60), (3, 100), (10, 0)])
def test_copy_slots_moves_tokens_whatever_the_alignment(first, count):
    """As whole blocks when the range starts on one (a buffer's growth), else through token-major copies (a
    sliding layer's compaction)."""
    generator = torch.Generator().manual_seed(count)
    tokens = random_codes(192, generator)
    for tiled in (False, True):
        src = torch.empty_like(tokens)
        store_token_major(src, tokens, tiled)
        dst = random_codes(128, generator)
        copy_slots(dst, src, first, count, tiled)
        got = token_major(dst, tiled).view(torch.uint8)[:, :, :, :count]
        assert torch.equal(got, tokens.view(torch.uint8)[:, :, :, first : first + count]), f"tiled={tiled}"


def test_tiled_values_outside_contiguous_planes_are_refused_by_name():
    """Tiled values are addressed within a contiguous (batch, head) plane: a view of codes narrowed along the
    head_dim is refused by the kernels' plans and the torch helpers, naming the strides."""
    from hf_fp8kv.kernels.formats import get_format
    from hf_fp8kv.kernels.triton_attention import attention
    from hf_fp8kv.kernels.view import KVView

    codes = random_codes(64, torch.Generator().manual_seed(0))
    codes = torch.cat([codes, codes], dim=-1)[..., :8]  # head_dim 8 of a 16-wide buffer
    view = KVView(codes=codes, scales=torch.ones(2, 1, 3, 1), fmt=get_format("fp8_e4m3"), end=32, recent_start=32,
                  value_tiled=True)  # fmt: skip
    key = torch.randn(2, 3, 1, 8)
    with pytest.raises(ValueError, match=r"tiled value codes need contiguous \(batch, head\) planes"):
        attention(torch.randn(2, 3, 1, 8), view, scaling=1.0)
    with pytest.raises(ValueError, match="contiguous"):
        write_kv(key, key, view, torch.zeros(2, 2, dtype=torch.int64))  # (32 tokens held: room for one more)
    with pytest.raises(ValueError, match="contiguous"):
        slot_codes(codes, 0, True)
    with pytest.raises(ValueError, match="contiguous"):
        token_major(codes, True)


def test_the_torch_path_refuses_tiled_values_by_name():
    """The torch path reads token-major values: a tiled view (the Triton backend's buffers) is refused, not
    misread; `materialize` (the slow path) reads it through a token-major copy."""
    from hf_fp8kv.kernels import cpu
    from hf_fp8kv.kernels.formats import get_format
    from hf_fp8kv.kernels.view import KVView

    tokens = random_codes(70, torch.Generator().manual_seed(1)).view(torch.uint8) & 0x77  # finite e4m3 codes
    tokens = tokens.view(torch.float8_e4m3fn)
    tiled = torch.empty_like(tokens)
    store_token_major(tiled, tokens, True)
    fmt, scales = get_format("fp8_e4m3"), torch.ones(2, 1, 3, 1)
    view = KVView(codes=tiled, scales=scales, fmt=fmt, end=70, recent_start=70, value_tiled=True)
    with pytest.raises(ValueError, match="the torch path reads token-major value codes"):
        cpu.attend(torch.randn(2, 3, 1, 8), view, scaling=1.0)
    plain = KVView(codes=tokens, scales=scales, fmt=fmt, end=70, recent_start=70)
    for got, expected in zip(cpu.materialize(view), cpu.materialize(plain)):
        assert torch.equal(got, expected)
