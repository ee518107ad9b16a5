"""What one layer's attention reads: FP8 codes over a timeline, plus recent and sink tokens in full precision.

Tokens are numbered by their position in the sequence (the timeline, shared by every batch row, padding
included). A layer stores:

- codes `[2, batch, kv_heads, slots, head_dim]` (keys, values) of the storage format, token t at slot
  `(t - offset) % slots` (a linear buffer when the tokens fit, a ring for static sliding-window layers: it holds
  the last `slots` tokens before `recent_start`), only for the tokens before `recent_start` (the recent ones have
  none: each token is stored once),
  with scales `[2, 1 | batch, kv_heads, 1 | slots]` (one per KV head, or per token and KV head), of each token's
  K/V or (`rotate`) of them times a Hadamard matrix (`rotation.py`). Keys are
  token-major; values too, or (`value_tiled`, the Triton backend's buffers) head_dim-major in blocks of
  `VALUE_TILE` slots, the last block as wide as the slots left: a (batch, head) plane's slot s, channel d is at
  element `first * head_dim + d * width + (s - first)` of the plane, `first` the block's first slot, `width`
  its slots. The attention's PV dot takes values reduced over tokens, so this is the layout its operand needs
  (FP8 bytes cannot be transposed on their way from shared memory: `docs/benchmarks.md`, issue 21);
- `recent` `[2, batch, kv_heads, R, head_dim]` in the model's dtype: the recent tokens `[recent_start, end)` at
  slot `t % R`;
- `sinks` `[2, batch, kv_heads, S, head_dim]` in the model's dtype: row b's sink tokens
  `[sink_start[b], sink_start[b] + sink_count[b])` (its first real tokens) at slot `t - sink_start[b]`;
- `outliers` `[2, batch, kv_heads, N, head_dim]` in the model's dtype: coded tokens kept exact too, per row and
  KV head, token `outlier_pos[b, h, i]` (`[batch, kv_heads, N]`, -1: an empty slot) at slot i; their key scales
  (per-token scales) are stored negated (`outliers.py`).

The attention sees tokens `[start, end)`: sink tokens from `sinks`, tokens at or after `recent_start` from
`recent`, a head's outlier tokens from `outliers`, every other one from the codes (so each token is read from
exactly one place).

Positions are Python ints, or (static buffers: CUDA graphs, `torch.compile`) 0-dim views of `positions`, an int64
device tensor `[end, recent_start]`; static buffers have one slot more than they hold, at the end, where writes
with nowhere to go land, and their mask covers positions `[0, max_len)`. Their tokens lie on `columns` columns
(`max_len`, or a ring's `min(window, max_len)`: token t at column t, or t % columns), which the torch path lays
them out on; the codes have `columns - R` slots (whole blocks of tiled values: the codes of `max_len` tokens less
the `R` recent ones, or of a ring's tokens before the recent ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, TypeVar

import torch

from .formats import StorageFormat

VALUE_TILE = 64  # slots per block of head_dim-major value codes (`value_tiled`)
Derived = TypeVar("Derived")  # what `KVView.derived` builds
Position = int | torch.Tensor  # a Python int, or a 0-dim int64 device tensor (static buffers)


def coded_end(end: Position, recent_start: Position, new_tokens: int, recent_slots: int) -> Position:
    """The end of the tokens with codes once `new_tokens` more are written after `end`: those among the newest
    `recent_slots` are held only in the recent buffer (each token is stored once)."""
    return max(recent_start, end + new_tokens - recent_slots) if recent_slots else end + new_tokens


def scale_dtypes(view: "KVView") -> tuple[torch.dtype, ...]:
    """The dtypes a view's scales may have: fp32, and for per-token scales bf16 (rounded up when written)."""
    return (torch.float32, torch.bfloat16) if view.per_token else (torch.float32,)


class NewToken(NamedTuple):
    """A decode step's new token for the attention launch to write (`triton_write.write_kv`'s work, no launch of
    its own): its keys and values `[batch, kv_heads, 1, head_dim]`, the write's statistics (`write_kv`'s `stats`)
    and the view's `recent_start` before it (the view given with it is the one after it; a static view's device
    positions are the ones before it, and the launch moves them)."""

    key: torch.Tensor
    value: torch.Tensor
    stats: torch.Tensor
    recent_start: int = 0


