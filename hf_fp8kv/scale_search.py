"""Per-token scales searched within an octave (`QuantizedFP8Cache(..., scale_search=16)`): the write tries
`candidates` scales per token and KV head and keeps the one with the least error (`reference.searched_scale`).

The keys' error counts each channel by the queries' mean square on it: the error a key adds to `q.k` is
`sum_c q_c e_c`, whose mean square over queries is about `sum_c E[q_c^2] e_c^2`. A layer keeps the sum of its
queries' squares per KV head and channel (the energy), over every query its attention has read (after the
attention: a token is coded against the queries before its own step, on every backend; a decode step's attention
launch adds them itself on the Triton backend, once every write of the launch has read them), in the space the
keys are coded in (times the per-channel key scales, rotated with the codes). The write turns it into integer weights
(`reference.search_weights`: 1 before any query; the values' always 1, their error reaches the output as
`sum_t p_t e_t`). Measured: docs/recent.md.
"""

from __future__ import annotations

import torch

CANDIDATES = (2, 4, 8, 16, 32, 64, 128)  # a power of two: evenly spread significands of a bf16 scale's binade


def check_scale_search(candidates: int) -> int:
    """`scale_search` checked: 0 (off) or a number of candidates (`CANDIDATES`)."""
    if isinstance(candidates, bool) or candidates not in (0, *CANDIDATES):
        raise ValueError(f"scale_search={candidates!r}: expected 0 (off) or a number of candidates in {CANDIDATES}")
    return candidates


class ScaleSearch:
    """One layer's scale search: its candidates (0: off) and, once allocated, the queries' energy per KV head and
    channel (`energy`, fp32 `[kv_heads, head_dim]`) and the counters with which a decode step's attention launch
    adds to it (`tickets`, int32 `[kv_heads]`, left at 0 by each launch: `KVView.search_tickets`)."""

    tickets: torch.Tensor | None = None  # (a search pickled before the counters: its sums take a launch of their own)

    def __init__(self, candidates: int):
        self.candidates = candidates
        self.energy: torch.Tensor | None = None

    def allocate(self, kv_heads: int, head_dim: int, device: torch.device) -> None:
        if self.candidates:
            self.energy = torch.zeros(kv_heads, head_dim, dtype=torch.float32, device=device)
            self.tickets = torch.zeros(kv_heads, dtype=torch.int32, device=device)
            if not torch.compiler.is_compiling():  # fixed addresses: a compiled step's CUDA graph adds to them
                for buffer in (self.energy, self.tickets):
                    torch._dynamo.mark_static_address(buffer)

    def view(self) -> dict:
        """The view's fields: what the write needs, and the attention launch that adds a step's queries."""
        if not self.candidates:
            return {}
        return dict(scale_search=self.candidates, search_energy=self.energy, search_tickets=self.tickets)

    def observe(self, query: torch.Tensor, key_channel_scale: torch.Tensor | None, rotate: bool, backend) -> None:
        """Add the squares of the queries `[batch, q_heads, q_len, head_dim]` an attention has read to the energy,
        in the space the keys are coded in (`reference.query_energy`), by `backend` (`kernels/ops.py`). Statistics,
        not a path for gradients: a forward pass that tracks them keeps no graph in the cache."""
        if self.candidates:
            backend.add_query_energy(self.energy, query.detach(), key_channel_scale, rotate)

    def reset(self) -> None:
        """Forget the queries (a reset cache starts over)."""
        if self.energy is not None:
            self.energy.zero_()
