"""The Triton attention kernels (decode and prefill, split-KV + reduce) against the oracle, over layer buffers
written from token streams: pure FP8, recent and sink tokens in full precision, static (device-position)
buffers and rings."""

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.formats import get_format
from hf_fp8kv.kernels.triton_attention import (
    AttentionPlan, NewToken, TileTime, _scale_words, attention, held_splits, merge_counters, merge_group, merge_reads,
    plan_attention, reduce_blocks, split_count, split_cost, split_plan,
)
from hf_fp8kv.kernels.targets import EXAMPLE_GPUS
from hf_fp8kv.kernels.triton_write import plan_write, write_kv
from hf_fp8kv.kernels.view import KVView, slot_codes
from streams import Stream, fill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# error relative to the largest output of the fp32 oracle, by query dtype (fp16 dots: the query's rounding)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass
class Case:
    stream: Stream = field(default_factory=Stream)
    group: int = 3
    q_len: int = 1
    dtype: torch.dtype = torch.float32
    splits: int | None = None
    mask: str | None = None  # "padding" ([batch, 1, 1|q, columns], a row fully masked), "per-head", "2d"
    options: dict = field(default_factory=dict)  # window, softcap, sink_logits=True, channel=True

    def __str__(self) -> str:
        fields = [f"{k}={v}" for k, v in vars(self).items() if k not in ("stream", "options") and v != getattr(Case, k, None)]
        return ",".join([str(self.stream), *fields, *(f"{k}={v}" for k, v in self.options.items())])


PREFILL_TILES = [
    Case(Stream(head_dim=32, updates=[200], tiled=True), q_len=200, group=1),
    Case(Stream(head_dim=32, updates=[100, 200], tiled=True, scales="per-head"), q_len=200, group=1,
         dtype=torch.float16),  # fmt: skip
    Case(Stream(head_dim=32, updates=[100, 100], tiled=True), q_len=100, group=2, dtype=torch.bfloat16),
    Case(Stream(head_dim=32, updates=[100, 200], tiled=True), q_len=200, group=1, options=dict(window=90)),
    Case(Stream(head_dim=32, updates=[230, 70], tiled=True, scales="per-tensor"), q_len=70, group=2,
         options=dict(window=150)),  # fmt: skip
    Case(Stream(head_dim=32, recent=40, sinks=4, updates=[100, 200], tiled=True), q_len=200, group=1),
    Case(Stream(head_dim=32, recent=40, sinks=4, sink_rows=[70, 0], updates=[100, 200], tiled=True), q_len=200,
         group=1),  # sink tokens among the codes
    Case(Stream(head_dim=32, updates=[100, 200], tiled=True), q_len=200, group=1, mask="padding"),
    Case(Stream(head_dim=32, recent=40, sinks=4, sink_rows=[4, 0], updates=[100, 200], tiled=True), q_len=200,
         group=1, mask="padding"),  # fmt: skip
]
ROTATED_CASES = [
    Case(Stream(rotate=True)),  # blocks of 16 channels at head_dim 80
    Case(Stream(rotate=True, updates=[129, 1], head_dim=128, fmt="fp8_e5m2", scales="per-head"), group=8, splits=2),
    Case(Stream(rotate=True, recent=8, sinks=2, updates=[100, 1], tiled=True), splits=3, options=dict(window=40)),
    Case(Stream(rotate=True, recent=8, sinks=2, updates=[100, 1]), options=dict(window=40, channel=True)),
    Case(Stream(rotate=True, static=80, recent=4, sinks=2, updates=[30, 1, 1], head_dim=64), splits=2,
         mask="padding"),  # fmt: skip
    Case(Stream(rotate=True, static=64, ring=True, recent=3, updates=[60, 1, 1, 1, 1], tiled=True), mask="padding"),
    Case(Stream(rotate=True, dtype=torch.bfloat16, recent=8, updates=[90, 1], tiled=True), dtype=torch.bfloat16,
         splits=3),  # fmt: skip
    Case(Stream(rotate=True, head_dim=32, recent=40, sinks=4, updates=[100, 200], tiled=True), q_len=200, group=1),
    Case(Stream(rotate=True, head_dim=32, updates=[100, 200], tiled=True, scales="per-head"), q_len=200, group=1,
         dtype=torch.bfloat16),  # fmt: skip
    Case(Stream(rotate=True, head_dim=32, recent=40, sinks=4, updates=[299, 1], tiled=True), group=1,
         dtype=torch.float16),  # fmt: skip
    Case(Stream(rotate=True, fmt="int8_per_token_head", head_dim=96), group=8, q_len=3, mask="per-head"),
]
OUTLIER_CASES = [  # coded tokens a head keeps exact too: left out of the codes' tiles, read with the held tokens
    Case(Stream(outliers=5), splits=3),
    Case(Stream(recent=8, sinks=2, outliers=4, updates=[100, 1], tiled=True), splits=3, options=dict(window=40)),
    Case(Stream(recent=8, sinks=2, sink_rows=[0, 4], outliers=4, updates=[100, 3]), q_len=3, splits=2,
         mask="padding"),  # fmt: skip
    Case(Stream(recent=6, sinks=2, outliers=3, updates=[60, 1], dtype=torch.float16), dtype=torch.float16,
         options=dict(softcap=8.0, sink_logits=True)),  # fmt: skip
    Case(Stream(dtype=torch.bfloat16, recent=8, sinks=2, outliers=4, updates=[90, 1], tiled=True),
         dtype=torch.bfloat16, splits=2),  # fmt: skip
    Case(Stream(static=80, recent=4, sinks=2, outliers=3, updates=[30, 1, 1]), splits=2, mask="padding"),
    Case(Stream(head_dim=32, recent=40, sinks=4, outliers=6, updates=[100, 200], tiled=True), q_len=200, group=1),
    Case(Stream(head_dim=32, outliers=40, updates=[150, 130], tiled=True), q_len=130, group=1, mask="per-head"),
    Case(Stream(rotate=True, recent=8, sinks=2, outliers=4, updates=[100, 1], tiled=True), splits=3),
    Case(Stream(fmt="int8_per_token_head", outliers=3, updates=[27, 3]), mask="2d", q_len=3),
]
CASES = [
    Case(),  # decode, GQA 3, dynamic scales
    Case(splits=3),
    Case(Stream(updates=[129, 1], head_dim=128), group=8, splits=2),
    Case(Stream(fmt="fp8_e5m2", head_dim=64, scales="per-tensor"), group=1, splits=2),
    Case(Stream(fmt="fp8_e4m3fnuz", head_dim=256, scales="per-head", updates=[19, 1])),
    Case(Stream(fmt="int8_per_token_head", head_dim=96), group=8, splits=2),
    Case(Stream(scales="per-tensor", updates=[55, 5]), q_len=5),  # continuation
    Case(Stream(updates=[9], head_dim=64), q_len=9, group=1),  # prefill with no past
    Case(Stream(fmt="fp8_e5m2", scales="per-head", updates=[60, 40]), q_len=40),  # several row blocks
    Case(Stream(updates=[150, 130]), q_len=130, group=1),  # 128-row prefill tiles
    Case(q_len=4, options=dict(window=10, sink_logits=True)),
    Case(q_len=4, splits=2, options=dict(window=10, sink_logits=True)),
    Case(mask="padding", splits=2, options=dict(sink_logits=True)),
    Case(mask="padding", q_len=3),
    Case(mask="per-head", q_len=2, splits=2),
    Case(Stream(updates=[27, 3]), mask="2d", q_len=3),
    Case(Stream(fmt="int8_per_token_head"), options=dict(softcap=5.0), q_len=3, splits=2),
    Case(Stream(scales="per-head"), options=dict(channel=True)),
    Case(dtype=torch.float16, splits=2),
    Case(Stream(scales="per-head"), dtype=torch.float16, q_len=6, options=dict(channel=True, softcap=20.0)),
    Case(Stream(fmt="fp8_e5m2", head_dim=128), dtype=torch.float16, mask="padding", group=8),
    Case(dtype=torch.bfloat16, splits=2),  # fp16 dots: the interpreter runs bf16 queries right
    # int8 codes under model-dtype queries: fp16 dots (on CUDA through the byte permutes, `INT8_TO_FP16`)
    Case(Stream(fmt="int8_per_token_head", head_dim=128, updates=[129, 1]), group=8, dtype=torch.bfloat16, splits=2),
    Case(Stream(fmt="int8_per_token_head", updates=[150, 130]), q_len=130, group=1, dtype=torch.float16),
    # the full-precision recent window and sink tokens
    Case(Stream(recent=8), splits=3),
    Case(Stream(recent=8, updates=[5, 1]), splits=2),  # everything in the window
    Case(Stream(recent=70, updates=[60, 1, 9]), q_len=9),  # a window wider than a tile
    Case(Stream(recent=6, sinks=3, sink_rows=[0, 4], scales="per-head"), mask="padding", splits=2),
    Case(Stream(recent=6, sinks=4, sink_rows=[3, 0], fmt="fp8_e5m2", scales="per-tensor"), q_len=7),
    Case(Stream(recent=6, sinks=3), splits=2),  # a decode step without a mask: the sinks' codes left out
    Case(Stream(recent=5, sinks=2, updates=[40, 8]), q_len=8, options=dict(softcap=8.0, sink_logits=True, channel=True)),
    Case(Stream(recent=4, sinks=2, dtype=torch.float16), dtype=torch.float16, splits=2, mask="padding"),
    # a decode step's window over recent and sink tokens: in a program of their own (splits), or after the codes
    Case(Stream(recent=8, sinks=2, updates=[100, 1]), splits=3, options=dict(window=40)),
    Case(Stream(recent=8, sinks=2, updates=[100, 1]), options=dict(window=40, channel=True)),
    Case(Stream(recent=5, sinks=2, updates=[40, 1]), splits=2, options=dict(softcap=8.0, channel=True)),
    Case(Stream(recent=70, sinks=2, updates=[100, 1]), splits=4, options=dict(window=90)),  # 3 splits of them
    Case(Stream(recent=70, sinks=2, updates=[100, 1]), splits=4, mask="padding"),
    Case(Stream(recent=8, sinks=2, updates=[100, 3]), q_len=3, splits=3, options=dict(window=50)),  # causal rows
    Case(Stream(recent=8, sinks=2, sink_rows=[0, 4], updates=[100, 3]), q_len=3, splits=2, mask="padding"),
    # static buffers: positions on the device, the mask over every slot, a fixed grid
    Case(Stream(static=80, recent=4, sinks=2, updates=[30, 1, 1]), splits=2, mask="padding"),
    Case(Stream(static=80, updates=[30, 5]), q_len=5),
    Case(Stream(static=16, ring=True, recent=3, updates=[10, 1, 1, 1, 1, 1, 1, 1, 1, 1]), mask="padding"),
    Case(Stream(static=16, ring=True, updates=[12, 1, 1, 1, 1, 1, 1]), options=dict(window=16)),
    # tiled values (the Triton backend's layers): whole tiles read unmasked, the partial ones at either end masked
    Case(Stream(updates=[150, 1], tiled=True), splits=3),
    Case(Stream(fmt="fp8_e5m2", scales="per-head", head_dim=128, updates=[150, 1], tiled=True), group=8, splits=2),
    Case(Stream(updates=[150, 130], tiled=True), q_len=130, group=1),  # 128-row prefill tiles, 32-token tiles
    Case(Stream(recent=8, sinks=3, sink_rows=[0, 4], updates=[100, 1], tiled=True), splits=2, mask="padding"),
    Case(Stream(updates=[120, 4], tiled=True), q_len=4, options=dict(window=70)),
    Case(Stream(recent=8, sinks=3, updates=[130, 1], tiled=True), splits=3, options=dict(window=70)),
    Case(Stream(dtype=torch.bfloat16, recent=8, sinks=2, updates=[90, 1], tiled=True), dtype=torch.bfloat16, splits=3,
         mask="padding"),
    Case(Stream(dtype=torch.bfloat16, updates=[90, 1], tiled=True), dtype=torch.bfloat16, splits=2),
    Case(Stream(static=130, updates=[128, 1], tiled=True), splits=2, mask="padding"),
    Case(Stream(static=64, ring=True, recent=3, updates=[60, 1, 1, 1, 1, 1, 1, 1], tiled=True), mask="padding"),
    Case(Stream(static=16, ring=True, updates=[12, 1, 1, 1, 1, 1, 1], tiled=True), options=dict(window=16)),  # any
    # a causal prefill's tiles (128 rows, 64 tokens): interior ones (every row sees them: no rule), diagonal ones,
    # partial ones at either end; the same tiles under a mask
    *PREFILL_TILES,
    # rotated codes: the query rotated for them, their share of the output rotated back before the held tokens
    *ROTATED_CASES,
    *OUTLIER_CASES,
]


