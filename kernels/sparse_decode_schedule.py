"""Balanced work for the sparse decode kernel: each CTA a contiguous share of all key tiles.

With one CTA per token, a wave of the decode grid lasts as long as its longest token: at HCA 1M
contexts a request may see 0 or 8192 compressed entries, so most SMs idle while a few finish.
The *balanced* schedule lays every token's key tiles end to end (token 0's, then token 1's,
...), each token charged :data:`TOKEN_OVERHEAD_TILES` extra for what a CTA pays per token
(its Q tile, the pipeline's first DRAM round trip, the epilogue), and cuts that line into
``num_parts`` equal shares: part ``p`` is one persistent CTA (per 64-head block) that runs its
share token by token. A token inside one part is finished there (bf16 output, sink applied); a
token cut by part boundaries leaves a partial per piece (fp16, row-scaled) in a compact slot,
merged by the combine kernel. Slots: a token with k cuts takes k + 1, so all tokens together
take at most ``2 (num_parts - 1)`` (:func:`max_partial_slots`).

A boundary that falls within a few tiles of a token's edge (its overhead, plus a sixteenth of a
share) moves to that edge: a cut costs a partial's write and read (64 KB each per 64 heads in
fp16, the bytes of ~3.5 FP8 tiles), more than the imbalance it saves there.

:func:`build_schedule` is the plan's definition, in torch ops on the device from the per-token
key counts (no host sync: a CUDA graph may capture it): ~50 small kernels, ~0.12 ms on an H100
even in a CUDA graph (docs/design.md §4.1.6). :mod:`dsv4_attn.fused.decode_schedule`
computes the same tensors in one Triton program. Either way a caller builds the plan once per
step and reuses it for every layer with the same counts, as vLLM does with FlashMLA's. Units:
*tiles* of ``BLOCK_N`` keys; *positions* on the line of all tokens' costs.

Plan tensors (int32, on the counts' device):
    part_plan  [num_parts, 4]: (first position, end position, first token, last token); a part
               with first token > last token has no work.
    token_plan [T, 5]: (position of the token's first tile, its tiles (at least 1: a token
               without keys still takes one empty tile, so some part writes its output),
               number of pieces, first partial slot (-1 when it has one piece), the part
               holding its first tile). Part p's piece of a cut token goes to slot
               ``first slot + p - first part``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from dsv4_attn.kernels.sparse_decode_config import BLOCK_H, BLOCK_N
from dsv4_attn.kv_cache import HEAD_DIM

__all__ = [
    "BALANCED_MIN_CAPACITY",
    "BALANCED_MIN_KEYS_PER_PART",
    "SNAP_DIV",
    "TOKEN_OVERHEAD_TILES",
    "DecodeSchedule",
    "balanced_parts",
    "balanced_pays",
    "balanced_plan",
    "balanced_workspace_shape",
    "build_schedule",
    "max_partial_slots",
    "min_share_tiles",
    "num_parts",
    "num_sms",
    "plan_for_counts",
]

# What one more token costs a CTA, in tiles of key work (a tile is ~1.3 us at 64 heads: Q's
# 64 KB, the first rows' DRAM round trip and the epilogue are ~2-3 us).
TOKEN_OVERHEAD_TILES = 2
# Least tiles per share, and the most pieces a token may take (from the split sweep on the H100:
# past ~32 pieces the partials cost more than the split saves).
MIN_SHARE_TILES = 2
MAX_PIECES = 32
# Boundaries within TOKEN_OVERHEAD_TILES + share // SNAP_DIV tiles of a token's edge move to it.
SNAP_DIV = 16
# When the balanced schedule pays (balanced_pays; docs/design.md §4.1.6): lists of at least
# window + 2048 entries (a 256K context) and capacity for at least 480 keys per part, from
# `python -m dsv4_attn.bench decode --against flashmla` on ragged HCA lists.
BALANCED_MIN_CAPACITY = 128 + 2048
BALANCED_MIN_KEYS_PER_PART = 480


@dataclass(frozen=True)
class DecodeSchedule:
    """A balanced plan (see the module docstring for the layouts)."""

    part_plan: torch.Tensor  # int32 [num_parts, 4]
    token_plan: torch.Tensor  # int32 [T, 5]

    @property
    def num_parts(self) -> int:
        return self.part_plan.shape[0]


def num_parts(num_sms: int, head_blocks: int) -> int:
    """Persistent CTAs per 64-head block: together one CTA per SM."""
    return max(1, num_sms // head_blocks)


def max_partial_slots(parts: int) -> int:
    """Most partial slots a plan with ``parts`` parts fills (k cuts make k + 1 pieces)."""
    return max(0, 2 * (parts - 1))


def min_share_tiles(capacity_tiles: int) -> int:
    """Least tiles per share for key lists of at most ``capacity_tiles`` tiles."""
    return max(MIN_SHARE_TILES, math.ceil(capacity_tiles / MAX_PIECES))


def build_schedule(
    key_counts: torch.Tensor, parts: int, min_share: int = MIN_SHARE_TILES
) -> DecodeSchedule:
    """The balanced plan for tokens with ``key_counts`` keys each (int ``[T]``, T >= 1)."""
    if key_counts.dim() != 1 or key_counts.shape[0] == 0:
        shape = tuple(key_counts.shape)
        raise ValueError(f"key_counts must be a non-empty 1-D tensor, got shape {shape}")
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    device = key_counts.device
    counts = key_counts.to(torch.int64).clamp_min(0)
    tiles = ((counts + BLOCK_N - 1) // BLOCK_N).clamp_min(1)
    cost = tiles + TOKEN_OVERHEAD_TILES
    end = torch.cumsum(cost, 0)  # each token's end position
    start = end - cost
    total = end[-1:]  # [1], stays on the device
    share = torch.clamp_min((total + parts - 1) // parts, min_share)

    # Boundaries: p * share clipped to the line, moved to a token's edge when close to it.
    p = torch.arange(parts + 1, device=device, dtype=torch.int64)
    bounds = torch.minimum(p * share, total)
    owner = torch.searchsorted(end, bounds, right=True).clamp_max(counts.shape[0] - 1)
    slack = TOKEN_OVERHEAD_TILES + share // SNAP_DIV
    inside = (bounds > start[owner]) & (bounds < end[owner])
    to_start = inside & (bounds - start[owner] <= slack)
    to_end = inside & ~to_start & (end[owner] - bounds <= slack)
    bounds = torch.where(to_start, start[owner], torch.where(to_end, end[owner], bounds))
    first_tile_at = start + TOKEN_OVERHEAD_TILES

    # Parts: [bounds[p], bounds[p + 1]); the tokens whose cost line meets it.
    lo, hi = bounds[:-1], bounds[1:]
    first_token = torch.searchsorted(end, lo, right=True)
    last_token = torch.searchsorted(end, hi - 1, right=True)
    empty = hi <= lo
    last_token = torch.where(empty, first_token - 1, last_token)
    part_plan = torch.stack([lo, hi, first_token, last_token], dim=1)

    # Tokens: the parts holding their first and last tile.
    first_part = torch.searchsorted(bounds, first_tile_at, right=True) - 1
    last_part = torch.searchsorted(bounds, first_tile_at + tiles - 1, right=True) - 1
    pieces = last_part - first_part + 1
    cut = pieces > 1
    slots = torch.where(cut, pieces, torch.zeros_like(pieces))
    slot_base = torch.cumsum(slots, 0) - slots
    slot_base = torch.where(cut, slot_base, torch.full_like(slot_base, -1))
    token_plan = torch.stack([first_tile_at, tiles, pieces, slot_base, first_part], dim=1)
    return DecodeSchedule(part_plan.to(torch.int32), token_plan.to(torch.int32))


# ----------------------------------------------------------------------------------------------
# Policy, sizes and the plan of a call
# ----------------------------------------------------------------------------------------------


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def balanced_parts(num_heads: int, device: torch.device) -> int:
    """Parts (persistent CTAs per 64-head block) of the balanced schedule: one CTA per SM."""
    return num_parts(num_sms(device.index or 0), math.ceil(num_heads / BLOCK_H))


def balanced_workspace_shape(parts: int, num_heads: int) -> tuple[tuple, tuple]:
    """Shapes of the balanced schedule's partials per slot: outputs (fp16,
    ``sparse_decode.PARTIAL_DTYPE``) and their (lse, row scale) pairs (fp32,
    ``sparse_decode.PARTIAL_PAIR_DTYPE``)."""
    slots = max(1, max_partial_slots(parts))
    return (slots, num_heads, HEAD_DIM), (slots, num_heads, 2)


def balanced_pays(num_tokens: int, key_capacity: int, num_parts: int) -> bool:
    """Whether the balanced schedule with ``num_parts`` parts (CTAs per 64-head block) is worth
    its plan for ``num_tokens`` tokens whose key lists hold up to ``key_capacity`` keys (the
    policy of ``DSV4_ATTN_DECODE_SCHEDULE=auto``): lists of at least
    :data:`BALANCED_MIN_CAPACITY` keys, and capacity for :data:`BALANCED_MIN_KEYS_PER_PART`
    keys per part.

    Measured on ragged HCA lists (each request's count uniform in [0, entries]; H100 and H200, CUDA
    graphs, fp16 split partials; docs/design.md §4.1.6): the balanced schedule wins by 5-40% from 8
    tokens at 8192 entries (1M context), from 16 at 4096 and from 32 at 2048, ties or loses below
    that, and never wins at 1024 entries, where a wave of the split launch is short anyway. (Lists
    all at the capacity lose 3-12% balanced, e.g. 1M at 8 tokens 1.41x -> 1.32x FlashMLA; the rule
    cannot see the counts, and real batches are ragged.)
    """
    return (
        key_capacity >= BALANCED_MIN_CAPACITY
        and num_tokens * key_capacity >= BALANCED_MIN_KEYS_PER_PART * num_parts
    )


def balanced_plan(
    window,
    extra,
    num_heads: int,
    *,
    method: str = "triton",
    out: DecodeSchedule | None = None,
) -> DecodeSchedule:
    """The balanced schedule of a call with these scopes (``window``, ``extra``: the
    :class:`~dsv4_attn.scope.KVScope` of the call) for ``num_heads`` query heads, from their key
    counts, on the device and without a host sync; build it once per step and pass it to every
    call with the same counts. See :func:`plan_for_counts` for ``method`` and ``out``."""
    return plan_for_counts(
        window.lens,
        extra.lens if extra is not None else None,
        (window.capacity, extra.capacity if extra is not None else 0),
        num_heads,
        method=method,
        out=out,
    )


def plan_for_counts(
    lens: torch.Tensor,
    extra_lens: torch.Tensor | None,
    capacities: tuple[int, int],
    num_heads: int,
    *,
    method: str = "triton",
    num_parts: int | None = None,
    out: DecodeSchedule | None = None,
) -> DecodeSchedule:
    """The balanced schedule of tokens with ``lens + extra_lens`` keys (int ``[T]``; the very
    tensors the call's scopes hold) in lists of at most ``capacities = (window, extra)`` keys
    (the scopes' widths), for ``num_heads`` query heads.

    Each length is clamped into ``0 ..`` its scope's width first, as the kernel clamps it: plan
    and kernel count the same keys whatever the lengths hold, and no length can push the plan's
    int32 positions, or the partial slots they give, out of range.

    ``method``: ``"triton"`` (on CUDA: one program, :mod:`dsv4_attn.fused.decode_schedule`) or
    ``"torch"`` (the construction it reproduces, ~50 small kernels, ~0.12 ms on an H100 even
    inside a CUDA graph). ``num_parts``: persistent CTAs per 64-head block (default
    :func:`balanced_parts`: one CTA per SM of the counts' GPU). ``out``: int32 tensors of the
    plan's shapes to write into (persistent buffers a CUDA graph replays), else new ones.
    """
    if method not in ("triton", "torch"):
        raise ValueError(f"method must be 'triton' or 'torch', got {method!r}")
    T = lens.shape[0]
    parts = num_parts if num_parts is not None else balanced_parts(num_heads, lens.device)
    window_capacity, extra_capacity = capacities if extra_lens is not None else (capacities[0], 0)
    capacity_tiles = math.ceil((window_capacity + extra_capacity) / BLOCK_N)
    # Positions on the cost line are int32 in the plan.
    if T * (capacity_tiles + TOKEN_OVERHEAD_TILES) >= 2**31:
        raise ValueError(
            f"{T} tokens of up to {capacity_tiles} key tiles: the balanced plan's positions "
            "must stay below 2^31 tiles; split the call"
        )
    min_share = min_share_tiles(capacity_tiles)
    if method == "triton" and lens.is_cuda:
        from dsv4_attn.fused import decode_schedule

        return decode_schedule.build_schedule(
            lens, extra_lens, (window_capacity, extra_capacity), parts, min_share, out=out
        )
    key_counts = lens.long().clamp(0, window_capacity)
    if extra_lens is not None:
        key_counts = key_counts + extra_lens.long().clamp(0, extra_capacity)
    plan = build_schedule(key_counts, parts, min_share)
    if out is None:
        return plan
    out.part_plan.copy_(plan.part_plan)
    out.token_plan.copy_(plan.token_plan)
    return out