@dataclass(kw_only=True, slots=True)
class KVView:
    codes: torch.Tensor
    scales: torch.Tensor
    fmt: StorageFormat
    end: Position
    recent_start: Position
    per_token: bool = False  # scales per token and KV head (else one per KV head)
    start: Position = 0
    offset: int = 0
    ring: bool = False  # the codes are a ring (static sliding layers); else token t is at slot t - offset
    recent: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    sink_start: torch.Tensor | None = None
    sink_count: torch.Tensor | None = None
    sink_rows: list[int] | None = None  # host positions: each row's first sink token (-1: none yet)
    outliers: torch.Tensor | None = None
    outlier_pos: torch.Tensor | None = None
    key_channel_scale: torch.Tensor | None = None
    rotate: bool = False  # the codes hold each token's K/V times a Hadamard matrix (`rotation.py`)
    scale_search: int = 0  # per-token scales searched among this many candidates (`reference.searched_scale`)
    search_energy: torch.Tensor | None = None  # the queries' energy its weights come from, fp32 [kv_heads, head_dim]
    # int32 [kv_heads] zeros: where given, a decode step's attention launch adds its queries to `search_energy`
    # itself, the last of each KV head's programs to have written (`triton_attention.sums_in_launch`)
    search_tickets: torch.Tensor | None = None
    has_nan: bool = True  # NaN codes may exist (the bit decode then needs its NaN select)
    value_tiled: bool = False  # value codes head_dim-major in blocks of VALUE_TILE slots (else token-major)
    positions: torch.Tensor | None = None  # device positions: int64 [2] holding `end`, `recent_start`
    mask_start: int | None = None  # the position of the mask's first column (None: the mask ends at `end`)
    columns: int = 0  # static buffers: the columns their tokens lie on (see the module docstring)
    memo: dict | None = None  # launch arguments derived from the buffers, kept by the layer's kernel handle

    @property
    def static(self) -> bool:
        """Positions on the device (static buffers)."""
        return self.positions is not None

    @property
    def slots(self) -> int:
        """Slots that hold tokens (static buffers have one more at the end, where writes with nowhere to go land)."""
        return self.codes.shape[3] - self.static

    def layout(self) -> tuple:
        """Everything about the buffers that a kernel plan depends on (not their contents, slots, positions or
        device, which a layer's kernel handle never changes): the key of every plan cache, so that no field can
        leave a plan stale."""
        shape, static = self.codes.shape, self.positions is not None
        return (
            self.fmt.name, shape[:3], shape[4], self.per_token, static, self.ring,
            None if self.recent is None else self.recent.shape[3], None if self.sinks is None else self.sinks.shape[3],
            self.key_channel_scale is not None, self.has_nan, self.rotate, self.scale_search,
            self.search_tickets is not None,
            None if self.outliers is None else self.outliers.shape[3],
            self.value_tiled and (shape[3] - static) % VALUE_TILE == 0,  # (tiled values in whole blocks)
        )  # fmt: skip

    def check_layout(self) -> None:
        """The buffers' layout is one the kernels address: tiled values in contiguous (batch, head) planes."""
        if self.value_tiled:
            check_tiled_plane(self.codes[1])

    def buffers(self) -> tuple:
        """The tensors the view reads (what launch arguments derive from)."""
        return (self.codes, self.scales, self.recent, self.sinks, self.sink_start, self.sink_count, self.positions,
                self.key_channel_scale, self.outliers, self.outlier_pos, self.search_energy,
                self.search_tickets)  # fmt: skip

    def derived(self, owner: object, build: Callable[["KVView"], Derived], *uses: torch.Tensor | None) -> Derived:
        """`build(self)`: what depends on the buffers alone (launch arguments, views of them), kept in `memo`
        under `owner` for the next views of the same buffers: built again when one of the buffers it `uses`
        (default: all of them) is another object. The entry holds them, so their ids, compared as ints, cannot be
        reused by others while it lives."""
        if self.memo is None:
            return build(self)
        buffers = uses or self.buffers()
        ids = tuple(map(id, buffers))
        entry = self.memo.get(owner)
        if entry is None or entry[1] != ids:
            entry = self.memo[owner] = (buffers, ids, build(self))
        return entry[2]

    def sink_spans(self) -> dict[tuple[int, int], list[int]]:
        """`{(first token, count): [rows]}` of the sink tokens held (host positions, from `sink_rows`)."""
        spans: dict[tuple[int, int], list[int]] = {}
        for row, first in enumerate(self.sink_rows or ()):
            count = min(max(self.end - first, 0), self.sinks.shape[3]) if first >= 0 else 0
            if count:
                spans.setdefault((first, count), []).append(row)
        return spans

    def shared_sink_count(self) -> int | None:
        """The sink tokens every row holds from `start` on (0 without sinks; host positions, from `sink_rows`, as
        `sink_spans` counts them), or None when the rows' sinks differ."""
        rows = self.sink_rows if self.sinks is not None else None
        if not rows or rows[0] < 0 and rows.count(-1) == len(rows):
            return 0
        if rows.count(rows[0]) != len(rows) or rows[0] != self.start:
            return None
        return min(self.end - self.start, self.sinks.shape[3])


