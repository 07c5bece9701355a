"""Triton writers of an NVFP4 KV cache for vLLM's DeepSeek-V4 layers (one kernel each).

* :func:`qnorm_rope_nvfp4_insert` — what vLLM's fused fp8_ds_mla insert does, for NVFP4: per-head
  RMSNorm (no weight) + GPT-J RoPE of q into a head-padded output, and RoPE + NVFP4 encode +
  paged store of each token's KV row at its SWA slot.
* :func:`store_staged_rows` — NVFP4 encode + paged store of the compressed rows vLLM's compressor
  kernel left, one per token, in a bf16 staging buffer.
* :func:`rope_quant_insert_nvfp4_ds` — what vLLM's ``_rope_quant_insert_nvfp4_kernel`` (SM100
  only: it needs the hardware e2m1 conversion) does: GPT-J RoPE + V4.1 ``NVFP4_DS`` encode +
  paged store of the compressed latent of each token that closes a group.

The math follows :func:`dsv4_attn.vllm_glue.writers.qnorm_rope` (float32, products and sums
rounded one operation at a time: the kernels are compiled without FMA contraction, as torch
evaluates them), so the KV bytes equal the torch path's; q agrees to rounding of the norm's sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_attn.fused.nvfp4 import (
    bf16_rne,
    load_nope_pairs,
    store_nvfp4_ds_record,
    store_nvfp4_row,
)
from dsv4_attn.kv_cache import HEAD_DIM, NOPE_DIM, ROPE_DIM, KVFormat, bytes_per_token, page_layout

__all__ = ["qnorm_rope_nvfp4_insert", "rope_quant_insert_nvfp4_ds", "store_staged_rows"]

_HEADS_PER_PROGRAM = 8
_HALF_ROPE = ROPE_DIM // 2


@triton.jit
def _rotate(even, odd, cos, sin):
    """GPT-J RoPE of pairs (even, odd) in float32: each product and difference rounded once."""
    a = even * cos
    b = odd * sin
    c = even * sin
    d = odd * cos
    return a - b, c + d


# Batch-dependent scalars are not specialized, so one compile serves every batch: num_slots is the
# step's token count. The strides, page geometry and head counts stay specialized: they are fixed
# for the model's life, and their divisibility lets the row loads and stores vectorize. positions
# and slots, read one element per program, may be views at a token offset (a micro-batch of
# vLLM's dual-batch overlap, DSpark's context rows): their alignment is not specialized either.
@triton.jit(
    do_not_specialize=["num_slots"],
    do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"],
)
def _qnorm_rope_nvfp4_insert_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    kv_ptr,
    kv_stride_t,
    q_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    cos_sin_stride,
    slots_ptr,
    num_slots,
    cache_ptr,
    page_stride,
    block_size,
    num_heads,
    padded_heads,
    eps,
    HEADS: tl.constexpr,
    Q_NORM: tl.constexpr,
):
    t = tl.program_id(0)
    head_block = tl.program_id(1)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    if head_block * HEADS < padded_heads:
        # q: heads head_block * HEADS ... (zeros for the padding heads >= num_heads), read and
        # written as whole contiguous rows; RoPE on pairs 224..255 of the normed row in registers.
        head = head_block * HEADS + tl.arange(0, HEADS)
        col = tl.arange(0, 512)
        real = head < num_heads
        src = q_ptr + t.to(tl.int64) * q_stride_t + head[:, None].to(tl.int64) * q_stride_h
        x = tl.load(src + col[None, :], mask=real[:, None], other=0.0).to(tl.float32)
        if Q_NORM:  # DeepSeek-V4's per-head RMSNorm without weight (V4.1 has none)
            x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / 512.0 + eps))[:, None]
        even, odd = tl.split(tl.reshape(x, (HEADS, 256, 2)))
        rope_pair = tl.arange(0, 256) - 224
        is_rope = rope_pair >= 0
        cos_all = tl.load(cos_sin_ptr + pos * cos_sin_stride + rope_pair, mask=is_rope, other=1.0)
        sin_all = tl.load(
            cos_sin_ptr + pos * cos_sin_stride + 32 + rope_pair, mask=is_rope, other=0.0
        )
        r_even, r_odd = _rotate(
            even, odd, cos_all.to(tl.float32)[None, :], sin_all.to(tl.float32)[None, :]
        )
        even = tl.where(is_rope[None, :], r_even, even)
        odd = tl.where(is_rope[None, :], r_odd, odd)
        y = tl.reshape(tl.join(even, odd), (HEADS, 512))
        dst = q_out_ptr + (t.to(tl.int64) * padded_heads + head[:, None]) * 512
        tl.store(dst + col[None, :], bf16_rne(y), mask=head[:, None] < padded_heads)
    elif t < num_slots:
        # KV: RoPE on the last 64 values, NVFP4 encode, store at the token's slot. The row and
        # its cos/sin are loaded before the slot test, so the loads overlap instead of queueing
        # behind the slot's (the step is latency-bound at decode sizes).
        slot = tl.load(slots_ptr + t)
        pair = tl.arange(0, 32)
        cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + pair).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + 32 + pair).to(tl.float32)
        rope_even_col = 448 + 2 * pair
        row = kv_ptr + t.to(tl.int64) * kv_stride_t
        even, odd = load_nope_pairs(row)
        k_even = tl.load(row + rope_even_col).to(tl.float32)
        k_odd = tl.load(row + rope_even_col + 1).to(tl.float32)
        if slot >= 0:
            r_even, r_odd = _rotate(k_even, k_odd, cos, sin)
            store_nvfp4_row(
                cache_ptr,
                page_stride,
                block_size,
                slot,
                even,
                odd,
                bf16_rne(r_even),
                bf16_rne(r_odd),
            )


def qnorm_rope_nvfp4_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    padded_heads: int,
    slots: torch.Tensor,
    cache: torch.Tensor,
    block_size: int,
    q_norm: bool = True,
) -> torch.Tensor:
    """Fused SWA insert of one step (CUDA). Returns the normed (where ``q_norm``: DeepSeek-V4),
    roped q.

    Args:
        q: ``bf16 [T, H, 512]`` queries after ``wq_b`` (row- and head-strided is fine).
        kv: ``bf16 [T, 512]`` KV rows after ``kv_norm``.
        positions: ``int64 [T]``; cos_sin_cache: ``[max_position, 64]`` (cos | sin).
        eps: RMSNorm epsilon; padded_heads: head count of the returned q (>= H, extra heads 0).
        slots: ``int64`` SWA slot per token, -1 = write nothing; tokens past its end write
            nothing either (vLLM may pad q past the slot mapping).
        cache: ``uint8 [num_blocks, >= page_bytes]`` NVFP4 pages of ``block_size`` rows.

    Returns:
        ``bf16 [T, padded_heads, 512]``.
    """
    T, H, D = q.shape
    if D != HEAD_DIM or kv.shape != (T, HEAD_DIM) or q.stride(2) != 1 or kv.stride(1) != 1:
        raise ValueError(f"q must be [T, H, 512] and kv [T, 512], got {q.shape} and {kv.shape}")
    q_out = torch.empty(T, padded_heads, HEAD_DIM, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    grid = (T, triton.cdiv(padded_heads, _HEADS_PER_PROGRAM) + 1)
    _qnorm_rope_nvfp4_insert_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        kv,
        kv.stride(0),
        q_out,
        positions,
        cos_sin_cache,
        cos_sin_cache.stride(0),
        slots,
        slots.shape[0],
        cache,
        cache.stride(0),
        block_size,
        H,
        padded_heads,
        eps,
        HEADS=_HEADS_PER_PROGRAM,
        Q_NORM=q_norm,
        enable_fp_fusion=False,
    )
    return q_out


# Nothing here depends on the batch (its token count is the grid; rows and write slots are
# prefixes of buffers allocated once): every argument stays specialized.
@triton.jit
def _store_staged_rows_kernel(
    rows_ptr, rows_stride, write_slots_ptr, cache_ptr, page_stride, block_size
):
    t = tl.program_id(0)
    slot = tl.load(write_slots_ptr + t)
    # The row is read whether or not it has a slot: its load overlaps the slot's.
    row = rows_ptr + t.to(tl.int64) * rows_stride
    even, odd = load_nope_pairs(row)
    pair = tl.arange(0, 32)
    rope_even = tl.load(row + 448 + 2 * pair)
    rope_odd = tl.load(row + 449 + 2 * pair)
    if slot >= 0:
        store_nvfp4_row(cache_ptr, page_stride, block_size, slot, even, odd, rope_even, rope_odd)


def store_staged_rows(
    rows: torch.Tensor, write_slots: torch.Tensor, cache: torch.Tensor, block_size: int
) -> None:
    """Encode staged row ``t`` and store it at ``write_slots[t]`` for every ``t`` with a slot
    (CUDA).

    Args:
        rows: ``bf16 [>= T, 512]`` one staged row per token (rows without a slot are read but
            not used: any values).
        write_slots: ``int64 [T]`` compressed-cache slot per token, -1 = none.
        cache: ``uint8 [num_blocks, >= page_bytes]`` NVFP4 pages of ``block_size`` rows.
    """
    T = write_slots.shape[0]
    if T == 0:
        return
    if rows.shape[0] < T or rows.shape[-1] != HEAD_DIM or rows.stride(-1) != 1:
        raise ValueError(f"rows must be [>= {T}, 512], got {tuple(rows.shape)}")
    _store_staged_rows_kernel[(T,)](
        rows, rows.stride(0), write_slots, cache, cache.stride(0), block_size
    )


_DS_RECORD_BYTES = bytes_per_token(KVFormat.NVFP4_DS)


# positions and slots may be views at a token offset (a micro-batch): their alignment is not
# specialized. The token count is the grid; everything else is fixed for the model's life.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"])
def _rope_quant_insert_nvfp4_ds_kernel(
    latent_ptr,
    latent_stride,
    positions_ptr,
    cos_sin_ptr,
    cos_sin_stride,
    slots_ptr,
    cache_ptr,
    page_stride,
    block_size,
    RATIO: tl.constexpr,
    RECORD_BYTES: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    # Only a group's last token (and one with a slot) publishes the group's latent.
    if (slot >= 0) & ((pos + 1) % RATIO == 0):
        block = tl.arange(0, 32)[:, None]
        pair = tl.arange(0, 8)[None, :]
        col = block * 16 + pair * 2
        row = latent_ptr + t.to(tl.int64) * latent_stride
        even = tl.load(row + col).to(tl.float32)
        odd = tl.load(row + col + 1).to(tl.float32)
        # Pairs 224..255 are the RoPE pairs; the nope pairs load (cos, sin) = (1, 0), so the
        # rotation leaves their values as they are. The group is rotated at its first position.
        rope_pair = block * 8 + pair - 224
        is_rope = rope_pair >= 0
        cs = cos_sin_ptr + (pos // RATIO * RATIO) * cos_sin_stride + tl.maximum(rope_pair, 0)
        cos = tl.load(cs, mask=is_rope, other=1.0).to(tl.float32)
        sin = tl.load(cs + 32, mask=is_rope, other=0.0).to(tl.float32)
        r_even, r_odd = _rotate(even, odd, cos, sin)
        slot = slot.to(tl.int64)
        record = cache_ptr + (slot // block_size) * page_stride + (slot % block_size) * RECORD_BYTES
        store_nvfp4_ds_record(record, r_even, r_odd)


def rope_quant_insert_nvfp4_ds(
    latent: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    compress_ratio: int,
    block_size: int | None = None,
) -> None:
    """vLLM's ``rope_quant_insert`` for the 288-byte ``NVFP4_DS`` record (CUDA, any arch):
    token ``t`` with ``slot_mapping[t] >= 0`` and ``(positions[t] + 1) % compress_ratio == 0``
    gets its latent row GPT-J-rotated (last 64 values, float32, at position
    ``positions[t] // compress_ratio * compress_ratio``), encoded as
    :func:`dsv4_attn.kv_cache.encode_rows` does for ``NVFP4_DS`` (on the float32 rotated values)
    and stored at its slot. Other tokens write nothing.

    Args:
        latent: ``bf16 [>= T, 512]`` compressed latent rows (unit stride along the row).
        positions: ``int64 [>= T]`` absolute positions.
        cos_sin_cache: ``float32`` or ``bf16 [max_position, 64]`` (32 cos | 32 sin).
        kv_cache: ``uint8``: vLLM's ``[num_blocks, block, 288]`` or this package's
            ``[num_blocks, >= page_bytes]`` (then ``block_size`` is required); either way page
            = :func:`dsv4_attn.kv_cache.page_layout` ``(NVFP4_DS, block)``.
        slot_mapping: ``int64 [T]`` cache slot per token, negative = write nothing.
        compress_ratio: tokens per compressed group (1 or more).
        block_size: records per page, for a 2-D ``kv_cache`` only.
    """
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache must be uint8, got {kv_cache.dtype}")
    if kv_cache.dim() == 3:
        if kv_cache.shape[2] != _DS_RECORD_BYTES or kv_cache.stride()[1:] != (_DS_RECORD_BYTES, 1):
            raise ValueError(f"kv_cache must be [blocks, block, 288], got {tuple(kv_cache.shape)}")
        if block_size not in (None, kv_cache.shape[1]):
            raise ValueError(f"block_size {block_size} != kv_cache.shape[1] {kv_cache.shape[1]}")
        block_size = kv_cache.shape[1]
    elif kv_cache.dim() != 2 or block_size is None or kv_cache.stride(1) != 1:
        raise ValueError("a 2-D kv_cache needs block_size and contiguous pages")
    elif kv_cache.shape[1] < page_layout(KVFormat.NVFP4_DS, block_size).page_bytes:
        raise ValueError(f"kv_cache pages are too small for block_size {block_size}")
    if compress_ratio < 1:
        raise ValueError(f"compress_ratio must be >= 1, got {compress_ratio}")
    T = slot_mapping.numel()
    if T == 0:
        return
    if latent.shape[0] < T or latent.shape[-1] != HEAD_DIM or latent.stride(-1) != 1:
        raise ValueError(f"latent must be [>= {T}, 512], got {tuple(latent.shape)}")
    if positions.numel() < T or cos_sin_cache.shape[-1] != 2 * _HALF_ROPE:
        raise ValueError("positions must cover the slots and cos_sin_cache be [max_pos, 64]")
    _rope_quant_insert_nvfp4_ds_kernel[(T,)](
        latent,
        latent.stride(0),
        positions,
        cos_sin_cache,
        cos_sin_cache.stride(0),
        slot_mapping,
        kv_cache,
        kv_cache.stride(0),
        block_size,
        RATIO=compress_ratio,
        RECORD_BYTES=_DS_RECORD_BYTES,
        enable_fp_fusion=False,
    )


assert NOPE_DIM == 448 and _HALF_ROPE == 32  # the kernels spell these out as literals
