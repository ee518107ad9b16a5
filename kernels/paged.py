"""Paged rows (continuous batching): the row format, its torch codec, and attention over rows read in place.

A row is one token's keys (or values) of one layer: `[codes of every KV head | fp32 scale per KV head]`
(per-token scales), `[codes]` (one scale per KV head) or the model-dtype values (a layer kept in the model
dtype), padded to `ROW_ALIGNMENT` bytes. A layer's page in a block holds `page_size` tokens in two planes of
`page_size * row_bytes` bytes, at byte `(p // block_stride) * bytes_per_block + layer_offset` for the token at
physical index `p` (its slot `p % block_stride`): the geometry of transformers' paged cache (`PageGeometry`). The
key plane holds the rows one after the other (slot `s` at `s * row_bytes`). The value plane holds them
transposed, head_dim-major: value element `e` (of `kv_heads * head_dim`) of slot `s` at `(e * page_size + s)` times
the element size, then the per-token scales, head `h`'s of slot `s` at `value_bytes * page_size + 4 * (h *
page_size + s)`. A tile of consecutive slots then reads each value channel as one vector, the layout the
tensor cores' P x V takes (token-major values were read a byte at a time: `triton_paged`).

Request r owns query rows `[cu_q[r], cu_q[r + 1])` and sees `past[r] + q_len` keys: the first `past[r]` read from
the pages through `read_index[k_first[r] : k_first[r] + past[r]]`, the last `q_len` from `new_rows` (this
step's tokens, encoded as rows `[tokens, 2, row_bytes]`), causally (query i is key `past + i`), and within
`window` keys when it is set. `attend` is the torch path (and the Triton paged kernel's reference): each
request's rows are gathered, decoded and attended in turn, never the whole cache.

With recent and sink tokens (`RecentRows`), each request also holds its newest and first tokens in the model's
dtype beside its pages, and those keys are read from there instead of from their codes, as the dense cache reads
its recent and sink buffers; so are its outlier tokens, per KV head (the pages, which requests share through the
prefix cache, are not marked: the kept tokens' positions say which codes not to read).

Rotated codes (`RowLayout.rotate`): the codes hold each token's keys and values times a Hadamard matrix
(`rotation.py`), as the dense cache's do; they are rotated back when decoded. The held recent and sink tokens stay
as they came (outlier tokens too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .cpu import attention_in_space, dequantize_stacked, write_stacked
from .formats import PER_TOKEN_SCALE_DTYPE, StorageFormat
from .reference import search_weights, searched_scale
from .rotation import hadamard

ROW_ALIGNMENT = 16  # bytes: rows padded to it load as 16-byte vectors (gpu_static: byte loads, 0.36-0.61 SASS
# instructions per KV byte in the paged decode loop and no pipelining, before)


def row_size(value_bytes: int, scaled_heads: int) -> int:
    """Bytes of one page row: `value_bytes` of codes, a 4-byte scale per head of `scaled_heads`, padded to
    `ROW_ALIGNMENT`."""
    return -(-(value_bytes + 4 * scaled_heads) // ROW_ALIGNMENT) * ROW_ALIGNMENT


@dataclass(frozen=True)
class RowLayout:
    """One token's keys (or values) of one layer in a page: its codes, then its scales (per-token only)."""

    fmt: StorageFormat | None  # None: the model dtype (a layer kept in it)
    per_token: bool
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model dtype
    key_channel: torch.Tensor | None = None  # static per-channel key scales [kv_heads, head_dim] (keys divided by)
    rotate: bool = False  # codes of the keys and values times a Hadamard matrix (`rotation.py`)
    scale_search: int = 0  # per-token scales searched among this many candidates (`reference.searched_scale`)

    @property
    def value_bytes(self) -> int:
        itemsize = 1 if self.fmt is not None else self.dtype.itemsize
        return self.kv_heads * self.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the row, padded so that rows start on 16 bytes (the kernel loads 16-byte vectors)."""
        return row_size(self.value_bytes, self.kv_heads if self.per_token else 0)

    @property
    def scale_bytes(self) -> slice:
        """Where a row's per-token scales lie."""
        return slice(self.value_bytes, self.value_bytes + 4 * self.kv_heads)


