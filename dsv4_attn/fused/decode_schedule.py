"""Triton kernel for the balanced decode schedule: the whole plan in one launch.

:func:`build_schedule` computes exactly what the torch construction
:func:`dsv4_attn.kernels.sparse_decode_schedule.build_schedule` computes (that module has the
rule and the layouts), from the window and compressed key counts, in one program of one CTA:
the torch construction is ~50 small kernels (~0.12 ms on an H100 even inside a CUDA graph).

The program walks the tokens in chunks four times: the cost line (a running prefix sum; the
token plan's first two columns), the owners of the share boundaries (before they move to a
token's edge), the parts' first and last tokens (after), and the tokens' parts and partial
slots (a running prefix sum again). Each pass compares a chunk of tokens with every boundary at
once (``BLOCK_P`` >= parts + 1 boundaries, ``CHUNK`` tokens), so no search is sequential. The
passes read what the earlier ones stored (global memory, the same CTA): a barrier separates
them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_attn.kernels.sparse_decode_config import BLOCK_N
from dsv4_attn.kernels.sparse_decode_schedule import (
    SNAP_DIV,
    TOKEN_OVERHEAD_TILES,
    DecodeSchedule,
)

__all__ = ["build_schedule"]

_CHUNK = 32  # tokens per pass step: CHUNK x BLOCK_P comparisons at a time


@triton.jit
def _token_ends(token_plan_ptr, t0, T, CHUNK: tl.constexpr):
    """End positions of tokens t0 .. t0 + CHUNK - 1 (past T: beyond any position)."""
    t = t0 + tl.arange(0, CHUNK)
    live = t < T
    at = tl.load(token_plan_ptr + t * 5, mask=live, other=0).to(tl.int64)
    tiles = tl.load(token_plan_ptr + t * 5 + 1, mask=live, other=0).to(tl.int64)
    return tl.where(live, at + tiles, 1 << 62)


# T, the step's decode token count, is not specialized, so one compile serves every batch. The
# capacities, parts and least share are the model's (fixed), and every pointer is a prefix of a
# buffer allocated once: they stay specialized.
@triton.jit(do_not_specialize=["T"])
def _decode_schedule_kernel(
    lens_ptr,
    extra_lens_ptr,
    window_capacity,
    extra_capacity,
    T,
    parts,
    min_share,
    part_plan_ptr,
    token_plan_ptr,
    HAS_EXTRA: tl.constexpr,
    KEYS_PER_TILE: tl.constexpr,
    OVERHEAD: tl.constexpr,
    SNAP_DIV: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # ---- pass 1: each token's tiles and the position of its first tile (a running prefix sum)
    total = tl.zeros([1], dtype=tl.int64)
    for t0 in range(0, T, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        live = t < T
        # Each length clamped into its scope's width, as the decode kernel clamps it.
        count = tl.load(lens_ptr + t, mask=live, other=0).to(tl.int64)
        count = tl.minimum(tl.maximum(count, 0), window_capacity)
        if HAS_EXTRA:
            extra = tl.load(extra_lens_ptr + t, mask=live, other=0).to(tl.int64)
            count += tl.minimum(tl.maximum(extra, 0), extra_capacity)
        tiles = tl.maximum((count + KEYS_PER_TILE - 1) // KEYS_PER_TILE, 1)
        cost = tl.where(live, tiles + OVERHEAD, 0)
        end = tl.cumsum(cost, axis=0) + total
        tl.store(token_plan_ptr + t * 5, (end - cost + OVERHEAD).to(tl.int32), mask=live)
        tl.store(token_plan_ptr + t * 5 + 1, tiles.to(tl.int32), mask=live)
        total += tl.sum(cost, axis=0)
    share = tl.maximum((total + parts - 1) // parts, min_share)
    tl.debug_barrier()

    # ---- pass 2: the boundaries p * share, their owners, moved to an edge when close to it
    p = tl.arange(0, BLOCK_P)
    bound = tl.minimum(p.to(tl.int64) * share, total)
    owner = tl.zeros([BLOCK_P], dtype=tl.int32)
    for t0 in range(0, T, CHUNK):
        end = _token_ends(token_plan_ptr, t0, T, CHUNK)
        owner += tl.sum((end[None, :] <= bound[:, None]).to(tl.int32), axis=1)
    owner = tl.minimum(owner, T - 1)
    owner_at = tl.load(token_plan_ptr + owner * 5).to(tl.int64)
    owner_start = owner_at - OVERHEAD
    owner_end = owner_at + tl.load(token_plan_ptr + owner * 5 + 1).to(tl.int64)
    slack = OVERHEAD + share // SNAP_DIV
    inside = (bound > owner_start) & (bound < owner_end)
    to_start = inside & (bound - owner_start <= slack)
    to_end = inside & (~to_start) & (owner_end - bound <= slack)
    bound = tl.where(to_start, owner_start, tl.where(to_end, owner_end, bound))
    # Each part's first token holds its first position; its last, the position before its end.
    first_token = tl.zeros([BLOCK_P], dtype=tl.int32)
    before_end = tl.zeros([BLOCK_P], dtype=tl.int32)
    for t0 in range(0, T, CHUNK):
        end = _token_ends(token_plan_ptr, t0, T, CHUNK)
        first_token += tl.sum((end[None, :] <= bound[:, None]).to(tl.int32), axis=1)
        before_end += tl.sum((end[None, :] <= bound[:, None] - 1).to(tl.int32), axis=1)
    is_part = p < parts
    tl.store(part_plan_ptr + p * 4, bound.to(tl.int32), mask=is_part)
    tl.store(part_plan_ptr + p * 4 + 2, first_token, mask=is_part)
    # Boundary p ends part p - 1.
    ends_part = (p >= 1) & (p <= parts)
    tl.store(part_plan_ptr + (p - 1) * 4 + 1, bound.to(tl.int32), mask=ends_part)
    tl.store(part_plan_ptr + (p - 1) * 4 + 3, before_end, mask=ends_part)
    tl.debug_barrier()

    # ---- pass 3: empty parts, then each token's parts and partial slots
    lo = tl.load(part_plan_ptr + p * 4, mask=is_part, other=0)
    hi = tl.load(part_plan_ptr + p * 4 + 1, mask=is_part, other=0)
    first = tl.load(part_plan_ptr + p * 4 + 2, mask=is_part, other=0)
    last = tl.load(part_plan_ptr + p * 4 + 3, mask=is_part, other=0)
    tl.store(part_plan_ptr + p * 4 + 3, tl.where(hi <= lo, first - 1, last), mask=is_part)
    # The moved boundaries again (parts + 1 of them: the last is the line's end, never moved).
    bounds = tl.where(is_part, lo.to(tl.int64), total)
    bounds = tl.where(p <= parts, bounds, 1 << 62)
    slot_total = tl.zeros([1], dtype=tl.int32)
    for t0 in range(0, T, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        live = t < T
        at = tl.load(token_plan_ptr + t * 5, mask=live, other=0).to(tl.int64)
        tiles = tl.load(token_plan_ptr + t * 5 + 1, mask=live, other=1).to(tl.int64)
        first_part = tl.sum((bounds[None, :] <= at[:, None]).to(tl.int32), axis=1) - 1
        last_part = tl.sum((bounds[None, :] <= (at + tiles - 1)[:, None]).to(tl.int32), axis=1) - 1
        pieces = last_part - first_part + 1
        slots = tl.where(live & (pieces > 1), pieces, 0)
        slot_base = tl.cumsum(slots, axis=0) - slots + slot_total
        tl.store(token_plan_ptr + t * 5 + 2, pieces, mask=live)
        tl.store(token_plan_ptr + t * 5 + 3, tl.where(pieces > 1, slot_base, -1), mask=live)
        tl.store(token_plan_ptr + t * 5 + 4, first_part, mask=live)
        slot_total += tl.sum(slots, axis=0)


def build_schedule(
    lens: torch.Tensor,
    extra_lens: torch.Tensor | None,
    capacities: tuple[int, int],
    parts: int,
    min_share: int,
    out: DecodeSchedule | None = None,
) -> DecodeSchedule:
    """The balanced plan for tokens with ``lens + extra_lens`` keys (int32/int64 ``[T]``,
    T >= 1; ``extra_lens`` may be None), each length clamped into ``0 ..`` its scope's width
    (``capacities``: window, extra), ``parts`` parts and shares of at least ``min_share``
    tiles: the same tensors as the torch construction on the clamped counts. ``out``: contiguous
    int32 tensors of exactly the plan's shapes to write it into (a caller's persistent buffers),
    else new ones."""
    T = lens.shape[0]
    if T == 0 or parts < 1:
        raise ValueError(f"need at least one token and one part, got T = {T}, parts = {parts}")
    if out is None:
        part_plan = torch.empty(parts, 4, dtype=torch.int32, device=lens.device)
        token_plan = torch.empty(T, 5, dtype=torch.int32, device=lens.device)
    else:
        part_plan, token_plan = out.part_plan, out.token_plan
        for name, got, want in (
            ("part_plan", part_plan, (parts, 4)),
            ("token_plan", token_plan, (T, 5)),
        ):
            if tuple(got.shape) != want or got.dtype != torch.int32 or not got.is_contiguous():
                raise ValueError(
                    f"out.{name} must be contiguous int32 {want}, got "
                    f"{got.dtype} {tuple(got.shape)}"
                )
    _decode_schedule_kernel[(1,)](
        lens,
        extra_lens if extra_lens is not None else lens,
        *capacities,
        T,
        parts,
        min_share,
        part_plan,
        token_plan,
        HAS_EXTRA=extra_lens is not None,
        KEYS_PER_TILE=BLOCK_N,
        OVERHEAD=TOKEN_OVERHEAD_TILES,
        SNAP_DIV=SNAP_DIV,
        BLOCK_P=triton.next_power_of_2(parts + 1),
        CHUNK=_CHUNK,
        num_warps=4,
    )
    return DecodeSchedule(part_plan, token_plan)
