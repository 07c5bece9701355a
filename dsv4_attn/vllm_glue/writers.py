"""NVFP4 KV writers for vLLM's DeepSeek-V4 layers: the SWA insert and the compressor output.

vLLM's writers know fp8_ds_mla and plain bf16/fp8 rows only; with an NVFP4 cache this backend
replaces them (with ``--kv-cache-dtype fp8*`` vLLM's writers stay in place):

* SWA insert (:func:`insert_swa_rows`) — what vLLM's fused op does for fp8_ds_mla: Q RMSNorm +
  RoPE, and KV RoPE + quantize + paged insert. On CUDA one Triton kernel
  (:mod:`dsv4_attn.fused.kv_writers`); elsewhere :func:`qnorm_rope` and
  :func:`dsv4_attn.kv_cache.write_unchecked`.
* Compressor output — vLLM's compressor kernel computes each compressed row (weighted
  compression of the saved states, RMSNorm, RoPE) and stores it. :class:`DSV4NVFP4Compressor`
  lets it store plain bf16 rows into a staging buffer shared by all layers
  (:func:`staging_rows`, one row per token), then :func:`store_staged_rows` encodes them into
  the layer's compressed cache (one Triton kernel on CUDA).

Both produce exactly :func:`dsv4_attn.kv_cache.encode_rows`' bytes, the format
:mod:`dsv4_attn.kv_cache` documents, with a fixed launch sequence of fixed shapes and no host
synchronisation, so they can sit inside vLLM's captured CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.models.deepseek_v4.compressor import CompressorMetadata, DeepseekCompressor

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import HEAD_DIM, NOPE_DIM, ROPE_DIM, KVFormat
from dsv4_attn.vllm_glue.compressor_state import compress_rows

__all__ = [
    "DSV4NVFP4Compressor",
    "insert_swa_rows",
    "qnorm_rope",
    "staging_rows",
    "store_staged_rows",
]


def qnorm_rope(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    padded_heads: int,
    q_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE/norm half of vLLM's fused DeepSeek-V4 SWA insert, in torch.

    Q: per-head RMSNorm without weight over all 512 values (DeepSeek-V4; ``q_norm=False`` for
    V4.1, which has none), then GPT-J (interleaved) RoPE on the last 64; KV: the same RoPE only
    (its RMSNorm ran before). RoPE pairs are values
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
    if q_norm:
        q32 = q32 * torch.rsqrt(q32.square().mean(dim=-1, keepdim=True) + eps)
    q_out = q.new_zeros(T, padded_heads, HEAD_DIM)
    q_out[:, :H, :NOPE_DIM] = q32[..., :NOPE_DIM].to(q.dtype)
    q_out[:, :H, NOPE_DIM:] = rotate(q32[..., NOPE_DIM:]).to(q.dtype)
    kv_out = torch.empty_like(kv)
    kv_out[:, :NOPE_DIM] = kv[:, :NOPE_DIM]
    kv_out[:, NOPE_DIM:] = rotate(kv[:, None, NOPE_DIM:].float())[:, 0].to(kv.dtype)
    return q_out, kv_out


def insert_swa_rows(
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
    """The NVFP4 SWA insert of a step: returns q normed (where ``q_norm``), roped and head-padded
    (``bf16 [T, padded_heads, 512]``) and writes each token's roped KV row, NVFP4-encoded, at
    ``slots[t]`` of ``cache`` (page view, ``block_size`` rows per page; -1 = none).

    CUDA: one fused Triton kernel (:func:`dsv4_attn.fused.kv_writers.qnorm_rope_nvfp4_insert`);
    elsewhere :func:`qnorm_rope` and :func:`dsv4_attn.kv_cache.write_unchecked` (same bytes).
    """
    if q.is_cuda:
        from dsv4_attn.fused.kv_writers import qnorm_rope_nvfp4_insert

        return qnorm_rope_nvfp4_insert(
            q, kv, positions, cos_sin_cache, eps, padded_heads, slots, cache, block_size, q_norm
        )
    q_out, kv_out = qnorm_rope(q, kv, positions, cos_sin_cache, eps, padded_heads, q_norm)
    n = min(slots.shape[0], kv_out.shape[0])  # rows past the slots are padding
    kv_cache.write_unchecked(cache, slots[:n], kv_out[:n], KVFormat.NVFP4, block_size)
    return q_out


_staging_buffers: dict[tuple[torch.device, int], torch.Tensor] = {}


def staging_rows(max_tokens: int, device: torch.device | str) -> torch.Tensor:
    """The shared staging buffer between vLLM's compressor kernel and an NVFP4 compressed cache:
    ``bf16 [max_tokens, 1, 512]``, row ``t`` for the step's token ``t`` (a cache of one-row
    blocks, as the kernel addresses it). One per device and size, allocated when the first layer
    is built (so vLLM's memory profile counts it) and shared by every layer: layers run one
    after another, and each stores its staged rows before the next layer's compressor runs."""
    device = torch.device(device)
    key = (device, max_tokens)
    rows = _staging_buffers.get(key)
    if rows is None:
        rows = torch.zeros(max_tokens, 1, HEAD_DIM, dtype=torch.bfloat16, device=device)
        _staging_buffers[key] = rows
    return rows


def store_staged_rows(
    rows: torch.Tensor, write_slots: torch.Tensor, cache: torch.Tensor, block_size: int
) -> None:
    """Encode staged row ``t`` (``rows [>= T, 1, 512]``) to NVFP4 and store it at
    ``write_slots[t]`` (``int64 [T]``, -1 = none) of ``cache`` (page view)."""
    if write_slots.is_cuda:
        from dsv4_attn.fused import kv_writers

        kv_writers.store_staged_rows(rows.view(-1, HEAD_DIM), write_slots, cache, block_size)
        return
    T = write_slots.shape[0]
    kv_cache.write_unchecked(cache, write_slots, rows[:T, 0], KVFormat.NVFP4, block_size)


@dataclass(frozen=True)
class _StagingSlots:
    """Stands in for the layer's metadata in the kernel call: where each token's row goes."""

    slot_mapping: torch.Tensor


class DSV4NVFP4Compressor(DeepseekCompressor):
    """The main (head_dim 512) compressor of a DSV4_NVFP4 layer whose cache is NVFP4.

    ``DeepseekCompressor.forward`` saves the partial states (vLLM's kernel, into a state of
    either dtype) and calls :meth:`_compress_norm_rope_store`, where the compressed rows go as
    plain bf16 into the staging buffer (row = token, where the step's metadata says the token
    completes an entry) and :func:`store_staged_rows` then writes them to the cache in NVFP4.
    The rows come from vLLM's kernel for an fp32 state (HCA) and from
    :func:`~dsv4_attn.vllm_glue.compressor_state.compress_rows` for the bf16 state of the CSA
    compressor (:mod:`~dsv4_attn.vllm_glue.compressor_state`).
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
        metadata = attn_metadata[self.k_cache_prefix]
        rows = layer.staging_rows
        if state_cache.dtype != torch.float32:  # a narrow state (CSA): ours, vLLM's reads fp32
            compress_rows(
                state_cache,
                state_metadata.block_table,
                state_metadata.token_to_req_indices,
                positions,
                state_metadata.slot_mapping,
                metadata.staging_rows,
                rows.view(-1, HEAD_DIM),
                self.compress_ratio,
                self.norm.weight,
                self.rms_norm_eps,
                rotary_emb.cos_sin_cache,
                self.rope_head_dim,
            )
            store_staged_rows(
                rows,
                metadata.slot_mapping,
                layer.compressed_pages(),
                layer.compressed_rows_per_block,
            )
            return
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
            k_cache_metadata=_StagingSlots(metadata.staging_rows),
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
        store_staged_rows(
            rows, metadata.slot_mapping, layer.compressed_pages(), layer.compressed_rows_per_block
        )

    @staticmethod
    def _store_rows_kernel() -> Any:
        """vLLM's CuTeDSL compressor (CUDA): compress, RMSNorm, RoPE, store plain rows."""
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL,
        )

        return _SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL
