"""The DeepSeek-V4.1 attention layer of the DSV4_NVFP4 backend, with fp8_ds_mla caches.

:class:`DSV41NVFP4Attention` subclasses vLLM 0.33.0's V4.1 FlashMLA layer
(``vllm.models.deepseek_v41.nvidia.flashmla.DeepseekV4FlashMLAAttention``) and keeps everything
that decides which bytes the caches hold and which rows a token reads: the projections, the
compressors and indexers of the KV and index source layers, the SWA and compressed-cache writers,
the metadata builders (bounded replay's ``replay_start`` and Engram's window metadata included)
and the output projection. The caches are therefore vLLM's V4.1 Hopper caches byte for byte
(584 B fp8_ds_mla rows, its page layout). What this class replaces are the two attention kernels:

* decode: every decode token's window list (``decode_swa_indices``) and its indexer's top-k
  compressed entries (mapped to cache slots by vLLM's ``compute_global_topk_indices_and_lens``)
  go, with the sink, to :func:`dsv4_attn.ops.sparse_attention` (the CuTeDSL kernel on Hopper)
  instead of FlashMLA's ``flash_mla_with_kvcache``;
* prefill: vLLM's gather of the compressed entries and the window into bf16 rows and its
  ``combine_topk_swa_indices`` as before, then this package's gathered FMHA
  (:func:`dsv4_attn.vllm_glue.prefill.attend`) instead of ``flash_mla_sparse_fwd``.

The scratch of both (the decode kernel's split partials, the log-sum-exp) comes from vLLM's
workspace manager and is reserved at its peak in the profiling run, beside vLLM's own prefill
workspace.

vLLM builds this class for a V4.1 checkpoint when ``--attention-backend DSV4_NVFP4
--kv-cache-dtype fp8`` is set (:mod:`.model_hook`); other cache formats are refused at build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.models.deepseek_v41.common.ops import (
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
    dequantize_and_gather_k_cache,
)
from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
from vllm.utils.math_utils import round_up

from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.layer_kind import Family, compressed_of
from dsv4_attn.log import LOGGER_PREFIX
from dsv4_attn.scope import KVScope
from dsv4_attn.vllm_glue import BACKEND_NAME, kv_spec, prefill
from dsv4_attn.vllm_glue.attention import (
    DSV4NVFP4Attention,
    _PageView,
    _workspace_manager,
    workspace_bytes,
)
from dsv4_attn.vllm_glue.metadata import dspark_window_width
from dsv4_attn.vllm_glue.support import check_serving_device, check_supported, padded_num_heads

if TYPE_CHECKING:
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

__all__ = ["DSV41NVFP4Attention", "v41_kv_format"]

logger = init_logger(LOGGER_PREFIX + __name__)

_FP8 = KVFormat.FP8_DS_MLA


def v41_kv_format(cache_dtype: str) -> KVFormat:
    """The row format DSV4_NVFP4 serves a V4.1 checkpoint with for ``--kv-cache-dtype
    cache_dtype``: fp8_ds_mla only (V4.1's own NVFP4 record is not implemented on Hopper yet).
    ValueError names the value and what is accepted."""
    fmt = kv_spec.resolve_kv_format(cache_dtype)
    if fmt is not _FP8:
        fp8_names = [name for name, f in kv_spec.KV_CACHE_DTYPES.items() if f is _FP8]
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} serves DeepSeek-V4.1 with fp8 KV caches only "
            f"(--kv-cache-dtype {' or '.join(fp8_names)}); got --kv-cache-dtype "
            f"{cache_dtype!r} ({fmt.value}). V4.1's NVFP4 cache is not implemented yet."
        )
    return fmt


class DSV41NVFP4Attention(DeepseekV4FlashMLAAttention):
    """DeepSeek-V4.1 attention: vLLM's V4.1 caches, writers and metadata; this package's
    decode and prefill kernels."""

    # The scratch rules of the V4 layer, which read only the attributes set in __init__ below.
    _maps_top_k = False  # vLLM's compute_global_topk_indices_and_lens maps the picks
    _key_capacity = DSV4NVFP4Attention._key_capacity
    _scratch_shapes = DSV4NVFP4Attention._scratch_shapes
    _scratch = DSV4NVFP4Attention._scratch
    _decode_call = DSV4NVFP4Attention._decode_call

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        check_supported(vllm_config)
        self.kv_format = v41_kv_format(vllm_config.cache_config.cache_dtype)
        super().__init__(vllm_config, *args, **kwargs)
        self.compressed_entries = compressed_of(Family.V41, self.compress_ratio)
        self._top_k = self.compressed_entries is not None  # every V4.1 ratio > 0 reads top-k
        self.device = torch.device(vllm_config.device_config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_serving_device(self.device)
        self._max_window_width = max(
            self.window_size, dspark_window_width(vllm_config, self.window_size)
        )
        self._swa_pages = _PageView()
        self._compressed_pages = _PageView()
        self._reserved_bytes: int | None = None  # the workspace the profiling run reserved
        self._cache_block_size = vllm_config.cache_config.block_size
        self._compiled = False
        # The decode kernel's entry once a first call through ops.sparse_attention ran it.
        self._decode_kernel: Callable[..., Any] | None = None
        logger.info_once(
            "DeepSeek-V4.1 attention runs through dsv4-attn (%s) with vLLM's fp8_ds_mla caches.",
            BACKEND_NAME,
        )

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return padded_num_heads(num_heads)

    def _may_run_balanced(self) -> bool:
        return False  # every compressed V4.1 layer reads a fixed top-k: the split launch

    def _peak_decode_scratch(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The most scratch a decode forward of this layer asks for."""
        return self._scratch_shapes(self.max_num_batched_tokens, self._key_capacity(0), peak=True)

    def _peak_prefill_scratch(self, head_dim: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The most scratch a prefill chunk asks for: vLLM's gathered rows (a chunk of
        ``PREFILL_CHUNK_SIZE`` requests, each its compressed entries + window + a step's tokens),
        index lists and lengths, as its FlashMLA layer reserves them, then the log-sum-exp."""
        tokens = self.max_num_batched_tokens
        entries = 0 if self.compress_ratio == 0 else -(-self.max_model_len // self.compress_ratio)
        return self._prefill_scratch_shapes(
            self.PREFILL_CHUNK_SIZE, entries + self.window_size + tokens, head_dim, tokens
        )

    def _prefill_scratch_shapes(
        self, requests: int, rows: int, head_dim: int, tokens: int
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One prefill chunk's scratch, in one request to the workspace (views of one request
        do not overlap; those of two do): ``rows`` gathered bf16 rows per request, vLLM's index
        lists and lengths (sized for a whole step, as vLLM asks), the fp32 log-sum-exp of the
        chunk's ``tokens``."""
        top_k = 0 if self.compress_ratio == 0 else self.topk_indices_buffer.shape[-1]
        width = round_up(top_k + self.window_size, 128)
        step = self.max_num_batched_tokens
        return [
            ((requests, rows, head_dim), torch.bfloat16),
            ((step, width), torch.int32),
            ((step,), torch.int32),
            ((tokens, self.padded_heads), torch.float32),
        ]

    def forward_mqa(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Attention of ``q [T, padded_heads, 512]`` into ``output`` (same shape), in place:
        vLLM's V4.1 split into prefill and decode tokens, this class's kernels for each."""
        if get_forward_context().attn_metadata is None:  # profiling / warm-up run
            self._reserve_scratch(q.shape[-1])
            output.zero_()
            return
        super().forward_mqa(q, kv, positions, output)

    def _reserve_scratch(self, head_dim: int) -> None:
        """Profiling run: ask vLLM's workspace manager for this layer's peak decode and prefill
        scratch, so vLLM counts both before it sizes the KV cache; on a GPU, compile the
        kernels once."""
        decode, chunk = self._peak_decode_scratch(), self._peak_prefill_scratch(head_dim)
        self._reserved_bytes = max(workspace_bytes(decode), workspace_bytes(chunk))
        if self.device.type == "cuda" and not self._compiled:
            # Outside any CUDA-graph capture, where loading a module is not allowed.
            from dsv4_attn.kernels.precompile import compile_layer_kernels

            compile_layer_kernels(
                self.kv_format,
                self.compressed_entries,
                self.swa_cache_layer.block_size,
                self._cache_block_size,
                False,
            )
            self._compiled = True
        manager = _workspace_manager()
        if manager is not None:
            manager.get_simultaneous(*decode)
            manager.get_simultaneous(*chunk)

    def _forward_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | None,
        swa_metadata: DeepseekSparseSWAMetadata,
        attn_metadata: DeepseekV4FlashMLAMetadata | None,
        swa_only: bool,
        output: torch.Tensor,
    ) -> None:
        """Decode tokens ``q [n, padded_heads, 512]`` into ``output`` (same shape), in place."""
        n = swa_metadata.num_decode_tokens
        extra = None
        if not swa_only:
            assert attn_metadata is not None and kv_cache is not None
            assert swa_metadata.is_valid_token is not None
            assert self.topk_indices_buffer is not None
            entries_per_block = attn_metadata.block_size // self.compress_ratio
            slots, lens = compute_global_topk_indices_and_lens(
                self.topk_indices_buffer[:n],
                swa_metadata.token_to_req_indices,
                attn_metadata.block_table[: swa_metadata.num_decodes],
                entries_per_block,
                swa_metadata.is_valid_token[:n],
            )
            pages = self._compressed_pages.get(kv_cache, _FP8, entries_per_block)
            extra = KVScope(pages, _FP8, entries_per_block, slots.view(n, -1), lens)
        assert swa_metadata.decode_swa_indices is not None
        assert swa_metadata.decode_swa_lens is not None
        swa_cache = self.swa_cache_layer.kv_cache
        window = KVScope(
            self._swa_pages.get(swa_cache, _FP8, swa_metadata.block_size),
            _FP8,
            swa_metadata.block_size,
            swa_metadata.decode_swa_indices[:n].view(n, -1),
            swa_metadata.decode_swa_lens[:n],
        )
        capacity = window.capacity + (extra.capacity if extra is not None else 0)
        lse, *partials = self._scratch(self._scratch_shapes(n, capacity), "decode")
        workspace = (partials[0], partials[1]) if partials else None
        args = (q[:n], window, self.attn_sink, self.scale, extra)
        self._decode_call(args, {"out": output[:n], "lse": lse, "workspace": workspace})

    def _forward_prefill(
        self,
        q: torch.Tensor,
        positions: torch.Tensor,
        compressed_k_cache: torch.Tensor | None,
        swa_k_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: DeepseekV4FlashMLAMetadata | None,
        swa_metadata: DeepseekSparseSWAMetadata,
    ) -> None:
        """The prefill tokens, chunk by chunk as vLLM's V4.1 layer plans them: its gather and
        index lists, then this package's gathered FMHA."""
        swa_only = self.compress_ratio == 0
        num_decodes = swa_metadata.num_decodes
        num_decode_tokens = swa_metadata.num_decode_tokens
        num_prefill_tokens = swa_metadata.num_prefill_tokens
        seq_lens = swa_metadata.prefill_seq_lens
        gather_lens = swa_metadata.prefill_gather_lens
        query_start_loc_cpu = swa_metadata.query_start_loc_cpu
        query_start_loc = swa_metadata.query_start_loc
        assert seq_lens is not None and gather_lens is not None
        assert query_start_loc_cpu is not None and query_start_loc is not None
        prefill_token_base = query_start_loc_cpu[num_decodes]
        assert self.topk_indices_buffer is not None
        topk_indices = self.topk_indices_buffer[num_decode_tokens:][:num_prefill_tokens]
        top_k = 0 if swa_only else topk_indices.shape[-1]
        chunk_plan = swa_metadata.get_prefill_chunk_plan(
            compress_ratio=self.compress_ratio,
            prefill_chunk_size=self.PREFILL_CHUNK_SIZE,
            has_compressed=not swa_only,
        )
        assert chunk_plan, "prefill chunk plan must be non-empty when num_prefills > 0"
        for chunk_start, chunk_end, chunk_N, chunk_M in chunk_plan:
            chunk_size = chunk_end - chunk_start
            query_start = query_start_loc_cpu[num_decodes + chunk_start] - prefill_token_base
            query_end = query_start_loc_cpu[num_decodes + chunk_end] - prefill_token_base
            tokens = int(query_end - query_start)
            kv, indices_out, lens_out, lse = self._scratch(
                self._prefill_scratch_shapes(chunk_size, chunk_M, q.shape[-1], tokens), "prefill"
            )
            if not swa_only:
                assert attn_metadata is not None
                block_table = attn_metadata.block_table[num_decodes:]
                dequantize_and_gather_k_cache(
                    kv[:chunk_size],
                    compressed_k_cache,
                    seq_lens=seq_lens[chunk_start:chunk_end] // self.compress_ratio,
                    gather_lens=None,
                    block_table=block_table[chunk_start:chunk_end],
                    block_size=attn_metadata.block_size // self.compress_ratio,
                    offset=0,
                )
            dequantize_and_gather_k_cache(
                kv[:chunk_size],
                swa_k_cache,
                seq_lens=seq_lens[chunk_start:chunk_end],
                gather_lens=gather_lens[chunk_start:chunk_end],
                block_table=swa_metadata.block_table[num_decodes:][chunk_start:chunk_end],
                block_size=swa_metadata.block_size,
                offset=chunk_N,
            )
            indices, lens = combine_topk_swa_indices(
                topk_indices[query_start:query_end],
                query_start_loc[num_decodes + chunk_start : num_decodes + chunk_end + 1],
                seq_lens[chunk_start:chunk_end],
                gather_lens[chunk_start:chunk_end],
                self.window_size,
                self.compress_ratio,
                top_k,
                chunk_M,
                chunk_N,
                out=(indices_out[:tokens], lens_out[:tokens]),
            )
            prefill.attend(
                q[query_start:query_end],
                kv,
                indices,
                lens,
                self.attn_sink,
                self.scale,
                output[query_start:query_end],
                lse,
            )
