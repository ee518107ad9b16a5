"""Triton kernel of a searched write's weights' source: the squares of a step's queries added to a layer's sums
per KV head and channel (`reference.query_energy`), one launch where the torch ops were 4-8 (`ScaleSearch.observe`:
a prompt's queries, pages, rotated codes; a dense cache's decode step has its attention launch add them,
`add_head_query_energy` in `triton_attention.sums_in_launch`). One program per KV head walks its rows in a fixed
order: the sums do not depend on the launch (no atomics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_search_energy, hadamard, rotation
from .triton_launch import Launch, launch_all, next_power_of_2

ROWS = 16  # query rows per iteration
# steps with up to this many query rows per KV head add their squares in one program per KV head (decode steps:
# launch-bound); longer ones by torch's reduction, which spreads over the GPU
KERNEL_ROWS = 4096


@triton.jit
def add_head_query_energy(energy_row, q_ptr, channel_ptr, q_sb, q_sh, q_sl, q_sd, kv_head, rows, group, q_len, d,
                          d_ok, HAS_CHANNEL: tl.constexpr, ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr,
                          BLOCK_R: tl.constexpr):  # fmt: skip
    """Adds to the fp32 sums at `energy_row` (channels `d`) the squares of KV head `kv_head`'s `rows` query rows
    (batch x `group` query heads x `q_len`, in that order), times the channel scales at `channel_ptr` (HAS_CHANNEL:
    the head's row), rotated (ROTATE_STAGES), `BLOCK_R` rows at a time in a fixed order."""
    per_batch = group * q_len
    total = tl.zeros(d.shape, tl.float32)
    for first in range(0, rows, BLOCK_R):
        r = first + tl.arange(0, BLOCK_R)
        head = kv_head * group + (r % per_batch) // q_len
        at = (r // per_batch).to(tl.int64) * q_sb + head.to(tl.int64) * q_sh + (r % q_len).to(tl.int64) * q_sl
        q = tl.load(q_ptr + at[:, None] + d[None, :] * q_sd, mask=(r < rows)[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        if HAS_CHANNEL:
            q = q * tl.load(channel_ptr + d, mask=d_ok, other=0.0)[None, :]
        if ROTATE_STAGES > 0:
            q = hadamard(q, ROTATE_STAGES, ROTATE_NORM)
        total += tl.sum(q * q, axis=0)
    tl.store(energy_row + d, tl.load(energy_row + d, mask=d_ok) + total, mask=d_ok)


@triton.jit
def _query_energy_kernel(
    q_ptr, energy_ptr, channel_ptr, q_sb, q_sh, q_sl, q_sd, rows, group, q_len, head_dim,
    HAS_CHANNEL: tl.constexpr, ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (kv_head,): `add_head_query_energy` of its `rows` to `energy_ptr`'s row."""
    kv_head = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    add_head_query_energy(energy_ptr + kv_head * head_dim, q_ptr, channel_ptr + kv_head * head_dim, q_sb, q_sh, q_sl,
                          q_sd, kv_head, rows, group, q_len, d, d < head_dim, HAS_CHANNEL, ROTATE_STAGES, ROTATE_NORM,
                          BLOCK_R)  # fmt: skip


def add_query_energy(
    energy: torch.Tensor, query: torch.Tensor, key_channel_scale: torch.Tensor | None = None, rotate: bool = False
) -> None:
    """`energy += reference.query_energy(query, ...)` in one launch (to fp32 rounding: another order of sums);
    `energy` fp32 `[kv_heads, head_dim]`, contiguous."""
    launch_all([plan_query_energy(energy, query, key_channel_scale, rotate)], query.device)


def plan_query_energy(
    energy: torch.Tensor, query: torch.Tensor, key_channel_scale: torch.Tensor | None = None, rotate: bool = False
) -> Launch:
    """The launch of `add_query_energy`."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = energy.shape[0]
    check_search_energy(energy, kv_heads, head_dim, "add_query_energy")
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the energy's {kv_heads} KV heads")
    channel = key_channel_scale if key_channel_scale is not None else energy
    return Launch(_query_energy_kernel, (kv_heads,), (
        query, energy, channel, *query.stride(), batch * q_heads // kv_heads * q_len, q_heads // kv_heads, q_len,
        head_dim,
    ), dict(HAS_CHANNEL=key_channel_scale is not None, **rotation(rotate, head_dim), BLOCK_R=ROWS,
            BLOCK_D=next_power_of_2(head_dim), num_warps=2))  # fmt: skip
