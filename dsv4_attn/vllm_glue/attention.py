"""The DeepSeek-V4 attention layer of the DSV4_NVFP4 backend.

:class:`DSV4NVFP4Attention` subclasses vLLM 0.33.0's ``DeepseekV4Attention``: projections, the
indexer, the compressor and the output projection are vLLM's; this class supplies the parts a
platform subclass owns (vLLM's ``forward_mqa`` contract):

* :meth:`~DSV4NVFP4Attention.forward_mqa` fills ``output`` in place with
  :func:`dsv4_attn.ops.sparse_attention` (CuTeDSL kernel where it covers the case, SDPA fallback
  otherwise), every token with its own window and compressed entries (:mod:`.metadata`);
* the KV-cache format from ``--kv-cache-dtype`` (:mod:`.kv_spec`): with NVFP4 it swaps in the NVFP4
  SWA spec and writers (:mod:`.writers`); with fp8 it keeps vLLM's fp8_ds_mla layout and writers;
* head padding: only up to the next head count the kernel supports
  (``sparse_decode.SUPPORTED_HEAD_COUNTS``), none where it takes the count as it is;
* ``_o_proj``: vLLM's DeepGEMM FP8 output projection, as vLLM's FlashMLA layer uses.

vLLM builds this class when ``--attention-backend DSV4_NVFP4`` is set (:mod:`.model_hook`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.models.deepseek_v4.attention import DeepseekV4Attention
from vllm.v1.kv_cache_interface import KVCacheSpec

from dsv4_attn import kv_cache, ops
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.vllm_glue import BACKEND_NAME, kv_spec
from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend, DSV4NVFP4SWABackend
from dsv4_attn.vllm_glue.metadata import (
    CSA_RATIO,
    DSV4CompressedMetadata,
    DSV4SWAMetadata,
    sparse_scopes,
)
from dsv4_attn.vllm_glue.writers import (
    CompressedRowStager,
    DSV4NVFP4Compressor,
    qnorm_rope,
)

__all__ = ["DSV4NVFP4Attention", "check_supported"]

logger = init_logger(__name__)


def check_supported(vllm_config: VllmConfig) -> None:
    """Raise ValueError for a configuration this backend does not serve (at model build)."""
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} does not support decode or prefill context "
            "parallelism; set both sizes to 1."
        )
    hf_config = vllm_config.model_config.hf_config
    if getattr(hf_config, "vision_n_layers", 0) > 0:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} serves the text model only; this checkpoint "
            "has vision layers, whose bidirectional image windows it does not implement."
        )
    spec = vllm_config.speculative_config
    if spec is not None and spec.use_dspark():
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} does not support DSpark speculation "
            "(non-causal draft windows); MTP speculation works."
        )


def _padded_num_heads(num_heads: int) -> int:
    """Query heads the layer allocates: the smallest head count the CuTeDSL kernel supports
    (``sparse_decode.SUPPORTED_HEAD_COUNTS``) that holds ``num_heads``, so no padding where the
    kernel takes the count as it is; ``num_heads`` itself when the kernel takes no count that
    large, or is absent (the SDPA fallback takes any count)."""
    try:
        from dsv4_attn.kernels import sparse_decode
    except ImportError:
        return num_heads
    counts = sorted(getattr(sparse_decode, "SUPPORTED_HEAD_COUNTS", ()))
    return next((c for c in counts if c >= num_heads), num_heads)


class DSV4NVFP4Attention(DeepseekV4Attention):
    """DeepSeek-V4 attention through :mod:`dsv4_attn.ops` with an NVFP4 or fp8_ds_mla cache."""

    backend_cls = DSV4NVFP4Backend
    swa_backend_cls = DSV4NVFP4SWABackend

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str,
        topk_indices_buffer: torch.Tensor | None = None,
        aux_stream_list: list[torch.cuda.Stream] | None = None,
    ) -> None:
        check_supported(vllm_config)
        # Known before the base __init__, which asks _uses_fp8_ds_mla_layout() for the layout.
        self.kv_format = kv_spec.resolve_kv_format(vllm_config.cache_config.cache_dtype)
        super().__init__(vllm_config, prefix, topk_indices_buffer, aux_stream_list)
        self.compressed_rows_per_block = vllm_config.cache_config.block_size // max(
            1, self.compress_ratio
        )
        self._einsum_recipe: tuple[int, int, int] | None = None
        self._tma_aligned_scales = False
        if self.kv_format is KVFormat.NVFP4:
            self._use_nvfp4_cache(vllm_config)
        logger.info_once(
            "DeepSeek-V4 attention runs through dsv4-attn (%s) with a %s KV cache.",
            BACKEND_NAME,
            self.kv_format.value,
        )

    def _use_nvfp4_cache(self, vllm_config: VllmConfig) -> None:
        # The base class built the SWA cache layer and the compressor for plain bf16 rows (the
        # layout it picks when _uses_fp8_ds_mla_layout() is False); give them NVFP4 behaviour.
        self.kv_cache_dtype = kv_spec.NVFP4_CACHE_DTYPE_LABEL
        self.kv_cache_torch_dtype = torch.uint8
        self.swa_cache_layer.__class__ = kv_spec.NVFP4SWACache
        self.swa_cache_layer.dtype = torch.uint8
        if self.compressor is not None:
            self.compressor.__class__ = DSV4NVFP4Compressor
            scheduler = vllm_config.scheduler_config
            self.compressed_row_stager = CompressedRowStager(
                scheduler.max_num_batched_tokens,
                scheduler.max_num_seqs,
                self.compress_ratio,
                device=self.compressor.device,
            )

    def _uses_fp8_ds_mla_layout(self) -> bool:
        return self.kv_format is KVFormat.FP8_DS_MLA

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return _padded_num_heads(num_heads)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        if self.kv_format is not KVFormat.NVFP4 or self.compress_ratio <= 1:
            return super().get_kv_cache_spec(vllm_config)
        return kv_spec.compressed_cache_spec(
            vllm_config.cache_config.block_size, self.compress_ratio
        )

    def swa_pages(self) -> torch.Tensor:
        """The SWA cache as ``uint8 [num_blocks, page_bytes]`` pages of 64 tokens."""
        layer = self.swa_cache_layer
        return kv_spec.paged_view(layer.kv_cache, self.kv_format, layer.block_size)

    def compressed_pages(self) -> torch.Tensor:
        """The compressed cache as ``uint8 [num_blocks, page_bytes]`` pages of
        :attr:`compressed_rows_per_block` entries."""
        return kv_spec.paged_view(self.kv_cache, self.kv_format, self.compressed_rows_per_block)

    def _fused_qnorm_rope_kv_insert(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        if self.kv_format is not KVFormat.NVFP4:
            return super()._fused_qnorm_rope_kv_insert(q, kv, positions, attn_metadata)
        if not isinstance(attn_metadata, dict):  # profile run: nothing to write
            return F.pad(q, (0, 0, 0, self.padded_heads - self.n_local_heads))
        swa = cast(DSV4SWAMetadata, attn_metadata[self.swa_cache_layer.prefix])
        q_out, kv_out = qnorm_rope(
            q, kv, positions, self.rotary_emb.cos_sin_cache, self.eps, self.padded_heads
        )
        n = min(swa.slot_mapping.shape[0], kv_out.shape[0])  # rows past the slots are padding
        kv_cache.write_unchecked(
            self.swa_pages(), swa.slot_mapping[:n], kv_out[:n], self.kv_format, swa.block_size
        )
        return q_out

    def forward_mqa(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Attention of ``q [T, padded_heads, 512]`` written into ``output`` (same shape), in place.

        ``kv`` and ``positions`` are unused: the KV rows are read from the caches the step's
        writers filled, and positions come with the metadata.
        """
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:  # profile / warm-up run
            output.zero_()
            return
        assert isinstance(attn_metadata, dict), type(attn_metadata)
        swa = cast(DSV4SWAMetadata, attn_metadata[self.swa_cache_layer.prefix])
        compressed = None
        if self.compress_ratio > 1:
            compressed = cast(DSV4CompressedMetadata, attn_metadata[self.prefix])
        assert swa.swa_indices is not None
        rows = swa.swa_indices.shape[0]  # the step's tokens, as the metadata counts them
        local_topk = None
        if self.compress_ratio == CSA_RATIO:
            assert self.topk_indices_buffer is not None
            local_topk = self.topk_indices_buffer[:rows]
        scopes = sparse_scopes(swa, compressed, local_topk)
        # q may carry more rows than the metadata (padding); those rows attend to nothing.
        n = min(rows, q.shape[0])
        extra: tuple[Any, ...] = (None, None, None, None)
        if scopes.extra_indices is not None and scopes.extra_lens is not None:
            extra = (
                self.compressed_pages(),
                self.compressed_rows_per_block,
                scopes.extra_indices[:n],
                scopes.extra_lens[:n],
            )
        out, _ = ops.sparse_attention(
            q[:n],
            self.swa_pages(),
            self.kv_format,
            swa.block_size,
            scopes.indices[:n],
            scopes.lens[:n],
            self.attn_sink,
            self.scale,
            *extra,
            check_values=False,
        )
        output[:n].copy_(out)
        output[n:].zero_()

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from vllm.models.deepseek_v4.nvidia.ops.o_proj import (
            compute_fp8_einsum_recipe,
            deep_gemm_fp8_o_proj,
        )

        if self._einsum_recipe is None:
            self._einsum_recipe, self._tma_aligned_scales = compute_fp8_einsum_recipe()
        return deep_gemm_fp8_o_proj(
            o,
            positions,
            self.rotary_emb.cos_sin_cache,
            self.wo_a,
            self.wo_b,
            n_groups=self.n_local_groups,
            heads_per_group=self.n_local_heads // self.n_local_groups,
            nope_dim=self.nope_head_dim,
            rope_dim=self.rope_head_dim,
            o_lora_rank=self.o_lora_rank,
            einsum_recipe=self._einsum_recipe,
            tma_aligned_scales=self._tma_aligned_scales,
        )
