"""The oracle against plain torch and textbook formulas: saturating quantization, scales, each token served from
the buffer that holds it (quantized once), and attention math."""

import math

import pytest
import torch

from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.formats import FORMATS, get_format
from hf_fp8kv.kernels.formats import TINY_SCALE
from hf_fp8kv.kernels.reference import attention, dynamic_scale, quantize
from streams import Stream, expected_kv, fill

FLOAT_FORMATS = [f for f in FORMATS.values() if f.is_float]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_quantize_saturates_and_counts_only_beyond_rounding(fmt):
    x = torch.tensor([0.0, -0.0, 1.0, fmt.max, fmt.clip_bound, fmt.clip_bound * 1.01, 1e30, -1e30, math.inf, -math.inf])
    codes, clipped, nonfinite = quantize(x, torch.tensor(1.0), fmt)
    values = codes.float()
    assert torch.isfinite(values).all()
    assert values[3] == fmt.max and values[5] == fmt.max and values[-1] == -fmt.max
    assert clipped.item() == 5  # 1.01 * bound, +-1e30, +-inf; max and the bound itself are rounding
    assert nonfinite.item() == 2


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=lambda f: f.name)
def test_quantize_matches_torch_cast_with_scale(fmt):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 16) * 30
    scale = torch.rand(1, 3, 1, 1) + 0.1
    codes, _, _ = quantize(x, scale, fmt)
    assert torch.equal(codes.view(torch.uint8), (x / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8))


def test_int8_rounds_half_to_even():
    codes, _, _ = quantize(torch.tensor([0.5, 1.5, 2.5, -0.5, 126.5]), torch.tensor(1.0), get_format("int8_per_token_head"))
    assert codes.tolist() == [0, 2, 2, 0, 126]


def test_dynamic_scale_ignores_non_finite_and_zero_rows():
    fmt = get_format("fp8")
    x = torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0], [math.inf, 44.8, -1.0]])
    assert dynamic_scale(x, fmt).tolist() == pytest.approx([2.0, TINY_SCALE, 0.1])


