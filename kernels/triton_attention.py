"""Triton attention over a layer's cache (`KVView`): one flash-attention kernel for decode and prefill, plus a
split reduce where the kernel does not merge its splits itself.

Rows of a program are the (query position, query head) pairs of one KV head, position-major: every query head
of a GQA group shares each K/V load (GQA packing), and a decode step (one position) fills one row block. The
codes' part of the timeline is split across programs (flash-decoding) when the row blocks alone would leave the
GPU idle; the full-precision recent and sink tokens are then read by a split of their own (else after the codes),
and the splits' partial results are merged by the last split of each row block to finish, found with an atomic
ticket, in the same launch (past 7 splits in two levels: groups of about the square root of the split count, then
the groups, `merge_group`; under a mask in one; with rotated codes, a mask over outlier tokens, and where the call
finds the merge dearer than a launch, `split_plan`: by `_reduce_kernel`, a launch of its own); both in a loop over
splits (`merge_splits`: no spill however many there are).

Both dots run in fp16 (fp32 `ieee` for fp32 queries): the query is scaled once (softmax scale, log2(e), per-head
K scale, per-channel K scale) and cast, the codes are converted to fp16 by the hardware on CUDA (e4m3fn, e5m2:
`cvt.rn.f16x2.e4m3x2`, two per instruction) or by exact bit operations (the interpreter, e4m3fnuz); per-token
K scales multiply the scores, per-token V scales the probabilities, per-head V scales the output. Nothing is
dequantized in memory. Rotated codes (`view.rotate`): the query is rotated once for the codes' scores, and the
codes' share of the output rotated back once, before the full-precision tokens (read with the query as it came).

Static caches (CUDA graphs): positions are read from a device tensor and the grid is fixed (the split count for
the full buffer); splits with no tokens write an empty partial result and exit.

A decode step's new token can be written by the launch itself (`NewToken`, WRITE): one program per (batch, KV head)
codes the token leaving the recent buffer and stores the new one before it reads anything, and attends the leaving
token itself; no write launch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_common import (
    E4M3_MAX, LOG2E, MIN_ROWS, P_SCALE, VALUE_TILE, as_dot, as_e4m3, attend_full_precision, attend_tile,
    block_sizes, check_search_energy, code_offsets, decode_codes, decode_settings, encoding, hadamard,
    load_token_scales, program_scratch, query_target, rotated_query, rotation, tile_tokens, to_e4m3, visibility,
    zero_columns,
)
from .targets import EXAMPLE_GPUS, GpuTarget, sum_rows
from .triton_search import add_head_query_energy
from .triton_write import check_write, move_positions, write_decode_token
from .triton_launch import Launch, cdiv, check_grid, compiled_occupancy, launch_all, next_power_of_2, plane_strides, planes
from .view import KVView, NewToken, scale_dtypes

# tokens of the tile that reads the token entering the codes in a decode step's write (the smallest a dot takes: with
# a whole 64-token tile sm_90's d128 per-token decode held 136 registers, 3 blocks per SM; with 16, 112 and 4;
# gpu_static)
ENTERING_TILE = tl.constexpr(16)
# tokens per tile of the full-precision (recent, sink) tokens: 64 took a default-window decode kernel at head_dim
# 128 to 168 registers and a 12 B spill, 32 to 144 and none (gpu_static)
FULL_PRECISION_TILE = tl.constexpr(32)
# a program's own cost in tiles of codes (its query read, its partial results written): without it, batch 1 at 8k
# tokens with the default recent and sink tokens was split 132 ways, one tile each
PROGRAM_TILES = 1
# the merge's reads come from L2, which one SM reads at about 127 GB/s (an assumption: 64 B per clock at 1.98 GHz;
# 3.5x an H200's memory bandwidth per SM, 4.8 TB/s over 132 SMs)
L2_SM_BANDWIDTH = 127e9
# a reduce launch's fixed cost, seconds: launch and tail, then the gap after the attention launch (the middle of the
# step model's ranges, 2-3 us and 0.3-1 us; docs/benchmarks.md), against which the split rule weighs the merge
REDUCE_LAUNCH_SECONDS = 3e-6
REDUCE_SPLITS = 16  # splits merged per reduce iteration
# the attention launch's merge: splits per iteration (16 spilled 40-44 B in sm_90's default-window decode, 4 none)
# and channels per pass (whole 128-channel rows took the per-token decode from 141 to 182 registers; with the merge
# in groups 32 spilled 20 B in sm_90's head_dim 64 per-token decode at its cap of 128, 16 none; gpu_static)
MERGE_SPLITS = tl.constexpr(4)
MERGE_CHUNK = tl.constexpr(16)
REDUCE_CHUNK = 32  # head_dim channels per reduce program
REDUCE_PROGRAMS = 128  # reduce programs to aim for (an H100/H200 has 132 SMs)


# positions move every step and the split count with the context (a multiple of 16 would compile a second
# kernel mid-generation): none of them specialized, one compile
@triton.jit(do_not_specialize=["num_splits", "held_splits", "merge_group", "start", "end", "recent_start",
                             "mask_start", "prior_recent_start"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, recent_k_ptr, recent_v_ptr, sink_k_ptr, sink_v_ptr,
    sink_start_ptr, sink_count_ptr, positions_ptr, outlier_k_ptr, outlier_v_ptr, outlier_pos_ptr, mask_ptr,
    sink_logits_ptr, channel_ptr, out_ptr, part_acc_ptr, part_stats_ptr, ticket_ptr, q_scratch_ptr, new_k_ptr,
    new_v_ptr, stats_ptr, energy_ptr, search_ticket_ptr,
    q_sb, q_sh, q_sl, q_sd,
    c_sb, c_sh, c_st, c_sd,
    s_sb, s_sh, s_st,
    r_sb, r_sh, r_st, r_sd,
    x_sb, x_sh, x_st, x_sd,
    u_sb, u_sh, u_st, u_sd, p_sb, p_sh, p_st,
    m_sb, m_sh, m_sl, m_st,
    o_sb, o_sh, o_sl, o_sd,
    nk_sb, nk_sh, nk_sd, nv_sb, nv_sh, nv_sd,
    kv_heads, q_len, head_dim, num_splits, held_splits, merge_group, slots, capacity, offset, recent_slots,
    sink_slots, outlier_slots, start, end, recent_start, mask_start, prior_recent_start, window,
    score_scale, code_factor, value_boost, out_factor, softcap,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FLOAT: tl.constexpr, HW_CONVERT: tl.constexpr, FP16_SHIFT: tl.constexpr, NAN_MASK: tl.constexpr,
    NAN_CODE: tl.constexpr, PER_TOKEN_K: tl.constexpr, PER_TOKEN_V: tl.constexpr,
    STATIC: tl.constexpr, RING: tl.constexpr, HAS_RECENT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINK_LOGITS: tl.constexpr,
    HAS_CHANNEL_SCALE: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    STAGES: tl.constexpr, DROP_UNSEEN: tl.constexpr, SCALE_WORDS: tl.constexpr, MASK_ROW: tl.constexpr,
    ONE_POSITION: tl.constexpr, VALUE_TILED: tl.constexpr, WHOLE_TILES: tl.constexpr, FP8_QK: tl.constexpr,
    FP8_PV: tl.constexpr, FP_PROGRAM: tl.constexpr, ROTATE_STAGES: tl.constexpr, ROTATE_NORM: tl.constexpr,
    HAS_OUTLIERS: tl.constexpr, MERGE: tl.constexpr, GROUPED_MERGE: tl.constexpr, WRITE: tl.constexpr,
    CLIP: tl.constexpr, ENC_IS_FLOAT: tl.constexpr, ENC_MAX: tl.constexpr, ENC_ROW_MAX: tl.constexpr,
    ENC_ROUND_SHIFT: tl.constexpr, ENC_NORMAL_OFFSET: tl.constexpr, ENC_MIN_NORMAL: tl.constexpr,
    ENC_SUB_MAGIC: tl.constexpr, ENC_SUB_MAGIC_BITS: tl.constexpr, ENC_NAN_CODE: tl.constexpr,
    ENC_SIGNED_ZERO: tl.constexpr, SEARCH: tl.constexpr, SUMS: tl.constexpr, SUM_ROWS: tl.constexpr,
):  # fmt: skip
    """Program (row block, batch * kv_head, split). SPLIT: the program's partial results are stored; MERGE: the last
    split of the row block merges them, with GROUPED_MERGE in groups of `merge_group` splits and then the groups
    where there are several (else `_reduce_kernel` does, in a launch of its own). WRITE: a decode step's new token
    (`new_k_ptr`, `new_v_ptr`) is written by this launch (`write_decode_token`, the ENC_ constexprs `encoding`'s):
    `end` and `recent_start` are the positions after it, `prior_recent_start` before it (static: the device
    positions are the ones before it, moved here and stored by the last program); one program per row writes it and
    attends the token entering the codes itself; SEARCH: its per-token scales searched, the keys' weighted by the
    queries' sums at `energy_ptr` (fp32 `[kv_heads, head_dim]`). SUMS: a decode step's queries added to those sums
    by this launch, once every program that reads them has (`sums_in_launch`), SUM_ROWS rows at a time."""
    pid_m = tl.program_id(0)
    b = (tl.program_id(1) // kv_heads).to(tl.int64)  # int64 bases: a cache can exceed 2^31 elements
    kv_head = (tl.program_id(1) % kv_heads).to(tl.int64)
    split = tl.program_id(2)
    if STATIC:  # positions on the device: nothing about them reaches the host (CUDA graphs); int32 as the host's
        end = tl.load(positions_ptr).to(tl.int32)  # (int64 positions made every index in the loop 64-bit)
        recent_start = tl.load(positions_ptr + 1).to(tl.int32)
    if WRITE:  # the new token is the last; the token it replaces in its recent slot (else itself) gets codes
        if STATIC:
            prior_recent_start = recent_start
            end += 1
            recent_start = end
            if HAS_RECENT:
                recent_start = tl.maximum(prior_recent_start, end - recent_slots)
        new_pos = end - 1
        if HAS_RECENT:  # (the host's positions stay parameters: computed ones took registers across the loop)
            entering_pos = new_pos - recent_slots
            entering = (entering_pos >= prior_recent_start) & (entering_pos >= (0 if RING else offset))
        else:
            entering_pos = new_pos
            entering = new_pos >= 0
    if RING:  # a slot holds the latest coded token of its residue: the last `slots` tokens before the recent ones
        start = tl.maximum(start, recent_start - slots)
    q_ptr += b * q_sb
    k_ptr += b * c_sb + kv_head * c_sh
    v_ptr += b * c_sb + kv_head * c_sh
    k_scale_ptr += b * s_sb + kv_head * s_sh
    v_scale_ptr += b * s_sb + kv_head * s_sh
    mask_ptr += b * m_sb

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < GROUP * q_len
    if ONE_POSITION:  # a decode step: every row's query is the last token
        q_pos = end - 1
        row_pos = tl.zeros([BLOCK_M], tl.int64)  # (the rows past the last are never read or stored)
    else:
        q_pos = end - q_len + pos  # the queries are the last q_len tokens
        row_pos = pos.to(tl.int64)  # its row offsets pass 2^31 in a long prefill (262k tokens x 64 heads x 128)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    code_splits = num_splits - held_splits
    if WRITE:  # one program per row writes (before the query is read: fewer values live), the one reading the new
        # token's recent slot (else the last split)
        owner = num_splits - 1
        if HAS_RECENT and FP_PROGRAM:
            share = tl.cdiv(tl.cdiv(recent_slots, FULL_PRECISION_TILE), held_splits) * FULL_PRECISION_TILE
            owner = code_splits + (new_pos % recent_slots) // share
        if split == owner:
            write_decode_token(
                new_k_ptr + b * nk_sb + kv_head * nk_sh, new_v_ptr + b * nv_sb + kv_head * nv_sh, nk_sd, nv_sd, k_ptr,
                v_ptr, k_scale_ptr, v_scale_ptr, recent_k_ptr + b * r_sb + kv_head * r_sh,
                recent_v_ptr + b * r_sb + kv_head * r_sh, stats_ptr, c_st, c_sd, s_st, r_st, r_sd, d, d_ok, new_pos,
                entering_pos, entering, slots, offset, capacity, recent_slots, VALUE_TILED, HAS_RECENT, RING,
                PER_TOKEN_K, CLIP, ROTATE_STAGES, ROTATE_NORM, ENC_IS_FLOAT, ENC_MAX, ENC_ROW_MAX, ENC_ROUND_SHIFT,
                ENC_NORMAL_OFFSET, ENC_MIN_NORMAL, ENC_SUB_MAGIC, ENC_SUB_MAGIC_BITS, ENC_NAN_CODE, ENC_SIGNED_ZERO,
                energy_ptr + kv_head * head_dim, SEARCH,
            )  # fmt: skip
    if SUMS:  # each row's owner (the writer, else the last split) takes a ticket, its write having read the sums;
        # the last of the KV head's rows adds every row's query in a fixed order (no atomic adds: the same bits
        # from launch to launch) and puts the counter back to 0 for the next launch (CUDA graph replays included).
        # Here, not after the loop: there it took sm_90's default-window decode loop from 0.122 to 0.131
        # instructions per KV byte and sm_80's masked one from 4 blocks per SM to 2 (gpu_static)
        sums_owner = num_splits - 1
        if WRITE:
            sums_owner = owner
        if (split == sums_owner) & (pid_m == 0):
            tl.debug_barrier()  # every thread's reads of the sums done
            batch = tl.num_programs(1) // kv_heads
            if tl.atomic_add(search_ticket_ptr + kv_head, 1, sem="acq_rel") == batch - 1:
                tl.store(search_ticket_ptr + kv_head, 0)
                add_head_query_energy(energy_ptr + kv_head * head_dim, q_ptr - b * q_sb,
                                      channel_ptr + kv_head * head_dim, q_sb, q_sh, q_sl, q_sd, kv_head, batch * GROUP,
                                      GROUP, 1, d, d_ok, HAS_CHANNEL_SCALE, 0, 1.0, SUM_ROWS)  # fmt: skip

    # the query, scaled once: softmax scale and log2(e) (score_scale), per-head K scale, per-channel K scale
    q_scale = score_scale
    if not PER_TOKEN_K:
        q_scale *= tl.load(k_scale_ptr)
    channel_ptr += kv_head * head_dim
    query_args = (q_ptr, q_sh, q_sl, q_sd, head, row_pos, row_ok, d, d_ok, q_scale, channel_ptr)
    q = _scaled_query(query_args, HAS_CHANNEL_SCALE)
    if ROTATE_STAGES > 0:  # rotated codes: the codes' scores are those of the rotated query
        q = rotated_query(q, program_scratch(q_scratch_ptr, BLOCK_M, BLOCK_D), True, ROTATE_STAGES, ROTATE_NORM)
    if FP8_QK:  # the codes' scores on FP8 tensor cores: the query in e4m3, one scale per row (its amax to the max)
        q_row = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30) / E4M3_MAX
        q_codes = to_e4m3(q / q_row[:, None], HW_CONVERT)
        q_row = q_row / code_factor  # (the bit decode's factor is in the query's scale; FP8 operands are values)
    q = as_dot(q, DOT)  # the scaled query fits fp16 for any sane model; never let it become inf
    if not FP8_QK:
        q_row = 1.0
        q_codes = q
    if HAS_SINK_TOKENS:
        sink_lo = tl.load(sink_start_ptr + b).to(tl.int32)  # int32 as every position (int64 made the loop's compares
        sink_hi = sink_lo + tl.load(sink_count_ptr + b).to(tl.int32)  # 64-bit)
    else:
        sink_lo = 0
        sink_hi = 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if WRITE:  # the entering token is left out of the codes' splits: the writing program starts from it (a one-token
        # tile; after the loop instead, what it reads kept live across the loop took sm_90's default-window decode
        # kernel from 128 registers to 168 and a 28 B spill, gpu_static)
        attends_entering = (split == owner) & entering & (entering_pos >= start)
        if attends_entering:
            base = 0 if RING else offset
            entering_args = (
                k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, c_st, c_sd, s_st, slots, offset, capacity, head_dim,
                entering_pos, entering_pos + 1, tl.arange(0, ENTERING_TILE), d, d_ok, value_boost, q_pos, row_ok,
                mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window, sink_lo, sink_hi, softcap, q_row,
            )  # fmt: skip
            acc, m_i, l_i = _codes_tile(
                q_codes, acc, m_i, l_i, base + (entering_pos - base) // ENTERING_TILE * ENTERING_TILE, entering_args,
                IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE, PER_TOKEN_K, PER_TOKEN_V, RING, HAS_MASK,
                HAS_WINDOW, HAS_SINK_TOKENS, HAS_SOFTCAP, PRECISION, DROP_UNSEEN, SCALE_WORDS, MASK_ROW, ONE_POSITION,
                DOT, BLOCK_D, VALUE_TILED, WHOLE_TILES, FP8_QK, FP8_PV, False, False, HAS_OUTLIERS,
            )  # fmt: skip

    # the full-precision tokens' arguments; their scores undo the query's K scaling (the scale and code factor)
    fp_args = (
        query_args, recent_k_ptr + b * r_sb + kv_head * r_sh, recent_v_ptr + b * r_sb + kv_head * r_sh,
        sink_k_ptr + b * x_sb + kv_head * x_sh, sink_v_ptr + b * x_sb + kv_head * x_sh, r_st, r_sd, x_st, x_sd,
        recent_slots, sink_slots, start, end, recent_start, d, d_ok, q_scale / score_scale * code_factor, q_pos,
        row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window, sink_lo, sink_hi, softcap,
        outlier_k_ptr + b * u_sb + kv_head * u_sh, outlier_v_ptr + b * u_sb + kv_head * u_sh,
        outlier_pos_ptr + b * p_sb + kv_head * p_sh, u_st, u_sd, p_st, outlier_slots,
    )  # fmt: skip
    # FP_PROGRAM: the last `held_splits` splits read the full-precision tokens alone, the others the codes, in
    # disjoint branches (the two in one program took a default-window decode kernel at head_dim 128 to 185
    # registers, 2 blocks per SM; apart, with 32-token tiles, 144: gpu_static); else one split reads the codes,
    # then the full-precision tokens
    if (split >= code_splits) & FP_PROGRAM:
        if WRITE:
            if attends_entering:  # the entering token's share as values, as the codes' splits turn theirs
                acc = acc * _values_scale(out_factor, v_scale_ptr, code_factor, PER_TOKEN_V, FP8_PV)
                if ROTATE_STAGES > 0:
                    acc = hadamard(acc, ROTATE_STAGES, ROTATE_NORM)
        acc, m_i, l_i = _full_precision_tokens(
            acc, m_i, l_i, fp_args, split - code_splits, held_splits, HAS_CHANNEL_SCALE, HAS_RECENT, HAS_SINK_TOKENS,
            HAS_OUTLIERS, HAS_MASK, HAS_WINDOW, MASK_ROW, ONE_POSITION, HAS_SOFTCAP, PRECISION, DOT,
            FULL_PRECISION_TILE,
        )  # fmt: skip
    else:
        # the codes' share of this split: [lo, hi) of [start, recent_start), narrowed to what the causal / window rule
        # lets this row block see (without a mask: masks skip whole tiles below instead)
        codes_end = tl.maximum(recent_start, start)
        if WRITE:
            codes_end = tl.maximum(recent_start - entering.to(tl.int32), start)
        origin = start
        if WHOLE_TILES:  # splits from the tile holding `start`: only the codes' first and last tiles can be partial
            base = 0 if RING else offset  # a token's slot is t - base in whole blocks (a ring's are whole blocks)
            origin = base + (start - base) // BLOCK_N * BLOCK_N
        split_tokens = tl.cdiv(tl.cdiv(codes_end - origin, BLOCK_N), code_splits) * BLOCK_N
        lo = tl.maximum(origin + split * split_tokens, start)
        hi = tl.minimum(origin + split * split_tokens + split_tokens, codes_end)
        if not HAS_MASK:
            first_pos = end - q_len + (pid_m * BLOCK_M) // GROUP
            last_pos = end - q_len + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, GROUP * q_len) - 1) // GROUP
            hi = tl.minimum(hi, last_pos + 1)
        n = tl.arange(0, BLOCK_N)
        if not HAS_MASK and HAS_WINDOW:  # the first tile's columns before every row's window are never read
            lo = tl.maximum(lo, first_pos - window + 1)
        # the tiles of whole value blocks (WHOLE_TILES: the buffer's slots are whole blocks) in a loop reading every
        # column; the partial ones at either end (at most one before), or every tile without WHOLE_TILES, masked
        head_tile = lo
        first_tail = lo
        whole_lo = lo
        whole_hi = lo
        if WHOLE_TILES:
            whole_lo = base + tl.cdiv(lo - base, BLOCK_N) * BLOCK_N
            whole_hi = tl.maximum(base + (hi - base) // BLOCK_N * BLOCK_N, whole_lo)
            head_tile = whole_lo - BLOCK_N
            first_tail = whole_hi
        before = (lo < tl.minimum(whole_lo, hi)).to(tl.int32)  # a partial tile before the whole ones (0 or 1)
        if WHOLE_TILES and not HAS_MASK and not ONE_POSITION:
            # a causal prefill's whole loop holds the tiles every row sees in full (at or below the first row's
            # position, past the sink tokens, inside the last row's window), read without the rule; the diagonal
            # tiles on either side of it join the masked ones: `before` tiles from `head_tile`, then the rest
            seen_lo = whole_lo
            if HAS_WINDOW:
                seen_lo = tl.maximum(seen_lo, last_pos - window + 1)
            if HAS_SINK_TOKENS:
                seen_lo = tl.maximum(seen_lo, sink_hi)
            seen_lo = tl.minimum(base + tl.cdiv(seen_lo - base, BLOCK_N) * BLOCK_N, whole_hi)
            seen_hi = tl.maximum(tl.minimum(base + (first_pos + 1 - base) // BLOCK_N * BLOCK_N, whole_hi), seen_lo)
            head_tile = whole_lo - before * BLOCK_N
            before += (seen_lo - whole_lo) // BLOCK_N
            whole_lo = seen_lo
            whole_hi = seen_hi
            first_tail = whole_hi
        # Loop order: the whole tiles first for a decode step in one split (masked first, the batch-64 decode kernel
        # spilled 8 B), the masked ones first otherwise (whole first, the split decode kernels took 0.115 -> 0.124
        # instructions per KV byte, padded 0.129 -> 0.132, and the windowed prefill spilled 88 B). A decode's masked
        # tiles (at most 2) are not pipelined (else 114 -> 125 registers at head_dim 128), nor a causal prefill's
        # (the diagonal ones, a few per row block: 3 stages spilled 64 B in the per-token prefill at 255 registers;
        # static 232 -> 220), a masked prefill's are (else its windowed case spilled 68 B) (gpu_static)
        tile_args = (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, c_st, c_sd, s_st, slots, offset, capacity, head_dim,
                     lo, hi, n, d, d_ok, value_boost, q_pos, row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head,
                     pos, window, sink_lo, sink_hi, softcap, q_row)  # fmt: skip
        for phase in tl.static_range(2):
            if (phase == 0) == (ONE_POSITION and not SPLIT):
                for tile in tl.range(whole_lo, whole_hi, BLOCK_N, num_stages=STAGES):
                    acc, m_i, l_i = _codes_tile(
                        q_codes, acc, m_i, l_i, tile, tile_args, IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE,
                        PER_TOKEN_K, PER_TOKEN_V, RING, HAS_MASK, HAS_WINDOW, HAS_SINK_TOKENS, HAS_SOFTCAP, PRECISION,
                        DROP_UNSEEN, SCALE_WORDS, MASK_ROW, ONE_POSITION, DOT, BLOCK_D, VALUE_TILED, WHOLE_TILES,
                        FP8_QK, FP8_PV, True, not HAS_MASK and not ONE_POSITION, HAS_OUTLIERS,
                    )  # fmt: skip
            else:
                masked = before + tl.cdiv(hi - first_tail, BLOCK_N)
                for i in tl.range(
                    0, masked, num_stages=1 if WHOLE_TILES and (ONE_POSITION or not HAS_MASK) else STAGES
                ):
                    # (decode steps and masked prefills: at most one tile before, and their figures as they were)
                    lead = head_tile + i * BLOCK_N if not HAS_MASK and not ONE_POSITION else head_tile
                    tile = tl.where(i < before, lead, first_tail + (i - before) * BLOCK_N)
                    acc, m_i, l_i = _codes_tile(
                        q_codes, acc, m_i, l_i, tile, tile_args, IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE,
                        PER_TOKEN_K, PER_TOKEN_V, RING, HAS_MASK, HAS_WINDOW, HAS_SINK_TOKENS, HAS_SOFTCAP, PRECISION,
                        DROP_UNSEEN, SCALE_WORDS, MASK_ROW, ONE_POSITION, DOT, BLOCK_D, VALUE_TILED, WHOLE_TILES,
                        FP8_QK, FP8_PV, False, False, HAS_OUTLIERS,
                    )  # fmt: skip

        # from here on `acc` holds values, not codes: the output scale of the codes applied once
        acc = acc * _values_scale(out_factor, v_scale_ptr, code_factor, PER_TOKEN_V, FP8_PV)
        if ROTATE_STAGES > 0:  # the codes' share rotated back, before the full-precision tokens join it
            acc = hadamard(acc, ROTATE_STAGES, ROTATE_NORM)
        if (split == num_splits - 1) & (not FP_PROGRAM):
            acc, m_i, l_i = _full_precision_tokens(
                acc, m_i, l_i, fp_args, 0, 1, HAS_CHANNEL_SCALE, HAS_RECENT, HAS_SINK_TOKENS, HAS_OUTLIERS, HAS_MASK,
                HAS_WINDOW, MASK_ROW, ONE_POSITION, HAS_SOFTCAP, PRECISION, DOT, FULL_PRECISION_TILE,
            )  # fmt: skip

    if SPLIT:
        # each row's partial results in a row: its splits', then (a merge in groups) its groups' (`merge_group`)
        part_stride = num_splits
        if MERGE:
            groups = tl.cdiv(num_splits, merge_group)
            part_stride += tl.where(groups > 1, groups, 0)
        first_part = ((b * kv_heads * GROUP + head) * q_len + pos) * part_stride
        part = first_part + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stats_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_stats_ptr + part * 2 + 1, l_i, mask=row_ok)
    if MERGE:
        # the last split of the row block to finish merges them all (a ticket per row block, taken after every
        # thread's stores): no reduce launch. Past a few splits in groups of `merge_group`: the last of each group
        # to finish merges the group's, and the last group merged merges the groups' (its own counter), so that no
        # program reads more than a group's and the groups' partial results. The counters go back to 0 for the next
        # launch (CUDA graph replays included).
        tl.debug_barrier()
        # a program's counters in a row: its groups', then (several groups) the groups' own. Without GROUPED_MERGE
        # the host passes `merge_group` = the split count, so `groups` is 1 at run time; only the group level's merge
        # is left out at compile time (the group counts made constexpr too took sm_90's masked default-window loop
        # from 540 to 567 SASS instructions, gpu_static)
        counters = tl.where(groups > 1, groups + 1, 1)
        ticket_ptr += (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + pid_m) * counters
        group = split // merge_group
        group_ticket = ticket_ptr + group
        group_splits = tl.minimum(merge_group, num_splits - group * merge_group)
        if tl.atomic_add(group_ticket, 1, sem="acq_rel") == group_splits - 1:
            tl.store(group_ticket, 0)
            last = groups == 1
            # (the two levels in one loop, `merge_splits` inlined once, spilled 4-44 B in seven of sm_90's decode
            # rows; gpu_static)
            if GROUPED_MERGE and groups > 1:  # the group's merged partial result, in the row's slot after its splits
                merged_part = first_part + num_splits + group
                group_part = first_part + group * merge_group
                for first in range(0, BLOCK_D, MERGE_CHUNK):
                    c = first + tl.arange(0, MERGE_CHUNK)
                    acc_c, m_c, l_c = merge_splits(
                        part_acc_ptr, part_stats_ptr, group_part, row_ok, c, group_splits, BLOCK_M, MERGE_CHUNK,
                        BLOCK_D, MERGE_SPLITS,
                    )  # fmt: skip
                    tl.store(part_acc_ptr + merged_part[:, None] * BLOCK_D + c[None, :], acc_c, mask=row_ok[:, None])
                    tl.store(part_stats_ptr + merged_part * 2, m_c, mask=row_ok)  # (every chunk's are the same)
                    tl.store(part_stats_ptr + merged_part * 2 + 1, l_c, mask=row_ok)
                tl.debug_barrier()
                last = tl.atomic_add(ticket_ptr + groups, 1, sem="acq_rel") == groups - 1
            if last:
                merged_first = first_part
                merged_count = num_splits
                if groups > 1:
                    tl.store(ticket_ptr + groups, 0)
                    merged_first += num_splits
                    merged_count = groups
                for first in range(0, BLOCK_D, MERGE_CHUNK):
                    c = first + tl.arange(0, MERGE_CHUNK)
                    acc_c, m_c, l_c = merge_splits(part_acc_ptr, part_stats_ptr, merged_first, row_ok, c, merged_count,
                                                   BLOCK_M, MERGE_CHUNK, BLOCK_D, MERGE_SPLITS)  # fmt: skip
                    out = _finalize(acc_c, m_c, l_c, head, row_ok, sink_logits_ptr, HAS_SINK_LOGITS)
                    tl.store(
                        out_ptr + b * o_sb + head[:, None] * o_sh + row_pos[:, None] * o_sl + c[None, :] * o_sd,
                        out.to(out_ptr.dtype.element_ty),
                        mask=row_ok[:, None] & (c < head_dim)[None, :],
                    )
    if not SPLIT:
        out = _finalize(acc, m_i, l_i, head, row_ok, sink_logits_ptr, HAS_SINK_LOGITS)
        tl.store(
            out_ptr + b * o_sb + head[:, None] * o_sh + row_pos[:, None] * o_sl + d[None, :] * o_sd,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    if WRITE and STATIC:  # the device positions move past the new token once every program has read them
        move_positions(positions_ptr, end, recent_start)


@triton.jit
def _values_scale(out_factor, v_scale_ptr, code_factor, PER_TOKEN_V: tl.constexpr, FP8_PV: tl.constexpr):
    """The factor that turns the codes' accumulated PV into values: the fp16 decode's factor and V boost
    (`out_factor`), the per-head V scale, and with FP8_PV the codes' own values and the probabilities' P_SCALE
    (per-token V scales count theirs in the running max instead: `attend_tile`)."""
    out_scale = out_factor
    if not PER_TOKEN_V:
        out_scale *= tl.load(v_scale_ptr)
    if FP8_PV:  # e4m3 values as they are, not their fp16 decode
        out_scale /= code_factor
        if not PER_TOKEN_V:
            out_scale /= P_SCALE
    return out_scale


@triton.jit
def _codes_tile(
    q, acc, m_i, l_i, tile, tile_args,
    IS_FLOAT: tl.constexpr, HW_CONVERT: tl.constexpr, FP16_SHIFT: tl.constexpr, NAN_MASK: tl.constexpr,
    NAN_CODE: tl.constexpr, PER_TOKEN_K: tl.constexpr, PER_TOKEN_V: tl.constexpr, RING: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr, DROP_UNSEEN: tl.constexpr, SCALE_WORDS: tl.constexpr, MASK_ROW: tl.constexpr,
    ONE_POSITION: tl.constexpr, DOT: tl.constexpr, BLOCK_D: tl.constexpr, VALUE_TILED: tl.constexpr,
    WHOLE_TILES: tl.constexpr, FP8_QK: tl.constexpr, FP8_PV: tl.constexpr, ALL_IN: tl.constexpr,
    ALL_SEEN: tl.constexpr, HAS_OUTLIERS: tl.constexpr,
):  # fmt: skip
    """Tokens `[tile, tile + BLOCK_N)` of the codes into the softmax, those in `[lo, hi)` (ALL_IN: all of them);
    `tile_args` the kernel's values the tiles read (pointers, strides, positions, the rows' indices). ALL_SEEN:
    every row sees every token (an interior tile of a causal prefill): no visibility rule. HAS_OUTLIERS: tokens
    whose K scale is negative are read from the outlier buffer instead.

    WHOLE_TILES: the tile lies in one whole block of tiled values, read whole as a head_dim-major tile; columns
    out of `[lo, hi)` are zeroed after it (they may hold anything, NaN codes included). Token-major values were
    transposed byte by byte on their way from shared memory (64 byte loads and 64 conversions per tile, every
    load masked); the whole tile's loads are 16-byte vectors (head_dim 128 decode, static scale: 136 -> 114
    registers, 0.153 -> 0.103 SASS instructions per KV byte, gpu_static)."""
    (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, c_st, c_sd, s_st, slots, offset, capacity, head_dim, lo, hi, n, d, d_ok,
     value_boost, q_pos, row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window, sink_lo, sink_hi,
     softcap, q_row) = tile_args  # fmt: skip
    t, t_ok = tile_tokens(tile, n, lo, hi, ALL_IN)
    if RING:
        slot = (t % slots).to(tl.int64)
    else:
        slot = (t - offset).to(tl.int64)
    k = tl.load(k_ptr + slot[None, :] * c_st + d[:, None] * c_sd, mask=t_ok[None, :] & d_ok[:, None], other=0.0)
    if WHOLE_TILES:
        first = ((tile % slots) if RING else (tile - offset)).to(tl.int64)
        block = tl.multiple_of(first // VALUE_TILE * VALUE_TILE * head_dim + first % VALUE_TILE, 16)
        v = tl.trans(tl.load(v_ptr + block + d[:, None] * VALUE_TILE + n[None, :], mask=d_ok[:, None], other=0.0))
    elif VALUE_TILED:
        offsets = code_offsets(slot, d, c_st, c_sd, capacity, True)
        v = tl.load(v_ptr + offsets, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_ptr + slot[:, None] * c_st + d[None, :] * c_sd, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8_QK:  # e4m3 codes are the FP8 dots' operands as they are
        k = as_e4m3(k)
    else:
        k = decode_codes(k, IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE, DOT)
    if FP8_PV:
        v = as_e4m3(v)
    else:
        v = decode_codes(v, IS_FLOAT, HW_CONVERT, FP16_SHIFT, NAN_MASK, NAN_CODE, DOT)
    if WHOLE_TILES and not ALL_IN:
        v = zero_columns(v, t_ok)
    if PER_TOKEN_K:
        k_scale = load_token_scales(k_scale_ptr, slot, s_st, t_ok, SCALE_WORDS)
    else:
        k_scale = 1.0
    if PER_TOKEN_V:
        v_scale = load_token_scales(v_scale_ptr, slot, s_st, t_ok, SCALE_WORDS) * value_boost
    else:
        v_scale = 1.0
    if ALL_SEEN:
        visible = None
    else:
        visible = visibility(t, t_ok, q_pos, row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window,
                             sink_lo, sink_hi, HAS_MASK, HAS_WINDOW, HAS_SINK_TOKENS, True, MASK_ROW,
                             ONE_POSITION)  # fmt: skip
    return attend_tile(
        q, acc, m_i, l_i, k, v, k_scale, v_scale, visible, softcap, PER_TOKEN_K, PER_TOKEN_V, HAS_SOFTCAP, PRECISION,
        DROP_UNSEEN, q_row, FP8_QK, FP8_PV, HW_CONVERT, HAS_OUTLIERS,
    )  # fmt: skip


@triton.jit
def _scaled_query(query_args, HAS_CHANNEL_SCALE: tl.constexpr):
    """The program's query rows in fp32 times `q_scale` (and the per-channel K scales, `channel_ptr`)."""
    q_ptr, q_sh, q_sl, q_sd, head, row_pos, row_ok, d, d_ok, q_scale, channel_ptr = query_args
    q = tl.load(
        q_ptr + head[:, None] * q_sh + row_pos[:, None] * q_sl + d[None, :] * q_sd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * q_scale
    if HAS_CHANNEL_SCALE:
        q = q * tl.load(channel_ptr + d, mask=d_ok, other=0.0)[None, :]
    return q


@triton.jit
def _full_precision_tokens(
    acc, m_i, l_i, fp_args, part, parts, HAS_CHANNEL_SCALE: tl.constexpr, HAS_RECENT: tl.constexpr,
    HAS_SINK_TOKENS: tl.constexpr, HAS_OUTLIERS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    MASK_ROW: tl.constexpr, ONE_POSITION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    DOT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The recent, sink and outlier tokens (in the model's dtype) into the softmax, `BLOCK_N` at a time: part `part`
    of `parts` (a share of the recent buffer's slots; the sinks and outliers in the last); `fp_args` the kernel's
    values they read. Not pipelined: a few tiles (3 stages: a default-window decode kernel's full-precision tiles
    took 163 -> 180 registers). The query is read again: the codes' copy, kept live across their loop, took a batch-64
    default-window decode kernel from 147 registers to 168 and a 20 B spill (gpu_static)."""
    (query_args, recent_k_ptr, recent_v_ptr, sink_k_ptr, sink_v_ptr, r_st, r_sd, x_st, x_sd, recent_slots, sink_slots,
     start, end, recent_start, d, d_ok, k_scaling, q_pos, row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos,
     window, sink_lo, sink_hi, softcap, outlier_k_ptr, outlier_v_ptr, outlier_pos_ptr, u_st, u_sd, p_st,
     outlier_slots) = fp_args  # fmt: skip
    q = as_dot(_scaled_query(query_args, HAS_CHANNEL_SCALE), DOT)
    n = tl.arange(0, BLOCK_N)
    fp_weight = tl.full([BLOCK_N], 1.0, tl.float32) / k_scaling
    if HAS_RECENT:
        recent_lo = tl.maximum(recent_start, start)
        share = tl.cdiv(tl.cdiv(recent_slots, BLOCK_N), parts) * BLOCK_N
        for first in tl.range(part * share, tl.minimum(part * share + share, recent_slots), BLOCK_N, num_stages=1):
            slot = first + n
            t = end - 1 - (end - 1 - slot) % recent_slots  # the latest token of the slot's residue
            t_ok = (slot < recent_slots) & (t >= recent_lo) & (t >= 0) & (t < end)
            acc, m_i, l_i = attend_full_precision(
                q, acc, m_i, l_i, recent_k_ptr, recent_v_ptr, slot, t, t_ok, r_st, r_sd, d, d_ok, fp_weight, q_pos,
                row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window, sink_lo, sink_hi, softcap, HAS_MASK,
                HAS_WINDOW, HAS_SINK_TOKENS, True, MASK_ROW, ONE_POSITION, HAS_SOFTCAP, PRECISION, DOT,
            )  # fmt: skip
    if HAS_SINK_TOKENS:
        for first in tl.range(0, tl.where(part == parts - 1, sink_slots, 0), BLOCK_N, num_stages=1):
            slot = first + n
            t = sink_lo + slot
            t_ok = (t < sink_hi) & (t >= start)
            acc, m_i, l_i = attend_full_precision(
                q, acc, m_i, l_i, sink_k_ptr, sink_v_ptr, slot, t, t_ok, x_st, x_sd, d, d_ok, fp_weight, q_pos,
                row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window, sink_lo, sink_hi, softcap, HAS_MASK,
                HAS_WINDOW, HAS_SINK_TOKENS, False, MASK_ROW, ONE_POSITION, HAS_SOFTCAP, PRECISION, DOT,
            )  # fmt: skip
    if HAS_OUTLIERS:
        for first in tl.range(0, tl.where(part == parts - 1, outlier_slots, 0), BLOCK_N, num_stages=1):
            slot = first + n
            t = tl.load(outlier_pos_ptr + slot * p_st, mask=slot < outlier_slots, other=-1).to(tl.int32)
            t_ok = (t >= 0) & (t >= start)
            acc, m_i, l_i = attend_full_precision(
                q, acc, m_i, l_i, outlier_k_ptr, outlier_v_ptr, slot, t, t_ok, u_st, u_sd, d, d_ok, fp_weight, q_pos,
                row_ok, mask_ptr, mask_start, m_sh, m_sl, m_st, head, pos, window, sink_lo, sink_hi, softcap, HAS_MASK,
                HAS_WINDOW, HAS_SINK_TOKENS, False, MASK_ROW, ONE_POSITION, HAS_SOFTCAP, PRECISION, DOT,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _finalize(acc, m, l, head, row_ok, sink_logits_ptr, HAS_SINK_LOGITS: tl.constexpr):
    """The attention output from the running max `m` (log2 units), denominator `l` and unnormalised `acc`;
    rows that attend to nothing give 0."""
    if HAS_SINK_LOGITS:
        sink = tl.load(sink_logits_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l > 0, l, 1.0)
    attended = (l > 0) | (l != l)  # NaN scores propagate as in the reference; rows that see nothing give 0
    return tl.where(attended[:, None], acc / l_safe[:, None], 0.0)


@triton.jit
def merge_splits(
    part_acc_ptr, part_stats_ptr, first_part, row_ok, d, num_splits,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PART_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """`(acc, m, l)` of BLOCK_R output rows, channels `d`, from their `num_splits` partial results (row r's at
    `first_part[r]` and the next ones), BLOCK_S splits at a time: registers stay BLOCK_R x BLOCK_C whatever the
    split count. Each split's weight is read back from its own statistics, not picked out of the [rows, splits]
    block. Everything is read through L2 (`.cg`: other programs of the launch may have written it)."""
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        part = first_part[:, None] + s[None, :]
        part_ok = row_ok[:, None] & (s < num_splits)[None, :]
        m_s = tl.load(part_stats_ptr + part * 2, mask=part_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_stats_ptr + part * 2 + 1, mask=part_ok, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(m_s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(l_s * tl.exp2(m_s - m_safe[:, None]), axis=1)
        acc = acc * alpha[:, None]
        for j in tl.static_range(BLOCK_S):  # one split's [rows, BLOCK_C] at a time: no 3-D tile in registers
            part_j = first_part + first + j
            ok_j = row_ok & (tl.full([BLOCK_R], first + j, tl.int32) < num_splits)
            m_j = tl.load(part_stats_ptr + part_j * 2, mask=ok_j, other=float("-inf"), cache_modifier=".cg")
            acc_j = tl.load(part_acc_ptr + part_j[:, None] * PART_D + d[None, :], mask=ok_j[:, None], other=0.0,
                            cache_modifier=".cg")  # fmt: skip
            acc += acc_j * tl.exp2(m_j - m_safe)[:, None]
        m = m_new
    return acc, m, l


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    part_acc_ptr, part_stats_ptr, sink_logits_ptr, out_ptr,
    o_sb, o_sh, o_sl, o_sd,
    out_rows, q_heads, q_len, head_dim, num_splits,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PART_D: tl.constexpr,
    HAS_SINK_LOGITS: tl.constexpr,
):  # fmt: skip
    """Program (block of output rows (batch, q_head, position), chunk of head_dim): merge the splits' partial
    results (the paged kernel's, and the dense one's where it does not merge them itself)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < out_rows
    pos = rows % q_len
    head = (rows // q_len) % q_heads
    b = rows // (q_len * q_heads)
    d = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc, m, l = merge_splits(part_acc_ptr, part_stats_ptr, rows * num_splits, row_ok, d, num_splits, BLOCK_R,
                             BLOCK_C, PART_D, BLOCK_S)  # fmt: skip
    out = _finalize(acc, m, l, head, row_ok, sink_logits_ptr, HAS_SINK_LOGITS)
    tl.store(
        out_ptr + (b * o_sb + head * o_sh + pos * o_sl)[:, None] + d[None, :] * o_sd,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (d < head_dim)[None, :],
    )


# --- launchers ---------------------------------------------------------------------------------------------------
def can_write_in_launch(view: KVView, new_tokens: int) -> bool:
    """Whether the attention launch can write an update's new tokens itself (`NewToken`): a decode step's one
    token, but with outlier tokens (their staging runs between the write and the attention)."""
    return new_tokens == 1 and view.outliers is None


def writes_in_launch(view: KVView, new_tokens: int, target: GpuTarget | None) -> bool:
    """Whether it does on `target` (None: the interpreter): where it costs no spill (`GpuTarget.writes_in_attention`),
    and not over rotated codes (their decode kernels spilled 4-20 B with it on sm_90, sm_100 and sm_120, gpu_static)."""
    return can_write_in_launch(view, new_tokens) and not view.rotate and (target is None or target.writes_in_attention)


def sums_in_launch(view: KVView, q_len: int) -> bool:
    """Whether the attention launch adds the step's queries to a searched view's sums (`ScaleSearch`) itself, where
    a launch of their own did (`triton_search.add_query_energy`): a decode step's (a prompt's queries keep their
    own launch), given the view's counters, but over rotated codes (their query is rotated on the way)."""
    return q_len == 1 and view.scale_search > 1 and view.search_tickets is not None and not view.rotate


def _check_sums(view: KVView, kv_heads: int, head_dim: int) -> None:
    owner = f"scale_search={view.scale_search} (the attention launch's query sums)"
    check_search_energy(view.search_energy, kv_heads, head_dim, owner)
    tickets = view.search_tickets
    if tickets.dtype != torch.int32 or tickets.shape != (kv_heads,) or not tickets.is_contiguous():
        raise ValueError(f"{owner} needs search_tickets as contiguous int32 [{kv_heads}] (zeros), got "
                         f"{(tickets.dtype, tuple(tickets.shape), tickets.stride())}")  # fmt: skip


def attention(
    query: torch.Tensor,
    view: KVView,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    num_splits: int | None = None,
    stages: int | None = None,
    fp8_prefill: bool = False,
    plans: dict | None = None,
    new_token: NewToken | None = None,
) -> torch.Tensor:
    """Attention of `query` `[batch, q_heads, q_len, head_dim]` over the tokens of `view` (see
    `reference.attend`); `num_splits` forces the number of KV splits (default: from the compiled kernel's
    occupancy on the GPU, one off GPU); `stages` the KV tiles the loop keeps in flight (default 3);
    `fp8_prefill`: a prefill's dots over e4m3 codes run on FP8 tensor cores (see `fp8_dots`), else in fp16. `plans` (a dict the caller keeps, e.g. one per cache layer) memoizes the plan of
    each kind of call, so that a decode step only fills in positions and tensors. `new_token`: a decode step whose
    write this launch does (see `NewToken`)."""
    settings = (scaling, window, softcap, num_splits, stages)
    if plans is None:
        plan = AttentionPlan(query, view, mask, sink_logits, *settings, fp8_prefill=fp8_prefill, new_token=new_token)
    else:
        key = (*settings, fp8_prefill, query.shape, query.dtype, view.layout(),
               None if mask is None else mask.shape[:-1], sink_logits is not None,
               None if new_token is None else (new_token.key.dtype, new_token.key.stride()))  # fmt: skip
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = AttentionPlan(query, view, mask, sink_logits, *settings, fp8_prefill=fp8_prefill,
                                              new_token=new_token)  # fmt: skip
    out, launches = plan.launches(query, view, mask, sink_logits, new_token=new_token)
    launch_all(launches, query.device)
    return out


@functools.lru_cache(maxsize=4096)
def split_plan(
    programs: int, tiles: int, resident_slots: int, held_tiles: int, merge_per_split: float | None,
    launch_tiles: float, grouped: bool = True,
) -> tuple[int, bool]:
    """The split count, and whether the attention launch merges the splits (else a reduce launch does): the cheaper
    by `split_cost`, the merge's `merge_per_split` tile-times per split (`TileTime.merge`) against the reduce launch's
    fixed cost of `launch_tiles` (`TileTime.reduce_launch`); ties to the merge (one launch less). `merge_per_split`
    None: the kernel does not merge; `grouped`: it merges in groups (`merge_group`), else in one."""
    splits = split_count(programs, tiles, resident_slots, held_tiles)
    if merge_per_split is None:
        return splits, False
    merged = split_count(programs, tiles, resident_slots, held_tiles, merge_per_split, grouped)
    reduced = split_cost(programs, tiles, resident_slots, held_tiles, splits) + (launch_tiles if splits > 1 else 0)
    if split_cost(programs, tiles, resident_slots, held_tiles, merged, merge_per_split, grouped) <= reduced:
        return merged, True
    return splits, False


@functools.lru_cache(maxsize=4096)
def split_count(
    programs: int, tiles: int, resident_slots: int, held_tiles: int = 0, merge_per_split: float = 0.0,
    grouped: bool = True,
) -> int:
    """KV splits for `programs` row-block programs over `tiles` tiles of codes on a GPU holding
    `resident_slots` blocks at once: the count that minimizes waves x the longest split's tiles, plus
    `PROGRAM_TILES` for its query and results (so the last wave is nearly full, and no split reads a tile or two
    for as much again of its own), plus the merge's `merge_per_split` tiles per partial result on its serial path
    (`TileTime.merge`, `merge_reads`: `grouped` or not); the smallest on ties. `held_tiles`: the full-precision
    tokens' work, in tiles of codes' bytes, shared as `held_splits` says."""
    # up to 8 splits even where the programs fill the GPU: 512 programs on an A100's 324 slots took 2 waves of 65
    # tile-times at 1 or 2 splits (the former cap), 8 of 14 at 5 (gpu_static)
    most = max(1, min(tiles + held_tiles, max(4 * resident_slots // max(programs, 1), 8)))
    costs = [split_cost(programs, tiles, resident_slots, held_tiles, n, merge_per_split, grouped)
             for n in range(1, most + 1)]  # fmt: skip
    return costs.index(min(costs)) + 1


def split_cost(
    programs: int, tiles: int, resident_slots: int, held_tiles: int, splits: int, merge_per_split: float = 0.0,
    grouped: bool = True,
) -> float:
    """`split_count`'s cost of `splits` splits, in tile-times: waves x (the longest split + PROGRAM_TILES), then
    the merge's serial reads (`merge_reads`)."""
    waves = cdiv(programs * splits, resident_slots)
    merge = merge_per_split * merge_reads(splits, grouped) if splits > 1 else 0
    return waves * (longest_split(tiles, held_tiles, splits) + PROGRAM_TILES) + merge


def merge_group(splits: int, grouped: bool = True) -> int:
    """Splits per group of the attention launch's merge (`_attention_kernel`'s MERGE): all of them (the last split
    merges them) where groups would save no read or the kernel merges in one group (not `grouped`), else about
    their square root, the fewest serial reads."""
    size = math.isqrt(splits - 1) + 1 if splits > 1 else 1  # ceil(sqrt(splits))
    return size if grouped and size + cdiv(splits, size) + 1 < splits else splits


def merge_reads(splits: int, grouped: bool = True) -> int:
    """Partial results read (or written) one after another on the merge's path in the attention launch: the last
    group's, its merged result stored, and the groups'; or every split's."""
    size = merge_group(splits, grouped)
    return splits if size == splits else size + 1 + cdiv(splits, size)


def merge_counters(splits: int, grouped: bool = True) -> int:
    """The merge's counters per row block and batch x KV head: one per group and one for the groups (a single
    group: one). Its groups' merged partial results take as many slots per output row as there are counters but
    one."""
    groups = cdiv(splits, merge_group(splits, grouped))
    return groups + 1 if groups > 1 else 1


def merge_seconds(rows: int, head_dim: int) -> float:
    """The time the merge takes per partial result it reads: a split's (`rows` rows of fp32 [head_dim]; their 8-byte
    statistics left out) read from L2 by one SM (`L2_SM_BANDWIDTH`)."""
    return rows * head_dim * 4 / L2_SM_BANDWIDTH


class TileTime(NamedTuple):
    """The split rule's unit: the time a resident block takes to read a tile of codes (`block_n` tokens of 1-byte K
    and V codes, `head_dim` channels each), its share of the memory `bandwidth` (bytes per second) with
    `resident_slots` blocks resident."""

    block_n: int
    head_dim: int
    resident_slots: int
    bandwidth: float

    @property
    def seconds(self) -> float:
        return self.block_n * self.head_dim * 2 * self.resident_slots / self.bandwidth

    def merge(self, rows: int) -> float:
        """The merge's cost per split (`merge_seconds`)."""
        return merge_seconds(rows, self.head_dim) / self.seconds

    @property
    def reduce_launch(self) -> float:
        """A reduce launch's fixed cost (`REDUCE_LAUNCH_SECONDS`)."""
        return REDUCE_LAUNCH_SECONDS / self.seconds


def longest_split(tiles: int, held_tiles: int, splits: int) -> int:
    """Tiles of the longest of `splits` splits over `tiles` tiles of codes and `held_tiles` of full-precision
    tokens (shared as `held_splits` says)."""
    held = held_splits(splits, tiles, held_tiles)
    return max(cdiv(tiles, splits - held), cdiv(held_tiles, held)) if held else cdiv(tiles + held_tiles, splits)


@functools.lru_cache(maxsize=4096)
def held_splits(splits: int, tiles: int, held_tiles: int) -> int:
    """How many of `splits` KV splits read the full-precision tokens (`held_tiles` tiles of codes' bytes) rather
    than `tiles` tiles of codes: none with one split (it reads both), else the count whose longest split is the
    shortest (at least one, the fewest on ties)."""
    if splits == 1 or not held_tiles:
        return 0
    longest = lambda held: max(cdiv(tiles, splits - held), cdiv(held_tiles, held))  # noqa: E731
    return min(range(1, min(held_tiles, splits - 1) + 1), key=longest)


def plan_attention(
    query: torch.Tensor,
    view: KVView,
    *,
    scaling: float,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    num_splits: int | None = None,
    stages: int | None = None,
    resident_slots: int | None = None,
    target: GpuTarget | None = None,
    fp8_prefill: bool = False,
    new_token: NewToken | None = None,
    merge: bool = True,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launches (attention, then the split reduce if any) that fill it.
    For planning without a GPU, `resident_slots` (SMs x blocks per SM) replaces the device's own and `target`
    plans that GPU's code path for tensors that are not on it; `merge` False: a reduce launch merges the splits."""
    plan = AttentionPlan(query, view, mask, sink_logits, scaling, window, softcap, num_splits, stages, resident_slots,
                         target, fp8_prefill=fp8_prefill, new_token=new_token, merge=merge)  # fmt: skip
    return plan.launches(query, view, mask, sink_logits, new_token=new_token)


class Stored(NamedTuple):
    """The kernel arguments that depend only on a view's buffers (kept in its memo, see `KVView.derived`)."""

    tensors: tuple
    channel: torch.Tensor
    strides: tuple
    slots: tuple[int, int]  # held, allocated
    fp_slots: tuple[int, int, int]  # recent, sink, outlier
    fp_tokens: int  # the full-precision buffers' bytes per head, in tokens of (1-byte) codes
    words: bool  # per-token scales readable as 4-byte words


class AttentionPlan:
    """What stays the same from one call to the next of one kind (a layer's decode steps): validation, block
    sizes, constexprs, launch options, scalar factors and the GPU's resident blocks. `launches` fills in the
    positions and tensors of a call."""

    def __init__(
        self,
        query: torch.Tensor,
        view: KVView,
        mask: torch.Tensor | None,
        sink_logits: torch.Tensor | None,
        scaling: float,
        window: int | None = None,
        softcap: float | None = None,
        num_splits: int | None = None,
        stages: int | None = None,
        resident_slots: int | None = None,
        target: GpuTarget | None = None,
        *,
        fp8_prefill: bool = False,
        new_token: NewToken | None = None,
        merge: bool = True,
    ):
        _check_attention(query, view, mask, sink_logits)
        if new_token is not None:
            _check_new_token(query, view, new_token)
        batch, q_heads, q_len, head_dim = query.shape
        fmt = view.fmt
        self.kv_heads = view.codes.shape[2]
        if sums_in_launch(view, q_len):
            _check_sums(view, self.kv_heads, head_dim)
        group = q_heads // self.kv_heads
        target = target or query_target(query)
        held = view.recent is not None or view.sinks is not None or view.outliers is not None
        self.block_m, self.block_n, self.block_d, options = block_sizes(
            group * q_len, head_dim, mask is not None, target, view.per_token and (held or view.rotate)
        )
        if stages is not None:
            options["STAGES"] = stages
        # the splits merged in the attention launch, but with rotated codes (there the merge took sm_90's decode
        # kernels from 146-148 registers to 168 and 12-16 B spilled; elsewhere their registers stay or fall), under
        # a mask over outlier tokens (40 B at sm_90's merge cap of 128) and on targets where it costs registers
        # (`GpuTarget.merges_splits`, `merges_masked_splits`; the interpreter merges: the tests' path); `merge`
        # False: never (a compiled graph given no counters). Each call then chooses (`split_plan`). Under a mask in
        # one group: in two levels sm_90's left-padded default-window decode loop took 550 SASS instructions (0.132
        # per KV byte; 537 with a reduce launch), in one 540 (gpu_static)
        merges = target is None or (target.merges_splits if mask is None else target.merges_masked_splits)
        self.merge = merge and merges and not view.rotate and (mask is None or view.outliers is None)
        self.grouped_merge = mask is None
        self.row_blocks = cdiv(group * q_len, self.block_m)
        check_grid((self.row_blocks, batch * self.kv_heads), "attention (row blocks, batch x KV heads)")
        decode = decode_settings(fmt, query, view.per_token, target)
        self.hw_convert, self.code_dtype = decode.hw_convert, decode.code_dtype
        _, code_factor, dot, value_boost, _ = decode
        # the fp16 decode of float codes is value / code_factor: the factor joins the score scale
        score_scale = scaling * code_factor * (1.0 if softcap is not None else LOG2E.value)
        self.scalars = (window or 0, score_scale, code_factor, value_boost, code_factor / value_boost, softcap or 1.0)
        fp8_qk = fp8_dots(fp8_prefill, group * q_len > 64, fmt, dot, target)
        constexprs = dict(
            GROUP=group, BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_D=self.block_d, IS_FLOAT=fmt.is_float,
            HW_CONVERT=self.hw_convert, FP16_SHIFT=fmt.fp16_shift, NAN_MASK=fmt.nan_code_mask,
            NAN_CODE=fmt.nan_code, PER_TOKEN_K=view.per_token, PER_TOKEN_V=view.per_token, STATIC=view.static,
            RING=view.ring, HAS_RECENT=view.recent is not None, HAS_SINK_TOKENS=view.sinks is not None,
            HAS_MASK=mask is not None, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
            HAS_SINK_LOGITS=sink_logits is not None, HAS_CHANNEL_SCALE=view.key_channel_scale is not None, DOT=dot,
            PRECISION=decode.precision, **options,
            # masked columns' values zeroed only where NaN codes may exist: the rows' reduction took a masked
            # 128-row prefill tile from 0.505 to 0.597 SASS instructions per KV byte (gpu_static)
            DROP_UNSEEN=mask is not None and view.has_nan,
            # one mask row per program: broadcast over the heads, one query position (the plan key holds the shape)
            MASK_ROW=mask is not None and mask.shape[1] == 1 and (q_len == 1 or mask.shape[2] == 1),
            ONE_POSITION=q_len == 1,  # a decode step: no causal rule
            # tiled values in whole blocks over every slot: what the layers allocate (a ring may have any slots)
            VALUE_TILED=view.value_tiled, WHOLE_TILES=view.value_tiled and view.slots % VALUE_TILE.value == 0,
            FP8_QK=fp8_qk, FP8_PV=fp8_qk and (not view.per_token or target is None or target.fp8_token_values),
            **rotation(view.rotate, head_dim),
            HAS_OUTLIERS=view.outliers is not None, WRITE=new_token is not None, CLIP=fmt.clip_bound,
            **{f"ENC_{name}": value for name, value in encoding(fmt).items()},
            SEARCH=view.scale_search if new_token is not None else 0, SUMS=sums_in_launch(view, q_len),
            SUM_ROWS=sum_rows(target),
        )  # fmt: skip
        # a decode step's write in the launch took ptxas past its own caps: sm_90's default-window decode kernel from
        # 128 registers to 135 (3 blocks per SM), 168 with a 12-36 B spill at batch 64, head_dim 64 (2 warps) from
        # 128 to 168 and 12-16 B. Capped: no spill, 8 blocks at head_dim 64, 3 at 128, 2 at 256 (was 1). sm_100's
        # merge alone settled at 128 registers and spilled 8-12 B; capped, none (gpu_static). (Only one row block
        # is split.) Unmerged decodes over outlier tokens have caps of their own (`targets.OUTLIER_TARGETS`)
        caps = {}
        for merged in (False, True):
            cap = target and target.decode_register_cap(
                options["num_warps"], new_token is not None, merged and self.row_blocks == 1,
                view.outliers is not None and q_len == 1, view.scale_search > 1,
            )  # fmt: skip
            if cap and "maxnreg" not in options:
                caps[merged] = {"maxnreg": cap}
        # by (splits, merged in the launch, scales read as words: a property of the buffers, decided with their
        # launch arguments); words up to head_dim 128 (64: 190 -> 181 registers); at 256 (8 warps) the 2-byte loads
        # ran 145 registers and 0.160 instructions per KV byte, words 171 and 0.168 (gpu_static)
        self.launch_options = {
            (split, merged, words): {
                **constexprs, "SPLIT": split, "SCALE_WORDS": words and self.block_d <= 128,
                "FP_PROGRAM": split and held, "MERGE": merged, "GROUPED_MERGE": self.grouped_merge,
                **caps.get(merged, {}),
            }
            for split in (False, True) for merged in {False, split and self.merge} for words in (False, True)
        }  # fmt: skip
        self.sizes = (self.kv_heads, q_len, head_dim)
        self.reduce = reduce_blocks(batch * q_heads * q_len, self.block_d)  # rows, head_dim chunk, warps
        self.out_shape = (batch, q_heads, q_len, head_dim)
        self.out_strides = (q_len * q_heads * head_dim, head_dim, q_heads * head_dim, 1)  # the layout returned
        self.parts: tuple[torch.Tensor, torch.Tensor] | None = None  # the splits' partial results, reused
        self.tickets: torch.Tensor | None = None  # a counter per program of a split (row block, batch x KV head)
        self.scratch: torch.Tensor | None = None  # the rotated query of each program, reused
        self.num_splits = num_splits
        self.resident_slots = resident_slots
        if num_splits is None and self.row_blocks == 1 and target is not None and not resident_slots:
            # blocks per SM of the kernel as compiled (registers, shared memory), times the SMs
            # (the buffers' launch arguments built here are not kept in the view's memo: an entry keyed by a plan
            # that is not the layer's would hold its buffers after the layer replaced them)
            stored, buffers = self._stored(view), self._buffers(query, 2, self.merge)
            held = int(stored.fp_tokens > 0)
            attention = self._attention(query, view, mask, sink_logits, 2, held, self.merge, stored, *buffers,
                                        new_token)[0]  # fmt: skip
            self.resident_slots = target.sms * compiled_occupancy(attention, target, query.device)
        self.split_costs: tuple[float | None, float, bool] | None = None  # `split_plan`'s merge, reduce launch costs
        if self.resident_slots:
            bandwidth = (target or EXAMPLE_GPUS["sm_90"]).memory_bandwidth  # (the interpreter: an H200's)
            tile = TileTime(self.block_n, head_dim, self.resident_slots, bandwidth)
            rows = min(group * q_len, self.block_m)  # a program's rows (the merge reads only those)
            self.split_costs = (tile.merge(rows) if self.merge else None, tile.reduce_launch, self.grouped_merge)

    def _buffers(
        self, query: torch.Tensor, splits: int, merged: bool, tickets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The output, the splits' partial results and the merge's tickets (kept from call to call: one allocation
        per step, the output); `merged`: the launch merges its splits; `tickets` the caller's own (`new_tickets`'s
        zeros)."""
        out = torch.empty_strided(self.out_shape, self.out_strides, dtype=query.dtype, device=query.device)
        if splits == 1:
            return out, out, out, out  # placeholders: a single split writes the output directly
        slots = splits + (merge_counters(splits, self.grouped_merge) - 1 if merged else 0)  # splits', then groups'
        rows = self.out_shape[0] * self.out_shape[1] * self.out_shape[2] * slots
        if self.parts is None or self.parts[1].numel() < rows * 2:
            device = query.device
            sizes = (rows * self.block_d, rows * 2)  # fp32 whatever torch's default dtype
            self.parts = tuple(torch.empty(n, dtype=torch.float32, device=device) for n in sizes)
        counters = self._counters(splits)
        if not merged:
            tickets = out  # (a placeholder: the reduce launch merges)
        elif tickets is None or tickets.numel() < counters:
            # (a compiled decode step's are made for one row block: a prompt split by force takes the plan's)
            if self.tickets is None or self.tickets.numel() < counters:
                self.tickets = self.new_tickets(query.device, splits)
            tickets = self.tickets
        return out, *self.parts, tickets

    def new_tickets(self, device: torch.device, splits: int) -> torch.Tensor:
        """Zeroed counters for the merge of this plan's launches of `splits` splits (`merge_counters` per row block
        and batch x KV head; each launch leaves them at 0)."""
        return torch.zeros(self._counters(splits), dtype=torch.int32, device=device)

    def _counters(self, splits: int) -> int:
        return self.row_blocks * self.out_shape[0] * self.kv_heads * merge_counters(splits, self.grouped_merge)

    def _query_scratch(self, query: torch.Tensor, splits: int) -> torch.Tensor:
        """fp32 rows for each program's rotated query (`rotated_query`): kept from call to call for decode steps
        (one query token), made per call otherwise (a prompt's is the size of its query in fp32: kept in every
        layer's plan, a long prompt's would stay held after its prefill)."""
        size = self.row_blocks * self.out_shape[0] * self.kv_heads * splits * self.block_m * self.block_d
        if self.out_shape[2] > 1:
            return torch.empty(size, dtype=torch.float32, device=query.device)
        if self.scratch is None or self.scratch.numel() < size:
            self.scratch = torch.empty(size, dtype=torch.float32, device=query.device)
        return self.scratch

    def splits(self, query: torch.Tensor, view: KVView) -> tuple[int, bool]:
        """The split count of this call, and whether its launch merges them (`split_plan`): forced, else from the
        resident blocks (static views: for a full buffer, so that the grid is the same at every step)."""
        splits, _, merged = self._split_count(query, view, self._stored(view))  # not kept in the view's memo
        return splits, merged

    def _split_count(self, query: torch.Tensor, view: KVView, stored: tuple) -> tuple[int, int, bool]:
        """The split count, how many of the splits read the full-precision tokens (`held_splits`), and whether the
        launch merges them (forced splits: wherever the kernel can)."""
        codes_tokens = view.slots if view.static else max(view.recent_start - view.start, 0)
        tiles, held_tiles = max(1, cdiv(codes_tokens, self.block_n)), cdiv(stored.fp_tokens, self.block_n)
        if self.num_splits is not None:
            splits, merged = max(1, min(self.num_splits, tiles + held_tiles)), self.merge
        elif not self.resident_slots or self.row_blocks > 1:
            splits, merged = 1, False
        else:
            programs = query.shape[0] * self.kv_heads * self.row_blocks
            splits, merged = split_plan(programs, tiles, self.resident_slots, held_tiles, *self.split_costs)
        return splits, held_splits(splits, tiles, held_tiles), merged and splits > 1

    def launches(
        self, query: torch.Tensor, view: KVView, mask: torch.Tensor | None, sink_logits: torch.Tensor | None,
        tickets: torch.Tensor | None = None, new_token: NewToken | None = None,
    ) -> tuple[torch.Tensor, list[Launch]]:
        """The output and the launches that fill it (the attention, then its reduce where the kernel does not
        merge its splits); `tickets`: the merge's counters where the caller keeps them (a compiled graph's plan
        lives for one call), else the plan's own; `new_token`: the step's write (the plan's kind)."""
        stored = view.derived(self, self._stored)
        splits, held, merged = self._split_count(query, view, stored)
        out, *buffers = self._buffers(query, splits, merged, tickets)
        return out, self._attention(query, view, mask, sink_logits, splits, held, merged, stored, out, *buffers,
                                    new_token)  # fmt: skip

    def _stored(self, view: KVView) -> Stored:
        """The kernel arguments that depend only on the view's buffers (tensors, strides, slot counts)."""
        placeholder = view.scales  # for a buffer the constexprs leave unread
        tensors = (
            *_codes(view, self.code_dtype), view.scales[0], view.scales[1], *planes(view.recent, placeholder),
            *planes(view.sinks, placeholder), _or(view.sink_start, placeholder), _or(view.sink_count, placeholder),
            _or(view.positions, placeholder), *planes(view.outliers, placeholder), _or(view.outlier_pos, placeholder),
        )  # fmt: skip
        strides = (
            *view.codes.stride()[1:], *_scale_strides(view), *plane_strides(view.recent), *plane_strides(view.sinks),
            *plane_strides(view.outliers), *(view.outlier_pos.stride() if view.outliers is not None else (0, 0, 0)),
        )  # fmt: skip
        return Stored(tensors, _or(view.key_channel_scale, placeholder), strides, (view.slots, view.codes.shape[3]),
                      (_slots(view.recent), _slots(view.sinks), _slots(view.outliers)), _fp_tokens(view),
                      _scale_words(view))  # fmt: skip

    def _attention(
        self, query, view, mask, sink_logits, splits, held, merged: bool, stored: Stored, out, part_acc, part_stats,
        tickets, new_token: NewToken | None = None,
    ) -> list[Launch]:
        if view.static:  # positions are read on the device
            start, end, recent_start, mask_start = view.start, 0, 0, 0
        else:
            start, end, recent_start = view.start, view.end, view.recent_start
            mask_start = view.mask_start if view.mask_start is not None else end - mask.shape[-1] if mask is not None else 0
        if new_token is not None:
            new_k, new_v, stats = new_token.key, new_token.value, new_token.stats
            new_strides = (*new_k.stride()[:2], new_k.stride(3), *new_v.stride()[:2], new_v.stride(3))
        else:
            new_k, new_v, stats, new_strides = query, query, query, (0,) * 6
        if mask is not None:
            mask = _expand_mask(mask, *self.out_shape[:3])
        tensors, channel, strides, slots, fp_slots, _, words = stored  # (unpacked: the step's hot path)
        launches = [Launch(_attention_kernel, (self.row_blocks, self.out_shape[0] * self.kv_heads, splits), (
            query, *tensors, _or(mask, query), _or(sink_logits, query), channel, out, part_acc, part_stats, tickets,
            self._query_scratch(query, splits) if view.rotate else query, new_k, new_v, stats,
            _or(view.search_energy, query), _or(view.search_tickets, query), *query.stride(),
            *strides, *(mask.stride() if mask is not None else (0, 0, 0, 0)), *out.stride(),
            *new_strides, *self.sizes, splits, held, merge_group(splits, self.grouped_merge) if merged else splits,
            *slots, view.offset, *fp_slots, start, end, recent_start, mask_start,
            new_token.recent_start if new_token is not None else 0, *self.scalars,
        ), self.launch_options[splits > 1, merged, words])]  # fmt: skip
        if splits > 1 and not merged:
            launches.append(reduce_launch(part_acc, part_stats, sink_logits, out, out.stride(), self.out_shape, splits,
                                          self.block_d, self.reduce))  # fmt: skip
        return launches


def reduce_launch(
    part_acc: torch.Tensor, part_stats: torch.Tensor, sink_logits: torch.Tensor | None, out: torch.Tensor,
    out_strides: tuple[int, int, int, int], sizes: tuple[int, int, int, int], splits: int, block_d: int,
    blocks: tuple[int, int, int],
) -> Launch:  # fmt: skip
    """`_reduce_kernel`'s launch: the `splits` partial results of each output row (batch, query head, position of
    `sizes` `(batch, q_heads, q_len, head_dim)`) merged into `out` at `out_strides` (batch, head, position,
    channel); `blocks`: `reduce_blocks`' rows, head_dim chunk and warps."""
    batch, q_heads, q_len, head_dim = sizes
    out_rows = batch * q_heads * q_len
    rows, chunk, warps = blocks
    return Launch(_reduce_kernel, (cdiv(out_rows, rows), block_d // chunk), (
        part_acc, part_stats, _or(sink_logits, out), out, *out_strides, out_rows, q_heads, q_len, head_dim, splits,
    ), dict(
        BLOCK_R=rows, BLOCK_S=min(REDUCE_SPLITS, next_power_of_2(splits)), BLOCK_C=chunk, PART_D=block_d,
        HAS_SINK_LOGITS=sink_logits is not None, num_warps=warps,
    ))  # fmt: skip


def fp8_dots(fp8_prefill: bool, prefill: bool, fmt, dot, target: GpuTarget | None) -> bool:
    """Whether a kernel's dots over codes run on FP8 tensor cores (QK, and PV but with per-token V scales where
    `GpuTarget.fp8_token_values` says): asked for, a prefill's tiles of more than 64 rows (a decode step is bound
    by memory), e4m3fn codes (the format's own), fp16 or bf16 queries (fp32 ones keep fp32 dots), a GPU with
    e4m3fn tensor cores (or the interpreter; a cache asking for them elsewhere is refused when built). Off by
    default: the query's and probabilities' 3 mantissa bits cost SmolLM2's prefill a mean KL of 3e-3 (the cache's
    own target is 6e-4), and the compiled loop is no leaner (docs/benchmarks.md, issue 21 round 3)."""
    return (
        fp8_prefill and prefill and fmt.dtype == torch.float8_e4m3fn and dot == tl.float16
        and (target is None or target.fp8_dots(fmt.dtype))
    )  # fmt: skip


def reduce_blocks(out_rows: int, block_d: int) -> tuple[int, int, int]:
    """Rows, head_dim chunk and warps of a reduce program: 32-channel chunks, rows per program growing with the
    rows to merge (at least REDUCE_PROGRAMS programs, 16 rows at most), one warp per 128 elements. A batch-1 step
    of 32 query heads had 2 programs of 16 rows x 128 channels over 47 splits (gpu_static); it now has 128."""
    chunk = min(block_d, REDUCE_CHUNK)
    chunks = block_d // chunk
    per_program = max(1, out_rows * chunks // REDUCE_PROGRAMS)
    rows = min(MIN_ROWS, 1 << (per_program.bit_length() - 1))  # a power of 2 at most per_program
    return rows, chunk, max(1, min(4, rows * chunk // 128))


def _or(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a placeholder pointer for an argument the kernel's constexprs leave unread."""
    return tensor if tensor is not None else placeholder


def _slots(buffer: torch.Tensor | None) -> int:
    return buffer.shape[3] if buffer is not None else 0


def _fp_tokens(view: KVView) -> int:
    """The full-precision buffers' bytes per head, in tokens of (1-byte) codes: the last split's extra work."""
    buffers = (view.recent, view.sinks, view.outliers)
    return sum(buffer.shape[3] * buffer.element_size() for buffer in buffers if buffer is not None)


def _codes(view: KVView, code_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value codes as the kernel reads them (`DecodeSettings.code_dtype`): fp8 for the hardware
    conversion, uint8 for the byte permutes, else int8 bits."""
    codes = view.codes if code_dtype is None else view.codes.view(code_dtype)
    return codes[0], codes[1]


def _scale_words(view: KVView) -> bool:
    """Whether the per-token scales can be read as 4-byte words (`load_token_scales`): bf16, one per slot, every
    (batch, head) row starting on a word."""
    scales = view.scales
    return bool(
        view.per_token and scales.dtype == torch.bfloat16 and scales.stride(3) == 1
        and scales.stride(1) % 2 == 0 and scales.stride(2) % 2 == 0 and scales[0].data_ptr() % 4 == 0
        and scales[1].data_ptr() % 4 == 0
    )  # fmt: skip


def _scale_strides(view: KVView) -> tuple[int, int, int]:
    """Batch, head and token strides of the scales (0 where a static scale broadcasts)."""
    _, batch, heads, slots = view.scales.shape
    return view.scales[0].expand(view.codes.shape[1], heads, slots).stride()


def _expand_mask(mask: torch.Tensor, batch: int, q_heads: int, q_len: int) -> torch.Tensor:
    """The bool mask as a `[batch, q_heads, q_len, columns]` uint8 view (broadcast dims at stride 0)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True = attend), got {mask.dtype}")
    try:
        return mask.expand(batch, q_heads, q_len, mask.shape[-1]).view(torch.uint8)
    except RuntimeError:
        raise ValueError(
            f"mask {tuple(mask.shape)} does not broadcast to [batch, heads, q_len, columns] = "
            f"{[batch, q_heads, q_len, mask.shape[-1]]}"
        ) from None


def _check_new_token(query: torch.Tensor, view: KVView, new_token: NewToken) -> None:
    """Refuse, by name, a write in the attention launch that it cannot do: more than one query token, outlier
    tokens (their staging runs between the write and the attention), anything `write_kv` refuses."""
    if query.shape[2] != 1 or not can_write_in_launch(view, new_token.key.shape[2]):
        raise ValueError(
            f"the attention launch writes one new token of a decode step without outlier tokens, got query "
            f"{tuple(query.shape)}, new keys {tuple(new_token.key.shape)}, outliers {view.outliers is not None}"
        )
    before = view if view.static else dataclasses.replace(view, end=view.end - 1, recent_start=new_token.recent_start)
    check_write(new_token.key, new_token.value, before, new_token.stats, view.static)


def _check_attention(query: torch.Tensor, view: KVView, mask: torch.Tensor | None, sink_logits: torch.Tensor | None) -> None:
    batch, q_heads, q_len, head_dim = query.shape
    _, cache_batch, kv_heads, _, cache_dim = view.codes.shape
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype {query.dtype} is not fp16, bf16 or fp32")
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, not a multiple of the cache's {kv_heads} KV heads")
    if cache_batch != batch or cache_dim != head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not match the cache's codes {tuple(view.codes.shape)}")
    if view.codes.dtype != view.fmt.dtype:
        raise ValueError(f"codes have dtype {view.codes.dtype}, format {view.fmt.name} stores {view.fmt.dtype}")
    if view.scales.dtype not in scale_dtypes(view) or view.scales.dim() != 4 or view.scales.shape[2] != kv_heads:
        raise ValueError(
            f"scales must be fp32 (per-token: or bf16) [2, 1 or batch, {kv_heads}, 1 or slots], got "
            f"{view.scales.dtype} {tuple(view.scales.shape)}"
        )
    if not view.static and not q_len <= view.end - view.start:
        raise ValueError(f"the {q_len} query tokens are not among the cache's {view.end - view.start} visible tokens")
    if mask is not None and not view.static and view.mask_start is None and mask.shape[-1] < view.end - view.start:
        raise ValueError(
            f"mask has {mask.shape[-1]} columns, fewer than the {view.end - view.start} tokens the queries see"
        )
    view.check_layout()
    if sink_logits is not None and sink_logits.shape != (q_heads,):
        raise ValueError(f"sink_logits must have one logit per query head ({q_heads}), got {tuple(sink_logits.shape)}")
    if view.key_channel_scale is not None and view.key_channel_scale.shape != (kv_heads, head_dim):
        raise ValueError(
            f"key_channel_scale must be [{kv_heads}, {head_dim}], got {tuple(view.key_channel_scale.shape)}"
        )
