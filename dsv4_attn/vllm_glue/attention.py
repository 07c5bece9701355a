"""The DeepSeek-V4 attention layer of the DSV4_NVFP4 backend.

:class:`DSV4NVFP4Attention` subclasses vLLM 0.33.0's ``DeepseekV4Attention``: projections, the
indexer, the compressor and the output projection are vLLM's; this class supplies the parts a
platform subclass owns (vLLM's ``forward_mqa`` contract):

* :meth:`~DSV4NVFP4Attention.forward_mqa` writes ``output`` in place with
  :func:`dsv4_attn.ops.sparse_attention` (the CuTeDSL kernel on Hopper; once the first decode
  call ran it, later ones call the kernel's entry directly, without the public checks), every
  token with its own window and compressed entries (:mod:`.metadata`); all its scratch (index
  lists, split partials, gathered prefill rows, the log-sum-exp) comes from vLLM's workspace
  manager and is reserved at its peak in the profiling run, so vLLM's memory profile counts it.
  A later request above that reservation raises: vLLM would grow its workspace by freeing the
  buffer that captured CUDA graphs still use;
* the KV-cache format from ``--kv-cache-dtype`` (:mod:`.kv_spec`): with NVFP4 it swaps in the NVFP4
  SWA spec and writers (:mod:`.writers`); with fp8 it keeps vLLM's fp8_ds_mla layout and writers;
* head padding: only up to the next head count the kernel supports
  (``sparse_decode.SUPPORTED_HEAD_COUNTS``), none where it takes the count as it is;
* ``_o_proj``: vLLM's DeepGEMM FP8 output projection, as vLLM's FlashMLA layer uses.

Sizes that depend on the KV cache (rows per compressed page) are read from the bound cache: on
CUDA, vLLM builds the layers while ``cache_config.block_size`` still holds a placeholder.

vLLM builds this class when ``--attention-backend DSV4_NVFP4`` is set (:mod:`.model_hook`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.models.deepseek_v4.attention import DeepseekV4Attention
from vllm.v1.kv_cache_interface import KVCacheSpec

from dsv4_attn import ops
from dsv4_attn.kernels import sparse_decode_schedule
from dsv4_attn.kernels.sparse_decode_schedule import DecodeSchedule
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.layer_kind import Family, compressed_of
from dsv4_attn.log import LOGGER_PREFIX
from dsv4_attn.vllm_glue import BACKEND_NAME, kv_spec, prefill
from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend, DSV4NVFP4SWABackend
from dsv4_attn.vllm_glue.balanced import balanced_capable, decode_schedule_choice
from dsv4_attn.vllm_glue.compressor_state import state_dtype
from dsv4_attn.vllm_glue.metadata import (
    DSV4CompressedMetadata,
    DSV4SWAMetadata,
    dspark_window_width,
    layer_scopes,
)
from dsv4_attn.vllm_glue.support import check_serving_device, check_supported, padded_num_heads
from dsv4_attn.vllm_glue.writers import DSV4NVFP4Compressor, insert_swa_rows, staging_rows

__all__ = ["DSV4NVFP4Attention", "check_supported"]

logger = init_logger(LOGGER_PREFIX + __name__)  # vLLM's, with its *_once methods

Shapes = list[tuple[tuple[int, ...], torch.dtype]]

_WORKSPACE_ALIGN = 256  # vLLM's WorkspaceManager.get_simultaneous starts each view on 256 B


def workspace_bytes(shapes: Shapes) -> int:
    """Bytes of vLLM's workspace that one ``get_simultaneous(*shapes)`` request covers."""
    align = _WORKSPACE_ALIGN
    return sum(-(-math.prod(shape) * dtype.itemsize // align) * align for shape, dtype in shapes)


def _workspace_manager():
    """vLLM's workspace manager where the worker made one, else None (tests without a worker)."""
    from vllm.v1.worker.workspace import (
        current_workspace_manager,
        is_workspace_manager_initialized,
    )

    return current_workspace_manager() if is_workspace_manager_initialized() else None


def _decode_plan(compressed: DSV4CompressedMetadata | None, n: int) -> DecodeSchedule | None:
    """The step's balanced plan when it covers exactly the ``n`` decode tokens, else None (the
    split launch)."""
    plan = compressed.decode_plan if compressed is not None else None
    if plan is None:
        return None
    if plan.token_plan.shape[0] != n:  # the builder and the layer split the step differently
        logger.warning_once(
            "%s: the step's balanced decode plan covers %d tokens, the layer decodes %d; "
            "using the split launch.",
            BACKEND_NAME,
            plan.token_plan.shape[0],
            n,
        )
        return None
    return plan


class _PageView:
    """A cache's page view for :mod:`dsv4_attn.ops`, rebuilt only when vLLM binds a new tensor."""

    def __init__(self) -> None:
        self._of: torch.Tensor | None = None
        self._view: torch.Tensor | None = None

    def get(self, cache: torch.Tensor, fmt: KVFormat, rows_per_block: int) -> torch.Tensor:
        if cache is not self._of or self._view is None:
            self._view = kv_spec.paged_view(cache, fmt, rows_per_block)
            self._of = cache
        return self._view


class DSV4NVFP4Attention(DeepseekV4Attention):
    """DeepSeek-V4 attention through :mod:`dsv4_attn.ops` with an NVFP4 or fp8_ds_mla cache."""

    backend_cls = DSV4NVFP4Backend
    swa_backend_cls = DSV4NVFP4SWABackend
    # A top-k layer maps its picks to cache slots into scratch of its own (entry slots, lengths).
    _maps_top_k = True

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str,
        topk_indices_buffer: torch.Tensor | None = None,
        aux_stream_list: list[torch.cuda.Stream] | None = None,
    ) -> None:
        check_supported(vllm_config)
        decode_schedule_choice()  # a bad DSV4_ATTN_DECODE_SCHEDULE fails at model build
        # Known before the base __init__, which asks _uses_fp8_ds_mla_layout() for the layout.
        self.kv_format = kv_spec.resolve_kv_format(vllm_config.cache_config.cache_dtype)
        super().__init__(vllm_config, prefix, topk_indices_buffer, aux_stream_list)
        # The compressed entries the layer's tokens attend to besides their window, and whether
        # they are the indexer's top-k of them (else every entry seen).
        self.compressed_entries = compressed_of(Family.V4, self.compress_ratio)
        self._top_k = self.compressed_entries is not None and self.compressed_entries.top_k
        self.cache_config = vllm_config.cache_config
        self.device = torch.device(vllm_config.device_config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_serving_device(self.device)
        self.compressed_rows_per_block = 0  # set when vLLM binds the compressed cache
        # The widest window list a decode step can bring: a DSpark draft block's, else the window.
        block_width = dspark_window_width(vllm_config, self.window_size)
        self._max_window_width = max(self.window_size, block_width)
        self._swa_pages = _PageView()
        self._compressed_pages = _PageView()
        self._peak_scratch: Shapes | None = None  # set by the first profiling forward
        self._reserved_bytes: int | None = None  # the workspace the profiling run reserved
        # The decode kernel's entry once the first decode call, made through
        # ops.sparse_attention (validation, dispatch, a loud fallback), ran it: the inputs keep
        # their structure from step to step, so later calls skip ~10 us of host checks.
        self._decode_kernel: Callable[..., Any] | None = None
        self._einsum_recipe: tuple[int, int, int] | None = None
        self._tma_aligned_scales = False
        if self.kv_format is KVFormat.NVFP4:
            self._use_nvfp4_cache()
        logger.info_once(
            "DeepSeek-V4 attention runs through dsv4-attn (%s) with a %s KV cache.",
            BACKEND_NAME,
            self.kv_format.value,
        )

    def _use_nvfp4_cache(self) -> None:
        # The base class built the SWA cache layer and the compressor for plain bf16 rows (the
        # layout it picks when _uses_fp8_ds_mla_layout() is False); give them NVFP4 behaviour.
        self.kv_cache_dtype = kv_spec.NVFP4_CACHE_DTYPE_LABEL
        self.kv_cache_torch_dtype = torch.uint8
        self.swa_cache_layer.__class__ = kv_spec.NVFP4SWACache
        self.swa_cache_layer.dtype = torch.uint8
        if self.compressor is not None:
            self.compressor.__class__ = DSV4NVFP4Compressor
            self.staging_rows = staging_rows(self.max_num_batched_tokens, self.compressor.device)
            # The CSA compressor's state in bf16 (compressor_state: else its fp32 group is the
            # widest in vLLM's accounting and caps NVFP4's capacity at 1.165x fp8's). Set
            # before vLLM asks the state cache for its spec, which reads this dtype.
            state = self.compressor.state_cache
            state.dtype = state_dtype(self.kv_format, self.compress_ratio, self.compressor.head_dim)

    def _uses_fp8_ds_mla_layout(self) -> bool:
        return self.kv_format is KVFormat.FP8_DS_MLA

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return padded_num_heads(num_heads)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        if self.kv_format is not KVFormat.NVFP4 or self.compress_ratio <= 1:
            return super().get_kv_cache_spec(vllm_config)
        return kv_spec.compressed_cache_spec(
            vllm_config.cache_config.block_size, self.compress_ratio
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)
        # [num_blocks, rows per block, row bytes]: a block holds block_size / ratio entries.
        self.compressed_rows_per_block = self.kv_cache.shape[1] if self.kv_cache.dim() == 3 else 0

    def swa_pages(self) -> torch.Tensor:
        """The SWA cache as ``uint8 [num_blocks, page_bytes]`` pages of 64 tokens."""
        layer = self.swa_cache_layer
        return self._swa_pages.get(layer.kv_cache, self.kv_format, layer.kv_cache.shape[1])

    def compressed_pages(self) -> torch.Tensor:
        """The compressed cache as ``uint8 [num_blocks, page_bytes]`` pages of
        :attr:`compressed_rows_per_block` entries."""
        if self.compressed_rows_per_block < 1:
            raise RuntimeError(f"{self.prefix}: the compressed KV cache is not bound yet")
        return self._compressed_pages.get(
            self.kv_cache, self.kv_format, self.compressed_rows_per_block
        )

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
        return insert_swa_rows(
            q,
            kv,
            positions,
            self.rotary_emb.cos_sin_cache,
            self.eps,
            self.padded_heads,
            swa.slot_mapping,
            self.swa_pages(),
            swa.block_size,
        )

    def insert_context_rows(
        self, kv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """DSpark's context KV into this layer's NVFP4 SWA cache: ``kv`` (``bf16 [n, 512]``,
        after ``kv_norm``) RoPE'd at ``positions``, NVFP4-encoded and written at
        ``slot_mapping`` (-1: none), as the step's own rows are. (vLLM's ``_insert_context_kv``
        picks its writer by the cache tensor's dtype, fp8_ds_mla for any uint8 cache; the model
        hook routes NVFP4 layers here and leaves fp8_ds_mla ones to vLLM's writer.)"""
        if self.kv_format is not KVFormat.NVFP4:
            raise ValueError(f"{self.prefix}: a {self.kv_format.value} cache is vLLM's to write")
        # The writer also norms and ropes a query; kv itself serves as a one-head dummy.
        cos_sin, block_size = self.rotary_emb.cos_sin_cache, self.swa_cache_layer.block_size
        insert_swa_rows(
            kv.unsqueeze(1),
            kv,
            positions,
            cos_sin,
            self.eps,
            1,
            slot_mapping,
            self.swa_pages(),
            block_size,
        )

    # ------------------------------------------------------------------------------------------
    # Attention
    # ------------------------------------------------------------------------------------------

    def _key_capacity(self, hca_width: int, window_width: int | None = None) -> int:
        """The widest key list of this layer's tokens: the window list (``window_width``
        wide, by default the widest a step may have: a DSpark draft block's) + compressed
        entries."""
        if window_width is None:
            window_width = self._max_window_width
        if self._top_k:
            assert self.topk_indices_buffer is not None
            return window_width + self.topk_indices_buffer.shape[1]
        if self.compressed_entries is not None:
            return window_width + hca_width
        return window_width

    def _may_run_balanced(self) -> bool:
        """Whether this layer's decode steps may run on the balanced schedule (an HCA layer
        whose lists are long enough, :func:`~dsv4_attn.vllm_glue.balanced.balanced_capable`):
        its workspace and kernels are then reserved and compiled in the profiling run."""
        if self.compressed_entries is None or self._top_k:
            return False
        max_hca_width = -(-self.max_model_len // self.compress_ratio)
        return balanced_capable(self.device, self._key_capacity(max_hca_width))

    def _scratch_shapes(
        self,
        num_tokens: int,
        capacity: int,
        peak: bool = False,
        plan: DecodeSchedule | None = None,
    ) -> Shapes:
        """Scratch of one decode forward of ``num_tokens`` tokens, in this order: a top-k layer's
        entry slots and lengths (where it maps them itself, :attr:`_maps_top_k`), the
        log-sum-exp (fp32 ``[num_tokens, heads]``), and the kernel's partials (split-KV, or the
        balanced ``plan``'s slots).
        ``peak``: the most any forward of at most ``num_tokens`` tokens asks for (each piece at
        its own maximum, the balanced schedule's included where the layer may run it)."""
        shapes: Shapes = []
        heads = self.padded_heads
        if self._top_k and self._maps_top_k:
            assert self.topk_indices_buffer is not None
            topk = self.topk_indices_buffer.shape[1]
            shapes += [((num_tokens, topk), torch.int32), ((num_tokens,), torch.int32)]
        shapes.append(((num_tokens, heads), torch.float32))  # lse
        if self.device.type != "cuda":
            return shapes  # the fallback takes no partials
        from dsv4_attn.kernels import sparse_decode

        o_dtype, pair_dtype = sparse_decode.WORKSPACE_DTYPES  # the kernel's partials
        if peak:
            o_numel, lse_numel = sparse_decode.peak_workspace_numel(
                num_tokens, heads, capacity, self.device
            )
            if self._may_run_balanced():
                parts = sparse_decode_schedule.balanced_parts(heads, self.device)
                o_shape, lse_shape = sparse_decode_schedule.balanced_workspace_shape(parts, heads)
                o_numel = max(o_numel, math.prod(o_shape))
                lse_numel = max(lse_numel, math.prod(lse_shape))
            if o_numel:
                shapes += [((o_numel,), o_dtype), ((lse_numel,), pair_dtype)]
            return shapes
        if plan is not None:
            o_shape, lse_shape = sparse_decode_schedule.balanced_workspace_shape(
                plan.num_parts, heads
            )
            return [*shapes, (o_shape, o_dtype), (lse_shape, pair_dtype)]
        split = sparse_decode.workspace_shapes(num_tokens, heads, capacity, self.device)
        if split is not None:
            shapes += [(split[0], o_dtype), (split[1], pair_dtype)]
        return shapes

    def _reserve_scratch(self) -> None:
        """Profiling and warm-up runs: ask the workspace manager for the peak, so vLLM counts it
        before it sizes the KV cache (as vLLM's FlashMLA layer does for its prefill workspace),
        and compile the kernels. Both are worked out once; later dummy runs only re-request."""
        if self._peak_scratch is None:
            max_hca_width = -(-self.max_model_len // max(1, self.compress_ratio))
            capacity = self._key_capacity(max_hca_width)
            self._peak_scratch = self._scratch_shapes(
                self.max_num_batched_tokens, capacity, peak=True
            )
            if self.device.type == "cuda":
                self._compile_kernels()
        prefill_peak = self._peak_prefill_scratch()  # prefill chunks, at other times
        self._reserved_bytes = max(
            workspace_bytes(self._peak_scratch), workspace_bytes(prefill_peak)
        )
        manager = _workspace_manager()
        if manager is not None:
            manager.get_simultaneous(*self._peak_scratch)
            manager.get_simultaneous(*prefill_peak)

    def _peak_prefill_scratch(self) -> Shapes:
        """The largest workspace a prefill chunk of this layer asks for."""
        topk = self.topk_indices_buffer.shape[1] if self._top_k else 0
        return prefill.peak_workspace_shapes(
            self.max_model_len,
            self.compressed_entries,
            self.window_size,
            topk,
            self.max_num_batched_tokens,
            self.padded_heads,
        )

    def _scratch(self, shapes: Shapes, what: str) -> list[torch.Tensor]:
        """Views for one forward's scratch tensors (``what``: the path asking, for errors),
        from vLLM's workspace manager where the worker has one, else freshly allocated.

        Raises RuntimeError where the request is above what this layer's profiling run
        reserved (or no profiling run reserved anything): vLLM's manager would grow the
        workspace by freeing the buffer it has, which CUDA graphs captured earlier still
        write into."""
        manager = _workspace_manager()
        if manager is None:
            return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        need = workspace_bytes(shapes)
        if self._reserved_bytes is None or need > self._reserved_bytes:
            reserved = "nothing" if self._reserved_bytes is None else f"{self._reserved_bytes} B"
            raise RuntimeError(
                f"{self.prefix}: a {what} step asks vLLM's workspace for {need} B of scratch, "
                f"but this layer's profiling run reserved {reserved}. Growing the workspace now "
                "would free the buffer that captured CUDA graphs use. This is a bug in "
                f"dsv4-attn's peak accounting ({BACKEND_NAME}); please report it with the "
                "`vllm serve` command."
            )
        return manager.get_simultaneous(*shapes)

    def _compile_kernels(self) -> None:
        """Compile (or load from the disk cache) this layer's kernels now, outside any CUDA-graph
        capture: loading a module while a graph is being captured is not allowed. (vLLM has set
        the final block size by the profiling run.) The prefill gathers are launched once on
        small caches of their own (:func:`.prefill.warm_gather`): vLLM's warm-up batches have
        no earlier context, so they would otherwise compile in a user's first request."""
        from dsv4_attn.kernels.precompile import compile_layer_kernels

        compile_layer_kernels(
            self.kv_format,
            self.compressed_entries,
            self.swa_cache_layer.block_size,
            self.cache_config.block_size,
            self._may_run_balanced(),
        )
        prefill.warm_gather(
            self.kv_format,
            self.compressed_entries,
            self.window_size,
            self.swa_cache_layer.block_size,
            self.cache_config.block_size,
            self.device,
        )

    def forward_mqa(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Attention of ``q [T, padded_heads, 512]`` written into ``output`` (same shape), in place.

        ``kv`` and ``positions`` are unused: the KV rows are read from the caches the step's
        writers filled, and positions come with the metadata. Rows of ``q`` past the step's
        tokens (padding) get output 0.
        """
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:  # profiling / warm-up run
            self._reserve_scratch()
            output.zero_()
            return
        assert isinstance(attn_metadata, dict), type(attn_metadata)
        swa = cast(DSV4SWAMetadata, attn_metadata[self.swa_cache_layer.prefix])
        compressed = None
        hca_width = 0
        if self.compress_ratio > 1:
            compressed = cast(DSV4CompressedMetadata, attn_metadata[self.prefix])
            if compressed.hca_indices is not None:
                hca_width = compressed.hca_indices.shape[1]
        n = min(swa.num_tokens, q.shape[0])
        if swa.num_prefills == 0:
            # Decode-only (what CUDA graphs capture): every row through the decode kernel,
            # padding rows included (they see no keys: output 0).
            self._forward_decode(q, output, swa, compressed, hca_width, n)
        else:
            self._forward_decode(q, output, swa, compressed, hca_width, swa.num_decode_tokens)
            end = self._forward_prefill(q, output, swa, compressed)
            n = min(n, end)
        if n < q.shape[0]:
            output[n:].zero_()

    def _forward_decode(
        self,
        q: torch.Tensor,
        output: torch.Tensor,
        swa: DSV4SWAMetadata,
        compressed: DSV4CompressedMetadata | None,
        hca_width: int,
        n: int,
    ) -> None:
        """Tokens ``0 .. n`` through the sparse-decode kernel, each reading its own rows (on
        the balanced schedule where the step's metadata planned it for these tokens)."""
        if n == 0:
            return
        plan = _decode_plan(compressed, n)
        capacity = self._key_capacity(hca_width, swa.decode_swa_width)
        scratch = self._scratch(self._scratch_shapes(n, capacity, plan=plan), "decode")
        entry_slots = None
        if self._top_k:
            entry_slots, scratch = (scratch[0], scratch[1]), scratch[2:]
        lse, partials = scratch[0], scratch[1:]
        window, extra = layer_scopes(
            swa,
            compressed,
            self.kv_format,
            self.swa_pages(),
            self.compressed_pages() if compressed is not None else None,
            n,
            local_topk=self.topk_indices_buffer,
            entry_slots=entry_slots,
        )
        if plan is not None:
            # The window lengths the plan counted: the same values as the SWA group's, from the
            # tensor the plan read, so plan and kernel cannot disagree on a token's keys.
            assert compressed is not None and compressed.window_lens is not None
            window = replace(window, lens=compressed.window_lens[:n])
        workspace = (partials[0], partials[1]) if partials else None
        args = (q[:n], window, self.attn_sink, self.scale, extra)
        self._decode_call(
            args, {"out": output[:n], "lse": lse, "workspace": workspace, "plan": plan}
        )

    def _decode_call(self, args: tuple, outputs: dict[str, Any]) -> None:
        """One sparse-decode call: through :func:`dsv4_attn.ops.sparse_attention` (validation,
        dispatch, a loud fallback) until it has run the kernel, then the kernel's entry."""
        if self._decode_kernel is not None:
            self._decode_kernel(*args, **outputs)
            return
        ops.sparse_attention(*args, **outputs, check_values=False)
        dispatch = ops.last_dispatch()
        if dispatch is not None and dispatch.backend == "cutedsl":
            from dsv4_attn.kernels import sparse_decode

            self._decode_kernel = sparse_decode.sparse_attention

    def _prefill_budget(self) -> int:
        return prefill.rows_budget(
            self.max_model_len,
            self.compressed_entries,
            self.window_size,
            self.max_num_batched_tokens,
        )

    def _forward_prefill(
        self,
        q: torch.Tensor,
        output: torch.Tensor,
        swa: DSV4SWAMetadata,
        compressed: DSV4CompressedMetadata | None,
    ) -> int:
        """The prefill requests' tokens through gather + the gathered FMHA kernel, chunk by
        chunk (:mod:`.prefill`). Returns the end of the step's real tokens."""
        assert swa.query_start_loc_cpu is not None and swa.seq_lens_cpu is not None
        assert swa.query_start_loc is not None and swa.seq_lens is not None
        plan_key = (self.compressed_entries, self.window_size, self._prefill_budget())
        chunks = swa.prefill_plans.get(plan_key)
        if chunks is None:
            chunks = swa.prefill_plans[plan_key] = prefill.plan_chunks(
                swa.query_start_loc_cpu,
                swa.seq_lens_cpu,
                swa.num_decodes,
                swa.num_prefills,
                *plan_key,
            )
        swa_pages = self.swa_pages()
        compressed_pages = self.compressed_pages() if compressed is not None else None
        vllm_caches = None
        if self.kv_format is KVFormat.FP8_DS_MLA:
            vllm_caches = (
                self.swa_cache_layer.kv_cache,
                self.kv_cache if compressed is not None else None,
            )
        topk = self.topk_indices_buffer.shape[1] if self._top_k else 0
        for chunk in chunks:
            reqs = slice(chunk.first_req, chunk.end_req)
            tokens = slice(chunk.first_token, chunk.end_token)
            query_start = swa.query_start_loc[chunk.first_req : chunk.end_req + 1]
            seq_lens = swa.seq_lens[reqs]
            C, T = chunk.end_req - chunk.first_req, chunk.end_token - chunk.first_token
            width = prefill.index_width(
                self.compressed_entries, topk, chunk.entries, self.window_size
            )
            rows_ws, indices_ws, lens_ws, lse_ws = self._scratch(
                prefill.chunk_workspace_shapes(C * chunk.rows, T, width, q.shape[1]), "prefill"
            )
            extra = None
            if compressed is not None and compressed_pages is not None:
                extra = (
                    compressed_pages,
                    compressed.block_table[reqs],
                    compressed.rows_per_block,
                    self.compress_ratio,
                )
            rows = prefill.gather_rows(
                rows_ws,
                chunk,
                self.kv_format,
                seq_lens,
                query_start[1:] - query_start[:-1],
                self.window_size,
                (swa_pages, swa.block_table[reqs], swa.block_size),
                extra,
                vllm_caches,
            )
            local_topk = None
            if self._top_k:
                assert self.topk_indices_buffer is not None
                local_topk = self.topk_indices_buffer[tokens]
            indices, lens = prefill.index_lists(
                chunk,
                query_start,
                seq_lens,
                self.window_size,
                self.compressed_entries,
                local_topk,
                (indices_ws, lens_ws),
            )
            prefill.attend(
                q[tokens], rows, indices, lens, self.attn_sink, self.scale, output[tokens], lse_ws
            )
        return int(swa.query_start_loc_cpu[swa.num_decodes + swa.num_prefills])

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
