"""Per-step attention metadata of the DSV4_NVFP4 backend, in buffers allocated once.

Every token of the step (decode or prefill, spec-decode drafts included) gets its own candidate
lists, so the attention (:mod:`dsv4_attn.ops`) treats all tokens alike.

Conventions (docs/design.md §1.2, §3.6). Tokens are the step's rows in vLLM's order
(``query_start_loc``); token ``t`` of request ``r`` sits at position ``pos = seq_len[r] -
query_len[r] + (t - query_start[r])``. A *slot* is a global row id in a paged cache,
``block_table[r][i // rows_per_block] * rows_per_block + i % rows_per_block`` for the request's
``i``-th row; -1 means none. A token is *valid* when it is a real token with a cache slot (vLLM pads
steps with tokens whose ``slot_mapping`` is -1); invalid tokens get empty lists (length 0), hence
output 0.

* SWA cache group (rows = tokens, 64 per block) — :class:`DSV4SWAMetadataBuilder`: each token's
  request and validity, its window ``max(0, pos - window + 1) .. pos`` as slots ``[T, window]`` and
  its length, and the fields of vLLM's ``DeepseekSparseSWAMetadata`` that vLLM's writers read. In
  a DSpark draft step (``causal=False``) each decode row sees its whole draft block after the
  ``window`` positions before it (:func:`block_window_slots`), in a wider buffer.
* compressed cache group (rows = compressed entries, ``256 / ratio`` per block) —
  :class:`DSV4CompressedMetadataBuilder`: the slot each token's compressed entry is written to
  (``slot_mapping``, read by vLLM's compressor), and for HCA (ratio 128) the slots of all visible
  entries ``i < (pos + 1) // ratio``. CSA (ratio 4) entries are the indexer's top-k, known only
  during the forward: :func:`layer_scopes` maps them to slots, -1 kept invalid.

How: the torch constructions below (:func:`map_tokens`, :func:`window_slots`, ...) define every
list; the builders fill their buffers with them on CPU and with one Triton kernel per group on
CUDA (:mod:`dsv4_attn.fused.step_metadata`, tested equal to them), with no host synchronisation
and no shape that depends on GPU values.

:func:`layer_scopes` assembles, per layer and step, the two :class:`~dsv4_attn.scope.KVScope` that
share one softmax with the attention sink, row-aligned with the step's query tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn.functional as F
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

from dsv4_attn.kernels.sparse_decode_schedule import DecodeSchedule
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.layer_kind import Family, compressed_of
from dsv4_attn.scope import KVScope
from dsv4_attn.vllm_glue.balanced import BalancedDecodePlanner, balanced_capable
from dsv4_attn.vllm_glue.support import padded_num_heads

__all__ = [
    "DSV4CompressedMetadata",
    "DSV4CompressedMetadataBuilder",
    "DSV4SWAMetadata",
    "DSV4SWAMetadataBuilder",
    "DSV41CompressedMetadataBuilder",
    "TokenMap",
    "block_window_slots",
    "compressed_write_slots",
    "dspark_window_width",
    "fill_block_window",
    "fill_compressed",
    "fill_entry_slots",
    "fill_window",
    "layer_scopes",
    "local_entry_slots",
    "map_tokens",
    "visible_entry_counts",
    "visible_entry_slots",
    "window_lengths",
    "window_slots",
]

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
    """int64 slots of request-local row ids ``rows [T, K]`` (-1 where ``use`` is False or the
    row's block lies outside the block table: no metadata makes a slot of another table row)."""
    inside = use & (rows >= 0) & (rows // rows_per_block < block_table.shape[1])
    rows = torch.where(inside, rows, 0)
    number = block_table[req[:, None], rows // rows_per_block].long()
    return torch.where(inside, number * rows_per_block + rows % rows_per_block, -1)


def _window_span(tokens: TokenMap, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[T]`` first position and length of each token's window ``max(0, pos - window
    + 1) .. pos`` (length 0 for invalid tokens); the Triton kernels' ``_window_span``."""
    start = (tokens.pos - (window - 1)).clamp(min=0)
    return start, torch.where(tokens.valid, tokens.pos - start + 1, 0)


def _span_slots(
    tokens: TokenMap,
    block_table: torch.Tensor,
    block_size: int,
    start: torch.Tensor,
    lens: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``int32 [T, width]`` of each token's positions ``start .. start + lens - 1`` in
    increasing order, -1 padded, and ``lens`` as int32 (``lens <= width``)."""
    offsets = torch.arange(width, device=tokens.pos.device)
    use = offsets[None, :] < lens[:, None]
    slots = _slots(block_table, tokens.req, start[:, None] + offsets, block_size, use)
    return slots.int(), lens.int()


def window_lengths(tokens: TokenMap, window: int) -> torch.Tensor:
    """int64 ``[T]``: how many positions of ``max(0, pos - window + 1) .. pos`` a token sees
    (0 for invalid tokens)."""
    return _window_span(tokens, window)[1]


def window_slots(
    tokens: TokenMap, block_table: torch.Tensor, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA slots ``int32 [T, window]`` of positions ``max(0, pos - window + 1) .. pos`` in
    increasing order, -1 padded, and their count ``int32 [T]``."""
    start, lens = _window_span(tokens, window)
    return _span_slots(tokens, block_table, block_size, start, lens, window)


def block_window_slots(
    tokens: TokenMap,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    window: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A DSpark draft block's non-causal window: every token of request ``r`` sees positions
    ``max(0, prefix - window) .. seq_len - 1`` (``prefix = seq_len - query_len``: the ``window``
    positions before its block, then the whole block, later tokens included), as slots
    ``int32 [T, width]`` in increasing order, -1 padded, and their count ``int32 [T]`` (0 for
    invalid tokens; at most ``width``). vLLM's builder gives the same lists
    (``sparse_swa.ComputeDSparkNoncausalSWAIndicesKernel``)."""
    T = tokens.pos.shape[0]
    device = tokens.pos.device
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0:
        return (
            torch.full((T, width), -1, dtype=torch.int32, device=device),
            torch.zeros(T, dtype=torch.int32, device=device),
        )
    qsl = query_start_loc[: num_reqs + 1].long()
    seq = seq_lens.long()[tokens.req]
    prefix = seq - (qsl[1:] - qsl[:-1])[tokens.req]
    start = (prefix - window).clamp(min=0)
    lens = torch.where(tokens.valid, (seq - start).clamp(min=0, max=width), 0)
    return _span_slots(tokens, block_table, block_size, start, lens, width)


def visible_entry_counts(tokens: TokenMap, compress_ratio: int) -> torch.Tensor:
    """int64 ``[T]``: how many compressed entries a token sees, ``(pos + 1) // compress_ratio``
    (the entries complete at its position; 0 for invalid tokens)."""
    return torch.where(tokens.valid, (tokens.pos + 1) // compress_ratio, 0)


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
    count = visible_entry_counts(tokens, compress_ratio).clamp(max=width)
    use = offsets[None, :] < count[:, None]
    rows = offsets[None, :].expand(tokens.pos.shape[0], width)
    return _slots(block_table, tokens.req, rows, rows_per_block, use).int(), count.int()


def local_entry_slots(
    local_entries: torch.Tensor,
    tokens: TokenMap,
    block_table: torch.Tensor,
    rows_per_block: int,
    visible_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``int32 [T, K]`` of request-local compressed entries ``local_entries [T, K]`` (the
    indexer's top-k, -1 = none; an entry ``>= visible_counts[t]``, one the token does not see,
    counts as none), and lengths ``int32 [T]``: one past the last valid entry, so every valid
    entry is counted wherever the -1 holes are (CSA)."""
    K = local_entries.shape[1]
    visible = visible_counts.to(local_entries.device)[:, None]
    use = (local_entries >= 0) & (local_entries < visible) & tokens.valid[:, None]
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


# ----------------------------------------------------------------------------------------------
# Filling persistent buffers (Triton on CUDA, the torch constructions above elsewhere)
# ----------------------------------------------------------------------------------------------


def fill_window(
    cm: CommonAttentionMetadata,
    block_size: int,
    *,
    token_req: torch.Tensor,
    valid: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
) -> None:
    """Write the SWA-group lists of ``T = swa_lens.shape[0]`` tokens into the given views."""
    T, window = swa_indices.shape
    if cm.block_table_tensor.is_cuda:
        from dsv4_attn.fused.step_metadata import fill_window_metadata

        fill_window_metadata(
            cm.query_start_loc,
            cm.seq_lens,
            cm.slot_mapping,
            cm.block_table_tensor,
            block_size,
            token_req=token_req,
            valid=valid,
            swa_indices=swa_indices,
            swa_lens=swa_lens,
        )
        return
    tokens = map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
    slots, lens = window_slots(tokens, cm.block_table_tensor, block_size, window)
    token_req.copy_(tokens.req)
    valid.copy_(tokens.valid)
    swa_indices.copy_(slots)
    swa_lens.copy_(lens)


def fill_block_window(
    cm: CommonAttentionMetadata,
    block_size: int,
    window: int,
    num_block_tokens: int,
    *,
    token_req: torch.Tensor,
    valid: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
) -> None:
    """Write the SWA-group lists of a step with DSpark draft blocks into the given views
    (``swa_indices [T, width]``, ``width >= window``): the first ``num_block_tokens`` tokens
    (the decode rows, one draft block per request) see their block's non-causal window
    (:func:`block_window_slots`), any later (prefill) token its causal window. Torch
    constructions on every device: no host sync, shapes fixed by ``T`` and ``width``."""
    T, width = swa_indices.shape
    tokens = map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
    block_slots, block_lens = block_window_slots(
        tokens, cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, block_size, window, width
    )
    slots, lens = window_slots(tokens, cm.block_table_tensor, block_size, window)
    in_block = torch.arange(T, device=swa_indices.device) < num_block_tokens
    swa_indices.copy_(
        torch.where(in_block[:, None], block_slots, F.pad(slots, (0, width - window), value=-1))
    )
    swa_lens.copy_(torch.where(in_block, block_lens, lens))
    token_req.copy_(tokens.req)
    valid.copy_(tokens.valid)


def fill_compressed(
    cm: CommonAttentionMetadata,
    rows_per_block: int,
    compress_ratio: int,
    *,
    token_req: torch.Tensor,
    valid: torch.Tensor,
    write_slots: torch.Tensor,
    staging_rows: torch.Tensor,
    visible_slots: torch.Tensor | None = None,
    visible_lens: torch.Tensor | None = None,
    window: int = 0,
    window_lens: torch.Tensor | None = None,
) -> None:
    """Write a compressed group's lists of ``T = write_slots.shape[0]`` tokens into the views:
    request, validity, compressed write slot, staging row (the token's own index where it
    completes an entry, else -1), for HCA the visible entries' slots and count (CSA: with
    ``visible_lens`` alone, the count ``(pos + 1) // ratio``), and with ``window_lens`` each
    token's length of a ``window``-token sliding window (:func:`window_lengths`)."""
    T = write_slots.shape[0]
    block_table = cm.block_table_tensor
    if block_table.is_cuda:
        from dsv4_attn.fused.step_metadata import fill_compressed_metadata

        fill_compressed_metadata(
            cm.query_start_loc,
            cm.seq_lens,
            cm.slot_mapping,
            block_table,
            rows_per_block,
            compress_ratio,
            token_req=token_req,
            valid=valid,
            write_slots=write_slots,
            staging_rows=staging_rows,
            visible_slots=visible_slots,
            visible_lens=visible_lens,
            window=window,
            window_lens=window_lens,
        )
        return
    tokens = map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
    slots = compressed_write_slots(tokens, block_table, rows_per_block, compress_ratio)
    token_req.copy_(tokens.req)
    valid.copy_(tokens.valid)
    write_slots.copy_(slots)
    staging_rows.copy_(torch.where(slots >= 0, torch.arange(T, device=slots.device), -1))
    if visible_slots is not None and visible_lens is not None:
        width = visible_slots.shape[1]
        visible, count = visible_entry_slots(
            tokens, block_table, rows_per_block, compress_ratio, width
        )
        visible_slots.copy_(visible)
        visible_lens.copy_(count)
    elif visible_lens is not None:
        visible_lens.copy_(visible_entry_counts(tokens, compress_ratio))
    if window_lens is not None:
        window_lens.copy_(window_lengths(tokens, window))


def fill_entry_slots(
    local_entries: torch.Tensor,
    token_req: torch.Tensor,
    valid: torch.Tensor,
    visible_counts: torch.Tensor,
    block_table: torch.Tensor,
    rows_per_block: int,
    *,
    slots: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Write the slots of a CSA layer's request-local entries (:func:`local_entry_slots`)."""
    if local_entries.is_cuda:
        from dsv4_attn.fused import step_metadata

        step_metadata.fill_entry_slots(
            local_entries,
            token_req,
            valid,
            visible_counts,
            block_table,
            rows_per_block,
            slots=slots,
            lens=lens,
        )
        return
    tokens = TokenMap(token_req.long(), torch.zeros_like(token_req, dtype=torch.int64), valid)
    got_slots, got_lens = local_entry_slots(
        local_entries, tokens, block_table, rows_per_block, visible_counts
    )
    slots.copy_(got_slots)
    lens.copy_(got_lens)


# ----------------------------------------------------------------------------------------------
# Metadata and builders
# ----------------------------------------------------------------------------------------------


@dataclass
class DSV4SWAMetadata(DeepseekSparseSWAMetadata):
    """vLLM's SWA metadata fields (vLLM's fp8 writer reads ``slot_mapping`` and ``block_size``)
    plus the window of every token. ``tile_sched_*`` stay None: no FlashMLA planner.

    The tensors are views of the builder's buffers (CUDA graphs replay them in place); row ``t``
    is the step's token ``t``, ``num_tokens`` rows in all.
    """

    num_tokens: int = 0
    swa_indices: torch.Tensor | None = None  # int32 [T, window] ([T, block width]: DSpark)
    swa_lens: torch.Tensor | None = None  # int32 [T]
    seq_lens_cpu: torch.Tensor | None = None  # host upper bounds of seq_lens (prefill chunking)
    # The step's prefill chunk plans by (compress ratio, window, rows budget): every layer of a
    # ratio plans the same chunks, so the first layer's host loop serves the others.
    prefill_plans: dict = field(default_factory=dict)


@dataclass
class DSV4CompressedMetadata(DeepseekV4FlashMLAMetadata):
    """vLLM's compressed-group metadata fields plus this backend's, as views of the builder's
    buffers. ``slot_mapping`` holds the compressed write slots (read by vLLM's compressor);
    ``block_size`` counts tokens, as in vLLM."""

    compress_ratio: int = 1
    # Whether a token reads the indexer's top-k entries (V4's CSA, V4.1's compressed layers),
    # else every entry it sees (V4's HCA).
    top_k: bool = False
    rows_per_block: int = 0  # compressed entries per block
    is_valid_token: torch.Tensor | None = None  # bool [T]
    staging_rows: torch.Tensor | None = None  # int64 [T] token index or -1 (NVFP4 staging)
    hca_indices: torch.Tensor | None = None  # int32 [T, W], HCA only
    hca_lens: torch.Tensor | None = None  # int32 [T], HCA only
    # int32 [T], top-k layers only: entries each token sees, (pos + 1) // ratio; the indexer's
    # picks at or past it are dropped (never read), whatever the indexer wrote.
    visible_counts: torch.Tensor | None = None
    # The balanced decode schedule (HCA, :mod:`.balanced`): the plan of the step's first
    # decode_plan.token_plan.shape[0] tokens, and the window lengths it counted (the layer's
    # kernel reads these, so plan and kernel count the same keys). None: the split launch.
    decode_plan: DecodeSchedule | None = None
    window_lens: torch.Tensor | None = None  # int32 [T]


def dspark_window_width(vllm_config: VllmConfig, window: int) -> int:
    """Width of a DSpark draft block's window lists, as vLLM pads them (``window`` plus the
    speculative tokens, rounded up to 64: ``get_dspark_swa_index_width``); 0 without DSpark."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.use_dspark():
        return 0
    from vllm.v1.attention.backends.mla.compressor_utils import get_dspark_swa_index_width

    return get_dspark_swa_index_width(window, spec.num_speculative_tokens)


def _seq_lens_cpu(cm: CommonAttentionMetadata) -> torch.Tensor:
    """Host upper bounds of the step's sequence lengths: vLLM's own (no sync) where it keeps
    them, else a copy of the device tensor."""
    if cm.seq_lens_cpu_upper_bound is not None:
        return cm.seq_lens_cpu_upper_bound
    return cm.seq_lens.cpu()


def _max_tokens(vllm_config: VllmConfig) -> int:
    return vllm_config.scheduler_config.max_num_batched_tokens


class DSV4SWAMetadataBuilder(AttentionMetadataBuilder[DSV4SWAMetadata]):
    """Builds :class:`DSV4SWAMetadata` for the SWA cache group into buffers allocated once
    (``max_num_batched_tokens`` rows).

    CUDA graphs: ``UNIFORM_BATCH``. Everything the step reads lives in those buffers or in vLLM's
    own persistent ones (``slot_mapping``, ``block_table``), and no shape depends on the batch's
    contents, so uniform decode batches replay as full graphs; mixed batches run piecewise.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: int | None = None
    # Draft steps (MTP, DSpark) recompute their lists in place from the step's device buffers
    # (update_draft_decode_metadata): a FULL draft graph records that instead of vLLM
    # rebuilding the metadata eagerly before each draft step.
    supports_draft_decode_metadata_update: ClassVar[bool] = True

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
        max_tokens = _max_tokens(vllm_config)
        self.token_req = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.valid = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.swa_indices = torch.full(
            (max_tokens, self.window_size), -1, dtype=torch.int32, device=device
        )
        self.swa_lens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        # DSpark drafts: a second, wider list buffer for their non-causal blocks (its own
        # address: FULL graphs of draft steps replay it, those of target steps the causal one).
        self.block_width = dspark_window_width(vllm_config, self.window_size)
        self.block_indices = None
        if self.block_width:
            self.block_indices = torch.full(
                (max_tokens, self.block_width), -1, dtype=torch.int32, device=device
            )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DSV4SWAMetadata:
        cm = common_attn_metadata
        T = cm.num_actual_tokens
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(cm, decode_threshold=self.decode_threshold)
        )
        token_req, valid, swa_lens = self.token_req[:T], self.valid[:T], self.swa_lens[:T]
        if not cm.causal:  # a DSpark draft step: its decode rows attend to their whole block
            if self.block_indices is None:
                raise ValueError(
                    "non-causal SWA metadata (a DSpark draft block) was asked for, but this "
                    "server has no DSpark speculation (--speculative-config method 'dspark')"
                )
            swa_indices = self.block_indices[:T]
        else:
            swa_indices = self.swa_indices[:T]
        self._fill_lists(
            cm,
            None if cm.causal else num_decode_tokens,
            token_req=token_req,
            valid=valid,
            swa_indices=swa_indices,
            swa_lens=swa_lens,
        )
        return DSV4SWAMetadata(
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            block_size=self.block_size,
            seq_lens=cm.seq_lens,
            query_start_loc=cm.query_start_loc,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            is_valid_token=valid,
            token_to_req_indices=token_req,
            decode_swa_width=swa_indices.shape[1],
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            num_decode_tokens=num_decode_tokens,
            num_prefill_tokens=num_prefill_tokens,
            max_decode_query_len=min(cm.max_query_len, self.decode_threshold),
            num_tokens=T,
            swa_indices=swa_indices,
            swa_lens=swa_lens,
            seq_lens_cpu=_seq_lens_cpu(cm) if num_prefills else None,
        )

    def update_draft_decode_metadata(self, metadata: DSV4SWAMetadata) -> None:
        """Recompute, in place, the lists of a draft decode step whose device inputs
        (``query_start_loc``, ``seq_lens``, ``slot_mapping``, ``block_table``: the model
        runner's persistent buffers, which the metadata references) changed since
        :meth:`build`: the same lists as a new build, in the same buffers, with no host sync
        (vLLM records this in FULL draft graphs). The step's sizes are the build's; a draft
        step has no prefill rows."""
        if metadata.num_decode_tokens == 0:
            return
        inputs = SimpleNamespace(
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            slot_mapping=metadata.slot_mapping,
            block_table_tensor=metadata.block_table,
        )
        blocks = self.block_indices
        in_blocks = blocks is not None and metadata.swa_indices.data_ptr() == blocks.data_ptr()
        self._fill_lists(
            inputs,
            metadata.num_decode_tokens if in_blocks else None,
            token_req=metadata.token_to_req_indices,
            valid=metadata.is_valid_token,
            swa_indices=metadata.swa_indices,
            swa_lens=metadata.swa_lens,
        )

    def _fill_lists(self, cm, block_tokens: int | None, **views: torch.Tensor) -> None:
        """The step's lists into ``views``: causal windows, or (``block_tokens``: the first
        that many rows are DSpark draft blocks) :func:`fill_block_window`'s."""
        if block_tokens is None:
            fill_window(cm, self.block_size, **views)
        else:
            fill_block_window(cm, self.block_size, self.window_size, block_tokens, **views)


class DSV4CompressedMetadataBuilder(AttentionMetadataBuilder[DSV4CompressedMetadata]):
    """Builds :class:`DSV4CompressedMetadata` for a compressed cache group (one ratio) into
    buffers allocated once.

    The HCA lists are ``[T, W]`` views of a ``[max_num_batched_tokens, ceil(max_model_len /
    ratio)]`` buffer: decode-only steps (the ones CUDA graphs capture) use the full width, so a
    replay sees every entry of any context; steps with prefills use the width their longest
    sequence needs. CUDA graphs: ``UNIFORM_BATCH``, as the SWA builder.

    HCA on Hopper with long lists: the step's decode tokens get the balanced decode schedule
    (:mod:`.balanced`), planned here once per step for every HCA layer, into the planner's
    buffers (``decode_plan``, ``window_lens``).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # The model family whose layer kinds this builder serves (the ratio's meaning).
    family: ClassVar[Family] = Family.V4

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
        entries = compressed_of(self.family, ratio) if isinstance(ratio, int) else None
        if entries is None:
            raise ValueError(
                f"a compressed cache needs the int compress ratio of a compressed layer, got "
                f"{ratio!r}"
            )
        self.compress_ratio = ratio
        self.top_k = entries.top_k
        self.rows_per_block = kv_cache_spec.num_states
        self.topk_tokens = vllm_config.model_config.hf_config.index_topk
        self.decode_threshold = max_decode_query_len(vllm_config)
        max_tokens = _max_tokens(vllm_config)
        self.token_req = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.valid = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.write_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.staging_rows = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.hca_indices = self.hca_lens = self.visible_counts = None
        self.window_size = vllm_config.model_config.hf_config.sliding_window
        self.planner: BalancedDecodePlanner | None = None
        if self.top_k:
            self.visible_counts = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        else:
            self.max_entries = -(-vllm_config.model_config.max_model_len // ratio)
            self.hca_indices = torch.full(
                (max_tokens, self.max_entries), -1, dtype=torch.int32, device=device
            )
            self.hca_lens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
            capacity = self.window_size + self.max_entries
            if balanced_capable(torch.device(device), capacity):
                heads = vllm_config.model_config.get_num_attention_heads(
                    vllm_config.parallel_config
                )
                self.planner = BalancedDecodePlanner(
                    padded_num_heads(heads),
                    (self.window_size, self.max_entries),
                    max_tokens,
                    torch.device(device),
                )

    def _hca_width(self, cm: CommonAttentionMetadata) -> int:
        if cm.max_query_len <= self.decode_threshold:
            return self.max_entries  # decode-only: may be captured, so the widest lists
        return min(self.max_entries, max(1, -(-cm.max_seq_len // self.compress_ratio)))

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DSV4CompressedMetadata:
        cm = common_attn_metadata
        T = cm.num_actual_tokens
        token_req, valid = self.token_req[:T], self.valid[:T]
        write_slots, staging_rows = self.write_slots[:T], self.staging_rows[:T]
        hca_indices = hca_lens = visible_counts = None
        if self.hca_indices is not None and self.hca_lens is not None:
            hca_indices = self.hca_indices[:T, : self._hca_width(cm)]
            hca_lens = self.hca_lens[:T]
        if self.visible_counts is not None:
            visible_counts = self.visible_counts[:T]
        _, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.decode_threshold
        )
        # The layer runs the first num_decode_tokens tokens through the decode kernel (all T
        # in a decode-only step, padding included): the plan covers exactly those.
        plan_tokens = num_decode_tokens if num_prefills else T
        window_lens = None
        if self.planner is not None and self.planner.wants(plan_tokens):
            window_lens = self.planner.window_lens[:T]
        fill_compressed(
            cm,
            self.rows_per_block,
            self.compress_ratio,
            token_req=token_req,
            valid=valid,
            write_slots=write_slots,
            staging_rows=staging_rows,
            visible_slots=hca_indices,
            visible_lens=hca_lens if hca_lens is not None else visible_counts,
            window=self.window_size,
            window_lens=window_lens,
        )
        decode_plan = None
        if window_lens is not None and hca_lens is not None and self.planner is not None:
            decode_plan = self.planner.build(window_lens[:plan_tokens], hca_lens[:plan_tokens])
        return DSV4CompressedMetadata(
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=T,
            query_start_loc=cm.query_start_loc,
            slot_mapping=write_slots,
            block_table=cm.block_table_tensor,
            req_id_per_token=token_req,
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
            compress_ratio=self.compress_ratio,
            top_k=self.top_k,
            rows_per_block=self.rows_per_block,
            is_valid_token=valid,
            staging_rows=staging_rows,
            hca_indices=hca_indices,
            hca_lens=hca_lens,
            visible_counts=visible_counts,
            decode_plan=decode_plan,
            window_lens=window_lens,
        )


class DSV41CompressedMetadataBuilder(DSV4CompressedMetadataBuilder):
    """:class:`DSV4CompressedMetadataBuilder` for DeepSeek-V4.1's compressed caches: ratios 1
    and 2, both read through the indexer's top-k."""

    family: ClassVar[Family] = Family.V41


# ----------------------------------------------------------------------------------------------
# Per-layer assembly
# ----------------------------------------------------------------------------------------------


def layer_scopes(
    swa: DSV4SWAMetadata,
    compressed: DSV4CompressedMetadata | None,
    fmt: KVFormat,
    swa_pages: torch.Tensor,
    compressed_pages: torch.Tensor | None,
    num_tokens: int,
    local_topk: torch.Tensor | None = None,
    entry_slots: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[KVScope, KVScope | None]:
    """A layer's two candidate lists for its first ``num_tokens`` query tokens: the window (SWA
    cache) and, for a compressed layer, its compressed entries; both join one softmax with the
    attention sink in :func:`dsv4_attn.ops.sparse_attention`.

    Args:
        swa, compressed: the step's metadata (``compressed`` None for a SWA-only layer).
        fmt: the caches' row format; swa_pages, compressed_pages: the layer's page views.
        local_topk: a CSA layer's ``[>= num_tokens, K]`` request-local indexer picks.
        entry_slots: ``(int32 [num_tokens, K], int32 [num_tokens])`` to write a CSA layer's
            slots into (allocated when None).
    """
    assert swa.swa_indices is not None and swa.swa_lens is not None
    n = num_tokens
    window = KVScope(swa_pages, fmt, swa.block_size, swa.swa_indices[:n], swa.swa_lens[:n])
    if compressed is None:
        return window, None
    assert compressed_pages is not None
    rows_per_block = compressed.rows_per_block
    if compressed.top_k:
        if local_topk is None:
            raise ValueError("a top-k layer needs the indexer's top-k entries (local_topk)")
        local = local_topk[:n]
        if entry_slots is None:
            entry_slots = (
                torch.empty_like(local, dtype=torch.int32),
                torch.empty(n, dtype=torch.int32, device=local.device),
            )
        slots, lens = entry_slots
        valid, visible = compressed.is_valid_token, compressed.visible_counts
        assert valid is not None and visible is not None
        token_req = compressed.req_id_per_token[:n]
        fill_entry_slots(
            local,
            token_req,
            valid[:n],
            visible[:n],
            compressed.block_table,
            rows_per_block,
            slots=slots,
            lens=lens,
        )
        return window, KVScope(compressed_pages, fmt, rows_per_block, slots, lens)
    assert compressed.hca_indices is not None and compressed.hca_lens is not None
    hca = KVScope(
        compressed_pages, fmt, rows_per_block, compressed.hca_indices[:n], compressed.hca_lens[:n]
    )
    return window, hca
