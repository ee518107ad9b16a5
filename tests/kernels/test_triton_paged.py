"""The Triton paged attention and row writer (continuous batching) against the oracle and the torch codec:
requests with cached pages at scattered physical indices and new rows, mixed query lengths (decode and chunked
prefill), GQA, sliding windows, every storage format, per-token and per-head scales, recent, sink and outlier
tokens held in full precision beside the pages."""

import math
from dataclasses import replace

import pytest
import torch

from hf_fp8kv.kernels import paged, reference
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.ops import TritonBackend
from hf_fp8kv.kernels.rotation import hadamard_stages
from hf_fp8kv.kernels.targets import EXAMPLE_GPUS
from hf_fp8kv.kernels.triton_common import encoding
from hf_fp8kv.kernels.triton_paged import page_tile_tokens, paged_attention, plan_paged_attention, write_rows
from pages import PAGE_SIZE, build, oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


CASES = [
    ("fp8_e4m3", True, [(0, 5), (7, 1), (3, 4), (12, 1)], 2, 16, None),
    ("fp8_e4m3", True, [(9, 3), (0, 1), (17, 1)], 3, 24, 6),  # head_dim not a power of 2, a sliding window
    ("fp8_e5m2", False, [(5, 1), (0, 18), (2, 2)], 1, 16, None),  # a prefill longer than a query block
    ("fp8_e4m3fnuz", False, [(11, 1), (4, 7)], 4, 32, 5),
    ("int8_per_token_head", True, [(6, 2), (33, 1)], 2, 16, None),  # past over several key tiles
    # (query position, head) rows over several row blocks: 160 and 100 rows of 64, with and without a window
    ("fp8_e4m3", True, [(5, 40), (2, 1)], 4, 16, None),
    ("fp8_e4m3", False, [(30, 50), (0, 3)], 2, 32, 7),
    # head_dim >= V_AS_COLUMNS_FROM: V tiles loaded as K's and transposed
    ("fp8_e4m3", True, [(9, 2), (20, 1)], 2, 128, None),
    ("fp8_e5m2", False, [(3, 5), (14, 1)], 1, 160, 6),
]


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # fp32 dots, else fp16 dots
DTYPE_CASES = [  # a model-dtype query: the query scaled and cast to fp16 once, both dots in fp16
    (torch.bfloat16, ("fp8_e4m3", True, [(9, 3), (0, 1), (17, 1)], 4, 64, None)),
    (torch.float16, ("fp8_e5m2", False, [(40, 1), (3, 20)], 2, 32, 9)),
]


# (case, (recent tokens, sink tokens, position of the first key)): held rows with decode and chunked prefill,
# fewer recent tokens than a prefill's queries, a sliding layer's keys from position 5 (no sinks), static scales
RECENT_CASES = [
    (CASES[0], (4, 2, 0)),
    (CASES[2], (8, 4, 0)),
    (CASES[1], (6, 3, 5)),
    (CASES[4], (3, 0, 0)),
    (CASES[7], (16, 4, 0)),
    (("fp8_e4m3", True, [(30, 1), (12, 1)], 2, 16, 10), (4, 0, 3)),  # a sliding layer's decode steps alone
]


