"""Paged rows built for tests: requests with cached pages at scattered physical indices and new rows, with what
the oracle says each request's queries must see; optionally each request's recent and sink tokens held in full
precision beside the pages (`RecentRows`), and per KV head some of its coded tokens too (outlier tokens)."""

import torch

from hf_fp8kv.kernels import reference
from hf_fp8kv.kernels.paged import PageGeometry, RecentRows, RowLayout, row_size
from hf_fp8kv.kernels.rotation import hadamard

PAGE_SIZE = 4
LAYERS = 2  # pages per block; the tested layer is the second one (a non-zero layer offset)


def encode(x: torch.Tensor, fmt, static: torch.Tensor | None, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[tokens, row_bytes]` of `x` `[tokens, kv_heads, D]` (rotated codes with `rotate`), and its dequantized
    values (rotated back)."""
    x = hadamard(x) if rotate else x
    scale = static[None, :] if static is not None else reference.dynamic_scale(x, fmt, torch.bfloat16)
    codes, _, _ = reference.quantize(x, scale[..., None], fmt)
    values = reference.dequantize(codes, scale[..., None], fmt)
    parts = [codes.view(torch.uint8).flatten(1)]
    if static is None:
        parts.append(scale.contiguous().view(torch.uint8))
    rows = torch.cat(parts, dim=1)
    padding = row_size(codes[0].numel(), 0 if static is not None else x.shape[1]) - rows.shape[1]
    return torch.nn.functional.pad(rows, (0, padding)), hadamard(values) if rotate else values


def build(requests, fmt, kv_heads, head_dim, group, dynamic, seed=0, block_padding=8, garbage_before=None,
          recent=None, dtype=torch.float32, page_size=PAGE_SIZE, new_in_pages=False, rotate=False,
          outliers=0):  # fmt: skip
    """Pages of `page_size` tokens and new rows of `requests` (`(past, q_len)` each), each request's tokens in its
    blocks' consecutive slots, as transformers' full-attention allocator places them; `garbage_before`: a window,
    whose cached rows before every query's window are overwritten with 0xFF bytes (NaN codes and scales) as a freed
    page's filler. `recent`: `(R, S, key_start)`, each request's newest R and first S tokens held in `dtype` rows
    (returned as the fifth item), every other request as if its prompt's first half came from another request (prefix
    sharing: neither those sinks nor those recent tokens held), its keys starting at position `key_start` (a sliding
    layer's window; sinks then apply to none). `new_in_pages`: each request's new tokens are in its pages too, their
    read indices after its past ones (a full-attention layer's step). `rotate`: rotated codes (`RowLayout.rotate`),
    the oracle's keys and values decoded and rotated back. `outliers` (with `recent`, keys from position 0): per
    request and KV head, that many random coded tokens of its own (not sinks, before its recent ones; request 1's
    head 0 half as many, so empty slots show) held in `dtype` rows too, their codes left in the pages."""
    generator = torch.Generator().manual_seed(seed)
    static = None if dynamic else (torch.rand(kv_heads, generator=generator) * 0.02 + 0.01,
                                   torch.rand(kv_heads, generator=generator) * 0.02 + 0.01)  # fmt: skip
    row_bytes = row_size(kv_heads * head_dim, kv_heads if dynamic else 0)
    page_bytes = 2 * page_size * row_bytes
    layer_offset = page_bytes  # the first layer's page comes first
    bytes_per_block = LAYERS * page_bytes + block_padding  # padded, as a block of mixed layers may be
    block_stride = 2 * page_size * LAYERS
    geometry = PageGeometry(layer_offset, bytes_per_block, block_stride, page_size)
    row_layout = RowLayout(fmt, dynamic, kv_heads, head_dim, dtype)
    total_pages = sum(-(-(past + q_len) // page_size) for past, q_len in requests) + 2
    pages = torch.full((total_pages * bytes_per_block,), 0xFF, dtype=torch.uint8)  # unwritten: NaN codes
    free_blocks = torch.randperm(total_pages, generator=generator).tolist()
    queries, new_rows, read_index, expected, held = [], [], [], [], []
    cu_q, k_first, pasts = [0], [], []
    for past, q_len in requests:
        keys = torch.randn(past + q_len, kv_heads, head_dim, generator=generator) * 3
        values = torch.randn(past + q_len, kv_heads, head_dim, generator=generator)
        k_rows, k_values = encode(keys, fmt, static[0] if static else None, rotate)
        v_rows, v_values = encode(values, fmt, static[1] if static else None, rotate)
        k_first.append(len(read_index))
        stored = past + q_len if new_in_pages else past
        blocks = [free_blocks.pop() for _ in range(-(-stored // page_size))]
        index = [blocks[t // page_size] * block_stride + t % page_size for t in range(stored)]
        cached = torch.stack((k_rows[:stored], v_rows[:stored]), dim=1)
        if garbage_before is not None:
            cached[: max(past - garbage_before + 1, 0)] = 0xFF
        geometry.write(pages, row_layout, torch.tensor(index, dtype=torch.int64), cached)
        read_index += index
        new_rows.append(torch.stack((k_rows[past:], v_rows[past:]), dim=1))
        query = torch.randn(q_len, kv_heads * group, head_dim, generator=generator)
        queries.append(query)
        if recent is not None:
            held.append(hold(keys, values, k_values, v_values, past // 2 if len(held) % 2 else 0, recent, dtype,
                             outliers, len(held), generator))  # fmt: skip
        expected.append((query, k_values, v_values))
        cu_q.append(cu_q[-1] + q_len)
        pasts.append(past)
    layout = dict(kv_heads=kv_heads, layer_offset=layer_offset, bytes_per_block=bytes_per_block,
                  block_stride=block_stride, page_size=page_size)  # fmt: skip
    tensors = (
        torch.cat(queries), pages, torch.cat(new_rows).contiguous(), torch.tensor(read_index, dtype=torch.int64),
        torch.tensor(cu_q, dtype=torch.int32), torch.tensor(k_first, dtype=torch.int32),
        torch.tensor(pasts, dtype=torch.int32),
    )  # fmt: skip
    if recent is None:
        return tensors, layout, static, expected
    rows = recent_rows(held, recent, kv_heads, head_dim, dtype, generator, outliers)
    return tensors, layout, static, expected, rows


def hold(keys, values, k_values, v_values, first, recent, dtype, outliers=0, request=0, generator=None):
    """The rows one request holds (`first`: the first position it computed itself; `recent`: `(R, S, key_start)`;
    `outliers`: per KV head, see `build`), laid over its expected keys and values: `(meta [sinks, recent_start,
    key_start], {position: (k, v)}, outlier tokens {(head, slot): (position, k, v)})`."""
    window, sinks, key_start = recent
    end = key_start + len(keys)
    sink_count = min(sinks, end) if first == 0 and key_start == 0 else 0
    recent_start = max(first, end - window)
    rows = {}
    for t in [*range(sink_count), *range(max(recent_start, key_start), end)]:
        k, v = keys[t - key_start].to(dtype), values[t - key_start].to(dtype)
        k_values[t - key_start], v_values[t - key_start] = k.float(), v.float()
        rows[t] = (k, v)
    kept = {}
    coded = torch.arange(recent_start)[max(first, sinks, key_start) :]
    for head in range(keys.shape[1] if outliers else 0):
        count = min(outliers // (2 if (request, head) == (1, 0) else 1), len(coded))
        for slot, t in enumerate(coded[torch.randperm(len(coded), generator=generator)[:count]].tolist()):
            k, v = keys[t - key_start, head].to(dtype), values[t - key_start, head].to(dtype)
            k_values[t - key_start, head], v_values[t - key_start, head] = k.float(), v.float()
            kept[head, slot] = (t, k, v)
    return (sink_count, recent_start, key_start), rows, kept


def recent_rows(held, recent, kv_heads, head_dim, dtype, generator, outliers=0) -> RecentRows:
    """Every request's rows in a pool of slots (in shuffled order, one spare), the rows nobody holds NaN (the
    outlier positions nobody holds: arbitrary positions, which no request may read)."""
    window, sinks, _ = recent
    per_slot = window + sinks + outliers
    slots = torch.randperm(len(held) + 1, generator=generator).tolist()
    rows = torch.full(((len(held) + 1) * per_slot, 2, kv_heads, head_dim), float("nan"), dtype=dtype)
    positions = torch.randint(0, 8, (len(held) + 1, kv_heads, outliers), generator=generator, dtype=torch.int32)
    meta = []
    for slot, ((sink_count, recent_start, key_start), tokens, kept) in zip(slots, held):
        positions[slot] = -1
        for (head, i), (t, k, v) in kept.items():
            positions[slot, head, i] = t
            rows[slot * per_slot + window + sinks + i, :, head] = torch.stack((k, v))
        for t, (k, v) in tokens.items():
            row = slot * per_slot + (window + t if t < sink_count else t % window)
            rows[row, 0], rows[row, 1] = k, v
            if t < sink_count and t >= recent_start:  # a sink among the newest tokens: held in both places
                rows[slot * per_slot + t % window] = rows[row]
        meta.append((slot, sink_count, recent_start, key_start))
    host = tuple(list(column) for column in zip(*meta))
    return RecentRows(rows, window, sinks, torch.tensor(host, dtype=torch.int32), host, outliers,
                      positions if outliers else None)  # fmt: skip


def oracle(expected, scaling, window):
    outs = []
    for query, keys, values in expected:
        out = reference.attention(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                  values.transpose(0, 1)[None], scaling=scaling, window=window)  # fmt: skip
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
