"""The metadata builders against a brute-force construction from positions and block tables.

Batches come as vLLM's model runner describes them (``CommonAttentionMetadata``): mixed decodes
and prefills, chunked prefills (a cached prefix), query lengths > 1 in decode position (spec
decode), requests shorter than the window, positions on block boundaries, padding rows.
"""

from __future__ import annotations

import pytest
import torch

from tests import vllm_glue_testing as vt

pytest.importorskip("vllm")

from dsv4_attn.vllm_glue import kv_spec
from dsv4_attn.vllm_glue.metadata import (
    DSV4CompressedMetadataBuilder,
    DSV4SWAMetadataBuilder,
    sparse_scopes,
)


@pytest.fixture(scope="module")
def config():
    return vt.engine_config()


def swa_builder(config) -> DSV4SWAMetadataBuilder:
    spec = kv_spec.swa_cache_spec(vt.SWA_BLOCK, vt.WINDOW)
    return DSV4SWAMetadataBuilder(spec, ["l.swa_cache"], config, torch.device("cpu"))


def compressed_builder(config, ratio: int) -> DSV4CompressedMetadataBuilder:
    spec = kv_spec.compressed_cache_spec(vt.CACHE_BLOCK, ratio)
    return DSV4CompressedMetadataBuilder(spec, ["l"], config, torch.device("cpu"))


# ----------------------------------------------------------------------------------------------
# Brute force
# ----------------------------------------------------------------------------------------------


def brute_split(batch: vt.Batch, threshold: int) -> int:
    """Number of decode requests, as vLLM splits a batch ordered decodes first."""
    if max(batch.query_lens) <= threshold:
        return len(batch.query_lens)
    return next(r for r, q in enumerate(batch.query_lens) if q > threshold)


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------

EDGE_CASES = {
    # (seq_lens, query_lens): requests decodes first
    "decode_only": ([1, 64, 65, 128, 129, 1000], [1] * 6),
    "block_boundaries": ([64, 128, 256, 257, 512], [1, 1, 64, 2, 129]),
    "shorter_than_window": ([3, 40, 127], [1, 40, 90]),
    "chunked_prefill": ([1500, 900], [300, 200]),
    "spec_decode_lengths": ([130, 300, 1024], [3, 4, 2]),
    "one_long_prefill": ([1100], [1100]),
}


def batches():
    gen = torch.Generator().manual_seed(20261122)
    for name, (seq, q) in EDGE_CASES.items():
        yield pytest.param(vt.make_batch(gen, seq, q, padding=2), id=name)
    for i in range(6):
        yield pytest.param(vt.random_batch(gen), id=f"random{i}")


BATCHES = list(batches())


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", BATCHES)
def test_swa_metadata_matches_brute_force(config, batch):
    md = swa_builder(config).build(0, batch.swa_cm)
    rows, lens = vt.brute_window(batch)
    assert md.swa_indices.dtype == torch.int32 and md.swa_lens.dtype == torch.int32
    assert md.swa_indices.tolist() == rows
    assert md.swa_lens.tolist() == lens
    real = len(batch.positions())
    assert md.is_valid_token.tolist() == [True] * real + [False] * (batch.num_tokens - real)
    assert md.positions[:real].tolist() == [p for _, p in batch.positions()]
    assert md.positions[:real].tolist() == batch.swa_cm.positions[:real].tolist()
    assert md.token_to_req_indices[:real].tolist() == [r for r, _ in batch.positions()]
    assert md.slot_mapping is batch.swa_cm.slot_mapping and md.block_size == vt.SWA_BLOCK

    num_decodes = brute_split(batch, threshold=1)
    decode_tokens = sum(batch.query_lens[:num_decodes])
    if num_decodes == len(batch.seq_lens):
        decode_tokens = batch.num_tokens  # vLLM counts padding rows with the decodes
    assert (md.num_decodes, md.num_prefills) == (num_decodes, len(batch.seq_lens) - num_decodes)
    assert md.num_decode_tokens == decode_tokens
    assert md.decode_swa_indices[:, 0].tolist() == rows[:decode_tokens]
    assert md.decode_swa_lens.tolist() == lens[:decode_tokens]
    assert md.num_prefill_tokens == batch.num_tokens - decode_tokens
    assert md.max_decode_query_len == min(max(batch.query_lens), 1)
    assert all(s is None for s in (md.tile_sched_swaonly, md.tile_sched_c4a, md.tile_sched_c128a))


