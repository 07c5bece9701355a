"""NVFP4 KV writers for vLLM's DeepSeek-V4 layers: the SWA insert and the compressor output.

vLLM's writers know fp8_ds_mla and plain bf16/fp8 rows only; with an NVFP4 cache this backend
replaces them (with ``--kv-cache-dtype fp8*`` vLLM's writers stay in place):

* SWA insert — vLLM's fused op does Q RMSNorm + RoPE and KV RoPE + quantize + paged insert.
  :func:`qnorm_rope` does the RoPE/norm part in torch,
  :func:`dsv4_attn.kv_cache.write_unchecked` the rest.
* Compressor output — vLLM's compressor kernel computes each compressed row (weighted
  compression of the saved states, RMSNorm, RoPE) and stores it. :class:`DSV4NVFP4Compressor`
  lets it store plain bf16 rows into a staging buffer (:class:`CompressedRowStager`) and then
  writes them to the layer's compressed cache in NVFP4.

Both produce exactly :func:`dsv4_attn.kv_cache.encode_rows`' bytes, the format
:mod:`dsv4_attn.kv_cache` documents. They run on CPU or CUDA with a fixed number of tensor ops of
fixed shapes and no host synchronisation, so they can sit inside vLLM's captured CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.models.deepseek_v4.compressor import CompressorMetadata, DeepseekCompressor

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import HEAD_DIM, NOPE_DIM, ROPE_DIM, KVFormat

__all__ = [
    "CompressedRowStager",
    "DSV4NVFP4Compressor",
    "qnorm_rope",
]


def qnorm_rope(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    padded_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE/norm half of vLLM's fused DeepSeek-V4 SWA insert, in torch.

    Q: per-head RMSNorm without weight over all 512 values, then GPT-J (interleaved) RoPE on the
    last 64; KV: the same RoPE only (its RMSNorm ran before). RoPE pairs are values
    ``(448 + 2i, 448 + 2i + 1)``, rotated by ``cos_sin_cache[pos, i]`` (cos) and
    ``cos_sin_cache[pos, 32 + i]`` (sin). Math in float32, results rounded once to bf16.

    Args:
        q: ``[T, H, 512]`` bf16 queries after ``wq_b``.
        kv: ``[T, 512]`` bf16 KV rows after ``kv_norm``.
        positions: ``int [T]`` token positions.
        cos_sin_cache: ``[max_position, 64]`` (cos | sin).
        eps: RMSNorm epsilon.
        padded_heads: head count of the returned q (>= H); extra heads are zero.

    Returns:
        ``(q_out bf16 [T, padded_heads, 512], kv_out bf16 [T, 512])``.
    """
    T, H, _ = q.shape
    half = ROPE_DIM // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # x float32 [T, h, 64]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    q32 = q.float()
    q32 = q32 * torch.rsqrt(q32.square().mean(dim=-1, keepdim=True) + eps)
    q_out = q.new_zeros(T, padded_heads, HEAD_DIM)
    q_out[:, :H, :NOPE_DIM] = q32[..., :NOPE_DIM].to(q.dtype)
    q_out[:, :H, NOPE_DIM:] = rotate(q32[..., NOPE_DIM:]).to(q.dtype)
    kv_out = torch.empty_like(kv)
    kv_out[:, :NOPE_DIM] = kv[:, :NOPE_DIM]
    kv_out[:, NOPE_DIM:] = rotate(kv[:, None, NOPE_DIM:].float())[:, 0].to(kv.dtype)
    return q_out, kv_out