def check(dtype, case, block_padding: int = 8, garbage: bool = False, recent=None, page_size=PAGE_SIZE,
          new_in_pages=False, rotate=False, num_splits=None, outliers=0, search=False) -> dict:  # fmt: skip
    """The kernel's output against the reference on `case` (`garbage`: NaN filler in the rows before the window;
    `recent`: `(R, S, key_start)` rows held in full precision, see `pages.build`, with `outliers` outlier tokens
    per request and KV head; `rotate`: rotated codes;
    `num_splits`: KV splits of a decode step, then the reduce; `search`: the launch adds the queries to a searched
    layer's sums, which must then hold the oracle's `query_energy` more (a dtype: sums of it); returns the attention
    launch's constexprs (what the kernel was told of its rows) and grid."""
    name, dynamic, requests, group, head_dim, window = case
    fmt = FORMATS[name]
    kv_heads = 2
    built = build(requests, fmt, kv_heads, head_dim, group, dynamic, block_padding=block_padding,
                  garbage_before=window if garbage else None, recent=recent, dtype=dtype,
                  page_size=page_size, new_in_pages=new_in_pages, rotate=rotate, outliers=outliers)  # fmt: skip
    tensors, layout, static, expected = built[:4]
    held = None if recent is None else replace(
        built[4], rows=built[4].rows.to(DEVICE), requests=built[4].requests.to(DEVICE),
        outlier_pos=None if built[4].outlier_pos is None else built[4].outlier_pos.to(DEVICE),
    )  # fmt: skip
    scaling = head_dim**-0.5
    query, pages, new_rows, read_index, cu_q, k_first, past = (t.to(DEVICE) for t in tensors)
    query = query.to(dtype)
    expected = [(q.to(dtype).float(), k, v) for q, k, v in expected]  # the oracle sees the same rounded query
    static = tuple(s.to(DEVICE) for s in static) if static else None
    if new_in_pages:  # the new rows' bytes are in the pages: the kernel must not read them from `new_rows`
        new_rows = torch.full_like(new_rows, 0xFF)
    energy = None
    if search:
        energy = torch.rand(kv_heads, head_dim, generator=torch.Generator().manual_seed(3))
        energy = energy.to(DEVICE, torch.float32 if search is True else search)
    before = None if energy is None else energy.clone()
    out, launches = plan_paged_attention(query, pages, new_rows, read_index, cu_q, k_first, past, fmt=fmt,
                                         scaling=scaling, window=window, static_scales=static, recent=held,
                                         new_in_pages=new_in_pages, rotate=rotate, num_splits=num_splits,
                                         search_energy=energy, **layout)  # fmt: skip
    for launch in launches:
        launch.run()
    if search:
        added = reference.query_energy(query.transpose(0, 1)[None], kv_heads)
        torch.testing.assert_close(energy, before + added, rtol=1e-5, atol=0)
    want = oracle(expected, scaling, window)
    error = (out.cpu() - want).abs().max().item() / want.abs().max().item()
    assert error < TOLERANCE[dtype], f"{name}: relative error {error}"
    # (with splits, the partial results' running sums: `[tokens x q_heads, splits]`)
    sums = launches[0].args[13].view(-1, num_splits, 2)[..., 1].cpu() if len(launches) > 1 else None
    return {**launches[0].kwargs, "grid": launches[0].grid, "launches": len(launches), "sums": sums}


# rotated codes: decode and prefill, a head_dim of 8-channel Hadamard blocks, V tiles as columns, model dtypes
ROTATED_CASES = [(torch.float32, CASES[i], True) for i in (0, 1, 2, 8)] + [(*case, True) for case in DTYPE_CASES]


@pytest.mark.parametrize("dtype, case, rotate", [(torch.float32, case, False) for case in CASES]
                         + [(*case, False) for case in DTYPE_CASES] + ROTATED_CASES)  # fmt: skip
def test_paged_attention_matches_reference(dtype, case, rotate):
    told = check(dtype, case, rotate=rotate)  # blocks of 8 padding bytes: byte-wise scale loads
    assert not told["ALIGNED"] and not told["PAGE_TILES"]  # 4-token pages: each token's slot read on its own
    assert told["ROTATE_STAGES"] == (rotate and hadamard_stages(case[4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case, recent, rotate", [(*case, False) for case in RECENT_CASES]
                         + [(*RECENT_CASES[i], True) for i in (0, 1, 4)] + [(CASES[5], (8, 2, 0), True)],
                         ids=str)  # fmt: skip (the last: 160 rows of prefill, its crowded 32-token tiles)
def test_recent_and_sink_tokens_are_read_in_full_precision(dtype, case, recent, rotate):
    """Each request's held recent and sink tokens (its unheld rows NaN) read from the model-dtype rows, the others
    from the codes, in one softmax: the oracle over exactly those values (rotated codes: their share of the output
    rotated back before the held tokens join it, whose scores take the query as it came)."""
    check(dtype, case, recent=recent, rotate=rotate)


@pytest.mark.parametrize("q_len", [1, 5])
def test_rotation_leaves_a_context_of_held_tokens_unchanged(q_len):
    """Every key held in full precision (no codes read): the rotated kernel's output is the unrotated one's, bit
    for bit."""
    outputs = []
    for rotate in (False, True):
        built = build([(6, q_len), (0, q_len)], FORMATS["fp8_e4m3"], 2, 16, 2, True, recent=(16, 2, 0),
                      dtype=torch.bfloat16)  # fmt: skip
        (query, *tensors), layout = built[0], built[1]
        out, (launch,) = plan_paged_attention(query.to(torch.bfloat16), *tensors, fmt=FORMATS["fp8_e4m3"],
                                              scaling=0.25, recent=built[4], rotate=rotate, **layout)  # fmt: skip
        launch.run()
        outputs.append(out)
    assert torch.equal(*outputs)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]])
