"""Triton kernels for the per-step slot lists of the DSV4_NVFP4 metadata (one kernel each).

They compute exactly what the torch constructions of :mod:`dsv4_attn.vllm_glue.metadata` compute
(the reference, and the CPU path), one program per token, into caller-owned buffers:

* :func:`fill_window_metadata` — the SWA group: each token's request, validity, window slots and
  window length;
* :func:`fill_compressed_metadata` — a compressed group: each token's request, validity, the slot
  of the compressed entry it completes (and the staging row of that entry), how many entries
  it sees, for HCA their slots (and, for the balanced decode plan, the token's window length);
* :func:`fill_entry_slots` — a CSA layer: the indexer's request-local top-k entries as slots.

Whatever the metadata holds, they stay inside their buffers: a row whose block lies past the
block table's width gets no slot (-1), as in the torch constructions.

Conventions as in :mod:`dsv4_attn.vllm_glue.metadata`: token ``t`` of request ``r`` sits at
``pos = seq_len[r] - query_len[r] + (t - query_start[r])``; it is valid when ``t`` is a real token
(``t < query_start[R]``) with a cache slot (``slot_mapping[t] >= 0``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fill_compressed_metadata", "fill_entry_slots", "fill_window_metadata"]

_BLOCK_REQS = 128
_BLOCK_ENTRIES = 256


@triton.jit
def _token_map(
    t, query_start_ptr, seq_lens_ptr, slot_mapping_ptr, num_reqs, BLOCK_REQS: tl.constexpr
):
    """(request, position, valid) of token ``t``; position 0 for invalid tokens."""
    count = tl.zeros([BLOCK_REQS], dtype=tl.int32)
    for start in range(0, num_reqs, BLOCK_REQS):
        r = start + 1 + tl.arange(0, BLOCK_REQS)
        ends = tl.load(query_start_ptr + r, mask=r <= num_reqs, other=2147483647)
        count += (ends <= t).to(tl.int32)
    req = tl.minimum(tl.sum(count, axis=0), tl.maximum(num_reqs - 1, 0))
    start_t = tl.load(query_start_ptr + req)
    end_t = tl.load(query_start_ptr + req + 1, mask=num_reqs > 0, other=0)
    seq_len = tl.load(seq_lens_ptr + req, mask=num_reqs > 0, other=0)
    last = tl.load(query_start_ptr + num_reqs)
    slot = tl.load(slot_mapping_ptr + t)
    valid = (t < last) & (slot >= 0) & (num_reqs > 0)
    pos = seq_len - (end_t - start_t) + (t - start_t)
    return req, tl.where(valid, pos, 0).to(tl.int64), valid


@triton.jit
def _row_slots(block_table_ptr, bt_stride, bt_width, req, rows, rows_per_block, use):
    """int64 slots of request-local rows (-1 where ``use`` is False or the row's block lies
    outside the request's ``bt_width`` table entries)."""
    inside = use & (rows >= 0) & (rows // rows_per_block < bt_width)
    block = tl.load(
        block_table_ptr + req.to(tl.int64) * bt_stride + rows // rows_per_block,
        mask=inside,
        other=0,
    ).to(tl.int64)
    return tl.where(inside, block * rows_per_block + rows % rows_per_block, -1)


@triton.jit
def _window_span(pos, valid, window):
    """(first position, length) of a token's window ``max(0, pos - window + 1) .. pos``; length
    0 for an invalid token."""
    first = tl.maximum(pos - (window - 1), 0)
    return first, tl.where(valid, pos - first + 1, 0)


# The rule of every kernel here: batch-dependent scalars are not specialized, so one compile
# serves every batch (Triton would otherwise compile again for each new value == 1 and each new
# divisibility by 16). The request count is one; so are the block table's row stride and width
# (vLLM hands its block table as a view, which a caller may narrow; only gathered from, so no
# hint is lost). Nor is the alignment of seq_lens, slot_mapping and the block table: a
# micro-batch of vLLM's dual-batch overlap gets them as views at a request or token offset (its
# query starts are a new tensor), and they are read one element per program. What is fixed for
# the model's life (block sizes, ratios, the list buffers' row strides) stays specialized: the
# divisibility of a row stride lets the list rows' stores vectorize.
_STEP_POINTERS = ["seq_lens_ptr", "slot_mapping_ptr", "block_table_ptr"]


@triton.jit(
    do_not_specialize=["num_reqs", "bt_stride", "bt_width"],
    do_not_specialize_on_alignment=_STEP_POINTERS,
)
def _window_kernel(
    query_start_ptr,
    seq_lens_ptr,
    slot_mapping_ptr,
    num_reqs,
    block_table_ptr,
    bt_stride,
    bt_width,
    block_size,
    req_out,
    valid_out,
    indices_out,
    indices_stride,
    lens_out,
    WINDOW: tl.constexpr,
    WINDOW_P2: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
):
    t = tl.program_id(0)
    req, pos, valid = _token_map(
        t, query_start_ptr, seq_lens_ptr, slot_mapping_ptr, num_reqs, BLOCK_REQS
    )
    first, length = _window_span(pos, valid, WINDOW)
    offset = tl.arange(0, WINDOW_P2)
    use = offset < length
    slots = _row_slots(block_table_ptr, bt_stride, bt_width, req, first + offset, block_size, use)
    row_out = indices_out + t.to(tl.int64) * indices_stride
    tl.store(row_out + offset, slots.to(tl.int32), mask=offset < WINDOW)
    tl.store(lens_out + t, length.to(tl.int32))
    tl.store(req_out + t, req.to(tl.int32))
    tl.store(valid_out + t, valid.to(tl.int8))


def fill_window_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    token_req: torch.Tensor,
    valid: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
) -> None:
    """Fill the SWA-group buffers of ``T = swa_lens.shape[0]`` tokens (CUDA).

    Args:
        query_start_loc: ``int32 [R + 1]``; seq_lens: ``int32 [R]``; slot_mapping: ``int64 [>= T]``.
        block_table: ``int32 [R, blocks]`` of ``block_size``-token SWA pages.
        token_req: ``int32 [T]``; valid: ``bool [T]``; swa_indices: ``int32 [T, window]``
            (row stride free); swa_lens: ``int32 [T]``.
    """
    T, window = swa_indices.shape
    if T == 0:
        return
    _window_kernel[(T,)](
        query_start_loc,
        seq_lens,
        slot_mapping,
        seq_lens.shape[0],
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        block_size,
        token_req,
        valid.view(torch.int8),
        swa_indices,
        swa_indices.stride(0),
        swa_lens,
        WINDOW=window,
        WINDOW_P2=triton.next_power_of_2(window),
        BLOCK_REQS=_BLOCK_REQS,
    )


# visible_width: an HCA step's list width follows its longest sequence; window: 0 or the model's
# window, as the step's balanced decode plan wants the window lengths or not (a runtime switch,
# not a constexpr, so that choice, made per step, never compiles a second variant).
@triton.jit(
    do_not_specialize=["num_reqs", "bt_stride", "bt_width", "visible_width", "window"],
    do_not_specialize_on_alignment=_STEP_POINTERS,
)
def _compressed_kernel(
    query_start_ptr,
    seq_lens_ptr,
    slot_mapping_ptr,
    num_reqs,
    block_table_ptr,
    bt_stride,
    bt_width,
    rows_per_block,
    ratio,
    req_out,
    valid_out,
    write_slots_out,
    staging_rows_out,
    visible_out,
    visible_stride,
    visible_width,
    visible_lens_out,
    window,
    window_lens_out,
    HAS_VISIBLE: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
    BLOCK_ENTRIES: tl.constexpr,
):
    t = tl.program_id(0)
    req, pos, valid = _token_map(
        t, query_start_ptr, seq_lens_ptr, slot_mapping_ptr, num_reqs, BLOCK_REQS
    )
    completes = valid & ((pos + 1) % ratio == 0)
    write_slot = _row_slots(
        block_table_ptr, bt_stride, bt_width, req, pos // ratio, rows_per_block, completes
    )
    tl.store(write_slots_out + t, write_slot)
    # An entry without a slot (its block past the table) is not staged either.
    tl.store(staging_rows_out + t, tl.where(write_slot >= 0, t.to(tl.int64), -1))
    tl.store(req_out + t, req.to(tl.int32))
    tl.store(valid_out + t, valid.to(tl.int8))
    if HAS_VISIBLE:
        count = tl.minimum(tl.where(valid, (pos + 1) // ratio, 0), visible_width)
        row_out = visible_out + t.to(tl.int64) * visible_stride
        for start in range(0, visible_width, BLOCK_ENTRIES):
            entry = start + tl.arange(0, BLOCK_ENTRIES)
            slots = _row_slots(
                block_table_ptr, bt_stride, bt_width, req, entry, rows_per_block, entry < count
            )
            tl.store(row_out + entry, slots.to(tl.int32), mask=entry < visible_width)
        tl.store(visible_lens_out + t, count.to(tl.int32))
    elif HAS_COUNTS:  # the count alone (CSA: bounds the indexer's picks)
        tl.store(visible_lens_out + t, tl.where(valid, (pos + 1) // ratio, 0).to(tl.int32))
    if window > 0:  # the token's window length, as the SWA group's kernel counts it
        _, length = _window_span(pos, valid, window)
        tl.store(window_lens_out + t, length.to(tl.int32))


def fill_compressed_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    rows_per_block: int,
    compress_ratio: int,
    *,
    token_req: torch.Tensor,
    valid: torch.Tensor,
    write_slots: torch.Tensor,
    staging_rows: torch.Tensor,
    visible_slots: torch.Tensor | None = None,
    visible_lens: torch.Tensor | None = None,
    window: int = 0,
    window_lens: torch.Tensor | None = None,
) -> None:
    """Fill a compressed group's buffers for ``T = write_slots.shape[0]`` tokens (CUDA).

    Args:
        block_table: ``int32 [R, blocks]``, blocks of ``rows_per_block`` compressed entries.
        token_req: ``int32 [T]``; valid: ``bool [T]``; write_slots, staging_rows: ``int64 [T]``.
        visible_slots, visible_lens: ``int32 [T, W]`` and ``[T]`` (HCA): the slots of the entries
            ``i < min((pos + 1) // ratio, W)``, -1 padded, and their count. With
            ``visible_lens`` alone (CSA), the count ``(pos + 1) // ratio`` of the entries each
            token sees, which bounds the indexer's picks (:func:`fill_entry_slots`).
        window, window_lens: with ``window_lens`` (``int32 [T]``), each token's sliding-window
            length for a ``window``-token window, as :func:`fill_window_metadata` writes it.
    """
    T = write_slots.shape[0]
    if T == 0:
        return
    has_visible = visible_slots is not None
    if has_visible and visible_lens is None:
        raise ValueError("visible_slots need visible_lens for their counts")
    has_counts = visible_lens is not None
    visible = visible_slots if has_visible else write_slots  # placeholder pointer
    visible_lens = visible_lens if has_counts else write_slots
    if window_lens is not None and window < 1:
        raise ValueError(f"window_lens needs the window size (>= 1), got {window}")
    _compressed_kernel[(T,)](
        query_start_loc,
        seq_lens,
        slot_mapping,
        seq_lens.shape[0],
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        rows_per_block,
        compress_ratio,
        token_req,
        valid.view(torch.int8),
        write_slots,
        staging_rows,
        visible,
        visible.stride(0) if has_visible else 0,
        visible.shape[1] if has_visible else 0,
        visible_lens,
        window if window_lens is not None else 0,
        # An int32 placeholder, as window_lens: the pointer's type is part of the compile key.
        window_lens if window_lens is not None else token_req,
        HAS_VISIBLE=has_visible,
        HAS_COUNTS=has_counts,
        BLOCK_REQS=_BLOCK_REQS,
        BLOCK_ENTRIES=_BLOCK_ENTRIES,
    )


# The top-k width and the list buffers' row strides are the model's; the block table is vLLM's.
@triton.jit(
    do_not_specialize=["bt_stride", "bt_width"],
    do_not_specialize_on_alignment=["block_table_ptr"],
)
def _entry_slots_kernel(
    entries_ptr,
    entries_stride,
    token_req_ptr,
    valid_ptr,
    visible_ptr,
    block_table_ptr,
    bt_stride,
    bt_width,
    rows_per_block,
    slots_out,
    slots_stride,
    lens_out,
    width,
    BLOCK_ENTRIES: tl.constexpr,
):
    t = tl.program_id(0)
    req = tl.load(token_req_ptr + t)
    valid = tl.load(valid_ptr + t) != 0
    visible = tl.load(visible_ptr + t)
    length = tl.zeros([BLOCK_ENTRIES], dtype=tl.int32)
    for start in range(0, width, BLOCK_ENTRIES):
        k = start + tl.arange(0, BLOCK_ENTRIES)
        inside = k < width
        entry = tl.load(entries_ptr + t.to(tl.int64) * entries_stride + k, mask=inside, other=-1)
        use = (entry >= 0) & (entry < visible) & valid
        slots = _row_slots(
            block_table_ptr, bt_stride, bt_width, req, entry.to(tl.int64), rows_per_block, use
        )
        tl.store(slots_out + t.to(tl.int64) * slots_stride + k, slots.to(tl.int32), mask=inside)
        length = tl.maximum(length, tl.where(use, k + 1, 0))
    tl.store(lens_out + t, tl.max(length, axis=0))


def fill_entry_slots(
    local_entries: torch.Tensor,
    token_req: torch.Tensor,
    valid: torch.Tensor,
    visible_counts: torch.Tensor,
    block_table: torch.Tensor,
    rows_per_block: int,
    *,
    slots: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Slots of request-local compressed entries (CUDA): ``slots[t, k]`` for ``0 <=
    local_entries[t, k] < visible_counts[t]`` of a valid token, else -1 (an entry the token
    does not see is never read, whatever the indexer wrote); ``lens[t]`` one past the last
    such ``k``.

    Args:
        local_entries: ``int32 [T, K]`` the indexer's top-k (-1 = none); token_req: ``int32
            [T]``; valid: ``bool [T]``; visible_counts: ``int32 [T]`` entries each token sees
            (:func:`fill_compressed_metadata`); block_table: ``int32 [R, blocks]``.
        slots: ``int32 [T, K]``; lens: ``int32 [T]``.
    """
    T, K = local_entries.shape
    if T == 0:
        return
    _entry_slots_kernel[(T,)](
        local_entries,
        local_entries.stride(0),
        token_req,
        valid.view(torch.int8),
        visible_counts,
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        rows_per_block,
        slots,
        slots.stride(0),
        lens,
        K,
        BLOCK_ENTRIES=_BLOCK_ENTRIES,
    )