def test_bf16_dynamic_scales_are_the_next_bf16_up():
    """A 2-byte scale is the smallest bf16 at or above the fp32 one, so no value divided by it leaves the range."""
    fmt = FORMATS["fp8_e4m3"]
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 4096)[:, None]
    exact, held = dynamic_scale(x, fmt), dynamic_scale(x, fmt, torch.bfloat16)
    below = torch.nextafter(held.bfloat16(), torch.zeros((), dtype=torch.bfloat16)).float()
    assert torch.equal(held.bfloat16().float(), held) and (held >= exact).all() and (below < exact).all()
    assert (held > exact).float().mean() > 0.9  # most fp32 scales are not bf16 values: they did round up
    assert (x.abs() / held[:, None]).max() <= fmt.row_max


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_searched_scale_has_the_least_weighted_error_of_its_octave(fmt, scale_dtype):
    """Each row's searched scale is a `scale_dtype` value in [s0, 2 s0) (s0: `dynamic_scale`) whose codes' weighted
    squared error, computed here in float64, is the least of the candidates' (within 1%: the integer error
    truncates each term, and fp32 scales' significands count by their top 8 bits; 0.2% seen here); with 1
    candidate it is s0; with every weight 0 (every error 0) it is s0."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, 64, generator=generator) * torch.logspace(-20, 20, 300)[:, None]
    x[:3, 5] = torch.tensor([math.nan, math.inf, -math.inf])  # non-finite elements count no error
    weight = torch.randint(0, 256, (64,), generator=generator)
    base = dynamic_scale(x, fmt, scale_dtype)
    assert torch.equal(reference.searched_scale(x, fmt, scale_dtype, 1, weight), base)
    assert torch.equal(reference.searched_scale(x, fmt, scale_dtype, 16, torch.zeros_like(weight)), base)
    chosen = reference.searched_scale(x, fmt, scale_dtype, 16, weight)
    assert torch.equal(chosen.to(scale_dtype).float(), chosen)
    assert (chosen >= base).all() and (chosen < 2 * base).all() and (chosen > base).any()

    def error(scale: torch.Tensor) -> torch.Tensor:
        finite = x.nan_to_num(0.0, 0.0, 0.0)
        read = reference.dequantize(quantize(finite, scale[:, None], fmt)[0], scale[:, None], fmt)
        return ((finite.double() - read.double()) ** 2 * weight).sum(-1)

    candidates = [(base.view(torch.int32) + i * 2**19).view(torch.float32) for i in range(16)]
    least = torch.stack([error(c) for c in candidates]).amin(0)
    assert (error(chosen) <= least * 1.01).all()


def test_search_weights_are_the_keys_energy_over_their_heads_largest():
    energy = torch.tensor([[4.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])  # the second head: no query yet
    weight = reference.search_weights(energy)
    assert weight.shape == (2, 1, 2, 1, 4) and weight.dtype == torch.int32
    assert weight[0, 0, :, 0].tolist() == [[255, 64, 0, 128], [1, 1, 1, 1]]  # 63.75 -> 64, 127.5 -> 128 (to even)
    assert (weight[1] == 1).all()


def test_search_candidates_are_a_power_of_two():
    with pytest.raises(ValueError, match="candidates=3"):
        reference.searched_scale(torch.ones(2, 4), get_format("fp8"), torch.bfloat16, 3)


def test_e4m3fnuz_dynamic_scales_map_amax_to_224_as_vllm():
    fmt = get_format("fp8_e4m3fnuz")
    assert dynamic_scale(torch.tensor([[448.0, 1.0]]), fmt).item() == 2.0
    assert fmt.max == 240.0  # static scales keep saturating at 240


STREAMS = [
    Stream(),
    Stream(scales="per-head", updates=[30, 1, 1]),
    Stream(recent=8, updates=[20, 1, 1, 3, 1, 1]),  # decode steps and a chunk shorter than the window
    Stream(recent=4, updates=[3, 1, 9, 1]),  # prefill shorter than the window, then a chunk longer
    Stream(recent=4, updates=[3, 1, 9, 1], scale_dtype=torch.float32),  # the pages' fp32 per-token scales
    Stream(recent=6, sinks=3, sink_rows=[0, 5], scales="per-tensor", fmt="fp8_e5m2"),
    Stream(recent=5, fmt="int8_per_token_head", dtype=torch.bfloat16),
    # rows sharing their sinks: the sinks, the codes and the window are joined, not laid over a decode of all
    Stream(recent=6, sinks=3, updates=[60, 1, 1, 5, 1], dtype=torch.bfloat16),  # (decoded into the result: large)
    Stream(recent=6, sinks=4, updates=[2, 1, 3, 1, 1]),  # the sinks overlap the window, then the codes start
    Stream(sinks=2, scales="per-head", updates=[1, 1, 9, 1]),  # sinks without a window
    Stream(static=64, recent=4, sinks=2, sink_rows=[2, 0], updates=[20, 1, 1, 6, 1]),
    Stream(static=16, ring=True, recent=3, updates=[10, 1, 1, 1, 1, 1, 1, 1, 1, 1]),  # wraps twice
    # rotated codes (blocks of 16 channels at head_dim 80; one block of 64)
    Stream(rotate=True),
    Stream(rotate=True, head_dim=64, recent=6, sinks=3, sink_rows=[0, 5], scales="per-tensor", fmt="fp8_e5m2"),
    Stream(rotate=True, recent=5, fmt="int8_per_token_head", dtype=torch.bfloat16),
    Stream(rotate=True, static=64, recent=4, sinks=2, sink_rows=[2, 0], updates=[20, 1, 1, 6, 1]),
    Stream(rotate=True, static=16, ring=True, recent=3, updates=[10, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
    # outlier tokens: coded tokens a head keeps exact too (row 1's head 0 has empty slots)
    Stream(recent=6, sinks=3, outliers=4, updates=[40, 1, 1, 5, 1]),
    Stream(outliers=3, scale_dtype=torch.float32),  # no window, no sinks
    Stream(recent=6, sinks=3, sink_rows=[0, 5], outliers=4, dtype=torch.bfloat16),  # the rows' sinks differ
    Stream(static=64, recent=4, sinks=2, sink_rows=[2, 0], outliers=3, updates=[20, 1, 1, 6, 1]),
    Stream(rotate=True, recent=5, sinks=2, outliers=4, updates=[40, 1, 1]),
    Stream(rotate=True, static=64, recent=4, outliers=3, updates=[30, 1]),
    # per-token scales searched within an octave (the keys' channels weighted)
    Stream(scale_search=16),
    Stream(scale_search=8, recent=8, sinks=3, updates=[20, 1, 1, 3, 1, 1], dtype=torch.bfloat16),
    Stream(scale_search=16, recent=4, updates=[3, 1, 9, 1], scale_dtype=torch.float32, fmt="fp8_e5m2"),
    Stream(scale_search=4, recent=5, fmt="int8_per_token_head", dtype=torch.float16),
    Stream(scale_search=16, fmt="fp8_e4m3fnuz", rotate=True, outliers=3),
    Stream(scale_search=16, static=64, recent=4, sinks=2, sink_rows=[2, 0], updates=[20, 1, 1, 6, 1]),
    Stream(scale_search=2, static=16, ring=True, recent=3, updates=[10, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
]


@pytest.mark.parametrize("stream", STREAMS, ids=str)
def test_buffers_serve_each_token_quantized_once(stream):
    view, kv, _ = fill(stream, reference.write, torch.Generator().manual_seed(0))
    keys, values = reference.materialize(view)
    expected = expected_kv(stream, kv, view)[:, :, :, reference.visible_positions(view)]
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


def naive_attention(q, k, v, mask, scaling, softcap=None, sink_logits=None):
    """Textbook attention over full-precision K/V: repeat KV heads, softmax with optional sink column."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, -math.inf)
    if sink_logits is not None:
        scores = torch.cat([scores, sink_logits[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)[..., : k.shape[2]]
    return probs @ v


@pytest.mark.parametrize("stream", [s for s in STREAMS if not s.ring], ids=str)
@pytest.mark.parametrize("q_len", [1, 4])
def test_attend_is_naive_attention_over_the_served_tokens(stream, q_len):
    generator = torch.Generator().manual_seed(2)
    view, kv, _ = fill(stream, reference.write, generator)
    expected_k, expected_v = expected_kv(stream, kv, view)
    query = torch.randn(stream.batch, 3 * stream.kv_heads, q_len, stream.head_dim, generator=generator)
    length = stream.length
    causal = reference.causal_mask(q_len, length)
    padding = torch.ones(stream.batch, 1, 1, length, dtype=torch.bool)
    padding[1, ..., :3] = False
    mask = padding & causal
    if view.static:  # the mask of a static cache covers every column
        mask = torch.cat([mask, torch.zeros(*mask.shape[:3], view.columns - length, dtype=torch.bool)], -1)
    got = reference.attend(query.to(stream.dtype), view, scaling=0.3, mask=mask)
    want = naive_attention(query.to(stream.dtype).float(), expected_k, expected_v, padding & causal, 0.3)
    tolerance = 1e-5 if stream.dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
    got = reference.attend(query, view, scaling=0.3)  # no mask: bottom-right causal
    want = naive_attention(query, expected_k, expected_v, causal.expand(stream.batch, 1, -1, -1), 0.3)
    if stream.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_window_softcap_and_sink_logits():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 3, 8)
    k, v = torch.randn(2, 1, 2, 9, 8)
    sink_logits = torch.randn(4)
    out = attention(q, k, v, scaling=0.5, window=4, softcap=2.0, sink_logits=sink_logits)
    window_mask = torch.ones(3, 9, dtype=torch.bool).tril(6) & torch.ones(3, 9, dtype=torch.bool).triu(3)
    expected = naive_attention(q, k, v, window_mask.expand(1, 1, -1, -1), 0.5, 2.0, sink_logits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_fully_masked_row_outputs_zero():
    q = torch.randn(1, 2, 1, 8)
    k = torch.randn(1, 2, 4, 8)
    mask = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    for softcap in (None, 5.0):
        out = attention(q, k, k, scaling=1.0, mask=mask, softcap=softcap)
        assert torch.equal(out, torch.zeros_like(out))


def test_explicit_softmax_path_stays_linear_in_memory():
    """The blocked path (softcap) holds one block of queries' scores: a 2k-token prefill allocates far less than
    its full score matrix."""
    q = torch.randn(1, 2, 2048, 16)
    k = torch.randn(1, 1, 2048, 16)
    full_scores = 2 * 2048 * 2048 * 4
    with torch.profiler.profile(profile_memory=True) as prof:
        attention(q, k, k, scaling=0.25, softcap=30.0)
    peak = max(e.cpu_memory_usage for e in prof.events())
    assert peak < full_scores / 4
