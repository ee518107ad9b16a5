"""What a layer holds, property-tested: after any sequence of updates, crops, row selections and resets, in the
dynamic and the static cache, every token is either held as it came (one of the newest `recent_tokens` since it
arrived, or one of the first `sink_tokens`) or as the codes of its own per-token scale, given when it left the
newest ones; never coded twice, never brought back. The oracle follows each token, not the layer's buffers."""

from __future__ import annotations

import torch
from hf_fp8kv.kernels import reference
from hypothesis import given, settings
from hypothesis import strategies as st

from transformers import DynamicCache

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.layer import PER_TOKEN_SCALE_DTYPE
from tests.models import left_padded_mask, tiny_model

MODELS = {dtype: tiny_model().to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
MAX_CACHE_LEN = 40


class Tokens:
    """The oracle: which positions left the newest tokens (a row's sinks, its first `sinks` real tokens, keep their
    values even so), and each row's first real token; the tokens as they came are the first layer's keys and values
    in a `DynamicCache` fed the same (its inputs do not depend on the cache)."""

    def __init__(self, recent: int, sinks: int):
        self.recent, self.sinks = recent, sinks
        self.left: list[bool] = []  # per position held
        self.recent_start = 0
        self.first: list[int] = []  # per row

    @property
    def end(self) -> int:
        return len(self.left)

    def update(self, new: int) -> None:
        self.left += [False] * new
        for t in range(self.recent_start, max(self.recent_start, self.end - self.recent)):
            self.left[t] = True
        self.recent_start = max(self.recent_start, self.end - self.recent)

    def crop(self, end: int) -> None:
        self.left = self.left[:end]
        self.recent_start = min(self.recent_start, end)

    def coded(self, row: int, t: int) -> bool:
        return self.left[t] and not self.first[row] <= t < self.first[row] + self.sinks

    def held(self, kv: torch.Tensor, fmt) -> torch.Tensor:
        """`kv` (`[2, batch, kv_heads, tokens, head_dim]`, as it came) as the layer should hold it."""
        held = kv.clone()
        for row in range(kv.shape[1]):
            for t in range(self.end):
                if self.coded(row, t):
                    x = kv[:, row, :, t]
                    scale = reference.dynamic_scale(x, fmt, PER_TOKEN_SCALE_DTYPE)[..., None]
                    codes, _, _ = reference.quantize(x, scale, fmt)
                    held[:, row, :, t] = reference.dequantize(codes, scale, fmt).to(x.dtype)
        return held


def batch_op(draw, batch: int, static: bool) -> tuple[str, list[int]]:
    """A beam search's reorder (rows picked with repeats, the same count) or, on the dynamic cache, a selection
    of fewer rows."""
    if static or draw(st.booleans()):
        return "reorder", draw(st.lists(st.integers(0, batch - 1), min_size=batch, max_size=batch))
    return "select", draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_token_is_held_as_it_came_or_as_its_own_codes(data):
    check_stored_tokens(data.draw, "torch")


@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_token_is_held_as_it_came_or_as_its_own_codes_on_the_triton_backend(data):
    check_stored_tokens(data.draw, "triton")


def check_stored_tokens(draw, backend: str) -> None:
    static = draw(st.booleans(), label="static")
    fmt_name = draw(st.sampled_from(["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "int8_per_token_head"]), label="format")
    model = MODELS[draw(st.sampled_from(list(MODELS)), label="dtype")]
    recent, sinks = draw(st.integers(0, 6), label="recent"), draw(st.integers(0, 3), label="sinks")
    batch = draw(st.integers(1, 3), label="batch")
    window = dict(max_cache_len=MAX_CACHE_LEN, max_batch_size=batch) if static else dict(block_size=draw(
        st.sampled_from([1, 4, 64]), label="block_size"))  # fmt: skip
    cache = QuantizedFP8Cache(model, kv_cache_dtype=fmt_name, scales="dynamic", recent_tokens=recent,
                              sink_tokens=sinks, backend=backend, **window)  # fmt: skip
    native, tokens, rows = DynamicCache(config=model.config), Tokens(recent, sinks), batch
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16), label="seed"))
    for _ in range(draw(st.integers(1, 8), label="steps")):
        room = MAX_CACHE_LEN - tokens.end if static else 12
        ops = ["update"] * (room > 0) + ["crop"] * (tokens.end > max(tokens.first, default=0) + 1)
        ops += ["batch"] * (tokens.end > 0) + ["reset"]
        op = draw(st.sampled_from(ops))
        if op == "update":
            ids = torch.randint(3, 128, (rows, draw(st.integers(1, min(room, 12)), label="new")), generator=generator)
            if not tokens.end:  # a first update: each row left-padded, with a real token at least
                tokens.first = draw(st.lists(st.integers(0, ids.shape[1] - 1), min_size=rows, max_size=rows),
                                    label="padding")  # fmt: skip
            mask = left_padded_mask(tokens.first, tokens.end + ids.shape[1])
            with torch.no_grad():
                for each in (cache, native):
                    model(input_ids=ids, attention_mask=mask, **cache_kwargs(each))
            tokens.update(ids.shape[1])
        elif op == "crop":  # (never a row's every real token: generate crops what it has just added)
            removed = draw(st.integers(1, tokens.end - max(tokens.first) - 1), label="removed")
            for each in (cache, native):
                each.crop(-removed)
            tokens.crop(tokens.end - removed)
        elif op == "batch":
            kind, picked = batch_op(draw, rows, static)
            for each in (cache, native):
                if kind == "reorder":
                    each.reorder_cache(torch.tensor(picked))
                else:
                    each.batch_select_indices(torch.tensor(picked))
            rows, tokens.first = len(picked), [tokens.first[row] for row in picked]
        else:
            cache.reset()
            native, tokens, rows = DynamicCache(config=model.config), Tokens(recent, sinks), batch
        assert int(cache.get_seq_length()) == tokens.end, op
        if tokens.end:
            keys, values = cache.layers[0].dequantized()
            expected = tokens.held(torch.stack([native.layers[0].keys, native.layers[0].values]), cache.layers[0].fmt)
            assert torch.equal(keys[:, :, : tokens.end], expected[0]), (op, tokens.left, tokens.first)
            assert torch.equal(values[:, :, : tokens.end], expected[1]), (op, tokens.left, tokens.first)
