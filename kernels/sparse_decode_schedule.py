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

import math
from dataclasses import dataclass

import torch

from dsv4_attn.kernels.sparse_decode_config import BLOCK_N

__all__ = [
    "SNAP_DIV",
    "TOKEN_OVERHEAD_TILES",
    "DecodeSchedule",
    "build_schedule",
    "max_partial_slots",
    "min_share_tiles",
    "num_parts",
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
