"""Triton gather-dequantize of an NVFP4 KV cache into a bf16 prefill workspace (one kernel).

:func:`gather_nvfp4_rows` does for NVFP4 what vLLM's ``dequantize_and_gather_k_cache`` does for
fp8_ds_mla: for each request ``c`` of a prefill chunk it decodes a contiguous run of the
request's rows (compressed entries ``0 .. seq_len // ratio``, or the window positions
``seq_len - gather_len .. seq_len``) from the paged cache and writes them, in order, to
``out[c, offset + i]``. The values are those of :func:`dsv4_attn.kv_cache.read` bit for bit
(float32 products as torch forms them, then round-to-nearest-even to bf16). A row whose block
lies outside the block table, or whose page lies outside the cache, is written as zeros and
nothing is read for it: no metadata makes the kernel read outside its buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_attn.fused.nvfp4 import (
    DATA_ROW_BYTES,
    NOPE_BYTES,
    SCALE_ROW_BYTES,
    bf16_rne,
    e4m3_value,
)
from dsv4_attn.kv_cache import HEAD_DIM, NOPE_DIM

__all__ = ["gather_nvfp4_rows"]


@triton.jit
def _e2m1_value(nibble):
    """float32 value of e2m1 codes (int32 0..15: sign << 3 | magnitude code), from bits."""
    code = nibble & 7
    exponent = code >> 1
    mantissa = code & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent > 0, normal, mantissa.to(tl.float32) * 0.5)
    return tl.where((nibble & 8) != 0, -magnitude, magnitude)


# Batch-dependent scalars are not specialized, so one compile serves every batch: the first row
# to write (a chunk's entry count) and the block table's row stride and width (a view vLLM hands
# over; a caller may narrow it). Nor is the cache's page count, which vLLM sizes after the
# profiling run: the warm-up there (vllm_glue.prefill.warm_gather) runs on pages of its own.
# The workspace's request stride (rows x 512) follows the chunk but is always a multiple of 16,
# so it stays specialized: that keeps the row stores vectorized.
# The page geometry and the ratio (per layer and variant) are fixed. seq_lens, gather_lens (for
# which seq_lens stands in when absent) and the block table are the chunk's slices of the step's
# tensors, views at a request offset read one element per program: alignment not specialized.
@triton.jit(
    do_not_specialize=["offset", "num_pages", "bt_stride", "bt_width"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "gather_lens_ptr", "block_table_ptr"],
)
def _gather_nvfp4_kernel(
    out_ptr,
    out_stride_req,
    out_stride_row,
    offset,
    cache_ptr,
    page_stride,
    block_size,
    num_pages,
    seq_lens_ptr,
    gather_lens_ptr,
    ratio,
    block_table_ptr,
    bt_stride,
    bt_width,
    WINDOW: tl.constexpr,
):
    i = tl.program_id(0)  # rows on the first grid axis: up to 2^31 - 1 (the others stop at 65535)
    c = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + c)
    if WINDOW:
        count = tl.load(gather_lens_ptr + c)
        start = seq_len - count
    else:
        count = seq_len // ratio
        start = 0
    if i < count:
        row_id = (start + i).to(tl.int64)
        in_table = (row_id >= 0) & (row_id // block_size < bt_width)
        block = tl.load(
            block_table_ptr + c.to(tl.int64) * bt_stride + row_id // block_size,
            mask=in_table,
            other=-1,
        ).to(tl.int64)
        live = in_table & (block >= 0) & (block < num_pages)
        block = tl.where(live, block, 0)
        row_id = tl.where(live, row_id, 0)
        page = cache_ptr + block * page_stride
        row = row_id % block_size
        data = page + row * DATA_ROW_BYTES
        scales = page + block_size * DATA_ROW_BYTES + row * SCALE_ROW_BYTES
        byte = tl.arange(0, 256)
        real = byte < NOPE_BYTES
        packed = tl.load(data + byte, mask=real & live, other=0).to(tl.int32)
        block_code = tl.load(scales + byte // 8, mask=real & live, other=0).to(tl.int32)
        exponent = tl.load(scales + 28, mask=live, other=0).to(tl.int32) - 127
        token_scale = tl.where(exponent >= -126, (exponent + 127) << 23, 1 << 22)
        step = e4m3_value(block_code) * token_scale.to(tl.float32, bitcast=True)
        low = bf16_rne(_e2m1_value(packed & 15) * step)
        high = bf16_rne(_e2m1_value(packed >> 4) * step)
        values = tl.reshape(tl.join(low, high), (512,))
        dst = out_ptr + c.to(tl.int64) * out_stride_req + (offset + i).to(tl.int64) * out_stride_row
        column = tl.arange(0, 512)
        tl.store(dst + column, values, mask=column < 448)
        rope = (data + NOPE_BYTES).to(tl.pointer_type(tl.bfloat16))
        rope_column = tl.arange(0, 64)
        tl.store(dst + 448 + rope_column, tl.load(rope + rope_column, mask=live, other=0.0))


def gather_nvfp4_rows(
    out: torch.Tensor,
    cache: torch.Tensor,
    block_size: int,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    offset: int,
    max_rows: int,
    *,
    ratio: int = 1,
    gather_lens: torch.Tensor | None = None,
) -> None:
    """Decode each request's run of rows into ``out[c, offset : offset + count_c]`` (CUDA).

    Args:
        out: ``bf16 [C, >= offset + max_rows, 512]`` (rows contiguous).
        cache: ``uint8 [num_blocks, >= page_bytes]`` NVFP4 pages of ``block_size`` rows.
        seq_lens: ``int32 [C]`` tokens of each request (this step's included).
        block_table: ``int32 [C, blocks]`` the cache group's pages of each request.
        offset: first row of ``out`` to write.
        max_rows: an upper bound of every request's count (the grid's second dimension).
        ratio: with ``gather_lens`` None: the run is compressed entries ``0 .. seq_len //
            ratio``.
        gather_lens: ``int32 [C]``: the run is positions ``seq_len - gather_len .. seq_len``.
    """
    C = seq_lens.shape[0]
    if C == 0 or max_rows == 0:
        return
    if out.shape[-1] != HEAD_DIM or out.stride(-1) != 1 or out.shape[1] < offset + max_rows:
        raise ValueError(f"out must be [C, >= {offset + max_rows}, 512], got {tuple(out.shape)}")
    window = gather_lens is not None
    _gather_nvfp4_kernel[(max_rows, C)](
        out,
        out.stride(0),
        out.stride(1),
        offset,
        cache,
        cache.stride(0),
        block_size,
        cache.shape[0],
        seq_lens,
        gather_lens if window else seq_lens,
        ratio,
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        WINDOW=window,
    )


assert NOPE_DIM == 448  # the kernel spells the geometry out as literals
