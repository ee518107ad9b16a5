"""The torch reference against plain torch: exact decoding, saturating quantization, attention math."""

import math

import pytest
import torch

from hf_fp8kv.kernels.formats import FORMATS, get_format
from hf_fp8kv.kernels.reference import attention, codes_to_float, dynamic_scale, quantize

FLOAT_FORMATS = [f for f in FORMATS.values() if f.is_float]


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=lambda f: f.name)
def test_codes_to_float_is_exact_for_every_code(fmt):
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype)
    expected = codes.float()
    finite = torch.isfinite(expected)
    assert torch.equal(codes_to_float(codes, fmt)[finite], expected[finite])


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_quantize_saturates_and_counts_only_beyond_rounding(fmt):
    x = torch.tensor([0.0, -0.0, 1.0, fmt.max, fmt.clip_bound, fmt.clip_bound * 1.01, 1e30, -1e30, math.inf, -math.inf])
    codes, clipped = quantize(x, torch.tensor(1.0), fmt)
    values = codes.float()
    assert torch.isfinite(values).all()
    assert values[3] == fmt.max and values[5] == fmt.max and values[-1] == -fmt.max
    assert clipped.item() == 5  # 1.01 * bound, +-1e30, +-inf; max and the bound itself are rounding


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=lambda f: f.name)
def test_quantize_matches_torch_cast_with_scale(fmt):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 16) * 30
    scale = torch.rand(1, 3, 1, 1) + 0.1
    codes, _ = quantize(x, scale, fmt)
    assert torch.equal(codes.view(torch.uint8), (x / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8))


def test_nan_policy():
    x = torch.tensor([math.nan, 1.0])
    codes, clipped = quantize(x, torch.tensor(1.0), get_format("fp8"))
    assert codes.float()[0].isnan() and clipped.item() == 0
    codes, _ = quantize(x, torch.tensor(1.0), get_format("int8_per_token_head"))
    assert codes.tolist() == [0, 1]


def test_int8_rounds_half_to_even():
    codes, _ = quantize(torch.tensor([0.5, 1.5, 2.5, -0.5, 126.5]), torch.tensor(1.0), get_format("int8_per_token_head"))
    assert codes.tolist() == [0, 2, 2, 0, 126]


def test_dynamic_scale_ignores_non_finite_and_zero_rows():
    fmt = get_format("fp8")
    x = torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0], [math.inf, 44.8, -1.0]])
    assert dynamic_scale(x, fmt).tolist() == pytest.approx([2.0, 1.0, 0.1])


def naive_attention(q, k, v, mask, scaling, softcap=None, sinks=None):
    """Textbook attention over full-precision K/V: repeat KV heads, softmax with optional sink column."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)[..., : k.shape[2]]
    return probs @ v


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("q_len", [1, 5])
def test_attention_equals_naive_over_dequantized_cache(q_heads, kv_heads, dynamic, q_len):
    torch.manual_seed(q_heads + q_len)
    fmt = get_format("fp8")
    batch, kv_len, dim = 2, 11, 16
    q = torch.randn(batch, q_heads, q_len, dim)
    k, v = torch.randn(2, batch, kv_heads, kv_len, dim) * 3
    if dynamic:
        k_scale, v_scale = dynamic_scale(k, fmt), dynamic_scale(v, fmt)
    else:
        k_scale, v_scale = torch.rand(2, 1, kv_heads, 1) + 0.01
    k_codes, _ = quantize(k, k_scale[..., None], fmt)
    v_codes, _ = quantize(v, v_scale[..., None], fmt)
    k_deq, v_deq = k_codes.float() * k_scale[..., None], v_codes.float() * v_scale[..., None]
    padding = torch.ones(batch, kv_len, dtype=torch.bool)
    padding[1, :3] = False  # left padding on the second row
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask = padding[:, None, None, :] & causal
    out = attention(q, k_codes, v_codes, k_scale, v_scale, fmt, scaling=0.3, mask=mask)
    torch.testing.assert_close(out, naive_attention(q, k_deq, v_deq, mask, 0.3), rtol=1e-5, atol=1e-5)
    # without a mask: bottom-right causal
    out = attention(q, k_codes, v_codes, k_scale, v_scale, fmt, scaling=0.3)
    torch.testing.assert_close(out, naive_attention(q, k_deq, v_deq, causal.expand(batch, 1, -1, -1), 0.3))


def test_attention_window_softcap_sinks_and_channel_scale():
    torch.manual_seed(1)
    fmt = get_format("fp8_e5m2")
    q = torch.randn(1, 4, 3, 8)
    k, v = torch.randn(2, 1, 2, 9, 8)
    scale = torch.ones(1, 2, 1)
    channel = torch.rand(2, 8) + 0.5
    k_codes, _ = quantize(k / channel[None, :, None, :], scale[..., None], fmt)
    v_codes, _ = quantize(v, scale[..., None], fmt)
    sinks = torch.randn(4)
    out = attention(
        q, k_codes, v_codes, scale, scale, fmt, scaling=0.5, window=4, softcap=2.0, sinks=sinks, key_channel_scale=channel
    )
    window_mask = torch.ones(3, 9, dtype=torch.bool).tril(6) & torch.ones(3, 9, dtype=torch.bool).triu(3)
    k_deq = k_codes.float() * channel[None, :, None, :]
    expected = naive_attention(q, k_deq, v_codes.float(), window_mask.expand(1, 1, -1, -1), 0.5, 2.0, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_fully_masked_row_outputs_zero():
    fmt = get_format("fp8")
    q = torch.randn(1, 2, 1, 8)
    codes = torch.randn(1, 2, 4, 8).to(fmt.dtype)
    mask = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    out = attention(q, codes, codes, torch.ones(1, 2, 1), torch.ones(1, 2, 1), fmt, scaling=1.0, mask=mask)
    assert torch.equal(out, torch.zeros_like(out))