def test_aligned_rows_take_the_vector_path(case):
    """Blocks of a multiple of 16 bytes: the kernel is told its rows are aligned (16-byte code loads, 4-byte
    scale loads) and still gives the reference's output."""
    assert check(torch.float32, case, block_padding=16)["ALIGNED"]


# (case, page size): pages of 16 and 64 tokens, read in tiles of consecutive slots (the tile shrinks to a 16-token
# page, and to a divisor of a sliding window), decode and chunked prefill, every request's last page part-written
PAGE_TILE_CASES = [
    (("fp8_e4m3", True, [(40, 1), (7, 3), (100, 1)], 2, 16, None), 16),
    (("fp8_e5m2", False, [(70, 2), (0, 9)], 4, 32, 32), 16),
    (("fp8_e4m3", True, [(130, 1), (64, 1), (5, 40)], 2, 128, None), 64),
    (("int8_per_token_head", True, [(90, 1), (33, 20)], 1, 16, 48), 64),
    (("fp8_e4m3fnuz", False, [(75, 4)], 2, 24, 64), 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case, page_size", PAGE_TILE_CASES, ids=str)
def test_page_tiles_read_whole_value_tiles(dtype, case, page_size):
    """Pages of a multiple of 16 tokens: each tile's values are read whole from its page's transposed value plane
    (the slots a request has not written, and those before the window, hold NaN codes and must reach no output)."""
    told = check(dtype, case, block_padding=16, garbage=case[-1] is not None, page_size=page_size)
    assert told["PAGE_TILES"] and told["ALIGNED"] and page_size % told["BLOCK_N"] == 0


@pytest.mark.parametrize("page_size, rotate", [(16, False), (64, False), (16, True)])
def test_page_tiles_with_recent_and_sink_tokens(page_size, rotate):
    """Held recent and sink tokens beside page tiles: the codes' first tile starts at the sinks' end, mid-tile."""
    told = check(torch.float32, PAGE_TILE_CASES[0][0], block_padding=16, recent=(16, 5, 0), page_size=page_size,
                 rotate=rotate)  # fmt: skip
    assert told["PAGE_TILES"]


@pytest.mark.parametrize("case, page_size", [*PAGE_TILE_CASES[:3], (CASES[1], PAGE_SIZE), (CASES[2], PAGE_SIZE)],
                         ids=str)
@pytest.mark.parametrize("dtype, rotate", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_this_steps_keys_read_from_the_pages(case, page_size, dtype, rotate):
    """A full-attention layer's step: the new tokens are written before the attention and listed in the read
    indices after the past ones; they are read from the pages (`new_rows` hold NaN codes here)."""
    told = check(dtype, case, block_padding=16, page_size=page_size, new_in_pages=True, rotate=rotate)
    assert told["NEW_IN_PAGES"]


# decode steps (one query per request) split over their keys: scattered slots and page tiles, held tokens, a
# window, this step's keys in the pages or the new rows, rotated codes; more splits than tiles (empty splits)
SPLIT_CASES = [
    (dict(case=("fp8_e4m3", True, [(40, 1), (7, 1), (100, 1)], 2, 16, None)), 3),
    (dict(case=("fp8_e5m2", False, [(70, 1), (0, 1), (33, 1)], 4, 32, 32), page_size=16, block_padding=16), 2),
    (dict(case=("fp8_e4m3", True, [(130, 1), (64, 1)], 2, 128, None), page_size=64, block_padding=16), 4),
    (dict(case=("int8_per_token_head", True, [(90, 1), (17, 1)], 1, 16, None), recent=(16, 4, 0)), 3),
    (dict(case=("fp8_e4m3", True, [(90, 1), (20, 1)], 2, 16, None), page_size=16, block_padding=16,
          recent=(16, 5, 0), rotate=True), 5),
    (dict(case=("fp8_e4m3fnuz", False, [(60, 1), (9, 1)], 2, 24, None), new_in_pages=True), 2),
    (dict(case=("fp8_e4m3", True, [(20, 1), (3, 1)], 2, 16, None), page_size=16, block_padding=16), 7),
    (dict(case=("fp8_e4m3", True, [(70, 1), (30, 1)], 2, 16, 24), recent=(8, 0, 2)), 3),  # a sliding layer's
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs, splits", SPLIT_CASES, ids=str)
def test_decode_split_over_the_keys_matches_reference(dtype, kwargs, splits):
    """Each request's keys split `splits` ways (the last split also reading the new rows and held tokens), the
    partial results merged by the reduce: the oracle's output, as one program per request gives it."""
    told = check(dtype, **kwargs, num_splits=splits)
    assert told["SPLIT"] and told["grid"][2] == splits and told["launches"] == 2
    sums = told["sums"]  # each split its own share of the keys: not every split the same sum (all keys read by each)
    assert (sums != sums[:, :1]).any(dim=1).all()
    if splits == 7:  # 20 and 3 past keys in 16-token tiles: splits 2-5 read nothing (the last: the new rows)
        assert (sums[:, 2:6] == 0).all() and (sums[:, 6] > 0).all()


# (check's arguments): outlier tokens beside held recent and sink tokens, 3 per KV head (request 1's head 0: 1, and
# an empty slot): decode and chunked prefill (this step's coded tokens among them, read from the new rows or the
# pages), a prefill over several row blocks, page tiles, head_dim 128, per-head scales
OUTLIER_CASES = [
    dict(case=CASES[0], recent=(4, 2, 0)),
    dict(case=CASES[2], recent=(8, 4, 0)),
    dict(case=CASES[5], recent=(8, 2, 0)),
    dict(case=("fp8_e4m3", True, [(30, 2), (40, 1)], 2, 128, None), recent=(8, 4, 0), new_in_pages=True),
    dict(case=PAGE_TILE_CASES[0][0], recent=(16, 5, 0), page_size=16, block_padding=16),
    dict(case=PAGE_TILE_CASES[2][0], recent=(16, 4, 0), page_size=64, block_padding=16, new_in_pages=True),
]


@pytest.mark.parametrize("dtype, rotate", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("kwargs", OUTLIER_CASES, ids=str)
def test_outlier_tokens_are_read_from_their_rows_not_their_codes(dtype, rotate, kwargs):
    """Each request's outlier tokens (per KV head, by position) are left out of the codes' tiles and read from its
    model-dtype rows with the held tokens (rotated codes: after the codes' share is rotated back): the oracle
    over exactly those values, where reading a kept token's codes too, or only them, is off."""
    told = check(dtype, **kwargs, rotate=rotate, outliers=3)
    assert told["HAS_OUTLIERS"] and told["OUTLIER_BLOCK"] == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs, splits", [(dict(SPLIT_CASES[3][0], outliers=8), 3),
                                            (dict(SPLIT_CASES[4][0], outliers=5), 5)], ids=str)  # fmt: skip
def test_split_decode_reads_outlier_tokens_once(dtype, kwargs, splits):
    """Decode split over the keys: every split leaves the outlier tokens out of its share of the codes, the last
    reads them with the held tokens."""
    told = check(dtype, **kwargs, num_splits=splits)
    assert told["SPLIT"] and told["HAS_OUTLIERS"] and told["launches"] == 2


def test_prefill_and_single_split_steps_are_not_split():
    """A step with a prefill (several queries in a request) runs one program per row block whatever `num_splits`
    asks; one split is the plain kernel."""
    told = check(torch.float32, CASES[0], num_splits=4)
    assert not told["SPLIT"] and told["launches"] == 1
    told = check(torch.float32, SPLIT_CASES[0][0]["case"], num_splits=1)
    assert not told["SPLIT"] and told["launches"] == 1


def test_page_tile_sizes():
    assert page_tile_tokens(64, 256, None) == 64
    assert page_tile_tokens(64, 16, None) == 16  # a page smaller than the tile
    assert page_tile_tokens(64, 256, 4096) == 64 and page_tile_tokens(64, 256, 48) == 16
    assert page_tile_tokens(64, 4, None) is None and page_tile_tokens(64, 256, 50) is None


def test_rows_of_the_wrong_size_are_refused():
    fmt = FORMATS["fp8_e4m3"]
    tensors, layout, _, _ = build([(2, 1)], fmt, 2, 16, 1, True)
    query, pages, new_rows, read_index, cu_q, k_first, past = tensors
    with pytest.raises(ValueError, match="rows of 48 bytes"):
        paged_attention(query, pages, new_rows, read_index, cu_q, k_first, past, fmt=fmt, scaling=1.0,
                        static_scales=(torch.ones(2), torch.ones(2)), **layout)  # fmt: skip


EDGES = [0.0, -0.0, 1e-30, -1e-30, 447.0, 449.0, 1e30, -1e30, math.inf, -math.inf, math.nan, 2.0**-10, 0.5, -2.5]


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("name, dynamic, search", [
    (name, dynamic, search) for name, fmt in FORMATS.items() for dynamic in (True, False) for search in (0, 16)
    if (dynamic or not fmt.per_token_only) and (dynamic or not search)
])  # fmt: skip
def test_encoded_rows_are_the_torch_codecs_bits(name, dynamic, search, rotate):
    """The Triton row writer against `paged.encode_rows` (the bits the CPU path stores): the same bytes, the same
    clipped and non-finite counts, edge values included; the pages it writes are `PageGeometry.write`'s bytes.
    Rotated: the edges' inf - inf make NaN, whose sign IEEE leaves to the hardware, so NaN codes compare as one.
    `search`: per-token scales searched, the keys weighted by a layer's query energy (a head without any)."""
    fmt = FORMATS[name]
    generator = torch.Generator().manual_seed(3)
    kv_heads, tokens, head_dim = 3, 21, 24
    states = torch.randn(2, kv_heads, tokens, head_dim, generator=generator) * 40
    states[0, 1, 4, : len(EDGES)] = torch.tensor(EDGES)
    states[1, 2, 7] = 0.0  # an all-zero row: the tiny scale
    static = None if dynamic else (torch.tensor([0.5, 0.02, 1.0]), torch.tensor([0.1, 0.3, 0.05]))
    want_stats = torch.zeros(2, 2, dtype=torch.int64)
    layout = paged.RowLayout(fmt, dynamic, kv_heads, head_dim, torch.float32, rotate=rotate, scale_search=search)
    energy = torch.rand(kv_heads, head_dim, generator=generator) ** 4 * torch.tensor([[1.0], [1e3], [0.0]])
    want, _ = paged.encode_rows(states, layout, want_stats, None if dynamic else torch.stack(static), energy)
    if search:  # (it searched: other scales than the amax ones)
        unsearched, _ = paged.encode_rows(states, replace(layout, scale_search=0), want_stats.clone(), None)
        assert not torch.equal(want, unsearched)
    stats = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    # 16-token pages of 2 layers in blocks of 3 (the second layer's), the tokens scattered over them
    geometry = paged.PageGeometry(2 * 16 * layout.nbytes, 4 * 16 * layout.nbytes + 16, 64, 16)
    index = torch.randperm(3 * 16, generator=generator)[:tokens]
    index = index // 16 * geometry.block_stride + index % 16
    want_pages = torch.randint(0, 256, (3 * geometry.bytes_per_block,), generator=generator, dtype=torch.uint8)
    pages = want_pages.to(DEVICE)
    geometry.write(want_pages, layout, index, want)
    rows = write_rows(states.to(DEVICE), fmt, stats, tuple(s.to(DEVICE) for s in static) if static else None,
                      pages, geometry, index.to(DEVICE), rotate, search, energy.to(DEVICE))  # fmt: skip
    rows, pages = rows.cpu(), pages.cpu()
    if rotate:
        rows, want = one_nan_code(rows, layout), one_nan_code(want, layout)
        for written in (pages, want_pages):  # (the tokens' codes in the pages, read as rows and written back)
            geometry.write(written, layout, index, one_nan_code(geometry.read(written, layout, index), layout))
    assert torch.equal(rows, want) and torch.equal(pages, want_pages)
    # inf, -inf, NaN; rotated: their Hadamard block of 8 channels
    assert torch.equal(stats.cpu(), want_stats) and want_stats[0, 1] == (8 if rotate else 3)


def test_a_searched_row_write_without_its_sums_or_per_token_scales_is_refused():
    states = torch.randn(2, 3, 4, 24, device=DEVICE)
    geometry = paged.PageGeometry(0, 4 * 16 * 96, 16, 16)
    pages = torch.zeros(4 * geometry.bytes_per_block, dtype=torch.uint8, device=DEVICE)
    index, stats = torch.arange(4, device=DEVICE), torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    fmt = FORMATS["fp8_e4m3"]
    static = (torch.ones(3, device=DEVICE), torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="scale_search=16 searches per-token scales; these rows have static ones"):
        write_rows(states, fmt, stats, static, pages, geometry, index, False, 16, torch.ones(3, 24, device=DEVICE))
    for energy in (None, torch.ones(3, 12, device=DEVICE), torch.ones(24, 3, device=DEVICE).t()):
        with pytest.raises(ValueError, match=r"scale_search=16 needs search_energy as contiguous fp32 \[3, 24\]"):
            write_rows(states, fmt, stats, None, pages, geometry, index, False, 16, energy)


def one_nan_code(rows: torch.Tensor, layout: paged.RowLayout) -> torch.Tensor:
    """Page rows with every NaN code of theirs (not of their scales) made the format's one NaN code."""
    codes = rows[..., : layout.value_bytes]
    nan = codes.view(layout.fmt.dtype).float().isnan()
    return torch.cat((codes.masked_fill(nan, encoding(layout.fmt)["NAN_CODE"]), rows[..., layout.value_bytes :]), -1)


@pytest.mark.parametrize("dtype, case, kwargs", [
    (torch.float32, CASES[0], {}), (torch.float32, SPLIT_CASES[3][0]["case"], dict(num_splits=3)),  # split
    (torch.bfloat16, DTYPE_CASES[0][1], dict(recent=(4, 2, 0))), (*DTYPE_CASES[1], {}),
], ids=str)  # fmt: skip
def test_the_launch_adds_the_queries_to_a_searched_layers_sums(dtype, case, kwargs):
    """`search_energy`: the first program of each KV head adds every query row's squares (`reference.query_energy`,
    to fp32 rounding); the output is the attention's as without them. Rotated queries are refused (their sums take
    a launch of their own)."""
    check(dtype, case, search=True, **kwargs)
    with pytest.raises(ValueError, match="adds no rotated queries"):
        check(torch.float32, CASES[0], search=True, rotate=True)


def test_sums_the_paged_launch_cannot_add_are_refused_by_name():
    """Sums of the wrong dtype are refused naming the launch; a call the paged kernel does not serve (a softcap
    goes the torch way) refuses sums rather than leave them out."""
    with pytest.raises(ValueError, match=r"paged attention's query sums needs search_energy as contiguous fp32 \[2,"):
        check(torch.float32, CASES[0], search=torch.float64)
    layout = paged.RowLayout(FORMATS["fp8_e4m3"], True, 2, 16, torch.float32)
    assert TritonBackend().paged_sums_in_attention(layout, 4) and not TritonBackend().paged_sums_in_attention(
        layout, 4, softcap=30.0
    )  # fmt: skip
    with pytest.raises(ValueError, match="search_energy is for the paged kernel's calls"):
        TritonBackend().paged_attend(torch.zeros(1, 4, 16), *[None] * 6, layout=layout, geometry=None, scaling=0.25,
                                     softcap=30.0, search_energy=torch.zeros(2, 16))  # fmt: skip


@pytest.mark.parametrize("case", [case for case in CASES if case[-1] is not None], ids=str)
def test_rows_before_the_window_are_never_read(case):
    """NaN filler in the cached rows no query's window reaches (what a freed or recycled page holds) reaches no
    output: the first key tile starts before the window, its earlier rows are masked out of the loads."""
    check(torch.float32, case, garbage=True)


def test_a_grid_past_the_limits_is_refused_naming_the_launch():
    """A 131k-token chunk at GQA 8 has 32,768 row blocks of 32 rows on the grid's z axis; a 262k-token one would
    need 65,536, past its 65,535: refused naming the launch (planned on meta tensors)."""

    def grid(requests: int, q_len: int, kv_heads: int = 8, group: int = 8, head_dim: int = 128) -> tuple:
        tokens, row_bytes = requests * q_len, paged.row_size(kv_heads * head_dim, kv_heads)
        meta = dict(device="meta")
        query = torch.empty(tokens, kv_heads * group, head_dim, dtype=torch.bfloat16, **meta)
        rows = torch.empty(tokens, 2, row_bytes, dtype=torch.uint8, **meta)
        lengths = [torch.empty(requests + n, dtype=torch.int32, **meta) for n in (1, 0, 0)]
        _, (launch,) = plan_paged_attention(
            query, torch.empty(4096, dtype=torch.uint8, **meta), rows, torch.empty(1, dtype=torch.int64, **meta),
            *lengths, fmt=FORMATS["fp8_e4m3"], kv_heads=kv_heads, layer_offset=0, bytes_per_block=4096,
            block_stride=512, page_size=256, scaling=0.1, max_q_len=q_len, target=EXAMPLE_GPUS["sm_90"],
        )  # fmt: skip
        return launch.grid

    assert grid(1, 131072) == (1, 8, 32768)
    with pytest.raises(ValueError, match=r"paged attention \(requests, KV heads, row blocks.*\): grid \(1, 8, 65536\)"):
        grid(1, 262144)
