"""KV-cache formats of the DSV4_NVFP4 backend inside vLLM: ``--kv-cache-dtype``, specs, page views.

DeepSeek-V4 keeps two kinds of KV cache per attention layer, both paged (docs/design.md §2.4):

* the sliding-window (SWA) cache, one row per token, vLLM pages of 64 tokens;
* the compressed cache (CSA ratio 4, HCA ratio 128), one row per ``ratio`` tokens; a vLLM block
  of ``cache_config.block_size`` (256) tokens holds ``256 / ratio`` rows.

``--kv-cache-dtype`` picks the row format for both (:func:`resolve_kv_format`):

==========================  ==============  =====================================================
``--kv-cache-dtype``        format          writers
==========================  ==============  =====================================================
``auto`` (default)          NVFP4, 384 B    this package (:mod:`dsv4_attn.vllm_glue.writers`)
``fp8``, ``fp8_e4m3``,      FP8_DS_MLA,     vLLM's own (same bytes as vLLM's FlashMLA path, so
``fp8_ds_mla``              584 B           the two backends can be compared on one cache)
==========================  ==============  =====================================================

Any other value raises a ValueError when the model is built. (vLLM itself refuses
``--kv-cache-dtype nvfp4`` for MLA models before any plugin code runs: NVFP4 is this backend's
``auto``.)

vLLM hands each layer a ``uint8 [num_blocks, rows_per_block, row_bytes]`` view whose block stride
may exceed the rows it shows (page padding). :func:`paged_view` turns it into the
``[num_blocks, page_bytes]`` page view that :mod:`dsv4_attn.kv_cache` and :mod:`dsv4_attn.ops`
read, without copying.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
from vllm.v1.kv_cache_interface import (
    KVCacheSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat

__all__ = [
    "KV_CACHE_DTYPES",
    "NVFP4_CACHE_DTYPE_LABEL",
    "NVFP4SWACache",
    "compressed_cache_spec",
    "paged_view",
    "resolve_kv_format",
    "swa_cache_spec",
]

NVFP4_CACHE_DTYPE_LABEL = "dsv4_nvfp4"
"""``cache_dtype_str`` of the NVFP4 specs (a label: vLLM keys no kernel on it)."""

KV_CACHE_DTYPES: dict[str, KVFormat] = {
    "auto": KVFormat.NVFP4,
    "fp8": KVFormat.FP8_DS_MLA,
    "fp8_e4m3": KVFormat.FP8_DS_MLA,
    "fp8_ds_mla": KVFormat.FP8_DS_MLA,
}
"""Accepted ``--kv-cache-dtype`` values and the format each selects."""

# Page alignment of the NVFP4 specs: kv_cache.py pads NVFP4 pages to 128 B, and 64-token SWA pages
# (24576 B) and 2-row C128 pages (768 B) are multiples of it already.
_NVFP4_PAGE_ALIGNMENT = 128


def resolve_kv_format(cache_dtype: str) -> KVFormat:
    """The row format for ``--kv-cache-dtype cache_dtype``; ValueError lists the accepted values."""
    fmt = KV_CACHE_DTYPES.get(cache_dtype)
    if fmt is None:
        accepted = ", ".join(f"{name} ({f.value})" for name, f in KV_CACHE_DTYPES.items())
        raise ValueError(
            f"--attention-backend DSV4_NVFP4 does not support --kv-cache-dtype {cache_dtype!r}; "
            f"accepted: {accepted}. 'auto' selects NVFP4, this backend's default."
        )
    return fmt


def swa_cache_spec(block_size: int, window: int) -> SlidingWindowMLASpec:
    """vLLM spec of an NVFP4 sliding-window cache: ``block_size`` tokens of 384 B per page."""
    return SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=HEAD_DIM,
        dtype=torch.uint8,
        sliding_window=window,
        cache_dtype_str=NVFP4_CACHE_DTYPE_LABEL,
        state_content_bytes=kv_cache.bytes_per_token(KVFormat.NVFP4),
        alignment=_NVFP4_PAGE_ALIGNMENT,
        model_version="deepseek_v4",
        kv_quant_mode=KVQuantMode.NONE,
    )


class NVFP4SWACache(DeepseekV4SWACache):
    """vLLM's SWA cache layer with the NVFP4 spec (vLLM's knows fp8_ds_mla and plain rows).

    A :class:`~dsv4_attn.vllm_glue.attention.DSV4NVFP4Attention` layer with an NVFP4 cache turns
    its SWA cache layer into this class after building it; nothing else changes.
    """

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return swa_cache_spec(self.block_size, self.window_size)


def compressed_cache_spec(block_size: int, compress_ratio: int) -> MLAAttentionSpec:
    """vLLM spec of an NVFP4 compressed cache: ``block_size / compress_ratio`` rows of 384 B per
    page (``block_size`` in tokens, as vLLM counts it)."""
    if compress_ratio < 1 or block_size % compress_ratio:
        raise ValueError(
            f"compress_ratio must be a positive divisor of block_size={block_size}, got "
            f"{compress_ratio}"
        )
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=HEAD_DIM,
        dtype=torch.uint8,
        tokens_per_state=compress_ratio,
        cache_dtype_str=NVFP4_CACHE_DTYPE_LABEL,
        alignment=_NVFP4_PAGE_ALIGNMENT,
        model_version="deepseek_v4",
        kv_quant_mode=KVQuantMode.NONE,
        state_content_bytes=kv_cache.bytes_per_token(KVFormat.NVFP4),
    )


def paged_view(cache: torch.Tensor, fmt: KVFormat, rows_per_block: int) -> torch.Tensor:
    """``uint8 [num_blocks, page_bytes]`` view of a layer's cache, for :mod:`dsv4_attn.ops`.

    Args:
        cache: the layer's cache as vLLM binds it, ``uint8 [num_blocks, rows_per_block,
            row_bytes]`` (rows dense within a block, blocks any stride apart), or already
            ``[num_blocks, >= page_bytes]``.
        fmt: the row format; a page holds ``rows_per_block`` rows of it.
        rows_per_block: rows (tokens or compressed entries) per block.

    The view spans the padded page (:func:`dsv4_attn.kv_cache.page_layout`), which may reach past
    the rows vLLM's view shows; it is checked to lie within the cache's storage.
    """
    layout = kv_cache.page_layout(fmt, rows_per_block)
    if cache.dtype != torch.uint8 or cache.dim() not in (2, 3):
        raise ValueError(
            f"cache must be uint8 [num_blocks, rows, row_bytes] or [num_blocks, bytes], "
            f"got {cache.dtype} {tuple(cache.shape)}"
        )
    if cache.dim() == 3:
        rows, row_bytes = cache.shape[1:]
        if rows * row_bytes != rows_per_block * kv_cache.bytes_per_token(fmt):
            raise ValueError(
                f"cache blocks hold {rows} x {row_bytes} B, but {rows_per_block} rows of "
                f"{fmt.value} take {rows_per_block} x {kv_cache.bytes_per_token(fmt)} B"
            )
        if cache.stride(2) != 1 or cache.stride(1) != row_bytes:
            raise ValueError(f"cache rows must be dense within a block, strides {cache.stride()}")
    elif cache.stride(1) != 1:
        raise ValueError(f"cache pages must be contiguous, strides {cache.stride()}")
    num_blocks = cache.shape[0]
    block_stride = cache.stride(0) if num_blocks > 1 else layout.page_bytes
    if block_stride < layout.page_bytes:
        raise ValueError(
            f"cache blocks are {block_stride} B apart, less than a {fmt.value} page of "
            f"{rows_per_block} rows ({layout.page_bytes} B)"
        )
    end = cache.storage_offset() + (num_blocks - 1) * block_stride + layout.page_bytes
    if num_blocks and end > cache.untyped_storage().nbytes():
        raise ValueError(
            f"the last page of the cache ({layout.page_bytes} B) runs past its storage"
        )
    return torch.as_strided(
        cache, (num_blocks, layout.page_bytes), (block_stride, 1), cache.storage_offset()
    )