class CompressedRowStager:
    """Staging buffer between vLLM's compressor kernel and an NVFP4 compressed cache.

    In a step, token ``t`` completes a compressed entry when its compressed write slot
    ``write_slots[t]`` (from the layer's metadata) is not -1; at most
    ``max_tokens // compress_ratio + max_requests`` tokens do. :meth:`stage` gives each of them a
    staging row, numbered in token order; the kernel writes bf16 rows there; :meth:`flush` encodes
    the staged rows and writes them to their cache slots. Buffers are allocated once, so their
    addresses stay fixed across steps (CUDA graphs).
    """

    def __init__(
        self, max_tokens: int, max_requests: int, compress_ratio: int, device: torch.device | str
    ) -> None:
        self.capacity = max_tokens // compress_ratio + max_requests
        # One extra row: the sink for tokens that stage nothing (index_put needs a target).
        self.rows = torch.zeros(self.capacity + 1, 1, HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.dest = torch.full((self.capacity + 1,), -1, dtype=torch.int64, device=device)
        self.row_of_token = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)

    def stage(self, write_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Assign staging rows for this step's ``write_slots`` (``int [T]``, -1 = none).

        Returns ``(rows, row_of_token)``: the ``bf16 [capacity + 1, 1, 512]`` buffer for the kernel
        to write into, as a cache of one-row blocks, and ``int64 [T]`` its slot per token (-1 =
        none), the kernel's ``kv_slot_mapping``.
        """
        valid = write_slots >= 0
        rank = torch.cumsum(valid, dim=0) - 1
        row_of_token = self.row_of_token[: write_slots.shape[0]]
        row_of_token.copy_(torch.where(valid, rank, -1))
        self.dest.fill_(-1)
        sink = torch.full_like(rank, self.capacity)
        self.dest.index_put_((torch.where(valid, rank, sink),), write_slots.long())
        return self.rows, row_of_token

    def flush(self, cache: torch.Tensor, fmt: KVFormat, block_size: int) -> None:
        """Write the staged rows to ``cache`` (page view, ``block_size`` rows per page)."""
        kv_cache.write_unchecked(
            cache, self.dest[: self.capacity], self.rows[: self.capacity, 0], fmt, block_size
        )


@dataclass(frozen=True)
class _StagingSlots:
    """Stands in for the layer's metadata in the kernel call: where each token's row goes."""

    slot_mapping: torch.Tensor


class DSV4NVFP4Compressor(DeepseekCompressor):
    """The main (head_dim 512) compressor of a DSV4_NVFP4 layer whose cache is NVFP4.

    Everything but the store is vLLM's: ``DeepseekCompressor.forward`` saves the partial states
    and calls :meth:`_compress_norm_rope_store`, where vLLM's kernel now writes plain bf16 rows
    into the layer's :class:`CompressedRowStager` and the rows then go to the cache in NVFP4.
    A :class:`DSV4NVFP4Attention` layer turns its compressor into this class after building it.
    """

    def _compress_norm_rope_store(
        self,
        state_metadata: CompressorMetadata,
        state_cache: torch.Tensor,
        state_width: int,
        positions: torch.Tensor,
        rotary_emb: Any,
        attn_metadata: dict[str, Any],
        pdl_kwargs: dict,
    ) -> None:
        layer = self._static_forward_context[self.k_cache_prefix]
        stager: CompressedRowStager = layer.compressed_row_stager
        rows, row_of_token = stager.stage(attn_metadata[self.k_cache_prefix].slot_mapping)
        self._store_rows_kernel()(
            state_cache=state_cache,
            num_actual=state_metadata.slot_mapping.shape[0],
            token_to_req_indices=state_metadata.token_to_req_indices,
            positions=positions,
            slot_mapping=state_metadata.slot_mapping,
            block_table=state_metadata.block_table,
            block_size=state_metadata.block_size,
            state_width=state_width,
            cos_sin_cache=rotary_emb.cos_sin_cache,
            kv_cache=rows,
            k_cache_metadata=_StagingSlots(row_of_token),
            pdl_kwargs=pdl_kwargs,
            head_dim=self.head_dim,
            rope_head_dim=self.rope_head_dim,
            compress_ratio=self.compress_ratio,
            overlap=self.overlap,
            use_fp4_cache=self.use_fp4_cache,
            rms_norm_weight=self.norm.weight,
            rms_norm_eps=self.rms_norm_eps,
            quant_block=self._quant_block,
            token_stride=self._token_stride,
            scale_dim=self._scale_dim,
            store_full_kv=True,
            store_full_fp8=False,
            fp8_scale=None,
        )
        stager.flush(layer.compressed_pages(), KVFormat.NVFP4, layer.compressed_rows_per_block)

    @staticmethod
    def _store_rows_kernel() -> Any:
        """vLLM's CuTeDSL compressor (CUDA): compress, RMSNorm, RoPE, store plain rows."""
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL,
        )

        return _SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL
