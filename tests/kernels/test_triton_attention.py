"""The Triton attention kernels (decode and prefill, split-KV + reduce) against the torch reference."""

from dataclasses import dataclass, field

import pytest
import torch

from hf_fp8kv.kernels import ops, reference
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.triton_attention import attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRACE_CHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")  # what torch.compile needs of a custom op
# error relative to the largest output of the fp32 oracle, by query dtype
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@dataclass
class Case:
    fmt: str = "fp8_e4m3"
    batch: int = 2
    kv_heads: int = 2
    group: int = 3
    q_len: int = 1
    length: int = 70  # not a multiple of the 64-token block
    head_dim: int = 80
    scales: str = "dynamic"  # or "per-tensor", "per-head"
    dtype: torch.dtype = torch.float32
    splits: int | None = None
    mask: str | None = None  # "padding" ([batch, 1, 1|q, length], a row fully masked), "per-head", "2d"
    options: dict = field(default_factory=dict)  # window, softcap, sinks=True, channel=True

    def __str__(self) -> str:
        fields = [f"{k}={v}" for k, v in vars(self).items() if v != getattr(Case, k, None) and k != "options"]
        return ",".join(fields + [f"{k}={v}" for k, v in self.options.items()]) or "default"


CASES = [
    Case(),  # decode, GQA 3
    Case(splits=3),
    Case(splits=2, group=8, head_dim=128, length=130),
    Case(group=1, head_dim=64, splits=2, fmt="fp8_e5m2"),
    Case(head_dim=256, length=20, fmt="fp8_e4m3fnuz", scales="per-head"),
    Case(head_dim=96, fmt="int8_per_token_head", group=8, splits=2),
    Case(scales="per-tensor", q_len=5),  # continuation
    Case(q_len=9, group=1, length=9, head_dim=64),  # prefill with no past
    Case(q_len=40, length=100, group=3, scales="per-head", fmt="fp8_e5m2"),  # several row blocks
    Case(q_len=4, options=dict(window=10, sinks=True)),
    Case(q_len=4, splits=2, options=dict(window=10, sinks=True)),
    Case(mask="padding", splits=2, options=dict(sinks=True)),
    Case(mask="padding", q_len=3),
    Case(mask="per-head", q_len=2, splits=2),
    Case(mask="2d", q_len=3, length=30),
    Case(options=dict(softcap=5.0), fmt="int8_per_token_head", q_len=3, splits=2),
    Case(options=dict(channel=True), scales="per-head"),
    Case(dtype=torch.float16, splits=2),
    Case(dtype=torch.float16, q_len=6, scales="per-head", options=dict(channel=True, softcap=20.0)),
    Case(dtype=torch.float16, fmt="fp8_e5m2", mask="padding", group=8, head_dim=128),
]
BF16_CASES = [
    Case(dtype=torch.bfloat16, splits=2),
    Case(dtype=torch.bfloat16, q_len=33, length=100, group=8, head_dim=128, options=dict(sinks=True)),
]


def make_cache(case: Case, generator: torch.Generator):
    """Codes and scales of `case.length` random tokens (with outlier channels), written by the reference."""
    fmt = FORMATS[case.fmt]
    shape = (case.batch, case.kv_heads, case.length, case.head_dim)
    key = torch.randn(shape, generator=generator) * 2
    key[..., :3] *= 20  # outlier channels
    value = torch.randn(shape, generator=generator)
    capacity = case.length + 5
    codes = [torch.zeros(*shape[:2], capacity, shape[3], dtype=fmt.dtype) for _ in range(2)]
    if case.scales == "dynamic":
        scales = [torch.zeros(*shape[:2], capacity) for _ in range(2)]
    else:
        heads = case.kv_heads if case.scales == "per-head" else 1
        scales = [(torch.rand(heads, generator=generator) * 0.5 + 0.5).expand(case.kv_heads).reshape(1, -1, 1) * s
                  for s in (60.0 / fmt.max, 4.0 / fmt.max)]  # fmt: skip
    ops.write(key, value, *codes, *scales, 0, fmt, case.scales == "dynamic", torch.zeros(2, dtype=torch.int64))
    return [t.to(DEVICE) for t in (*codes, *scales)]


def make_mask(case: Case, generator: torch.Generator) -> torch.Tensor | None:
    q_heads = case.kv_heads * case.group
    causal = reference.causal_mask(case.q_len, case.length)
    if case.mask == "padding":  # left padding: batch 0 starts late, batch 1 sees nothing
        padding = torch.ones(case.batch, 1, 1, case.length, dtype=torch.bool)
        padding[0, ..., :17] = False
        padding[1] = False
        return padding & causal
    if case.mask == "per-head":
        return torch.rand(case.batch, q_heads, case.q_len, case.length, generator=generator) > 0.3
    if case.mask == "2d":
        return causal & (torch.arange(case.length) % 3 != 0)
    return None


