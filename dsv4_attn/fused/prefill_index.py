"""Triton kernel for the prefill path's per-token index lists (one program per token).

:func:`fill_prefill_index` computes exactly what the torch construction in
:func:`dsv4_attn.vllm_glue.prefill.index_lists` computes: for each token of a chunk of prefill
requests, its rows in the chunk's gather workspace (request ``c`` owns rows ``c * M ..``:
compressed entries at ``0 .. N``, window positions ``seq_len - gather_len ..`` at ``N ..``).

* top-k layers (V4's CSA, V4.1's compressed layers): the indexer's request-local entries (-1,
  or one the token does not see yet, ``>= (pos + 1) // ratio``: -1) in columns ``0 .. K``, the
  window in ``K .. K + window``; ``lens = K + window length``.
* V4's HCA: every entry the token sees (``(pos + 1) // ratio``), then its window,
  packed; -1 after.
* SWA-only: the window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_attn.layer_kind import Compressed

__all__ = ["fill_prefill_index"]

_BLOCK_REQS = 128
_BLOCK_COLUMNS = 256


# Batch-dependent scalars are not specialized, so one compile serves every batch: the chunk's
# request count, first token, entries (N) and rows (M) per request, and its lists' width and row
# stride (they follow N). The top-k width and row stride (the indexer's buffer; 0 without one)
# and the ratio are the layer's, fixed. query_start and seq_lens are the chunk's slices of the
# step's tensors, views at a request offset read one element per program: their alignment is not
# specialized either.
@triton.jit(
    do_not_specialize=["num_reqs", "first_token", "indices_stride", "width", "N", "M"],
    do_not_specialize_on_alignment=["query_start_ptr", "seq_lens_ptr"],
)
def _prefill_index_kernel(
    query_start_ptr,
    seq_lens_ptr,
    num_reqs,
    first_token,
    topk_ptr,
    topk_stride,
    topk,
    indices_ptr,
    indices_stride,
    width,
    lens_ptr,
    N,
    M,
    ratio,
    WINDOW: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
    BLOCK_COLUMNS: tl.constexpr,
):
    i = tl.program_id(0)
    t = first_token + i
    count = tl.zeros([BLOCK_REQS], dtype=tl.int32)
    for start in range(0, num_reqs, BLOCK_REQS):
        r = start + 1 + tl.arange(0, BLOCK_REQS)
        ends = tl.load(query_start_ptr + r, mask=r <= num_reqs, other=2147483647)
        count += (ends <= t).to(tl.int32)
    c = tl.minimum(tl.sum(count, axis=0), num_reqs - 1)
    q0 = tl.load(query_start_ptr + c)
    q1 = tl.load(query_start_ptr + c + 1)
    seq = tl.load(seq_lens_ptr + c)
    query_len = q1 - q0
    pos = seq - query_len + (t - q0)
    gather_len = query_len + tl.minimum(tl.maximum(seq - query_len, 0), WINDOW - 1)
    first = tl.maximum(pos - (WINDOW - 1), 0)
    wlen = pos - first + 1
    base = c.to(tl.int64) * M
    window_base = base + N + (first - (seq - gather_len))
    row_out = indices_ptr + i.to(tl.int64) * indices_stride
    if MODE == 2:  # HCA: entries then window, packed
        visible = (pos + 1) // ratio
        for col0 in range(0, width, BLOCK_COLUMNS):
            col = col0 + tl.arange(0, BLOCK_COLUMNS)
            from_window = col - visible
            value = tl.where(col < visible, base + col, window_base + from_window)
            value = tl.where(from_window < wlen, value, -1)
            tl.store(row_out + col, value.to(tl.int32), mask=col < width)
        tl.store(lens_ptr + i, visible + wlen)
    else:
        offset = 0
        if MODE == 1:  # CSA: the indexer's picks, then the window
            visible = (pos + 1) // ratio  # entries complete at the token's position
            for col0 in range(0, topk, BLOCK_COLUMNS):
                col = col0 + tl.arange(0, BLOCK_COLUMNS)
                entry = tl.load(
                    topk_ptr + i.to(tl.int64) * topk_stride + col, mask=col < topk, other=-1
                )
                usable = (entry >= 0) & (entry < visible)
                tl.store(
                    row_out + col, tl.where(usable, base + entry, -1).to(tl.int32), mask=col < topk
                )
            offset = topk
        col = tl.arange(0, WINDOW)
        value = tl.where(col < wlen, window_base + col, -1)
        tl.store(row_out + offset + col, value.to(tl.int32))
        tl.store(lens_ptr + i, offset + wlen)


def fill_prefill_index(
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    first_token: int,
    num_tokens: int,
    entries: int,
    rows: int,
    compressed: Compressed | None,
    window: int,
    local_topk: torch.Tensor | None,
    indices: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Fill ``indices [num_tokens, width]`` and ``lens [num_tokens]`` (int32, CUDA) for tokens
    ``first_token ..`` of a chunk (arguments as :func:`dsv4_attn.vllm_glue.prefill.index_lists`;
    ``entries``/``rows`` are the chunk's N and M; ``window`` a power of two)."""
    if num_tokens == 0:
        return
    if window & (window - 1):
        raise ValueError(f"the window must be a power of two, got {window}")
    mode = 0 if compressed is None else 1 if compressed.top_k else 2
    topk = local_topk if local_topk is not None else indices  # a placeholder pointer
    _prefill_index_kernel[(num_tokens,)](
        query_start,
        seq_lens,
        seq_lens.shape[0],
        first_token,
        topk,
        # 0 for the placeholder: the lists' stride would follow the chunk (never read).
        topk.stride(0) if local_topk is not None else 0,
        local_topk.shape[1] if local_topk is not None else 0,
        indices,
        indices.stride(0),
        indices.shape[1],
        lens,
        entries,
        rows,
        compressed.ratio if compressed is not None else 1,
        WINDOW=window,
        MODE=mode,
        BLOCK_REQS=_BLOCK_REQS,
        BLOCK_COLUMNS=_BLOCK_COLUMNS,
    )
