"""Triton kernel: DeepSeek-V4's compressed KV rows from the compressor's paged state, in any
float state dtype (one kernel).

vLLM's compressor keeps, per position, ``C * D`` kv values and ``C * D`` scores (positional bias
added) in a paged "state" cache, and at each position that completes an entry turns the last
``C * ratio`` positions into one compressed row (:func:`dsv4_attn.reference.compressed_entries`
has the math). vLLM's kernels read an fp32 state only; :func:`compress_rows` reads any float
state (the DSV4_NVFP4 backend keeps the CSA compressor's state in bf16) and writes the row in
bf16 where the NVFP4 writer picks it up. One program per token; tokens that complete no entry
(or have no state slot) write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["compress_rows"]


# Batch-dependent scalars are not specialized, so one compile serves every batch: the block
# table's row stride and width (a view vLLM hands over, which a caller may narrow; only gathered
# from). The state's and output's strides and the state block size are fixed for the model's
# life and stay specialized (the state rows' loads vectorize on them). The block table, the
# positions and the state slots, read one element per program, come as views at a request or
# token offset in a micro-batch of vLLM's dual-batch overlap: their alignment is not specialized
# either (token_req and out_rows are prefixes of the metadata builders' buffers).
@triton.jit(
    do_not_specialize=["bt_stride", "bt_width"],
    do_not_specialize_on_alignment=["block_table_ptr", "positions_ptr", "state_slots_ptr"],
)
def _compress_rows_kernel(
    state_ptr,
    state_stride_block,
    state_stride_row,
    block_table_ptr,
    bt_stride,
    bt_width,
    state_block_size,
    token_req_ptr,
    positions_ptr,
    state_slots_ptr,
    out_rows_ptr,
    norm_weight_ptr,
    eps,
    cos_sin_ptr,
    cos_sin_stride,
    out_ptr,
    out_stride,
    D: tl.constexpr,
    C: tl.constexpr,
    RATIO: tl.constexpr,
    WINDOW_P2: tl.constexpr,
    ROPE_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    out_row = tl.load(out_rows_ptr + t)
    if (out_row < 0) | (tl.load(state_slots_ptr + t) < 0):
        return
    position = tl.load(positions_ptr + t).to(tl.int64)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    # The window: positions position - C * RATIO + 1 .. position; the older block (C = 2) reads
    # its first D columns, the entry's own block its last D.
    i = tl.arange(0, WINDOW_P2)
    pos = position - C * RATIO + 1 + i
    block = pos // state_block_size
    live = (i < C * RATIO) & (pos >= 0) & (block < bt_width)
    page = tl.load(block_table_ptr + req * bt_stride + block, mask=live, other=0).to(tl.int64)
    live &= page >= 0
    column0 = tl.where(i >= (C - 1) * RATIO, (C - 1) * D, 0)
    row = state_ptr + page * state_stride_block + (pos % state_block_size) * state_stride_row
    j = tl.arange(0, D)
    at = row[:, None] + column0[:, None] + j[None, :]
    score = tl.load(at + C * D, mask=live[:, None], other=float("-inf")).to(tl.float32)
    kv = tl.load(at, mask=live[:, None], other=0.0).to(tl.float32)
    top = tl.max(score, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no live position (bad metadata): x = 0
    weights = tl.exp(score - top[None, :])
    x = tl.sum(weights * kv, axis=0) / tl.maximum(tl.sum(weights, axis=0), 1e-30)
    # RMSNorm, then GPT-J RoPE of the last ROPE_DIM values at the entry's first position.
    x = x / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    x = x * tl.load(norm_weight_ptr + j).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (D // 2, 2)))
    pair = tl.arange(0, D // 2) - (D - ROPE_DIM) // 2
    rope = pair >= 0
    entry_pos = (position // RATIO) * RATIO
    cs = cos_sin_ptr + entry_pos * cos_sin_stride + tl.maximum(pair, 0)
    cos = tl.load(cs, mask=rope, other=1.0).to(tl.float32)
    sin = tl.load(cs + ROPE_DIM // 2, mask=rope, other=0.0).to(tl.float32)
    rotated = tl.interleave(even * cos - odd * sin, even * sin + odd * cos)
    tl.store(out_ptr + out_row.to(tl.int64) * out_stride + j, rotated.to(tl.bfloat16))


def compress_rows(
    state: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    state_slots: torch.Tensor,
    out_rows: torch.Tensor,
    out: torch.Tensor,
    compress_ratio: int,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    rope_dim: int = 64,
) -> None:
    """Write the compressed row of every token ``t < T = out_rows.shape[0]`` that completes an
    entry into ``out[out_rows[t]]`` (CUDA).

    Args:
        state: ``[blocks, state_block_size, 2 * C * D]`` the compressor's paged state (kv then
            scores), any float dtype; ``C = 2`` for ratio 4, else 1.
        block_table: ``int32 [R, width]`` the state group's pages of each request.
        token_req: ``int32 [>= T]``; positions: ``int [>= T]``; state_slots: ``int64 [>= T]``
            (-1: a token without state, e.g. padding).
        out_rows: ``int64 [T]``: the row of ``out`` for the token's entry, -1 where the token
            completes none.
        out: ``bf16 [rows, D]`` (rows contiguous).
        norm_weight: ``[D]``; cos_sin: ``[max_position, rope_dim]`` (cos | sin).
    """
    T = out_rows.shape[0]
    if T == 0:
        return
    C = 2 if compress_ratio == 4 else 1
    D = out.shape[-1]
    if state.shape[-1] != 2 * C * D or out.stride(-1) != 1 or state.stride(-1) != 1:
        raise ValueError(
            f"state must end in 2 * {C} * {D} contiguous values and out in {D}, got "
            f"{tuple(state.shape)} and {tuple(out.shape)}"
        )
    _compress_rows_kernel[(T,)](
        state,
        state.stride(0),
        state.stride(1),
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        state.shape[1],
        token_req,
        positions,
        state_slots,
        out_rows,
        norm_weight,
        eps,
        cos_sin,
        cos_sin.stride(0),
        out,
        out.stride(-2),
        D=D,
        C=C,
        RATIO=compress_ratio,
        WINDOW_P2=triton.next_power_of_2(C * compress_ratio),
        ROPE_DIM=rope_dim,
    )