def run(case: Case):
    generator = torch.Generator().manual_seed(0)
    fmt = FORMATS[case.fmt]
    key_codes, value_codes, key_scale, value_scale = make_cache(case, generator)
    q_heads = case.kv_heads * case.group
    query = torch.randn(case.batch, q_heads, case.q_len, case.head_dim, generator=generator)
    mask = make_mask(case, generator)
    kwargs = dict(
        scaling=case.head_dim**-0.5,
        mask=None if mask is None else mask.to(DEVICE),
        window=case.options.get("window"),
        softcap=case.options.get("softcap"),
        sinks=torch.randn(q_heads, generator=generator).to(DEVICE) if case.options.get("sinks") else None,
        key_channel_scale=(torch.rand(case.kv_heads, case.head_dim, generator=generator) + 0.5).to(DEVICE)
        if case.options.get("channel")
        else None,
    )
    query = query.to(DEVICE, case.dtype)
    expected = ops.attend(query.float(), key_codes, value_codes, key_scale, value_scale, case.length, fmt, **kwargs)
    got = attention(query, key_codes, value_codes, key_scale, value_scale, case.length, fmt,
                    num_splits=case.splits, **kwargs)  # fmt: skip
    return got, expected


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == expected.shape
    error = (got.float() - expected).abs().max() / expected.abs().max()
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_reference(case):
    got, expected = run(case)
    assert_close(got, expected, case.dtype)
    if case.mask == "padding":  # batch 1's rows see no token: exactly 0, not NaN
        assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's bf16 tl.dot is broken: GPU only")
@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_attention_bf16_on_gpu(case):
    got, expected = run(case)
    assert_close(got, expected, case.dtype)


def test_splits_agree_with_one_split():
    case = Case(length=200, group=8, splits=1)
    one, _ = run(case)
    for splits in (2, 4):
        case.splits = splits
        assert_close(run(case)[0], one, torch.float32)


def test_registered_op_is_the_launcher():
    case = Case(q_len=2, options=dict(softcap=10.0))
    fmt = FORMATS[case.fmt]
    key_codes, value_codes, key_scale, value_scale = make_cache(case, torch.Generator().manual_seed(1))
    query = torch.randn(case.batch, case.kv_heads * case.group, case.q_len, case.head_dim, device=DEVICE)
    args = (query, key_codes, value_codes, key_scale, value_scale, case.length)
    direct = attention(*args, fmt, scaling=0.1, softcap=10.0)
    registered = ops.triton_ops().attend(*args, fmt.name, 0.1, None, None, 10.0, None, None)
    assert torch.equal(registered, direct)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake-tensor tracing needs compiled kernels (GPU)")
def test_registered_op_traces_for_torch_compile():
    case = Case(q_len=3, scales="per-head", mask="padding")
    key_codes, value_codes, key_scale, value_scale = make_cache(case, torch.Generator().manual_seed(1))
    query = torch.randn(case.batch, case.kv_heads * case.group, case.q_len, case.head_dim, device=DEVICE)
    mask = make_mask(case, torch.Generator()).to(DEVICE)
    args = (query, key_codes, value_codes, key_scale, value_scale, case.length, case.fmt, 0.1, mask, None, 30.0,
            None, None)  # fmt: skip
    torch.library.opcheck(ops.triton_ops().attend.default, args, test_utils=TRACE_CHECKS)


def test_bad_inputs_are_named():
    case = Case()
    fmt = FORMATS[case.fmt]
    key_codes, value_codes, key_scale, value_scale = make_cache(case, torch.Generator().manual_seed(0))
    query = torch.randn(2, 6, 1, 80, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple of the cache's 2 KV heads"):
        attention(query[:, :5], key_codes, value_codes, key_scale, value_scale, 70, fmt, scaling=1.0)
    with pytest.raises(ValueError, match="mask .* does not broadcast"):
        mask = torch.ones(2, 1, 1, 69, dtype=torch.bool, device=DEVICE)
        attention(query, key_codes, value_codes, key_scale, value_scale, 70, fmt, scaling=1.0, mask=mask)
    with pytest.raises(ValueError, match="sinks must have one logit per query head"):
        sinks = torch.zeros(2, device=DEVICE)
        attention(query, key_codes, value_codes, key_scale, value_scale, 70, fmt, scaling=1.0, sinks=sinks)