@dataclass(frozen=True)
class PageGeometry:
    """Where one layer's tokens lie in the page bytes (see the module docstring)."""

    layer_offset: int
    bytes_per_block: int
    block_stride: int
    page_size: int

    def locate(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (block, slot) of physical indices."""
        return index // self.block_stride, index % self.block_stride

    def read(self, pages: torch.Tensor, layout: RowLayout, index: torch.Tensor) -> torch.Tensor:
        """The rows `[tokens, 2, row bytes]` of the tokens at physical indices `index`."""
        keys, values, scales = self._planes(pages, layout)
        blocks, slots = self.locate(index)
        rows = pages.new_zeros(index.numel(), 2, layout.nbytes)
        rows[:, 0] = keys[blocks, slots]
        rows[:, 1, : layout.value_bytes] = values[blocks, :, slots].flatten(1)
        if scales is not None:
            rows[:, 1, layout.scale_bytes] = scales[blocks, :, slots].flatten(1)
        return rows

    def write(self, pages: torch.Tensor, layout: RowLayout, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows `[tokens, 2, row bytes]` at physical indices `index`."""
        keys, values, scales = self._planes(pages, layout)
        blocks, slots = self.locate(index)
        keys[blocks, slots] = rows[:, 0]
        values[blocks, :, slots] = rows[:, 1, : layout.value_bytes].unflatten(-1, values.shape[1::2])
        if scales is not None:
            scales[blocks, :, slots] = rows[:, 1, layout.scale_bytes].unflatten(-1, scales.shape[1::2])

    def _planes(self, pages: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Views of the layer's pages: key rows `[blocks, page_size, row bytes]`, value elements `[blocks,
        kv_heads * head_dim, page_size, element bytes]`, per-token value scales `[blocks, kv_heads, page_size, 4]`
        (None without them)."""
        blocks, size, row = pages.numel() // self.bytes_per_block, self.page_size, layout.nbytes
        keys = pages.as_strided((blocks, size, row), (self.bytes_per_block, row, 1), self.layer_offset)
        elements = layout.kv_heads * layout.head_dim
        item = layout.value_bytes // elements
        value_at = self.layer_offset + size * row
        values = pages.as_strided((blocks, elements, size, item), (self.bytes_per_block, size * item, item, 1),
                                  value_at)  # fmt: skip
        if not layout.per_token:
            return keys, values, None
        scales = pages.as_strided((blocks, layout.kv_heads, size, 4), (self.bytes_per_block, size * 4, 4, 1),
                                  value_at + size * layout.value_bytes)  # fmt: skip
        return keys, values, scales


@dataclass(frozen=True)
class RecentRows:
    """One layer's recent, sink and outlier tokens in the model's dtype, per request, beside its pages.

    `rows` `[slots * per_slot, 2 (K, V), kv_heads, head_dim]`, `per_slot = recent + sinks + outliers`: the request
    holding slot s keeps its token at position t at row `s * per_slot + t % recent` while t is among its newest
    `recent` tokens, its sink token t (t < `sinks`) at row `s * per_slot + recent + t`, and per KV head h its
    outlier tokens (coded tokens kept exact too, `hf_fp8kv/outliers.py`'s rule) at rows `s * per_slot + recent +
    sinks + i`, head h's token at position `outlier_pos[s, h, i]` (int32 `[slots, kv_heads, outliers]`, -1: an
    empty slot; its codes are in the pages too, read from these rows instead). `requests` (int32 `[4, requests]`,
    on the rows' device; `host`: the same as lists) gives, per request of the step: its slot, its sink tokens held
    (keys `[0, count)` are read from the sink rows; full-attention layers only), the position from which keys are
    read from the recent rows, and the position of its first key (sliding layers read from their window's start).
    """

    rows: torch.Tensor
    recent: int
    sinks: int
    requests: torch.Tensor
    host: tuple[list[int], list[int], list[int], list[int]]
    outliers: int = 0
    outlier_pos: torch.Tensor | None = None

    @property
    def per_slot(self) -> int:
        return self.recent + self.sinks + self.outliers

    def lay_over(self, kv: torch.Tensor, request: int, as_held: Callable = torch.Tensor.float) -> None:
        """Replace, in request `request`'s decoded keys and values `kv` (`[2, kv_heads, keys, head_dim]`), the
        codes of its held recent, sink and outlier tokens by their model-dtype rows (`as_held` of them)."""
        slot, sinks, recent_start, key_start = (column[request] for column in self.host)
        base, keys = slot * self.per_slot, kv.shape[2]
        if sinks:  # (full-attention layers only: their keys start at position 0)
            kv[:, :, :sinks] = as_held(self.rows[base + self.recent : base + self.recent + sinks].permute(1, 2, 0, 3))
        first = max(recent_start - key_start, 0)
        if first < keys:
            ring = base + torch.arange(key_start + first, key_start + keys, device=self.rows.device) % self.recent
            kv[:, :, first:] = as_held(self.rows[ring].permute(1, 2, 0, 3))
        if self.outliers:
            column = self.outlier_pos[slot].long() - key_start  # [kv_heads, outliers]
            heads, kept = torch.nonzero((column >= 0) & (column < keys), as_tuple=True)
            held = self.rows[base + self.recent + self.sinks + kept, :, heads]  # [tokens, 2, head_dim]
            kv[:, heads, column[heads, kept]] = as_held(held).transpose(0, 1)

    def codes_read(self, request: int) -> bool:
        """Whether request `request` reads any key from its codes (one before its recent tokens, not a sink)."""
        _, sinks, recent_start, key_start = (column[request] for column in self.host)
        return recent_start - key_start > sinks


def encode_rows(
    states: torch.Tensor, layout: RowLayout, stats: torch.Tensor | None, static_scales: torch.Tensor | None,
    search_energy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool]:
    """Page rows `[tokens, 2, row bytes]` of `states` (`[2, kv_heads, tokens, head_dim]`, keys divided by the
    per-channel key scales already): codes and scales as `cpu.write_stacked` writes them (the bits the dense cache
    stores; `static_scales`: `[2, kv_heads]`, None for per-token ones; rotated first with `layout.rotate`;
    searched with `layout.scale_search`, the keys weighted by the queries' `search_energy` `[kv_heads, head_dim]`),
    or the model-dtype values of a layer kept in it; and whether an input (rotated) was non-finite."""
    tokens = states.shape[2]
    rows = torch.zeros(tokens, 2, layout.nbytes, dtype=torch.uint8, device=states.device)
    codes = _stored_values(rows, layout)
    if layout.fmt is None:
        codes.copy_(states)
        return rows, False
    if static_scales is None:
        scale = rows[..., layout.scale_bytes].view(torch.float32).permute(1, 2, 0)[..., None]
    else:
        scale = static_scales[:, :, None, None]
    if layout.rotate:
        states = hadamard(states)
    if layout.scale_search > 1:  # the searched scales, then a write under them (as the dense cache's)
        weight = search_weights(search_energy)[:, 0]
        scale.copy_(searched_scale(states, layout.fmt, PER_TOKEN_SCALE_DTYPE, layout.scale_search, weight)[..., None])
        return rows, write_stacked(states, codes, scale, layout.fmt, False, stats)
    return rows, write_stacked(states, codes, scale, layout.fmt, static_scales is None, stats, PER_TOKEN_SCALE_DTYPE)


def _stored_values(rows: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """The codes (or model-dtype values) of page rows `[tokens, 2, row bytes]`, as `[2, kv_heads, tokens, head_dim]`."""
    dtype = layout.dtype if layout.fmt is None else layout.fmt.dtype
    values = rows[..., : layout.value_bytes].view(dtype).unflatten(-1, (layout.kv_heads, layout.head_dim))
    return values.permute(1, 2, 0, 3)


def decode_rows(
    rows: torch.Tensor, layout: RowLayout, has_nan: bool, static_scales: torch.Tensor | None, rotated: bool = False
) -> torch.Tensor:
    """fp32 keys and values `[2, kv_heads, tokens, head_dim]` of page rows `[tokens, 2, row bytes]` (rotated back
    with `layout.rotate`, before the per-channel key scales, the inverse of `encode_rows`; `rotated`: left in the
    rotated space)."""
    codes = _stored_values(rows, layout)
    if layout.fmt is None:
        return codes.float()
    if static_scales is None:
        scale = rows[..., layout.scale_bytes].contiguous().view(torch.float32).permute(1, 2, 0)[..., None]
    else:
        scale = static_scales[:, :, None, None]
    kv = dequantize_stacked(codes, scale, layout.fmt, has_nan)
    if layout.rotate and not rotated:
        kv = hadamard(kv)
    if layout.key_channel is not None:
        kv[0] *= layout.key_channel.to(kv.device)[:, None, :]
    return kv


def attend(
    query: torch.Tensor,
    pages: torch.Tensor,
    new_rows: torch.Tensor,
    read_index: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    k_first: torch.Tensor,
    past: torch.Tensor,
    *,
    layout: RowLayout,
    geometry: PageGeometry,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    static_scales: torch.Tensor | None = None,
    has_nan: bool = True,
    recent: RecentRows | None = None,
) -> torch.Tensor:
    """Attention `[tokens, q_heads, head_dim]` (the query's dtype) of `query` `[tokens, q_heads, head_dim]`: each
    request's queries over its own rows (see the module docstring), one request at a time; the held recent and
    sink tokens from `recent`. Rotated codes are attended in the rotated space, as the dense torch path does
    (`cpu.attend`): the query and the output rotated, the held tokens rotated in, where the request reads codes."""
    out = torch.zeros_like(query)
    cu_q, firsts, pasts = cu_seq_lens_q.tolist(), k_first.tolist(), past.tolist()
    for r, (first, count) in enumerate(zip(firsts, pasts)):
        q_first, q_len = cu_q[r], cu_q[r + 1] - cu_q[r]
        if not q_len:
            continue
        rows = new_rows[q_first : q_first + q_len]
        if count:
            rows = torch.cat((geometry.read(pages, layout, read_index[first : first + count]), rows))
        rotated = (layout.rotate and layout.fmt is not None and layout.key_channel is None
                   and (recent is None or recent.codes_read(r)))  # fmt: skip
        kv = decode_rows(rows, layout, has_nan, static_scales, rotated)
        if recent is not None:
            recent.lay_over(kv, r, hadamard if rotated else torch.Tensor.float)
        out[q_first : q_first + q_len] = attention_in_space(
            rotated, query[q_first : q_first + q_len].transpose(0, 1)[None], kv[0][None], kv[1][None],
            scaling=scaling, window=window, softcap=softcap, sink_logits=sink_logits,
        )[0].transpose(0, 1).to(query.dtype)  # fmt: skip
    return out