# --- the value codes' layout, for torch code (the kernels address it themselves) --------------------------------
def slot_codes(codes: torch.Tensor, slot: int, value_tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Writable views of the key and value codes of `slot`, each `[batch, kv_heads, head_dim]`."""
    if not value_tiled:
        return codes[0, :, :, slot], codes[1, :, :, slot]
    plane = codes[1]
    check_tiled_plane(plane)
    first = slot - slot % VALUE_TILE
    width = min(VALUE_TILE, plane.shape[2] - first)
    batch, heads, _, head_dim = plane.shape
    value = plane.as_strided(
        (batch, heads, head_dim), (*plane.stride()[:2], width), plane.storage_offset() + first * head_dim + slot - first
    )  # fmt: skip
    return codes[0, :, :, slot], value


def token_major(codes: torch.Tensor, value_tiled: bool) -> torch.Tensor:
    """`codes` with token-major values (`codes` itself when they are; else a copy)."""
    if not value_tiled:
        return codes
    blocks, rest = _value_pieces(codes[1])
    values = torch.cat((blocks.flatten(2, 3), rest), dim=2)
    return torch.stack((codes[0].view(torch.uint8), values)).view(codes.dtype)


def store_token_major(codes: torch.Tensor, tokens: torch.Tensor, value_tiled: bool) -> None:
    """Write `tokens` (codes with token-major values, the shape of `codes`) into `codes`, in its layout."""
    if not value_tiled:
        if tokens is not codes:
            codes.copy_(tokens)
        return
    codes[0].copy_(tokens[0])
    blocks, rest = _value_pieces(codes[1])
    values = tokens[1].view(torch.uint8)
    whole = blocks.shape[2] * VALUE_TILE
    blocks.copy_(values[:, :, :whole].unflatten(2, (-1, VALUE_TILE)))
    rest.copy_(values[:, :, whole:])


def copy_slots(dst: torch.Tensor, src: torch.Tensor, src_first: int, count: int, value_tiled: bool) -> None:
    """`dst`'s slots `[0, count)` = `src`'s slots `[src_first, src_first + count)` (codes, both in one layout).
    Tiled values move as whole blocks when the range starts on a block and both buffers hold it in whole ones."""
    blocks = count + (-count) % VALUE_TILE  # the slots of the whole blocks holding them
    in_whole_blocks = src_first % VALUE_TILE == 0 and blocks <= min(
        _whole_block_slots(dst), _whole_block_slots(src) - src_first
    )
    if not value_tiled or in_whole_blocks:
        moved = blocks if value_tiled else count
        dst[:, :, :, :moved] = src[:, :, :, src_first : src_first + moved]
        return
    tokens = token_major(dst, True)
    tokens[:, :, :, :count] = token_major(src, True)[:, :, :, src_first : src_first + count]
    store_token_major(dst, tokens, True)


def _whole_block_slots(codes: torch.Tensor) -> int:
    return codes.shape[3] - codes.shape[3] % VALUE_TILE


def check_tiled_plane(plane: torch.Tensor) -> None:
    """Tiled value codes are addressed within contiguous (batch, head) planes (`[batch, kv_heads, slots, D]`)."""
    if plane.stride()[2:] != (plane.shape[3], 1):
        raise ValueError(f"tiled value codes need contiguous (batch, head) planes, got strides {plane.stride()}")


def _value_pieces(plane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major views of a tiled value plane: its whole blocks `[batch, kv_heads, blocks, VALUE_TILE,
    head_dim]` and the last, narrower block `[batch, kv_heads, slots left, head_dim]`."""
    check_tiled_plane(plane)
    plane = plane.view(torch.uint8)
    batch, heads, slots, head_dim = plane.shape
    blocks, rest = divmod(slots, VALUE_TILE)
    strides, base = plane.stride()[:2], plane.storage_offset()
    whole = plane.as_strided(
        (batch, heads, blocks, VALUE_TILE, head_dim), (*strides, VALUE_TILE * head_dim, 1, VALUE_TILE), base
    )
    last = plane.as_strided((batch, heads, rest, head_dim), (*strides, 1, rest), base + blocks * VALUE_TILE * head_dim)
    return whole, last
