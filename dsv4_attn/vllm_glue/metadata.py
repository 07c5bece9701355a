"""Per-step attention metadata of the DSV4_NVFP4 backend, built with vectorized torch ops.

vLLM's own DeepSeek-V4 builders compute their fields with Triton kernels; these builders compute
what this backend needs with plain torch ops, on CPU or CUDA, without a host synchronisation.
Every token of the step (decode or prefill, spec-decode drafts included) gets its own candidate
lists, so the attention (:mod:`dsv4_attn.ops`) treats all tokens alike.

Conventions (DESIGN.md §2, §4). Tokens are the step's rows in vLLM's order (``query_start_loc``);
token ``t`` of request ``r`` sits at position ``pos = seq_len[r] - query_len[r] + (t -
query_start[r])``. A *slot* is a global row id in a paged cache, ``block_table[r][i //
rows_per_block] * rows_per_block + i % rows_per_block`` for the request's ``i``-th row; -1 means
none. A token is *valid* when it is a real token with a cache slot (vLLM pads steps with tokens
whose ``slot_mapping`` is -1); invalid tokens get empty lists (length 0), hence output 0.

* SWA cache group (rows = tokens, 64 per block) — :class:`DSV4SWAMetadataBuilder`: the window
  ``max(0, pos - window + 1) .. pos`` as slots ``[T, window]`` and lengths, the prefill gather
  plan, and the fields of vLLM's ``DeepseekSparseSWAMetadata`` that vLLM's own writers read.
* compressed cache group (rows = compressed entries, ``256 / ratio`` per block) —
  :class:`DSV4CompressedMetadataBuilder`: the slot each token's compressed entry is written to
  (``slot_mapping``, read by vLLM's compressor), and for HCA (ratio 128) the slots of all visible
  entries ``i < (pos + 1) // ratio``. CSA (ratio 4) entries are the indexer's top-k, known only
  during the forward: :func:`local_entry_slots` maps them to slots, -1 kept invalid.

:func:`sparse_scopes` assembles, per layer and step, the two candidate scopes that share one
softmax with the attention sink (the sink merge inputs of :func:`dsv4_attn.ops.sparse_attention`):
the window and the compressed entries, row-aligned with the step's query tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    max_decode_query_len,
)
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec

__all__ = [
    "CSA_RATIO",
    "DSV4CompressedMetadata",
    "DSV4CompressedMetadataBuilder",
    "DSV4SWAMetadata",
    "DSV4SWAMetadataBuilder",
    "SparseScopes",
    "TokenMap",
    "compressed_write_slots",
    "local_entry_slots",
    "map_tokens",
    "prefill_gather_lens",
    "sparse_scopes",
    "visible_entry_slots",
    "window_slots",
]

CSA_RATIO = 4
"""Compression ratio of the CSA layers, whose entries the indexer picks (top-k)."""


# ----------------------------------------------------------------------------------------------
# Vectorized constructions (any device, no host sync)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenMap:
    """Where each token of a step belongs."""

    req: torch.Tensor  # int64 [T] request index (clamped into range for padding tokens)
    pos: torch.Tensor  # int64 [T] position in its sequence (0 for invalid tokens)
    valid: torch.Tensor  # bool [T] a real token with a cache slot


def map_tokens(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> TokenMap:
    """Request, position and validity of the step's first ``num_tokens`` tokens.

    Args:
        query_start_loc: ``int [R + 1]`` token offsets of the requests (device).
        seq_lens: ``int [R]`` tokens per request including this step's.
        slot_mapping: ``int [>= num_tokens]`` the tokens' own cache slots, -1 for padding.
        num_tokens: rows of the step (may exceed ``query_start_loc[-1]``: padding).
    """
    device = query_start_loc.device
    t = torch.arange(num_tokens, device=device)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0:
        zeros = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        return TokenMap(zeros, zeros, torch.zeros(num_tokens, dtype=torch.bool, device=device))
    qsl = query_start_loc[: num_reqs + 1].long()
    req = torch.searchsorted(qsl[1:], t, right=True).clamp(max=num_reqs - 1)
    query_len = qsl[1:] - qsl[:-1]
    pos = seq_lens.long()[req] - query_len[req] + (t - qsl[req])
    valid = (t < qsl[num_reqs]) & (slot_mapping[:num_tokens] >= 0)
    return TokenMap(req, torch.where(valid, pos, 0), valid)


def _slots(
    block_table: torch.Tensor,
    req: torch.Tensor,
    rows: torch.Tensor,
    rows_per_block: int,
    use: torch.Tensor,
) -> torch.Tensor:
    """int64 slots of request-local row ids ``rows [T, K]`` (-1 where ``use`` is False)."""
    rows = torch.where(use, rows, 0)
    block = (rows // rows_per_block).clamp(max=block_table.shape[1] - 1)
    number = block_table[req[:, None], block].long()
    return torch.where(use, number * rows_per_block + rows % rows_per_block, -1)


def window_slots(
    tokens: TokenMap, block_table: torch.Tensor, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA slots ``int32 [T, window]`` of positions ``max(0, pos - window + 1) .. pos`` in
    increasing order, -1 padded, and their count ``int32 [T]``."""
    offsets = torch.arange(window, device=tokens.pos.device)
    start = (tokens.pos - (window - 1)).clamp(min=0)
    lens = torch.where(tokens.valid, tokens.pos - start + 1, 0)
    use = offsets[None, :] < lens[:, None]
    slots = _slots(block_table, tokens.req, start[:, None] + offsets, block_size, use)
    return slots.int(), lens.int()


