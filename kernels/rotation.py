"""Rotation before quantizing ("incoherent processing", FlashAttention-3's FP8 trick): the codes hold `x H`, an
orthonormal Walsh-Hadamard transform of each key and value over the head dimension. FP8 rounding error is relative
per element: a few large channels (RoPE'd keys have outlier channel pairs) carry the error of q.k; H spreads them
over every channel. Attention is unchanged, `q.k = (qH).(kH)` and `sum p v = (sum p (vH)) H` (H is symmetric and
its own inverse), so the kernels rotate the query once and the codes' share of the output back once.

H is block-diagonal, in blocks of the largest power of two dividing head_dim (64, 128, 256: one block; 80 and
112: 16; 96: 32). It is applied as butterfly stages in this file's order, the Triton kernels'
(`triton_common.hadamard`) too, so both give the same bits. Only codes are rotated: the recent and sink tokens stay
in the model's dtype as they came (a context shorter than the recent window is exact).
"""

from __future__ import annotations

import math

import torch


def hadamard_block(head_dim: int) -> int:
    """The Hadamard blocks' size: the largest power of two dividing `head_dim`."""
    return head_dim & -head_dim


def hadamard_stages(head_dim: int) -> int:
    """Butterfly stages of the transform (log2 of the block)."""
    return hadamard_block(head_dim).bit_length() - 1


def hadamard_norm(head_dim: int) -> float:
    """The orthonormal factor `1 / sqrt(block)` as an fp32 number (what the kernels multiply by)."""
    return float(torch.tensor(1 / math.sqrt(hadamard_block(head_dim)), dtype=torch.float32))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """`x H` over the last dim in fp32: stage h adds and subtracts channels h apart in groups of 2h (h = 1, 2, 4,
    ... up to half the block), then the orthonormal factor. Its own inverse (up to rounding)."""
    head_dim = x.shape[-1]
    y = x.to(torch.float32, copy=True)
    spare = torch.empty_like(y)
    for stage in range(hadamard_stages(head_dim)):
        h = 1 << stage
        a, b = y.unflatten(-1, (head_dim // (2 * h), 2, h)).unbind(-2)
        total, difference = spare.unflatten(-1, (head_dim // (2 * h), 2, h)).unbind(-2)
        # into a spare buffer, in place: half the time of stacking new tensors (2048 tokens x 3 heads x 64, one
        # CPU thread: 63 ms against 120 ms), the same bits
        torch.add(a, b, out=total)
        torch.sub(a, b, out=difference)
        y, spare = spare, y
    return y.mul_(hadamard_norm(head_dim))
