"""The torch path of paged rows (`kernels/paged.py`, continuous batching off CUDA) against the oracle: the row
codec round-trips the CPU path's bits, and attention over rows read in place through the pages' geometry is each
request's attention alone, whatever its rows before the window hold; held recent, sink and outlier tokens replace
their codes."""

from dataclasses import replace

import pytest
import torch

from hf_fp8kv.kernels import paged
from hf_fp8kv.kernels.cpu import dequantize_stacked
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.rotation import hadamard
from pages import PAGE_SIZE, build, oracle
from test_triton_paged import CASES, OUTLIER_CASES, RECENT_CASES


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head"])
def test_rows_round_trip_through_the_codec(name, rotate):
    """Rows decode to their codes' values; rotated rows are the codes of the rotated states, decoded and rotated
    back (close to the states)."""
    fmt = FORMATS[name]
    states = torch.randn(2, 3, 7, 24, generator=torch.Generator().manual_seed(0)) * 20
    layout = paged.RowLayout(fmt, True, 3, 24, torch.float32, rotate=rotate)
    stats = torch.zeros(2, 2, dtype=torch.int64)
    rows, nonfinite = paged.encode_rows(states, layout, stats, None)
    assert rows.shape == (7, 2, layout.nbytes) and layout.nbytes % paged.ROW_ALIGNMENT == 0 and not nonfinite
    codes = rows[..., : layout.value_bytes].view(fmt.dtype).unflatten(-1, (3, 24)).permute(1, 2, 0, 3)
    scales = rows[..., layout.scale_bytes].contiguous().view(torch.float32).permute(1, 2, 0)[..., None]
    values = dequantize_stacked(codes, scales, fmt, False)
    decoded = paged.decode_rows(rows, layout, False, None)
    if rotate:
        plain = replace(layout, rotate=False)
        assert torch.equal(rows, paged.encode_rows(hadamard(states), plain, None, None)[0])
        values = hadamard(values)
    assert torch.equal(decoded, values)
    assert (decoded - states).norm() < 0.1 * states.norm()


@pytest.mark.parametrize("per_token, dtype", [(True, None), (False, None), (False, torch.bfloat16)])
def test_pages_hold_key_rows_and_transposed_value_planes(per_token, dtype):
    """The page bytes of `PageGeometry.write`: key rows one after the other, value elements head_dim-major with
    the per-token scales after them (see the module docstring); `read` gives the rows back."""
    fmt = None if dtype else FORMATS["fp8_e4m3"]
    layout = paged.RowLayout(fmt, per_token, 2, 8, dtype or torch.float32)
    geometry = paged.PageGeometry(layer_offset=32, bytes_per_block=2 * 16 * layout.nbytes + 64, block_stride=48,
                                  page_size=16)  # fmt: skip
    pages = torch.zeros(3 * geometry.bytes_per_block, dtype=torch.uint8)
    index = torch.tensor([48 + 5, 2 * 48 + 15, 7])  # (block, slot): (1, 5), (2, 15), (0, 7)
    rows = torch.randint(0, 256, (3, 2, layout.nbytes), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    rows[..., layout.value_bytes + (4 * 2 if per_token else 0) :] = 0  # padding
    geometry.write(pages, layout, index, rows)
    assert torch.equal(geometry.read(pages, layout, index), rows)
    item = 2 if dtype else 1
    for token, (block, slot) in enumerate([(1, 5), (2, 15), (0, 7)]):
        page = block * geometry.bytes_per_block + 32
        key_at = page + slot * layout.nbytes
        assert torch.equal(pages[key_at : key_at + layout.nbytes], rows[token, 0])
        plane = page + 16 * layout.nbytes
        for element in (0, 9, 15):  # value element e of the slot at (e * page_size + slot) * item
            at = plane + (element * 16 + slot) * item
            assert torch.equal(pages[at : at + item], rows[token, 1, element * item : element * item + item])
        if per_token:
            for head in range(2):
                at = plane + 16 * layout.value_bytes + 4 * (head * 16 + slot)
                assert torch.equal(pages[at : at + 4], rows[token, 1, layout.value_bytes + 4 * head :][:4])


# every case, and those with a window again with NaN filler in the rows before it
ATTEND_CASES = [(case, False) for case in CASES] + [(case, True) for case in CASES if case[-1] is not None]


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("case,garbage", ATTEND_CASES, ids=lambda x: str(x) if isinstance(x, tuple) else str(x))
def test_attend_is_each_requests_attention(case, garbage, rotate):
    check(case, garbage_before=case[-1] if garbage else None, rotate=rotate)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("case, recent", RECENT_CASES, ids=str)
def test_held_recent_and_sink_tokens_replace_their_codes(case, recent, rotate):
    """A request's held recent and sink tokens are read from its model-dtype rows (its unheld rows are NaN), every
    other key from its codes (rotated codes: rotated back, the held tokens as they came)."""
    check(case, recent=recent, rotate=rotate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("kwargs", OUTLIER_CASES, ids=str)
def test_outlier_tokens_replace_their_codes(kwargs, rotate, dtype):
    """Each request's outlier tokens, per KV head (request 1's head 0 with an empty slot), are read from its
    model-dtype rows, not from their codes (rotated codes: rotated in, as the held tokens), with its held recent
    and sink tokens; the other requests' and heads' codes of the same positions stay read."""
    check(kwargs["case"], rotate=rotate, recent=kwargs["recent"], outliers=3, dtype=dtype)


def check(case, rotate=False, **options) -> None:
    """`paged.attend` against the oracle on `case` (`options`: `pages.build`'s; `rotate`: rotated codes)."""
    name, dynamic, requests, group, head_dim, window = case
    fmt = FORMATS[name]
    built = build(requests, fmt, 2, head_dim, group, dynamic, rotate=rotate, **options)
    (query, pages, new_rows, read_index, cu_q, k_first, past), geometry, static, expected = built[:4]
    layout = paged.RowLayout(fmt, dynamic, 2, head_dim, options.get("dtype", torch.float32), rotate=rotate)
    out = paged.attend(
        query, pages, new_rows, read_index, cu_q, k_first, past, layout=layout,
        geometry=paged.PageGeometry(geometry["layer_offset"], geometry["bytes_per_block"], geometry["block_stride"],
                                    PAGE_SIZE),
        scaling=head_dim**-0.5, window=window, static_scales=None if static is None else torch.stack(static),
        recent=built[4] if len(built) > 4 else None,
    )  # fmt: skip
    torch.testing.assert_close(out, oracle(expected, head_dim**-0.5, window), rtol=1e-5, atol=1e-5)