@pytest.mark.parametrize("batch", BATCHES)
def test_prefill_gather_plan_matches_brute_force(config, batch):
    md = swa_builder(config).build(0, batch.swa_cm)
    first = brute_split(batch, threshold=1)
    if first == len(batch.seq_lens):
        assert md.num_prefills == 0 and md.prefill_gather_lens is None
        return
    seq, q = batch.seq_lens[first:], batch.query_lens[first:]
    gather = [qq + min(s - qq, vt.WINDOW - 1) for s, qq in zip(seq, q, strict=True)]
    assert md.prefill_gather_lens.tolist() == gather
    assert md.prefill_seq_lens.tolist() == seq
    assert md.prefill_seq_lens_cpu.tolist() == seq
    assert md.prefill_query_lens_cpu.tolist() == q
    rows, lens = vt.brute_window(batch)
    start = sum(batch.query_lens[:first])
    assert md.prefill_swa_indices[:, 0].tolist() == rows[start:]
    assert md.prefill_swa_lens.tolist() == lens[start:]
    # vLLM's chunk planner runs on these fields (CPU only) and covers every prefill request.
    plan = md.get_prefill_chunk_plan(compress_ratio=4, prefill_chunk_size=4)
    starts, ends = [c[0] for c in plan], [c[1] for c in plan]
    assert starts == [0, *ends[:-1]] and ends[-1] == len(seq)


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("batch", BATCHES)
def test_compressed_write_slots_match_brute_force(config, batch, ratio):
    builder = compressed_builder(config, ratio)
    md = builder.build(0, batch.cache_cm)
    assert md.slot_mapping.tolist() == vt.brute_write_slots(batch, ratio)
    # vLLM's compressor reads it inside captured graphs: one buffer, every step.
    assert md.slot_mapping.data_ptr() == builder.write_slots.data_ptr()
    assert (md.compress_ratio, md.rows_per_block, md.block_size) == (ratio, 256 // ratio, 256)
    real = len(batch.positions())
    assert md.req_id_per_token[:real].tolist() == [r for r, _ in batch.positions()]
    assert md.positions[:real].tolist() == [p for _, p in batch.positions()]
    assert md.is_valid_token.tolist() == [True] * real + [False] * (batch.num_tokens - real)
    assert md.block_table is batch.cache_cm.block_table_tensor
    assert (md.num_reqs, md.num_actual_tokens) == (len(batch.seq_lens), batch.num_tokens)
    assert (md.hca_indices is None) == (ratio == 4)


@pytest.mark.parametrize("batch", BATCHES)
def test_hca_visible_entries_match_brute_force(config, batch):
    md = compressed_builder(config, 128).build(0, batch.cache_cm)
    width = max(1, max(batch.seq_lens) // 128)
    rows, lens = vt.brute_visible(batch, 128, width)
    assert md.hca_indices.tolist() == rows
    assert md.hca_lens.tolist() == lens


@pytest.mark.parametrize("batch", BATCHES)
def test_scopes_match_brute_force(config, batch):
    """The per-layer inputs of the one softmax + sink: window and compressed scopes, per token."""
    gen = torch.Generator().manual_seed(len(batch.positions()))
    swa = swa_builder(config).build(0, batch.swa_cm)
    window_rows, window_lens = vt.brute_window(batch)

    scopes = sparse_scopes(swa, None)
    assert scopes.indices.tolist() == window_rows and scopes.extra_indices is None

    csa = compressed_builder(config, 4).build(0, batch.cache_cm)
    local = vt.random_local_topk(gen, batch, vt.INDEX_TOPK)
    scopes = sparse_scopes(swa, csa, local)
    rows, lens = vt.brute_local(batch, local)
    assert scopes.indices.tolist() == window_rows and scopes.lens.tolist() == window_lens
    assert scopes.extra_indices.tolist() == rows
    assert scopes.extra_lens.tolist() == lens

    hca = compressed_builder(config, 128).build(0, batch.cache_cm)
    scopes = sparse_scopes(swa, hca)
    rows, lens = vt.brute_visible(batch, 128, max(1, max(batch.seq_lens) // 128))
    assert scopes.extra_indices.tolist() == rows and scopes.extra_lens.tolist() == lens


def test_csa_scope_needs_the_indexer_picks(config):
    batch = vt.make_batch(torch.Generator().manual_seed(1), [10], [1])
    swa = swa_builder(config).build(0, batch.swa_cm)
    csa = compressed_builder(config, 4).build(0, batch.cache_cm)
    with pytest.raises(ValueError, match="top-k"):
        sparse_scopes(swa, csa, None)


def test_builders_declare_uniform_batch_cudagraphs(config):
    from vllm.v1.attention.backend import AttentionCGSupport

    spec = kv_spec.swa_cache_spec(vt.SWA_BLOCK, vt.WINDOW)
    for cls in (DSV4SWAMetadataBuilder, DSV4CompressedMetadataBuilder):
        assert cls.get_cudagraph_support(config, spec) == AttentionCGSupport.UNIFORM_BATCH