def make_mask(case: Case, view, generator: torch.Generator) -> torch.Tensor | None:
    stream = case.stream
    # a static mask covers [0, max_cache_len) (a ring's max_cache_len is longer than the ring)
    columns = stream.length + 4 if view.ring else view.columns if view.static else stream.length
    q_heads = stream.kv_heads * case.group
    causal = reference.causal_mask(case.q_len, columns, q_end=stream.length)
    if case.mask == "padding":  # left padding: batch 0 starts late, batch 1 sees nothing
        padding = torch.ones(stream.batch, 1, 1, columns, dtype=torch.bool)
        padding[0, ..., :4] = False
        padding[1] = False
        return padding & causal
    if case.mask == "per-head":
        return (torch.rand(stream.batch, q_heads, case.q_len, columns, generator=generator) > 0.3) & causal
    if case.mask == "2d":
        return causal & (torch.arange(columns) % 3 != 0)
    return None


def run(case: Case):
    generator = torch.Generator().manual_seed(0)
    stream = case.stream
    view, _, _ = fill(stream, reference.write, generator, DEVICE)
    q_heads = stream.kv_heads * case.group
    query = torch.randn(stream.batch, q_heads, case.q_len, stream.head_dim, generator=generator)
    mask = make_mask(case, view, generator)
    if case.options.get("channel"):
        view.key_channel_scale = (torch.rand(stream.kv_heads, stream.head_dim, generator=generator) + 0.5).to(DEVICE)
    kwargs = dict(
        scaling=stream.head_dim**-0.5,
        mask=None if mask is None else mask.to(DEVICE),
        window=case.options.get("window"),
        softcap=case.options.get("softcap"),
        sink_logits=torch.randn(q_heads, generator=generator).to(DEVICE) if case.options.get("sink_logits") else None,
    )
    query = query.to(DEVICE, case.dtype)
    expected = reference.attend(query.float(), view, **kwargs)
    got = attention(query, view, num_splits=case.splits, **kwargs)
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


@pytest.mark.parametrize("case", [
    Case(Stream(recent=8, updates=[5, 1]), splits=2),
    Case(Stream(recent=16, sinks=2, updates=[9, 4], dtype=torch.bfloat16, tiled=True), q_len=4, dtype=torch.bfloat16),
], ids=str)  # fmt: skip
def test_rotation_changes_nothing_while_every_token_is_held(case):
    """No codes yet (a context within the recent window): the rotated cache's output is the plain one's, bit for
    bit (the codes' empty share is rotated, nothing else)."""
    plain = run(case)[0]
    case.stream.rotate = True
    assert torch.equal(run(case)[0], plain)


def test_a_prompts_rotated_query_scratch_is_not_kept():
    """The rotated query's scratch is the query's size in fp32: a decode step's plan keeps it (one allocation less
    per step), a prompt's does not (kept in every layer's plan, it would hold a long prompt's query after it)."""
    generator = torch.Generator().manual_seed(0)
    view, _, _ = fill(Stream(updates=[60, 1], rotate=True), reference.write, generator, DEVICE)
    plans = {}
    for q_len in (20, 1):
        query = torch.randn(2, 4, q_len, 80, generator=generator).to(DEVICE)
        got = attention(query, view, scaling=0.1, plans=plans)
        assert_close(got, reference.attend(query, view, scaling=0.1), torch.float32)
    assert {plan.out_shape[2]: plan.scratch is not None for plan in plans.values()} == {20: False, 1: True}


