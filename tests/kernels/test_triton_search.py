"""The query-energy kernel (`triton_search`) against the oracle (`reference.query_energy`): the sums of a step's
squared queries per KV head and channel, times the key channel scales, rotated, added to the running sums."""

import pytest
import torch

from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.triton_search import add_query_energy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("head_dim, q_len, dtype, channel, rotate", [
    (64, 1, torch.float32, False, False),  # a decode step
    (80, 5, torch.bfloat16, True, True),  # block-diagonal rotation (16-wide blocks), padded channels
    (128, 37, torch.float16, True, False),  # several row blocks per program
    (64, 1, torch.bfloat16, False, True),
], ids=str)  # fmt: skip
def test_query_energy_is_the_oracles_sum(head_dim, q_len, dtype, channel, rotate):
    """Added to sums already there, from a strided query (the projections' layout, heads transposed), GQA groups of
    3 over 2 KV heads and a batch of 2: the oracle's sums to fp32 rounding (the kernel sums in another order)."""
    generator = torch.Generator().manual_seed(4)
    batch, kv_heads, group = 2, 2, 3
    query = (torch.randn(batch, q_len, kv_heads * group, head_dim, generator=generator) * 3).to(dtype).transpose(1, 2)
    scale = torch.rand(kv_heads, head_dim, generator=generator) + 0.5 if channel else None
    before = torch.rand(kv_heads, head_dim, generator=generator) * 100
    energy = before.clone().to(DEVICE)
    add_query_energy(energy, query.to(DEVICE), None if scale is None else scale.to(DEVICE), rotate)
    expected = before + reference.query_energy(query, kv_heads, scale, rotate)
    torch.testing.assert_close(energy.cpu(), expected, rtol=1e-5, atol=0)


def test_bad_energy_is_named():
    query = torch.randn(1, 6, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"add_query_energy needs search_energy as contiguous fp32 \[2, 64\]"):
        add_query_energy(torch.zeros(2, 64, dtype=torch.float64, device=DEVICE), query)
    with pytest.raises(ValueError, match="query has 6 heads, not a multiple of the energy's 4 KV heads"):
        add_query_energy(torch.zeros(4, 64, device=DEVICE), query)
