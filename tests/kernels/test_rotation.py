"""The Hadamard rotation of rotated codes (`kernels/rotation.py`) against the matrix it stands for."""

import pytest
import torch

from hf_fp8kv.kernels.rotation import hadamard, hadamard_block


def sylvester(size: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of a power-of-two `size`, built by Sylvester's doubling."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return h / size**0.5


@pytest.mark.parametrize("head_dim,block", [(2, 2), (64, 64), (80, 16), (96, 32), (112, 16), (128, 128), (256, 256)])
def test_rotation_is_block_diagonal_sylvester(head_dim, block):
    assert hadamard_block(head_dim) == block
    x = torch.randn(3, 5, head_dim, dtype=torch.float64)
    expected = (x.unflatten(-1, (head_dim // block, block)) @ sylvester(block)).flatten(-2)
    torch.testing.assert_close(hadamard(x).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_rotation_is_orthonormal_and_its_own_inverse(head_dim):
    x = torch.randn(7, head_dim)
    y = hadamard(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(hadamard(y), x, rtol=1e-5, atol=1e-6)
    q = torch.randn(7, head_dim)
    torch.testing.assert_close((hadamard(q) * y).sum(-1), (q * x).sum(-1), rtol=1e-4, atol=1e-4)


def test_rotation_spreads_an_outlier_channel_over_its_block():
    x = torch.zeros(96)
    x[37] = 8.0  # channel 37 lies in the second 32-channel block
    y = hadamard(x)
    assert torch.equal(y[32:64].abs(), torch.full((32,), 8.0 / 32**0.5))
    assert not y[:32].any() and not y[64:].any()
