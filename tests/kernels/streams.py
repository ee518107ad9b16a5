"""Layer buffers filled from a token stream by the reference write path, and what they must hold.

A stream is written in updates (a prefill, then decode steps or chunks) as a cache layer would; the expected
keys and values of token t are its full-precision value if it is still in the recent window (or a sink), else
its value quantized once, when it left the window: `expected_kv` computes that independently of the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.formats import FORMATS
from hf_fp8kv.kernels.rotation import hadamard
from hf_fp8kv.kernels.view import VALUE_TILE, KVView


@dataclass
class Stream:
    fmt: str = "fp8_e4m3"
    batch: int = 2
    kv_heads: int = 2
    head_dim: int = 80
    updates: list[int] = field(default_factory=lambda: [50, 1, 1, 7, 1])  # tokens per update
    scales: str = "dynamic"  # or "per-tensor", "per-head"
    recent: int = 0
    sinks: int = 0
    sink_rows: list[int] | None = None  # each row's first real token (default 0)
    static: int = 0  # max_cache_len of a static (device-positions) layer; 0: dynamic
    ring: bool = False  # static: a window of `static` tokens, its codes in a ring (of `static - recent` slots)
    dtype: torch.dtype = torch.float32
    scale_dtype: torch.dtype = torch.bfloat16  # of per-token scales (the layers'; pages hold fp32)
    tiled: bool = False  # value codes tiled (the Triton backend's layout, `KVView.value_tiled`)
    rotate: bool = False  # codes of the rotated keys and values (`KVView.rotate`)
    outliers: int = 0  # outlier slots per row and KV head (`KVView.outliers`; per-token scales, no ring)
    scale_search: int = 0  # per-token scales searched among this many candidates, keys weighted (`search_energy`)

    @property
    def length(self) -> int:
        return sum(self.updates)

    def __str__(self) -> str:
        fields = [f"{k}={v}" for k, v in vars(self).items() if v != getattr(Stream, k, None)]
        return ",".join(fields) or "default"


def tokens(stream: Stream, generator: torch.Generator) -> torch.Tensor:
    """`[2, batch, kv_heads, length, head_dim]` keys (with outlier channels) and values."""
    fmt = FORMATS[stream.fmt]
    shape = (stream.batch, stream.kv_heads, stream.length, stream.head_dim)
    keys = torch.randn(shape, generator=generator) * 2
    keys[..., :3] *= 20
    values = torch.randn(shape, generator=generator) * (4.0 if fmt.max < 1000 else 40.0)
    return torch.stack([keys, values]).to(stream.dtype)


def search_energy(stream: Stream) -> torch.Tensor:
    """The queries' energy of a stream's searches (`KVView.search_energy`): some channels 0 (no query reads them),
    the last head none yet (weights 1)."""
    energy = torch.rand(stream.kv_heads, stream.head_dim, generator=torch.Generator().manual_seed(7)) ** 4 * 1e3
    energy[:, 1::7] = 0
    energy[-1] = 0
    return energy


def static_scales(stream: Stream, generator: torch.Generator) -> torch.Tensor:
    fmt = FORMATS[stream.fmt]
    heads = stream.kv_heads if stream.scales == "per-head" else 1
    per_head = (torch.rand(heads, generator=generator) * 0.5 + 0.5).expand(stream.kv_heads)
    return torch.stack([per_head * 60.0 / fmt.max, per_head * 12.0 / fmt.max]).reshape(2, 1, stream.kv_heads, 1)


def empty_view(stream: Stream, generator: torch.Generator, device="cpu") -> KVView:
    fmt = FORMATS[stream.fmt]
    # static: codes for all but the recent tokens, + the spare slot; tiled values: whole blocks (as the layers
    # allocate them; a ring keeps its size)
    slots = max(stream.static - stream.recent, 1) if stream.static else stream.length + 3
    if stream.tiled and not stream.ring:
        slots += -slots % VALUE_TILE
    slots += bool(stream.static)
    shape = (2, stream.batch, stream.kv_heads, slots, stream.head_dim)
    codes = torch.full(shape, 0x55, dtype=torch.uint8).view(fmt.dtype)
    if stream.scales == "dynamic":
        scales = torch.full(shape[:4], -1.0, dtype=stream.scale_dtype)
    else:
        scales = static_scales(stream, generator)
    recent = torch.zeros(*shape[:3], stream.recent, stream.head_dim, dtype=stream.dtype) if stream.recent else None
    positions = torch.zeros(3, dtype=torch.int64, device=device) if stream.static else None  # (and a write ticket)
    view = KVView(
        codes=codes.to(device), scales=scales.to(device), fmt=fmt, per_token=stream.scales == "dynamic",
        end=positions[0] if stream.static else 0, recent_start=positions[1] if stream.static else 0,
        recent=None if recent is None else recent.to(device), ring=stream.ring, positions=positions,
        value_tiled=stream.tiled, columns=stream.static, rotate=stream.rotate, scale_search=stream.scale_search,
        search_energy=search_energy(stream).to(device) if stream.scale_search else None,
    )  # fmt: skip
    return view


def advance(view: KVView, stream: Stream, new_tokens: int) -> None:
    """Positions after an update of `new_tokens`, as the layers keep them."""
    if view.static:
        view.positions[0] += new_tokens
        torch.maximum(view.positions[1], view.positions[0] - stream.recent, out=view.positions[1])
    else:
        view.end += new_tokens
        view.recent_start = max(view.recent_start, view.end - stream.recent)


def attach_sinks(view: KVView, stream: Stream, kv: torch.Tensor) -> None:
    """The sink tokens of each row (its first `stream.sinks` real tokens), as a layer captures them."""
    if not stream.sinks:
        return
    end = int(view.end)
    rows = stream.sink_rows or [0] * stream.batch
    view.sinks = torch.zeros(2, stream.batch, stream.kv_heads, stream.sinks, stream.head_dim, dtype=stream.dtype)
    counts = [max(0, min(stream.sinks, end - r)) for r in rows]
    for row, (first, count) in enumerate(zip(rows, counts)):
        view.sinks[:, row, :, :count] = kv[:, row, :, first : first + count]
    device = view.codes.device
    view.sinks = view.sinks.to(device)
    view.sink_start = torch.tensor(rows, device=device)
    view.sink_count = torch.tensor(counts, device=device)
    view.sink_rows = rows


def attach_outliers(view: KVView, stream: Stream, kv: torch.Tensor, generator: torch.Generator) -> None:
    """Outlier tokens as `hf_fp8kv/outliers.py` keeps them: per row and KV head, up to `stream.outliers` random coded
    tokens past the row's sinks (row 1's head 0 fewer, so empty slots show), exact in `view.outliers`, their key
    scales negated."""
    if not stream.outliers:
        return
    device = view.codes.device
    positions = torch.full((stream.batch, stream.kv_heads, stream.outliers), -1, dtype=torch.int64)
    rows = stream.sink_rows or [0] * stream.batch
    for row in range(stream.batch):
        coded = torch.arange(rows[row] + stream.sinks, int(view.recent_start))
        for head in range(stream.kv_heads):
            count = min(stream.outliers // (2 if (row, head) == (1, 0) else 1), len(coded))
            positions[row, head, :count] = coded[torch.randperm(len(coded), generator=generator)[:count]]
    view.outliers = torch.zeros(2, stream.batch, stream.kv_heads, stream.outliers, stream.head_dim, dtype=stream.dtype)
    for row, head, slot in (positions >= 0).nonzero().tolist():
        view.outliers[:, row, head, slot] = kv[:, row, head, positions[row, head, slot]]
        view.scales[0, row, head, int(positions[row, head, slot]) - view.offset] *= -1
    view.outliers, view.outlier_pos = view.outliers.to(device), positions.to(device)


def fill(stream: Stream, write, generator: torch.Generator, device="cpu", edges=None):
    """Write the stream's tokens update by update with `write(key, value, view, stats)` (`edges`: a
    function that edits the tokens first); returns the view after the last update, the tokens and the clipped /
    non-finite counts."""
    kv = tokens(stream, generator)
    if edges is not None:
        kv = edges(kv)
    view = empty_view(stream, generator, device)
    stats = torch.zeros(2, 2, dtype=torch.int64, device=device)
    first = 0
    for new in stream.updates:
        chunk = kv[:, :, :, first : first + new].to(device)
        write(chunk[0], chunk[1], view, stats)
        advance(view, stream, new)
        first += new
    attach_sinks(view, stream, kv)
    attach_outliers(view, stream, kv, generator)
    if stream.ring:  # a ring shows the last `static` tokens
        view.start = 0
    return view, kv, stats


def expected_kv(stream: Stream, kv: torch.Tensor, view: KVView) -> torch.Tensor:
    """Each token's keys and values as the cache must serve them: quantized once (with the scale it had when it
    left the window) unless it is among the newest `recent` or a row's sinks; rotated codes rotated back.
    `[2, batch, heads, length, D]`."""
    fmt = FORMATS[stream.fmt]
    x = kv.float()
    coded = hadamard(x) if stream.rotate else x
    if stream.scale_search:  # (the weights broadcast against [2, batch, heads, tokens, D])
        weight = reference.search_weights(search_energy(stream))
        scale = reference.searched_scale(coded, fmt, stream.scale_dtype, stream.scale_search, weight)
        scale = scale[..., None]
    elif stream.scales == "dynamic":
        scale = reference.dynamic_scale(coded, fmt, stream.scale_dtype)[..., None]
    else:
        scale = view.scales.cpu()[..., None]
    codes, _, _ = reference.quantize(coded, scale, fmt)
    out = reference.dequantize(codes, scale, fmt)
    if stream.rotate:
        out = hadamard(out)
    end = stream.length
    if stream.recent:
        out[:, :, :, max(end - stream.recent, 0) :] = x[:, :, :, max(end - stream.recent, 0) :]
    if stream.sinks:
        rows = stream.sink_rows or [0] * stream.batch
        for row, first in enumerate(rows):
            out[:, row, :, first : first + stream.sinks] = x[:, row, :, first : first + stream.sinks]
    if view.outliers is not None:
        for row, head, slot in (view.outlier_pos >= 0).nonzero().tolist():
            t = int(view.outlier_pos[row, head, slot])
            out[:, row, head, t] = x[:, row, head, t]
    return out