def test_splits_agree_with_one_split():
    case = Case(Stream(updates=[200, 1], recent=5), group=8, splits=1)
    one, _ = run(case)
    for splits in (2, 4):
        case.splits = splits
        assert_close(run(case)[0], one, torch.float32)


def test_held_tokens_shared_by_several_splits_agree_with_one_split():
    """70 fp32 recent tokens and 2 sinks (288 bytes per channel: 5 tiles of codes' bytes) beside one tile of codes:
    4 splits give them 3 (32-token shares of the recent slots, the sinks in the last), 6 give them 5."""
    assert (held_splits(4, 1, 5), held_splits(6, 1, 5)) == (3, 5)
    case = Case(Stream(updates=[100, 1], recent=70, sinks=2), group=8, splits=1)
    one, _ = run(case)
    for splits in (4, 6):
        case.splits = splits
        assert_close(run(case)[0], one, torch.float32)


def test_split_partials_are_fp32_whatever_the_default_dtype():
    view, _, _ = fill(Stream(updates=[200, 1]), reference.write, torch.Generator().manual_seed(0), DEVICE)
    query = torch.randn(2, 8, 1, 80, device=DEVICE)
    want = attention(query, view, scaling=0.1, num_splits=4)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a user's setting: the splits' partial results stay fp32
    try:
        got = attention(query, view, scaling=0.1, num_splits=4)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(got, want)


def test_nan_codes_read_as_nan_on_every_path():
    stream = Stream(updates=[20, 1])
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(3), DEVICE)
    view.codes.view(torch.uint8)[1, 0, 0, 5] = 0x7F  # a NaN value code in row 0
    query = torch.randn(2, 6, 1, 80, device=DEVICE)
    got = attention(query, view, scaling=0.1)
    expected = reference.attend(query, view, scaling=0.1)
    assert got[0, :3].isnan().all() and expected[0, :3].isnan().all()  # the query heads of KV head 0
    assert not got[0, 3:].isnan().any() and not got[1].isnan().any() and not expected[1].isnan().any()


