"""DynamicFP8SlidingLayer against transformers' DynamicSlidingWindowLayer, update by update."""

import pytest
import torch
from hf_fp8kv.kernels.formats import get_format
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_fp8kv.dynamic import DynamicFP8SlidingLayer
from hf_fp8kv.layer import QuantizedKV
from hf_fp8kv.scales import PerHeadScales, PerTokenScales

WINDOW, BLOCK, HEADS, DIM = 8, 4, 2, 16
# Prefill shorter than the window, decode across it, a chunk longer than the window, more decode.
SCHEDULE = [5, 1, 1, 1, 1, 3, 12, 1, 1, 2, 1, 1, 1, 1, 1, 1]


def fp8_layer(dynamic: bool, window: int = WINDOW, backend: str = "torch", rotate: bool = False) -> DynamicFP8SlidingLayer:
    ones = torch.ones(HEADS)
    scales = PerTokenScales() if dynamic else PerHeadScales(ones, ones, "per-tensor", "test")
    return DynamicFP8SlidingLayer(get_format("fp8"), scales, BLOCK, backend, lambda: True, 0, sliding_window=window,
                                  rotate=rotate)  # fmt: skip


def exact_states(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Small integers: exact in e4m3 with scale 1, so the FP8 layer must reproduce them bit for bit."""
    def one():
        return torch.randint(-8, 9, (2, HEADS, tokens, DIM), generator=generator).float()

    return one(), one()


def assert_same_state(ours: DynamicFP8SlidingLayer, theirs: DynamicSlidingWindowLayer, query_length: int = 1):
    assert ours.get_seq_length() == theirs.get_seq_length()
    assert ours.get_mask_sizes(query_length) == theirs.get_mask_sizes(query_length)
    keys, values = ours.dequantized()
    assert torch.equal(keys, theirs.keys) and torch.equal(values, theirs.values)


@pytest.mark.parametrize("dynamic", [False, True])
def test_updates_match_transformers_sliding_layer(dynamic):
    generator = torch.Generator().manual_seed(0)
    ours, theirs = fp8_layer(dynamic), DynamicSlidingWindowLayer(sliding_window=WINDOW)
    for tokens in SCHEDULE:
        kv_length, _ = theirs.get_mask_sizes(tokens)
        assert ours.get_mask_sizes(tokens) == theirs.get_mask_sizes(tokens)
        key, value = exact_states(tokens, generator)
        view, _ = ours.update(key, value)
        expected_keys, expected_values = theirs.update(key, value)
        assert isinstance(view, QuantizedKV)
        # the attention sees exactly the tokens transformers returns, i.e. the mask's columns
        assert view.shape[2] == expected_keys.shape[2] == kv_length
        got_keys, got_values = view.dequantized()
        torch.testing.assert_close(got_keys, expected_keys, rtol=2**-4 if dynamic else 0, atol=0)
        torch.testing.assert_close(got_values, expected_values, rtol=2**-4 if dynamic else 0, atol=0)
        if not dynamic:
            assert_same_state(ours, theirs)
    assert ours.get_max_length() == theirs.get_max_length() == WINDOW


def test_attention_over_the_view_equals_attention_over_transformers_states():
    generator = torch.Generator().manual_seed(1)
    ours, theirs = fp8_layer(False), DynamicSlidingWindowLayer(sliding_window=WINDOW)
    for tokens in SCHEDULE[:8]:
        kv_len, _ = theirs.get_mask_sizes(tokens)
        key, value = exact_states(tokens, generator)
        view, _ = ours.update(key, value)
        keys, values = theirs.update(key, value)
        query = torch.randn(2, 2 * HEADS, tokens, DIM, generator=generator)
        q_pos = torch.arange(kv_len - tokens, kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - WINDOW)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True
        )
        torch.testing.assert_close(view.attend(query, scaling=0.25, mask=mask), expected, rtol=1e-5, atol=1e-5)


def test_bytes_stay_bounded_and_compaction_is_amortized():
    generator = torch.Generator().manual_seed(2)
    layer = fp8_layer(False)
    layer.update(*exact_states(30, generator))  # a prefill longer than the window
    buffers = set()
    for _ in range(40):
        layer.update(*exact_states(1, generator))
        buffers.add(layer.key_codes.data_ptr())
        assert layer.capacity <= WINDOW + 2 * BLOCK
    assert layer.get_seq_length() == 70 and layer.length == WINDOW - 1
    # decode moves the kept window to the front of the buffer at most once per block of steps
    assert len(buffers) <= 40 // BLOCK + 2


def test_past_recording_and_crop_match_transformers():
    generator = torch.Generator().manual_seed(3)
    ours, theirs = fp8_layer(False), DynamicSlidingWindowLayer(sliding_window=WINDOW)
    ours.activate_past_recording(recurrent_states_to_keep=2)  # (transformers >= 5.25's Cache passes it to every layer)
    theirs.activate_past_recording()
    for tokens, crop in [(6, None), (4, -2), (3, 0), (5, -3), (1, -1), (2, 0)]:
        key, value = exact_states(tokens, generator)
        view, _ = ours.update(key, value)
        expected, _ = theirs.update(key, value)
        assert torch.equal(view.dequantized()[0], expected)
        if crop is not None:
            ours.crop(crop)
            theirs.crop(crop)
        assert_same_state(ours, theirs)


def test_crop_before_the_window_is_reached_and_errors_after():
    generator = torch.Generator().manual_seed(4)
    ours, theirs = fp8_layer(False), DynamicSlidingWindowLayer(sliding_window=WINDOW)
    for layer in (ours, theirs):
        layer.update(*exact_states(5, torch.Generator().manual_seed(5)))
        layer.crop(-2)
    assert_same_state(ours, theirs)
    ours.update(*exact_states(10, generator))
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        ours.crop(-1)
    ours.activate_past_recording()
    with pytest.raises(RuntimeError, match="negative"):
        ours.crop(3)


@pytest.mark.parametrize("second, sees", [(1, 2), (11, 0)])
def test_a_second_crop_refuses_what_the_first_dropped(second, sees):
    """A crop keeps the last `sliding_window - 1` tokens, as transformers' layer does, so a second crop before the
    next update cannot roll back further, by one token or past them all: it is refused, naming the tokens
    (transformers' layer drops them, and the next step reads fewer; past them all it counts a negative length),
    and the layer keeps what it held. One crop by the whole count is served."""
    ours, whole = fp8_layer(False), fp8_layer(False)
    for layer in (ours, whole):
        layer.activate_past_recording()
        layer.update(*exact_states(WINDOW + 3, torch.Generator().manual_seed(7)))
    ours.crop(-1)
    held = ours.dequantized()
    refusal = rf"layer 0: after crop\(-{second}\) the next token sees tokens from {sees} on, but .* holds tokens from 3"
    with pytest.raises(RuntimeError, match=refusal):
        ours.crop(-second)
    assert ours.get_seq_length() == WINDOW + 2 and all(torch.equal(a, b) for a, b in zip(ours.dequantized(), held))
    whole.crop(-2)
    assert whole.get_seq_length() == WINDOW + 1


def test_reset_and_batch_operations():
    generator = torch.Generator().manual_seed(6)
    ours, theirs = fp8_layer(False), DynamicSlidingWindowLayer(sliding_window=WINDOW)
    for tokens in (10, 1, 1):
        key, value = exact_states(tokens, generator)
        ours.update(key, value)
        theirs.update(key, value)
    for layer in (ours, theirs):
        layer.batch_repeat_interleave(2)
        layer.batch_select_indices(torch.tensor([3, 0]))
    assert_same_state(ours, theirs)
    ours.reset()
    assert ours.get_seq_length() == 0 and ours.get_mask_sizes(3) == (3, 0) and ours.nbytes == 0


def test_window_too_small_is_refused():
    with pytest.raises(ValueError, match="layer 0: sliding_window=1"):
        fp8_layer(False, window=1)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_triton_reads_the_sliding_view_like_torch(dynamic, rotate):
    """Once the window wraps, the view starts inside the buffers: the Triton kernel (the interpreter on CPU) must
    read it at that offset, as the torch reference does (rotated codes too)."""
    generator = torch.Generator().manual_seed(7)
    layers = {backend: fp8_layer(dynamic, backend=backend, rotate=rotate) for backend in ("torch", "triton")}
    offsets = []
    for tokens in [5, 1, 1, 1, 12, 1, 1]:
        key, value = torch.randn(2, 1, HEADS, tokens, DIM, generator=generator)
        query = torch.randn(1, 2 * HEADS, tokens, DIM, generator=generator)
        outs = {}
        for backend, layer in layers.items():
            view, _ = layer.update(key, value)
            outs[backend] = view.attend(query, scaling=0.25, window=WINDOW)
        offsets.append(view.view.start - view.view.offset)
        assert view.view.rotate is rotate
        torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)
    assert max(offsets) > 0