def visible_entry_slots(
    tokens: TokenMap,
    block_table: torch.Tensor,
    rows_per_block: int,
    compress_ratio: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``int32 [T, width]`` of all compressed entries a token sees, ``i < (pos + 1) //
    compress_ratio`` in order, -1 padded, and their count ``int32 [T]`` (HCA)."""
    offsets = torch.arange(width, device=tokens.pos.device)
    count = torch.where(tokens.valid, (tokens.pos + 1) // compress_ratio, 0).clamp(max=width)
    use = offsets[None, :] < count[:, None]
    rows = offsets[None, :].expand(tokens.pos.shape[0], width)
    return _slots(block_table, tokens.req, rows, rows_per_block, use).int(), count.int()


def local_entry_slots(
    local_entries: torch.Tensor,
    tokens: TokenMap,
    block_table: torch.Tensor,
    rows_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``int32 [T, K]`` of request-local compressed entries ``local_entries [T, K]`` (the
    indexer's top-k, -1 = none), and lengths ``int32 [T]``: one past the last valid entry, so every
    valid entry is counted wherever the -1 holes are (CSA)."""
    K = local_entries.shape[1]
    use = (local_entries >= 0) & tokens.valid[:, None]
    slots = _slots(block_table, tokens.req, local_entries.long(), rows_per_block, use)
    order = torch.arange(1, K + 1, device=local_entries.device)
    lens = (use * order).amax(dim=1) if K else torch.zeros_like(tokens.pos)
    return slots.int(), lens.int()


def compressed_write_slots(
    tokens: TokenMap, block_table: torch.Tensor, rows_per_block: int, compress_ratio: int
) -> torch.Tensor:
    """int64 ``[T]``: the slot of the compressed entry token ``t`` completes (entry ``pos //
    ratio`` when ``(pos + 1) % ratio == 0``), else -1. Same as vLLM's compressed slot mapping."""
    use = tokens.valid & ((tokens.pos + 1) % compress_ratio == 0)
    entry = (tokens.pos // compress_ratio)[:, None]
    return _slots(block_table, tokens.req, entry, rows_per_block, use[:, None])[:, 0]


def prefill_gather_lens(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, first: int, window: int
) -> torch.Tensor:
    """int32 ``[R - first]``: tokens a prefill request ``r >= first`` gathers from its SWA cache,
    ``query_len + min(prefix_len, window - 1)`` (the window of its first query token onwards)."""
    qsl = query_start_loc.long()
    query_len = qsl[first + 1 :] - qsl[first:-1]
    prefix = seq_lens[first:].long() - query_len
    return (query_len + prefix.clamp(max=window - 1)).int()


# ----------------------------------------------------------------------------------------------
# Metadata and builders
# ----------------------------------------------------------------------------------------------


@dataclass
class DSV4SWAMetadata(DeepseekSparseSWAMetadata):
    """vLLM's SWA metadata fields (vLLM's writers read ``slot_mapping`` and ``block_size``) plus
    the per-token window of every token. ``tile_sched_*`` stay None: no FlashMLA planner."""

    positions: torch.Tensor | None = None  # int64 [T]
    swa_indices: torch.Tensor | None = None  # int32 [T, window]
    swa_lens: torch.Tensor | None = None  # int32 [T]
    window_size: int = 0


@dataclass
class DSV4CompressedMetadata(DeepseekV4FlashMLAMetadata):
    """vLLM's compressed-group metadata fields (vLLM's compressor reads ``slot_mapping``, here the
    compressed write slots) plus this backend's. ``block_size`` counts tokens, as in vLLM."""

    compress_ratio: int = 1
    rows_per_block: int = 0  # compressed entries per block
    positions: torch.Tensor | None = None  # int64 [T]
    is_valid_token: torch.Tensor | None = None  # bool [T]
    hca_indices: torch.Tensor | None = None  # int32 [T, W], HCA only
    hca_lens: torch.Tensor | None = None  # int32 [T], HCA only


class DSV4SWAMetadataBuilder(AttentionMetadataBuilder[DSV4SWAMetadata]):
    """Builds :class:`DSV4SWAMetadata` for the SWA cache group.

    CUDA graphs: ``UNIFORM_BATCH``, as vLLM's SWA builder. The fields read inside captured
    regions (``slot_mapping``, ``block_table``) are vLLM's persistent buffers; the rest is read
    by ``forward_mqa``, which runs in vLLM's eager break. Mixed-batch full graphs are not claimed.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.window_size = vllm_config.model_config.hf_config.sliding_window
        self.decode_threshold = max_decode_query_len(vllm_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DSV4SWAMetadata:
        cm = common_attn_metadata
        T = cm.num_actual_tokens
        tokens = map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
        swa_indices, swa_lens = window_slots(
            tokens, cm.block_table_tensor, self.block_size, self.window_size
        )
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(cm, decode_threshold=self.decode_threshold)
        )
        prefill: dict[str, object] = {}
        if num_prefills > 0:
            assert cm.seq_lens_cpu_upper_bound is not None
            qsl_cpu = cm.query_start_loc_cpu
            prefill = dict(
                prefill_swa_indices=swa_indices[num_decode_tokens:T, None, :],
                prefill_swa_lens=swa_lens[num_decode_tokens:T],
                prefill_seq_lens=cm.seq_lens[num_decodes:],
                prefill_seq_lens_cpu=cm.seq_lens_cpu_upper_bound[num_decodes:],
                prefill_gather_lens=prefill_gather_lens(
                    cm.seq_lens, cm.query_start_loc, num_decodes, self.window_size
                ),
                prefill_query_lens_cpu=(qsl_cpu[num_decodes + 1 :] - qsl_cpu[num_decodes:-1]).int(),
                prefill_window_size=self.window_size,
                prefill_max_model_len=self.max_model_len,
                prefill_max_num_batched_tokens=self.max_num_batched_tokens,
            )
        return DSV4SWAMetadata(
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            block_size=self.block_size,
            seq_lens=cm.seq_lens,
            query_start_loc=cm.query_start_loc,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            is_valid_token=tokens.valid,
            token_to_req_indices=tokens.req.int(),
            decode_swa_indices=swa_indices[:num_decode_tokens, None, :],
            decode_swa_lens=swa_lens[:num_decode_tokens],
            decode_swa_width=self.window_size,
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            num_decode_tokens=num_decode_tokens,
            num_prefill_tokens=num_prefill_tokens,
            max_decode_query_len=min(cm.max_query_len, self.decode_threshold),
            positions=tokens.pos,
            swa_indices=swa_indices,
            swa_lens=swa_lens,
            window_size=self.window_size,
            **prefill,  # type: ignore[arg-type]
        )


class DSV4CompressedMetadataBuilder(AttentionMetadataBuilder[DSV4CompressedMetadata]):
    """Builds :class:`DSV4CompressedMetadata` for a compressed cache group (one ratio).

    CUDA graphs: ``UNIFORM_BATCH``. ``slot_mapping`` (read by the compressor inside captured
    regions) lives in a buffer allocated once; the rest is read in the eager ``forward_mqa``.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        ratio = kv_cache_spec.tokens_per_state
        if not isinstance(ratio, int) or ratio < 2:
            raise ValueError(f"a compressed cache needs an int compress ratio >= 2, got {ratio}")
        self.compress_ratio = ratio
        self.rows_per_block = kv_cache_spec.num_states
        self.topk_tokens = vllm_config.model_config.hf_config.index_topk
        self.write_slots = torch.full(
            (vllm_config.scheduler_config.max_num_batched_tokens,),
            -1,
            dtype=torch.int64,
            device=device,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DSV4CompressedMetadata:
        cm = common_attn_metadata
        T = cm.num_actual_tokens
        tokens = map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
        block_table = cm.block_table_tensor
        self.write_slots.fill_(-1)
        write_slots = self.write_slots[:T]
        write_slots.copy_(
            compressed_write_slots(tokens, block_table, self.rows_per_block, self.compress_ratio)
        )
        hca_indices = hca_lens = None
        if self.compress_ratio != CSA_RATIO:
            width = max(1, cm.max_seq_len // self.compress_ratio)
            hca_indices, hca_lens = visible_entry_slots(
                tokens, block_table, self.rows_per_block, self.compress_ratio, width
            )
        return DSV4CompressedMetadata(
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=T,
            query_start_loc=cm.query_start_loc,
            slot_mapping=write_slots,
            block_table=block_table,
            req_id_per_token=tokens.req.int(),
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
            compress_ratio=self.compress_ratio,
            rows_per_block=self.rows_per_block,
            positions=tokens.pos,
            is_valid_token=tokens.valid,
            hca_indices=hca_indices,
            hca_lens=hca_lens,
        )


# ----------------------------------------------------------------------------------------------
# Per-layer assembly
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseScopes:
    """The candidate lists of one layer and step, rows aligned with the step's query tokens:
    the window (SWA cache) and, for compressed layers, the compressed entries. Both join one
    softmax with the attention sink in :func:`dsv4_attn.ops.sparse_attention`."""

    indices: torch.Tensor  # int32 [T, window] SWA slots
    lens: torch.Tensor  # int32 [T]
    extra_indices: torch.Tensor | None = None  # int32 [T, K] compressed slots
    extra_lens: torch.Tensor | None = None  # int32 [T]


def sparse_scopes(
    swa: DSV4SWAMetadata,
    compressed: DSV4CompressedMetadata | None,
    local_topk: torch.Tensor | None = None,
) -> SparseScopes:
    """Assemble a layer's scopes; ``compressed`` None for a SWA-only layer, ``local_topk`` the
    indexer's ``[T, K]`` request-local entries for a CSA layer."""
    assert swa.swa_indices is not None and swa.swa_lens is not None
    if compressed is None:
        return SparseScopes(swa.swa_indices, swa.swa_lens)
    if compressed.compress_ratio == CSA_RATIO:
        if local_topk is None:
            raise ValueError("a CSA layer needs the indexer's top-k entries (local_topk)")
        tokens = TokenMap(
            compressed.req_id_per_token.long(), compressed.positions, compressed.is_valid_token
        )
        slots, lens = local_entry_slots(
            local_topk, tokens, compressed.block_table, compressed.rows_per_block
        )
        return SparseScopes(swa.swa_indices, swa.swa_lens, slots, lens)
    assert compressed.hca_indices is not None and compressed.hca_lens is not None
    return SparseScopes(swa.swa_indices, swa.swa_lens, compressed.hca_indices, compressed.hca_lens)