def test_split_count_fills_the_last_wave():
    for programs in (8, 16, 32, 64, 128, 256, 512):
        for tiles in (64, 512, 2048):
            for held_tiles in (0, 5):  # the default 128 recent + 4 sink bf16 tokens: 264 bytes per channel
                slots = 132 * 2
                splits = split_count(programs, tiles, slots, held_tiles)
                blocks = programs * splits
                efficiency = blocks / (-(-blocks // slots) * slots)
                # (or a split of held tokens is the longest: no more splits of codes would end sooner)
                held = held_splits(splits, tiles, held_tiles)
                held_bound = held > 0 and -(-tiles // (splits - held)) <= -(-held_tiles // held)
                assert efficiency >= 0.85 or held_bound, (programs, tiles, held_tiles, splits, efficiency)


def test_the_split_rule_weighs_the_merge_against_a_reduce_launch():
    """`split_plan`: the merge in the attention launch where its serial reads cost no more than a reduce launch's
    fixed cost saves (ties to it: a launch less), else the reduce launch's split count; the kernel's own split count
    either way."""
    tile = TileTime(64, 128, 58 * 3, EXAMPLE_GPUS["sm_89"].bandwidth)  # an L4, 3 blocks per SM
    launch = tile.reduce_launch
    assert 0 < tile.merge(8) < launch < 1  # (a tile-time there is 9.5 us: a 3 us launch is a third of one)
    # a program of 8 rows merges 171 splits in 28 reads (`merge_reads`) for less than a launch; one of 32 does not
    for rows, programs, tiles, merged in ((8, 8, 64, True), (8, 8, 512, True), (8, 1, 512, True), (8, 1, 64, True),
                                          (32, 1, 512, False), (32, 1, 64, True)):  # fmt: skip
        merge = tile.merge(rows)
        splits, merges = split_plan(programs, tiles, 174, 0, merge, launch)
        assert merges == merged, (programs, tiles)
        assert splits == split_count(programs, tiles, 174, 0, merge if merged else 0.0)
        costs = [split_cost(programs, tiles, 174, 0, splits, merge if merged else 0.0) + (0 if merged else launch)
                 for merged, splits in ((True, split_count(programs, tiles, 174, 0, merge)),
                                        (False, split_count(programs, tiles, 174, 0)))]  # fmt: skip
        assert costs[not merged] <= costs[merged], (programs, tiles, costs)
    assert split_plan(1, 512, 174, 0, None, launch) == (split_count(1, 512, 174), False)  # a kernel that cannot merge
    assert split_plan(8, 64, 174, 0, tile.merge(8), 0.0)[1] is False  # a free reduce launch beats any merge


def test_the_merge_in_groups_reads_fewer_partial_results():
    """`merge_group`: one group where groups save no read (up to 7 splits), else groups that cover every split
    once, with fewer serial reads (`merge_reads`) than one program reading them all: 171 splits in 28."""
    for splits in range(1, 400):
        size = merge_group(splits)
        groups = -(-splits // size)
        assert 1 <= size <= splits and (size == splits) == (splits <= 7), splits
        assert merge_reads(splits) == (splits if groups == 1 else size + 1 + groups) <= splits
        assert merge_counters(splits) == (1 if groups == 1 else groups + 1)
    assert (merge_group(171), merge_reads(171)) == (14, 28)


def test_a_plan_chooses_the_merge_call_by_call():
    """One plan of an L4's decode steps over one KV head and 32 query heads: at 4k tokens its launch merges its
    splits; at 32k the reduce launch merges them (one program would merge 171 splits in groups of 14, 28 serial
    reads of a 74th of a tile-time each: 0.38 tile-times where the reduce launch costs 0.32); planned on the meta
    device, as gpu_static plans."""
    fmt = get_format("fp8_e4m3")
    capacity = 32768
    codes = torch.empty(2, 1, 1, capacity, 128, dtype=fmt.dtype, device="meta")
    scales = torch.ones(2, 1, 1, 1, device="meta")
    query = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    plan = None
    kernels = {}
    for end in (4096, 32768):
        view = KVView(codes=codes, scales=scales, fmt=fmt, end=end, recent_start=end, has_nan=False)
        plan = plan or AttentionPlan(query, view, None, None, 0.1, resident_slots=58 * 3, target=EXAMPLE_GPUS["sm_89"])
        _, launches = plan.launches(query, view, None, None)
        kernels[end] = [(launch.kernel.fn.__name__, launch.kwargs.get("MERGE")) for launch in launches]
        assert launches[0].grid[2] > 1
    assert kernels == {4096: [("_attention_kernel", True)],
                       32768: [("_attention_kernel", False), ("_reduce_kernel", None)]}  # fmt: skip


@pytest.mark.parametrize("splits", [3, 9])
def test_a_split_decode_merged_in_its_launch_or_by_a_reduce_launch(splits):
    """A static view's split decode, as a compiled graph runs it (replayed: the same counters twice): merged in
    the launch where the merge's counters are given (9 splits: in 3 groups of 3, `merge_group`; under a mask in
    one), by a reduce launch where they are not (the split rule chose it); each the one-split result."""
    from hf_fp8kv.kernels import ops

    stream = Stream(static=640, recent=4, sinks=2, updates=[580, 1], tiled=True)
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(6), DEVICE)
    query = torch.randn(2, 6, 1, 80, device=DEVICE)
    one = attention(query, view, scaling=0.1, num_splits=1)
    assert merge_counters(splits) == (1 if splits == 3 else 4)
    tickets = torch.zeros(2 * 2 * merge_counters(splits), dtype=torch.int32, device=DEVICE)
    for given in (tickets, tickets, None):
        assert_close(ops.triton_ops().attend(*_op_args(view, query, None, splits, given)), one, torch.float32)
        assert not tickets.any()
    for given, kernels in ((tickets, ["_attention_kernel"]), (None, ["_attention_kernel", "_reduce_kernel"])):
        plan = AttentionPlan(query, view, None, None, 0.1, num_splits=splits, merge=given is not None)
        launches = plan.launches(query, view, None, None, given)[1]
        assert [launch.kernel.fn.__name__ for launch in launches] == kernels and launches[0].grid[2] == splits
        assert [launch.kernel.fn.__name__ for launch in plan.launches(query, view, None, None, given)[1]] == kernels
    # a left-padded batch: merged in one group (a counter per program) with the same counters
    mask = torch.ones(2, 1, 1, 640, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :100] = False
    masked = attention(query, view, scaling=0.1, mask=mask, num_splits=1)
    for _ in range(2):
        assert_close(ops.triton_ops().attend(*_op_args(view, query, mask, splits, tickets)), masked, torch.float32)
        assert not tickets.any()
    plan = AttentionPlan(query, view, mask, None, 0.1, num_splits=splits)
    assert [launch.kernel.fn.__name__ for launch in plan.launches(query, view, mask, None, tickets)[1]] == [
        "_attention_kernel"
    ]


def test_held_tokens_are_read_by_splits_of_their_own():
    """With recent / sink tokens, one split reads them after its codes; more splits give them 1 or more of their
    own beside at least one of codes. Batch 1 at 4k and 8k tokens (8 programs): the longest split is no longer
    than with the held tokens' bytes counted as codes and read by the last split."""
    assert held_splits(1, 100, 5) == 0 and held_splits(7, 100, 0) == 0
    for splits in (2, 3, 8, 40):
        for tiles in (1, 64, 2048):
            assert 1 <= held_splits(splits, tiles, 5) <= min(5, splits - 1)
    for tiles in (64, 129):
        splits = split_count(8, tiles, 396, held_tiles=5)
        held = held_splits(splits, tiles, 5)
        longest = max(-(-tiles // (splits - held)), -(-5 // held))
        counted = split_count(8, tiles + 5, 396)
        assert longest <= max(-(-(tiles + 5) // counted), 5) and held >= 1, (tiles, splits, held)


def test_static_grid_is_fixed():
    """A static view's launches do not depend on how many tokens it holds (CUDA graphs replay them)."""
    grids = []
    for updates in ([5], [40, 1]):
        stream = Stream(static=640, recent=4, updates=updates)
        view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)
        query = torch.randn(2, 6, 1, 80, device=DEVICE)
        _, launches = plan_attention(query, view, scaling=0.1, resident_slots=264)
        grids.append([launch.grid for launch in launches])
    assert grids[0] == grids[1] and len(grids[0]) == 1 and grids[0][0][2] > 1  # split, merged in the launch


def test_bad_inputs_are_named():
    stream = Stream(updates=[70])
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)
    query = torch.randn(2, 6, 1, 80, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple of the cache's 2 KV heads"):
        attention(query[:, :5], view, scaling=1.0)
    with pytest.raises(ValueError, match="mask .* does not broadcast"):
        attention(query, view, scaling=1.0, mask=torch.ones(3, 1, 1, 70, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="sink_logits must have one logit per query head"):
        attention(query, view, scaling=1.0, sink_logits=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="mask has 60 columns"):
        attention(query, view, scaling=1.0, mask=torch.ones(2, 1, 1, 60, dtype=torch.bool, device=DEVICE))


def _op_args(view, query, mask, num_splits, tickets=None, new_token=None, scaling=0.1, window=None, softcap=None,
             sink_logits=None):  # fmt: skip
    new = (None, None, None) if new_token is None else new_token[:3]
    return (query, view.codes, view.scales, view.recent, view.sinks, view.sink_start, view.sink_count, view.positions,
            mask, sink_logits, view.key_channel_scale, view.outliers, view.outlier_pos, tickets, *new, view.fmt.name,
            view.per_token, view.ring, view.rotate, scaling, window or 0, softcap or 0.0, num_splits, False,
            view.search_energy, view.search_tickets, view.scale_search)  # fmt: skip


@pytest.mark.parametrize("outliers", [0, 3])
def test_registered_op_is_the_launcher_on_a_static_view(outliers):
    """`torch.ops.hf_fp8kv.attend`, what a compiled graph calls, computes what the launcher does."""
    from hf_fp8kv.kernels import ops

    stream = Stream(static=64, recent=4, sinks=2, updates=[20, 1], tiled=True, rotate=True, outliers=outliers)
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(4), DEVICE)
    query = torch.randn(2, 6, 1, 80, device=DEVICE)
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool, device=DEVICE)
    direct = attention(query, view, scaling=0.1, mask=mask, num_splits=2)
    assert torch.equal(ops.triton_ops().attend(*_op_args(view, query, mask, 2)), direct)
    # the merge's counters a compiled graph is given (a layer's, of fixed address): the same result at every replay,
    # and back at 0 after each
    tickets = torch.zeros(2 * 2, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        assert torch.equal(ops.triton_ops().attend(*_op_args(view, query, mask, 2, tickets)), direct)
        assert not tickets.any()


@pytest.mark.parametrize("splits, dtype, held", [
    (5, torch.float32, True), (8, torch.float32, True), (8, torch.bfloat16, True), (8, torch.float16, False),
])  # fmt: skip
def test_the_last_split_merges_and_leaves_the_tickets_at_zero(splits, dtype, held):
    """The splits' partial results are merged in the attention launch by the last split of each program to take
    its ticket (8 splits: the last of each group of 3, 3 and 2 merges the group's, the last group merged merges
    the groups'; with a mask in one group): the plan's counters are back at 0 after every launch, so that the next
    step merges again. `held`: recent and sink tokens beside the codes (else pure FP8)."""
    tokens = 200 if splits == 5 else 400 if held else 520  # (8 tiles of codes at least: 8 splits)
    stream = Stream(updates=[tokens, 1], recent=5 if held else 0, sinks=2 if held else 0)
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(5), DEVICE)
    query = torch.randn(2, 8, 1, 80, device=DEVICE).to(dtype)
    plans = {}
    one = attention(query, view, scaling=0.1, num_splits=1).float()
    counters = 2 * 2 * (1 if splits == 5 else 4)
    for _ in range(2):  # a layer's decode steps reuse its plan's counters
        got = attention(query, view, scaling=0.1, num_splits=splits, plans=plans)
        assert_close(got, one, dtype)
        (plan,) = plans.values()
        assert plan.tickets is not None and plan.tickets.shape == (counters,) and not plan.tickets.any()
        assert plan.launches(query, view, None, None)[1][0].grid[2] == splits
    # with a mask the launch merges the splits in one group: a counter per program, at 0 after every launch
    mask = torch.ones(2, 1, 1, view.end, dtype=torch.bool, device=DEVICE)
    mask[0, ..., : view.end // 2] = False  # a left-padded row: its first splits see padding alone
    masked_one = attention(query, view, scaling=0.1, mask=mask, num_splits=1).float()
    plans = {}
    for _ in range(2):
        assert_close(attention(query, view, scaling=0.1, mask=mask, num_splits=splits, plans=plans), masked_one, dtype)
        (plan,) = plans.values()
        assert plan.tickets.shape == (2 * 2,) and not plan.tickets.any()
        launches = plan.launches(query, view, mask, None)[1]
        assert [launch.kernel.fn.__name__ for launch in launches] == ["_attention_kernel"]
    # a sliding layer's window under the mask: the splits before it see nothing either, and still merge
    window = view.end // 3
    plans = {}
    assert_close(attention(query, view, scaling=0.1, mask=mask, window=window, num_splits=splits, plans=plans),
                 attention(query, view, scaling=0.1, mask=mask, window=window, num_splits=1).float(), dtype)  # fmt: skip
    (plan,) = plans.values()
    assert not plan.tickets.any() and len(plan.launches(query, view, mask, None)[1]) == 1
    # rotated codes leave the merge to a reduce launch (registers, gpu_static)
    generator = torch.Generator().manual_seed(5)
    rotated, _, _ = fill(dataclasses.replace(stream, rotate=True), reference.write, generator, DEVICE)
    _, launches = plan_attention(query, rotated, scaling=0.1, mask=mask, num_splits=splits)
    assert [launch.kernel.fn.__name__ for launch in launches] == ["_attention_kernel", "_reduce_kernel"]
    assert_close(attention(query, rotated, scaling=0.1, mask=mask, num_splits=splits),
                 attention(query, rotated, scaling=0.1, mask=mask, num_splits=1).float(), dtype)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake-tensor tracing of Triton kernels needs a GPU")
def test_registered_op_traces_for_torch_compile():
    from hf_fp8kv.kernels import ops

    stream = Stream(static=64, recent=4, sinks=2, updates=[20, 1], tiled=True, rotate=True, outliers=3)
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(4), DEVICE)
    query = torch.randn(2, 6, 1, 80, device=DEVICE)
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool, device=DEVICE)
    args = _op_args(view, query, mask, 2)
    torch.library.opcheck(ops.triton_ops().attend.default, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def poison_unseen(case: Case, view, mask: torch.Tensor | None) -> int:
    """NaN in every slot (codes, per-token scales, recent and sink buffers) of the tokens no query row of a batch
    row may see, as garbage in a padded row's slots or outside the window; returns how many tokens."""
    stream, end = case.stream, case.stream.length
    positions = torch.arange(end)
    if mask is not None:
        q_heads = stream.kv_heads * case.group
        seen = mask.expand(stream.batch, q_heads, case.q_len, mask.shape[-1]).any(2)
        seen = seen.unflatten(1, (stream.kv_heads, case.group)).any(2)  # [batch, kv_heads, columns]
        first_column = 0 if view.static else end - mask.shape[-1]
        seen = seen[..., positions - first_column] & (positions >= first_column)
    else:
        seen = (positions > end - case.q_len - case.options["window"]).expand(stream.batch, stream.kv_heads, end)
    start = max(int(view.start), int(view.recent_start) - view.slots) if view.ring else int(view.start)
    unseen = (~seen) & (positions >= start)
    nan_code = view.fmt.nan_code if view.fmt.nan_code >= 0 else (0x7F if view.fmt.is_float else None)
    recent_start = int(view.recent_start)
    for b, h, t in unseen.nonzero().tolist():
        slot = t % view.slots if view.ring else t - view.offset
        if nan_code is not None:
            for codes in slot_codes(view.codes.view(torch.uint8), slot, view.value_tiled):
                codes[b, h] = nan_code
        if view.per_token:
            view.scales[:, b, h, slot] = float("nan")
        if view.recent is not None and t >= recent_start:
            view.recent[:, b, h, t % view.recent.shape[3]] = float("nan")
        if view.sinks is not None and 0 <= t - int(view.sink_start[b]) < int(view.sink_count[b]):
            view.sinks[:, b, h, t - int(view.sink_start[b])] = float("nan")
    return int(unseen.sum())


# (the random per-head mask leaves no token unseen by every row; the ring as wide as its window holds none)
UNSEEN_CASES = [
    case for case in CASES if case.mask not in (None, "per-head") or "window" in case.options and not case.stream.ring
]


@pytest.mark.parametrize("case", UNSEEN_CASES, ids=str)
def test_tokens_no_row_sees_contribute_nothing(case):
    """NaN in the slots of masked tokens (a padded row's, outside the window) reaches no output, on both paths
    (vLLM's kernels never read a masked value either): the output is the one over clean buffers."""
    generator = torch.Generator().manual_seed(0)
    stream = case.stream
    view, _, _ = fill(stream, reference.write, generator, DEVICE)
    query = torch.randn(stream.batch, stream.kv_heads * case.group, case.q_len, stream.head_dim, generator=generator)
    mask = make_mask(case, view, generator)
    kwargs = dict(scaling=stream.head_dim**-0.5, mask=None if mask is None else mask.to(DEVICE),
                  window=case.options.get("window"), softcap=case.options.get("softcap"))  # fmt: skip
    query = query.to(DEVICE, case.dtype)
    clean = reference.attend(query.float(), view, **kwargs)
    assert poison_unseen(case, view, mask) > 0
    poisoned_reference = reference.attend(query.float(), view, **kwargs)
    got = attention(query, view, num_splits=case.splits, **kwargs)
    assert not poisoned_reference.isnan().any() and not got.isnan().any()
    assert torch.equal(poisoned_reference, clean)
    assert_close(got, clean, case.dtype)


def test_stages_reach_the_launch():
    """The KV tiles in flight are selectable per call (gpu_check times 3 against 4); 3 by default."""
    query = torch.randn(1, 8, 1, 64)
    codes = torch.zeros(2, 1, 2, 256, 64, dtype=torch.float8_e4m3fn)
    view = KVView(codes=codes, scales=torch.ones(2, 1, 2, 1), fmt=get_format("fp8_e4m3"), end=200, recent_start=200)
    for stages in (None, 4):
        _, launches = plan_attention(query, view, scaling=0.125, stages=stages, num_splits=2)
        assert [launch.kwargs.get("STAGES") for launch in launches] == [stages or 3]  # (splits merged in it)


WORD_CASES = [
    Case(Stream(), splits=2),
    Case(Stream(recent=6, sinks=3, sink_rows=[0, 4]), mask="padding", splits=2),
    Case(Stream(static=80, recent=4, sinks=2, updates=[30, 1, 1]), splits=2, mask="padding"),
    Case(Stream(updates=[60, 1, 1, 2]), q_len=2, dtype=torch.float16),
]


@pytest.mark.parametrize("case", WORD_CASES, ids=str)
def test_bf16_scales_read_as_words_match_the_oracle(case):
    """Where every (batch, head) row of the bf16 per-token scales starts on a 4-byte word, the kernel reads each
    scale from its word (odd and even slots alike); the streams above have odd slot counts (plain 2-byte loads)."""
    generator = torch.Generator().manual_seed(0)
    stream = case.stream
    view, _, _ = fill(stream, reference.write, generator, DEVICE)
    assert not _scale_words(view)  # an odd slot count: rows start on half words
    padded = torch.full((*view.scales.shape[:3], view.scales.shape[3] + 1), -1.0, dtype=view.scales.dtype, device=DEVICE)
    padded[..., :-1] = view.scales
    view.scales = padded[..., :-1]  # the same scales, rows 2 x (odd + 1) bytes apart
    assert _scale_words(view)
    query = torch.randn(stream.batch, stream.kv_heads * case.group, case.q_len, stream.head_dim, generator=generator)
    mask = make_mask(case, view, generator)
    mask = None if mask is None else mask.to(DEVICE)
    query = query.to(DEVICE, case.dtype)
    expected = reference.attend(query.float(), view, scaling=stream.head_dim**-0.5, mask=mask)
    got = attention(query, view, scaling=stream.head_dim**-0.5, mask=mask, num_splits=case.splits)
    assert_close(got, expected, case.dtype)


def test_reduce_programs_fill_the_gpu_at_batch_one():
    """Rows and head_dim chunk of a reduce program: a batch-1 step of 32 query heads is spread over 128 programs
    (one row, 32 channels, one warp each); a batch of 16 over 128 programs of 16 rows."""
    assert reduce_blocks(32, 128) == (1, 32, 1)
    assert reduce_blocks(512, 128) == (16, 32, 4)
    assert reduce_blocks(84, 128) == (2, 32, 1)
    assert reduce_blocks(4096, 64) == (16, 32, 4)  # never more than 16 rows


def test_a_plan_that_is_not_the_layers_keeps_nothing_in_the_views_memo():
    """The split count asked of a plan of its own (a compiled decode's, planned eagerly) leaves no entry in the
    view's memo: an entry keyed by that plan would hold the layer's buffers after the layer replaced them."""
    generator = torch.Generator().manual_seed(0)
    view, _, _ = fill(Stream(recent=6, sinks=3), reference.write, generator, DEVICE)
    view.memo = {}
    query = torch.randn(2, 6, 1, 80, generator=generator).to(DEVICE)
    plan = AttentionPlan(query, view, None, None, 0.1)
    assert plan.splits(query, view)[0] >= 1 and view.memo == {}
    plan.launches(query, view, None, None)
    assert list(view.memo) == [plan]  # the plan that launches keeps its arguments there


# fp8_prefill: 128-row prefill tiles over e4m3 codes (QK and PV on FP8 tensor cores)
FP8_CASES = [
    Case(Stream(scales="per-head", updates=[150, 130], tiled=True), q_len=130, group=1, dtype=torch.float16),
    Case(Stream(updates=[150, 130], tiled=True), q_len=130, group=1, dtype=torch.bfloat16),
    Case(Stream(scales="per-tensor", updates=[100, 130], tiled=True), q_len=130, group=1, dtype=torch.float16,
         options=dict(window=70)),  # fmt: skip
    Case(Stream(updates=[150, 130], tiled=True, rotate=True), q_len=130, group=1, dtype=torch.float16),
    Case(Stream(updates=[150, 130], tiled=True, outliers=8), q_len=130, group=1, dtype=torch.float16),
    Case(Stream(updates=[150, 130], tiled=True, recent=20, sinks=3), q_len=130, group=1, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
def test_fp8_prefill_computes_the_fp8_arithmetic(case):
    """`fp8_prefill=True` computes `reference.fp8_dots_attention` (the query rounded to e4m3 per row, the
    probabilities times 256, or times the per-token V scales, to e4m3): far closer to it than either is to the
    exact oracle (tiles meet the running max in another order, so single probabilities may round apart)."""
    generator = torch.Generator().manual_seed(0)
    stream = case.stream
    view, _, _ = fill(stream, reference.write, generator, DEVICE)
    query = torch.randn(stream.batch, stream.kv_heads, case.q_len, stream.head_dim, generator=generator)
    query = query.to(DEVICE, case.dtype)
    window, scaling = case.options.get("window"), stream.head_dim**-0.5
    keys, values = reference.materialize(view)
    mask = reference.causal_mask(case.q_len, keys.shape[2], window, DEVICE)
    emulated = reference.fp8_dots_attention(
        query, keys, values, scaling=scaling, mask=mask, rotate=view.rotate,
        value_scales=reference.value_scales(view) if view.per_token else None,
    )  # fmt: skip
    exact = reference.attend(query.float(), view, scaling=scaling, window=window)
    got = attention(query, view, scaling=scaling, window=window, fp8_prefill=True).float()
    fp16 = attention(query, view, scaling=scaling, window=window).float()

    def error(a, b):
        return ((a - b).abs().mean() / b.abs().mean()).item()

    assert error(got, emulated) < error(emulated, exact) / 5  # measured: 11-64x apart
    assert error(fp16, exact) < error(got, exact) / 5  # the default path keeps its fp16 accuracy (10-100x)


ONE_TILE_FP8_CASES = [  # 72 rows over 49 tokens: one tile of codes, so no tile order to differ from the emulation's
    Case(Stream(updates=[40, 9], tiled=True), q_len=9, group=8, dtype=torch.float16),
    Case(Stream(updates=[40, 9], tiled=True, recent=8, sinks=2), q_len=9, group=8, dtype=torch.float16),
    Case(Stream(scales="per-head", updates=[40, 9], tiled=True), q_len=9, group=8, dtype=torch.float16),
]


@pytest.mark.parametrize("case", ONE_TILE_FP8_CASES, ids=str)
def test_fp8_prefill_values_dot_is_the_emulated_arithmetic(case):
    """Over one tile of codes the FP8 values' dot is `reference.fp8_dots_attention`'s: per-token V scales in the
    e4m3 operand, the row's largest probability times scale at 256, the full-precision tokens after the codes from
    the unrounded query (measured: 29-150x closer to it than it is to exact attention, and 3.3-32x closer than to
    the emulation without the FP8 values' dot)."""
    generator = torch.Generator().manual_seed(0)
    stream = case.stream
    view, _, _ = fill(stream, reference.write, generator, DEVICE)
    query = torch.randn(stream.batch, stream.kv_heads * case.group, case.q_len, stream.head_dim, generator=generator)
    query, scaling = query.to(DEVICE, case.dtype), stream.head_dim**-0.5
    keys, values = reference.materialize(view)
    scales = reference.value_scales(view) if view.per_token else None

    def emulated(fp8_pv):
        return reference.fp8_dots_attention(query, keys, values, scaling=scaling, value_scales=scales, fp8_pv=fp8_pv)

    def error(a, b):
        return ((a - b).abs().mean() / b.abs().mean()).item()

    exact = reference.attend(query.float(), view, scaling=scaling)
    got = attention(query, view, scaling=scaling, fp8_prefill=True).float()
    assert error(got, emulated(True)) < error(emulated(True), exact) / 20
    assert error(got, emulated(True)) < error(got, emulated(False)) / 2.5


def test_fp8_prefill_values_dot_with_per_token_scales_by_target():
    """With per-token V scales the values' dot is FP8 where a dot's operands are in registers (sm_89, sm_120,
    gfx950, the interpreter) and fp16 on wgmma / tcgen05 targets (sm_90, sm_100); per-head scales, FP8
    everywhere. That QK-only kernel still computes the emulated arithmetic: the interpreter's plan with FP8_PV off
    (the interpreter cannot run a GPU target's own plan, whose conversions are the hardware's)."""
    generator = torch.Generator().manual_seed(0)
    views = {s: fill(Stream(scales=s, updates=[150, 130], tiled=True), reference.write, generator, DEVICE)[0]
             for s in ("dynamic", "per-head")}  # fmt: skip
    query = torch.randn(2, 2, 130, 80, generator=generator).to(DEVICE, torch.float16)

    def fp8_pv(view, target):
        plan = AttentionPlan(query, view, None, None, 0.1, target=target, fp8_prefill=True)
        return {options["FP8_PV"] for options in plan.launch_options.values()}

    for arch in ("sm_89", "sm_90", "sm_100", "sm_120", "gfx950"):
        assert fp8_pv(views["dynamic"], EXAMPLE_GPUS[arch]) == {arch in ("sm_89", "sm_120", "gfx950")}, arch
        assert fp8_pv(views["per-head"], EXAMPLE_GPUS[arch]) == {True}, arch
    view = views["dynamic"]
    assert fp8_pv(view, None) == {True}
    plan = AttentionPlan(query, view, None, None, 0.1, fp8_prefill=True)
    for options in plan.launch_options.values():
        options["FP8_PV"] = False  # what sm_90 compiles
    out, launches = plan.launches(query, view, None, None)
    for launch in launches:
        launch.run()
    keys, values = reference.materialize(view)
    scales = reference.value_scales(view)
    qk_only = reference.fp8_dots_attention(query, keys, values, scaling=0.1, value_scales=scales, fp8_pv=False)
    exact = reference.attend(query.float(), view, scaling=0.1)

    def error(a, b):
        return ((a - b).abs().mean() / b.abs().mean()).item()

    assert error(out.float(), qk_only) < error(qk_only, exact) / 5


def test_fp8_prefill_only_where_it_applies():
    """FP8 dots for 128-row tiles over e4m3fn codes with fp16 or bf16 queries, and only when asked."""
    stream = Stream(updates=[140], tiled=True)
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)
    prefill = torch.randn(2, 2, 140, 80, device=DEVICE)

    def uses_fp8(query, **kwargs):
        return AttentionPlan(query, view, None, None, 0.1, **kwargs).launch_options[False, False, False]["FP8_QK"]

    assert uses_fp8(prefill.half(), fp8_prefill=True) and uses_fp8(prefill.bfloat16(), fp8_prefill=True)
    assert not uses_fp8(prefill.half()) and not uses_fp8(prefill, fp8_prefill=True)  # default; fp32 queries
    assert not uses_fp8(prefill[:, :, -1:].half(), fp8_prefill=True)  # a decode step
    stream = Stream(fmt="fp8_e5m2", updates=[140], tiled=True)
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)
    assert not uses_fp8(prefill.half(), fp8_prefill=True)  # e5m2 codes keep fp16 dots


WRITING_CASES = [  # decode steps whose last token the attention launch writes
    Case(),
    Case(splits=3),
    Case(Stream(fmt="fp8_e5m2", head_dim=64, scales="per-tensor"), group=1, splits=2),
    Case(Stream(fmt="fp8_e4m3fnuz", head_dim=256, scales="per-head", updates=[19, 1])),
    Case(Stream(fmt="int8_per_token_head", head_dim=96), group=8, splits=2),
    Case(Stream(recent=8, updates=[5, 1]), splits=2),  # the recent buffer not full: no token gets codes
    Case(Stream(sinks=3, updates=[60, 1]), splits=3),  # sinks alone: the held split writes the new token's codes
    Case(Stream(recent=8, sinks=2, updates=[100, 1], tiled=True), splits=3, options=dict(window=40)),
    Case(Stream(recent=8, sinks=2, updates=[100, 1]), options=dict(window=40, channel=True)),
    Case(Stream(recent=70, sinks=2, updates=[100, 1]), splits=4, mask="padding"),  # 3 splits of held tokens
    Case(Stream(recent=70, sinks=2, updates=[100, 1, 1, 1, 1, 1, 1]), splits=4),  # another held split writes
    Case(Stream(dtype=torch.bfloat16, recent=8, sinks=2, updates=[90, 1], tiled=True), dtype=torch.bfloat16,
         splits=3, mask="padding"),  # fmt: skip
    Case(Stream(recent=4, sinks=2, dtype=torch.float16), dtype=torch.float16, splits=2,
         options=dict(softcap=8.0, sink_logits=True)),  # fmt: skip
    Case(Stream(static=80, recent=4, sinks=2, updates=[30, 1, 1]), splits=2, mask="padding"),
    Case(Stream(static=80, updates=[30, 1])),
    Case(Stream(static=16, ring=True, recent=3, updates=[10, 1, 1, 1, 1, 1, 1, 1, 1, 1]), mask="padding"),
    Case(Stream(static=64, ring=True, recent=3, updates=[60, 1, 1, 1, 1, 1, 1, 1], tiled=True), splits=2),
    Case(Stream(static=80, recent=4, sinks=2, updates=[30, 1, 1], tiled=True), splits=2, mask="padding"),
    Case(Stream(static=80, updates=[30, 1], tiled=True, dtype=torch.bfloat16), dtype=torch.bfloat16, splits=3),
    Case(Stream(rotate=True, recent=8, sinks=2, updates=[100, 1], tiled=True), splits=3, options=dict(window=40)),
    # searched scales: the owner program searches the entering token's (the launch's own when gpu_static finds it
    # costs no spill, `writes_in_launch`)
    Case(Stream(scale_search=16, recent=8, sinks=2, updates=[100, 1], tiled=True), splits=3, mask="padding"),
    Case(Stream(scale_search=16, static=80, updates=[30, 1], tiled=True, dtype=torch.bfloat16), dtype=torch.bfloat16),
    Case(Stream(scale_search=8, fmt="int8_per_token_head", head_dim=96, updates=[20, 1]), group=8, splits=2),
]


def _copy(view: KVView) -> KVView:
    copies = {name: getattr(view, name).clone() for name in ("codes", "scales", "recent", "positions")
              if getattr(view, name) is not None}  # fmt: skip
    if view.static:  # (a static view's host fields are its positions' elements)
        copies.update(end=copies["positions"][0], recent_start=copies["positions"][1])
    return dataclasses.replace(view, **copies)


@pytest.mark.parametrize("case", WRITING_CASES, ids=str)
def test_a_decode_step_written_by_its_attention_launch_is_write_then_attend(case):
    """`attention(new_token=...)`: one launch writes the step's token (the one it replaces in the recent buffer
    gets codes) and attends. The buffers, statistics and static positions it leaves are bit for bit those of
    `write_kv` (which the write tests hold to the oracle), and its output is the attention after that write."""
    stream = case.stream
    generator = torch.Generator().manual_seed(0)
    last = len(stream.updates) - 1
    held = {}

    def write_but_the_last(key, value, view, stats):
        if len(held) == 0 and int(view.end) + key.shape[2] == stream.length:
            held.update(key=key, value=value, before=(int(view.end), int(view.recent_start)), stats=stats.clone())
            return
        reference.write(key, value, view, stats)

    view, _, _ = fill(stream, write_but_the_last, generator, DEVICE)  # positions after the last update
    assert stream.updates[last] == 1 and held
    q_heads = stream.kv_heads * case.group
    query = torch.randn(stream.batch, q_heads, 1, stream.head_dim, generator=generator).to(DEVICE, case.dtype)
    mask = make_mask(case, view, generator)
    if case.options.get("channel"):
        view.key_channel_scale = (torch.rand(stream.kv_heads, stream.head_dim, generator=generator) + 0.5).to(DEVICE)
    sink_logits = torch.randn(q_heads, generator=generator).to(DEVICE) if case.options.get("sink_logits") else None
    kwargs = dict(scaling=stream.head_dim**-0.5, mask=None if mask is None else mask.to(DEVICE),
                  window=case.options.get("window"), softcap=case.options.get("softcap"), sink_logits=sink_logits,
                  num_splits=case.splits)  # fmt: skip
    end, recent_start = held["before"]
    if view.static:  # the device positions as they were before the step
        view.positions[:2] = torch.tensor([end, recent_start])

    apart, apart_stats = _copy(view), held["stats"].clone()
    before = apart if view.static else dataclasses.replace(apart, end=end, recent_start=recent_start)
    write_kv(held["key"], held["value"], before, apart_stats, advance=view.static)
    expected = attention(query, apart, **kwargs)

    fused, fused_stats = _copy(view), held["stats"].clone()
    new_token = NewToken(held["key"], held["value"], fused_stats, recent_start)
    got = attention(query, fused, new_token=new_token, **kwargs)
    for name in ("codes", "scales", "recent", "positions"):
        if getattr(view, name) is not None:
            a, b = getattr(apart, name), getattr(fused, name)
            bits = (lambda t: t.view(torch.uint8)) if name == "codes" else (lambda t: t)  # noqa: E731
            assert torch.equal(bits(a), bits(b)), name
    assert torch.equal(apart_stats, fused_stats)
    assert_close(got, expected.float(), case.dtype)
    if view.static and view.value_tiled:  # the registered op a compiled graph calls (over the Triton layers'
        # layout): the same launch, its merge's counters given
        from hf_fp8kv.kernels import ops

        op, op_stats = _copy(view), held["stats"].clone()
        tickets = torch.zeros(64, dtype=torch.int32, device=DEVICE) if mask is None else None
        settings = {name: kwargs[name] for name in ("scaling", "window", "softcap", "sink_logits")}
        new_token = NewToken(held["key"], held["value"], op_stats)
        out = ops.triton_ops().attend(*_op_args(op, query, kwargs["mask"], case.splits or 1, tickets, new_token,
                                                **settings))  # fmt: skip
        for name in ("codes", "scales", "recent", "positions"):
            if getattr(view, name) is not None:
                assert torch.equal(getattr(op, name).view(torch.uint8), getattr(fused, name).view(torch.uint8)), name
        assert torch.equal(op_stats, fused_stats) and torch.equal(out, got)
        assert tickets is None or not tickets.any()
    del kwargs["num_splits"]
    assert_close(got, reference.attend(query.float(), apart, **kwargs), case.dtype)


SUMMING_CASES = [  # searched decode steps whose attention launch adds the step's queries to the sums
    Case(Stream(scale_search=16, recent=8, sinks=2, updates=[100, 1], tiled=True), splits=3, mask="padding"),
    Case(Stream(scale_search=16, batch=3, updates=[40, 1], dtype=torch.float16), dtype=torch.float16, group=4,
         options=dict(channel=True)),  # fmt: skip
    Case(Stream(scale_search=8, fmt="int8_per_token_head", head_dim=96, updates=[20, 1]), group=8, splits=2),
    Case(Stream(scale_search=16, static=80, updates=[30, 1], tiled=True, dtype=torch.bfloat16), dtype=torch.bfloat16,
         splits=2),  # fmt: skip
]


@pytest.mark.parametrize("writes", [True, False], ids=["write in the launch", "written before"])
@pytest.mark.parametrize("case", SUMMING_CASES, ids=str)
def test_a_searched_decode_step_adds_its_queries_to_the_sums_in_its_launch(case, writes):
    """Given the view's counters (`KVView.search_tickets`), a searched decode step's attention launch adds its
    queries' squares to the layer's sums (`reference.query_energy`, to fp32 rounding), after every write of the
    launch has read them: the codes, scales and output are the launch's without the counters (the sums added after
    it, as a launch of their own did), the counters are back at 0, and a second step adds again. Where the token
    was written before the launch (`write_kv`: outlier tokens, rotated codes, targets that do not write in the
    attention) too; through the registered op a compiled graph calls as well."""
    from hf_fp8kv.kernels import ops

    stream = case.stream
    generator = torch.Generator().manual_seed(0)
    held = {}

    def write_but_the_last(key, value, view, stats):
        if not held and int(view.end) + key.shape[2] == stream.length:
            held.update(key=key, value=value, before=(int(view.end), int(view.recent_start)), stats=stats.clone())
            return
        reference.write(key, value, view, stats)

    view, _, _ = fill(stream, write_but_the_last, generator, DEVICE)
    end, recent_start = held["before"]
    if view.static:
        view.positions[:2] = torch.tensor([end, recent_start])
    if case.options.get("channel"):
        view.key_channel_scale = (torch.rand(stream.kv_heads, stream.head_dim, generator=generator) + 0.5).to(DEVICE)
    query = torch.randn(stream.batch, stream.kv_heads * case.group, 1, stream.head_dim, generator=generator) * 30
    query = query.to(DEVICE, case.dtype)
    mask = make_mask(case, view, generator)
    kwargs = dict(scaling=stream.head_dim**-0.5, mask=None if mask is None else mask.to(DEVICE),
                  num_splits=case.splits)  # fmt: skip

    def step(summing: bool, query: torch.Tensor, op: bool = False):
        copy, stats = _copy(view), held["stats"].clone()
        copy.search_energy = view.search_energy.clone()
        copy.search_tickets = torch.zeros(stream.kv_heads, dtype=torch.int32, device=DEVICE) if summing else None
        new_token = NewToken(held["key"], held["value"], stats, recent_start)
        if not writes:
            before = copy if view.static else dataclasses.replace(copy, end=end, recent_start=recent_start)
            write_kv(held["key"], held["value"], before, stats, advance=view.static)
            if view.static:  # (the write moved the device positions past the token)
                copy.end, copy.recent_start = copy.positions[0], copy.positions[1]
            new_token = None
        if op:
            out = ops.triton_ops().attend(*_op_args(copy, query, kwargs["mask"], case.splits or 1, None, new_token,
                                                    scaling=kwargs["scaling"]))  # fmt: skip
        else:
            out = attention(query, copy, new_token=new_token, **kwargs)
        return out, copy, stats

    expected, apart, apart_stats = step(False, query)
    channel = view.key_channel_scale
    expected_energy = view.search_energy + reference.query_energy(query, stream.kv_heads, channel)
    for op in (False, True) if view.static and view.value_tiled else (False,):
        got, summed, summed_stats = step(True, query, op)
        for name in ("codes", "scales", "recent", "positions"):
            if getattr(view, name) is not None:
                a, b = getattr(apart, name), getattr(summed, name)
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        assert torch.equal(apart_stats, summed_stats) and torch.equal(got, expected)
        assert not summed.search_tickets.any()
        torch.testing.assert_close(summed.search_energy, expected_energy, rtol=1e-5, atol=0)
        assert not torch.equal(summed.search_energy, view.search_energy)
    # a second step over the same counters adds again (each launch leaves them at 0)
    second = torch.randn(query.shape, generator=generator).to(DEVICE, case.dtype)
    attention(second, summed, **kwargs)
    expected_energy += reference.query_energy(second, stream.kv_heads, channel)
    torch.testing.assert_close(summed.search_energy, expected_energy, rtol=1e-5, atol=0)
    assert not summed.search_tickets.any()


def test_query_sums_the_attention_launch_cannot_address_are_refused_by_name():
    stream = Stream(scale_search=16, updates=[20, 1])
    view, _, _ = fill(stream, reference.write, torch.Generator().manual_seed(0), DEVICE)
    query = torch.randn(stream.batch, stream.kv_heads, 1, stream.head_dim, device=DEVICE)
    view.search_tickets = torch.zeros(stream.kv_heads, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"query sums\) needs search_tickets as contiguous int32 \[2\]"):
        attention(query, view, scaling=1.0)
    view.search_tickets = torch.zeros(stream.kv_heads, dtype=torch.int32, device=DEVICE)
    view.search_energy = view.search_energy[:, :40]
    with pytest.raises(ValueError, match=r"query sums\) needs search_energy as contiguous fp32 \[2, 80\]"):
        attention(query, view, scaling=1.0)


def test_a_write_the_attention_launch_cannot_do_is_refused_by_name():
    stream = Stream(recent=4, outliers=2, updates=[40, 1])
    generator = torch.Generator().manual_seed(0)
    view, kv, stats = fill(stream, reference.write, generator, DEVICE)
    query = torch.randn(stream.batch, stream.kv_heads, 1, stream.head_dim, generator=generator).to(DEVICE)
    new = kv[:, :, :, -1:].to(DEVICE)
    with pytest.raises(ValueError, match="without outlier tokens"):
        attention(query, view, scaling=1.0, new_token=NewToken(new[0], new[1], stats, int(view.recent_start)))
    view.outliers = view.outlier_pos = None
    searched = dataclasses.replace(view, scale_search=16, search_energy=torch.ones(3, stream.head_dim, device=DEVICE))
    with pytest.raises(ValueError, match=r"scale_search=16 needs search_energy as contiguous fp32 \[2, 80\]"):
        attention(query, searched, scaling=1.0, new_token=NewToken(new[0], new[1], stats, int(view.recent_start)))
    with pytest.raises(ValueError, match="one new token"):
        attention(query.expand(-1, -1, 2, -1), view, scaling=1.0, new_token=NewToken(new[0], new[1], stats, 0))
    with pytest.raises(ValueError, match="stats must be an int64"):
        attention(query, view, scaling=1.0, new_token=NewToken(new[0], new[1], stats.int(), int(view.recent_start)))


def test_the_launch_writes_a_decode_step_only_where_it_was_measured_clean():
    """`writes_in_launch`: the interpreter and the targets gpu_static measured without a spill; never over rotated
    codes or with outlier tokens (a write launch of its own, as before), never for several tokens."""
    from hf_fp8kv.kernels.targets import EXAMPLE_GPUS
    from hf_fp8kv.kernels.triton_attention import writes_in_launch

    view, _, _ = fill(Stream(recent=4, updates=[20, 1]), reference.write, torch.Generator().manual_seed(0), DEVICE)
    assert writes_in_launch(view, 1, None) and not writes_in_launch(view, 2, None)
    writing = {arch for arch, gpu in EXAMPLE_GPUS.items() if writes_in_launch(view, 1, gpu)}
    assert writing == {"sm_86", "sm_89", "sm_90", "sm_100", "sm_120"}
    assert not writes_in_launch(dataclasses.replace(view, rotate=True), 1, None)
    assert not writes_in_launch(dataclasses.replace(view, outliers=view.recent), 1, EXAMPLE_GPUS["sm_90"])


@pytest.mark.parametrize("rotate", [False, True])
def test_a_static_views_launches_are_planned_without_reading_its_positions(rotate):
    """A compiled graph traces the registered ops' planning with fake tensors: nothing in it may read a static
    view's device positions on the host (a data-dependent branch fails the trace). Planned here under
    `FakeTensorMode`: the write's launches (rotated codes: a write launch of its own) and the attention's, with
    the step's token written by its launch where it can be."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    stream = Stream(static=64, recent=4, sinks=2, updates=[20, 1], tiled=True, rotate=rotate)
    view, _, stats = fill(stream, reference.write, torch.Generator().manual_seed(4), DEVICE)
    query, key = torch.randn(2, 6, 1, 80, device=DEVICE), torch.randn(2, 2, 1, 80, device=DEVICE)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = dataclasses.replace(view, **{name: mode.from_tensor(getattr(view, name)) for name in (
            "codes", "scales", "recent", "sinks", "sink_start", "sink_count", "positions")})  # fmt: skip
        fake.end, fake.recent_start = fake.positions[0], fake.positions[1]
        query, key, stats = mode.from_tensor(query), mode.from_tensor(key), mode.from_tensor(stats)
        with pytest.raises(DataDependentOutputException):  # (what a host read of them meets)
            bool(fake.positions[0] > 0)
        assert [launch.kernel.fn.__name__ for launch in plan_write(key, -key, fake, stats, advance=True)]
        new_token = None if rotate else NewToken(key, -key, stats)
        for mask in (None, torch.ones(2, 1, 1, 64, dtype=torch.bool, device=DEVICE)):  # (made in the mode: fake)
            _, launches = plan_attention(query, fake, scaling=0.1, mask=mask, num_splits=2, new_token=new_token)
            assert launches[0].kwargs["WRITE"] == (not rotate) and launches[0].grid[2] == 2
