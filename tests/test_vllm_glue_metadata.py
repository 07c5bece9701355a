"""The metadata builders against a brute-force construction from positions and block tables.

Batches come as vLLM's model runner describes them (``CommonAttentionMetadata``): mixed decodes
and prefills, chunked prefills (a cached prefix), query lengths > 1 in decode position (spec
decode), requests shorter than the window, positions on block boundaries, padding rows.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests import vllm_glue_testing as vt

pytest.importorskip("vllm")

from dsv4_attn.kernels import sparse_decode_schedule as schedule
from dsv4_attn.kernels.sparse_decode_config import BLOCK_N
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.vllm_glue import balanced, kv_spec, metadata
from dsv4_attn.vllm_glue.metadata import (
    DSV4CompressedMetadataBuilder,
    DSV4SWAMetadataBuilder,
    DSV41CompressedMetadataBuilder,
    layer_scopes,
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
    assert md.num_tokens == batch.num_tokens
    assert md.swa_indices.tolist() == rows
    assert md.swa_lens.tolist() == lens
    real = len(batch.positions())
    assert md.is_valid_token.tolist() == [True] * real + [False] * (batch.num_tokens - real)
    assert md.token_to_req_indices[:real].tolist() == [r for r, _ in batch.positions()]
    assert md.slot_mapping is batch.swa_cm.slot_mapping and md.block_size == vt.SWA_BLOCK

    num_decodes = brute_split(batch, threshold=1)
    decode_tokens = sum(batch.query_lens[:num_decodes])
    if num_decodes == len(batch.seq_lens):
        decode_tokens = batch.num_tokens  # vLLM counts padding rows with the decodes
    assert (md.num_decodes, md.num_prefills) == (num_decodes, len(batch.seq_lens) - num_decodes)
    assert md.num_decode_tokens == decode_tokens
    assert md.num_prefill_tokens == batch.num_tokens - decode_tokens
    assert md.max_decode_query_len == min(max(batch.query_lens), 1)
    assert all(s is None for s in (md.tile_sched_swaonly, md.tile_sched_c4a, md.tile_sched_c128a))


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("batch", BATCHES)
def test_compressed_write_slots_match_brute_force(config, batch, ratio):
    builder = compressed_builder(config, ratio)
    md = builder.build(0, batch.cache_cm)
    write_slots = vt.brute_write_slots(batch, ratio)
    assert md.slot_mapping.tolist() == write_slots
    # The NVFP4 compressor stages the row of token t in staging row t.
    assert md.staging_rows.tolist() == [t if s >= 0 else -1 for t, s in enumerate(write_slots)]
    assert (md.compress_ratio, md.rows_per_block, md.block_size) == (ratio, 256 // ratio, 256)
    real = len(batch.positions())
    assert md.req_id_per_token[:real].tolist() == [r for r, _ in batch.positions()]
    assert md.is_valid_token.tolist() == [True] * real + [False] * (batch.num_tokens - real)
    assert md.block_table is batch.cache_cm.block_table_tensor
    assert (md.num_reqs, md.num_actual_tokens) == (len(batch.seq_lens), batch.num_tokens)
    assert (md.hca_indices is None) == (ratio == 4)


@pytest.mark.parametrize("batch", BATCHES)
def test_hca_visible_entries_match_brute_force(config, batch):
    builder = compressed_builder(config, 128)
    md = builder.build(0, batch.cache_cm)
    width = md.hca_indices.shape[1]
    if max(batch.query_lens) <= 1:  # decode-only: the full width, as a CUDA graph replays it
        assert width == -(-vt.MAX_MODEL_LEN // 128)
    else:
        assert width == max(1, -(-max(batch.seq_lens) // 128))
    rows, lens = vt.brute_visible(batch, 128, width)
    assert md.hca_indices.tolist() == rows
    assert md.hca_lens.tolist() == lens


def test_builders_fill_buffers_allocated_once(config):
    """Every tensor the forward reads is a view of a buffer the builder allocated once, at the
    same address every step (what a CUDA-graph replay reads), refilled for the new batch."""
    gen = torch.Generator().manual_seed(7)
    swa, hca = swa_builder(config), compressed_builder(config, 128)
    first, second = (vt.make_batch(gen, [300, 5, 40], [1, 1, 1]) for _ in range(2))
    md = [(swa.build(0, b.swa_cm), hca.build(0, b.cache_cm)) for b in (first, second)]
    (swa1, hca1), (swa2, hca2) = md
    for name in ("swa_indices", "swa_lens", "token_to_req_indices", "is_valid_token"):
        assert getattr(swa1, name).data_ptr() == getattr(swa2, name).data_ptr(), name
    for name in ("slot_mapping", "staging_rows", "hca_indices", "hca_lens", "req_id_per_token"):
        assert getattr(hca1, name).data_ptr() == getattr(hca2, name).data_ptr(), name
    assert hca1.hca_indices.shape == hca2.hca_indices.shape  # decode-only: one fixed width
    assert swa2.swa_indices.tolist() == vt.brute_window(second)[0]
    assert hca2.hca_indices.tolist() == vt.brute_visible(second, 128, hca2.hca_indices.shape[1])[0]


def planned_builder(config, parts: int) -> DSV4CompressedMetadataBuilder:
    """An HCA builder with a balanced planner of ``parts`` parts on the CPU."""
    builder = compressed_builder(config, 128)
    vt.attach_planner(builder, vt.NUM_HEADS, parts)
    return builder


@pytest.mark.parametrize("batch", BATCHES)
def test_hca_builder_plans_the_decode_tokens_balanced(config, batch, monkeypatch):
    """With the balanced schedule, the HCA builder writes every token's window length (the
    SWA group's, from its own group's metadata) and the plan of exactly the tokens the layer
    decodes (all in a decode-only step, padding included; the decodes of a mixed step), counted
    from those window lengths and the visible entries."""
    monkeypatch.setenv(balanced.SCHEDULE_ENV, "balanced")
    builder = planned_builder(config, parts=8)
    md = builder.build(0, batch.cache_cm)
    num_decodes = brute_split(batch, threshold=1)
    plan_tokens = sum(batch.query_lens[:num_decodes])
    if num_decodes == len(batch.seq_lens):
        plan_tokens = batch.num_tokens
    if plan_tokens == 0:  # prefills only: nothing for the decode kernel
        assert md.decode_plan is None and md.window_lens is None
        return
    _, window_lens = vt.brute_window(batch)
    assert md.window_lens.tolist() == window_lens
    counts = torch.tensor(window_lens[:plan_tokens]) + md.hca_lens[:plan_tokens]
    capacity_tiles = -(-(vt.WINDOW + builder.max_entries) // BLOCK_N)
    want = schedule.build_schedule(counts, 8, schedule.min_share_tiles(capacity_tiles))
    assert torch.equal(md.decode_plan.part_plan, want.part_plan)
    assert torch.equal(md.decode_plan.token_plan, want.token_plan)
    assert md.decode_plan.token_plan.data_ptr() == builder.planner.token_plan.data_ptr()
    assert md.window_lens.data_ptr() == builder.planner.window_lens.data_ptr()


def test_hca_builder_plans_nothing_when_the_split_launch_is_chosen(config, monkeypatch):
    monkeypatch.setenv(balanced.SCHEDULE_ENV, "auto")
    builder = planned_builder(config, parts=8)  # tiny lists: auto keeps the split launch
    batch = vt.make_batch(torch.Generator().manual_seed(2), [300, 5, 40], [1, 1, 1])
    md = builder.build(0, batch.cache_cm)
    assert md.decode_plan is None and md.window_lens is None


@pytest.mark.parametrize("batch", BATCHES)
def test_scopes_match_brute_force(config, batch):
    """The per-layer inputs of the one softmax + sink: window and compressed scopes, per token."""
    gen = torch.Generator().manual_seed(len(batch.positions()))
    swa = swa_builder(config).build(0, batch.swa_cm)
    window_rows, window_lens = vt.brute_window(batch)
    T = batch.num_tokens
    pages = torch.zeros(1, 1, dtype=torch.uint8)  # layer_scopes only carries the pages along

    window, extra = layer_scopes(swa, None, KVFormat.NVFP4, pages, None, T)
    assert window.indices.tolist() == window_rows and extra is None
    assert window.lens.tolist() == window_lens and window.block_size == vt.SWA_BLOCK

    csa = compressed_builder(config, 4).build(0, batch.cache_cm)
    local = vt.random_local_topk(gen, batch, vt.INDEX_TOPK)
    window, extra = layer_scopes(swa, csa, KVFormat.NVFP4, pages, pages, T, local_topk=local)
    rows, lens = vt.brute_local(batch, local)
    assert window.indices.tolist() == window_rows and window.lens.tolist() == window_lens
    assert extra.indices.tolist() == rows and extra.lens.tolist() == lens
    assert extra.block_size == 256 // 4 and extra.fmt is KVFormat.NVFP4

    hca = compressed_builder(config, 128).build(0, batch.cache_cm)
    window, extra = layer_scopes(swa, hca, KVFormat.NVFP4, pages, pages, T)
    rows, lens = vt.brute_visible(batch, 128, hca.hca_indices.shape[1])
    assert extra.indices.tolist() == rows and extra.lens.tolist() == lens


@pytest.mark.parametrize("batch", BATCHES[:8])
def test_csa_picks_the_token_does_not_see_are_never_read(config, batch):
    """Indexer picks at or past the token's visible entries ``(pos + 1) // 4`` (a future entry,
    or garbage past the block table) are dropped as -1 holes, as the prefill path drops them:
    the scope equals the one of the picks without them."""
    gen = torch.Generator().manual_seed(5 + len(batch.positions()))
    swa = swa_builder(config).build(0, batch.swa_cm)
    csa = compressed_builder(config, 4).build(0, batch.cache_cm)
    local = vt.random_local_topk(gen, batch, vt.INDEX_TOPK)
    visible = torch.zeros(batch.num_tokens, 1, dtype=torch.int32)
    for t, (_, pos) in enumerate(batch.positions()):
        visible[t] = (pos + 1) // 4
    bad = torch.randint(0, 3, local.shape, generator=gen, dtype=torch.int32)
    bad = torch.where(bad == 2, torch.full_like(bad, 1 << 24), visible + bad)  # at/after it
    poisoned = torch.where(torch.rand(local.shape, generator=gen) < 0.2, bad, local)
    assert bool((poisoned != local).any())
    pages = torch.zeros(1, 1, dtype=torch.uint8)
    T = batch.num_tokens
    _, extra = layer_scopes(swa, csa, KVFormat.NVFP4, pages, pages, T, local_topk=poisoned)
    rows, lens = vt.brute_local(batch, torch.where(poisoned >= visible, -1, poisoned))
    assert extra.indices.tolist() == rows and extra.lens.tolist() == lens


def _v41_picks(gen: torch.Generator, batch: vt.Batch, ratio: int, k: int) -> torch.Tensor:
    """V4.1's indexer output at decode: per token ``min((pos + 1) // ratio, k)`` distinct
    entries it sees, packed first, -1 after (padding rows: garbage)."""
    out = torch.randint(-1, 50, (batch.num_tokens, k), generator=gen, dtype=torch.int32)
    for t, (_, pos) in enumerate(batch.positions()):
        visible = (pos + 1) // ratio
        count = min(visible, k)
        out[t] = -1
        out[t, :count] = torch.randperm(visible, generator=gen)[:count].int()
    return out


def test_v41_top_k_scopes_read_the_slots_vllms_v41_decode_reads():
    """A V4.1 layer of ratio 1 or 2 (the V4.1 builder): each token's compressed scope holds,
    as a multiset, the slots vLLM's own V4.1 decode path reads for the same picks and block
    table (``compute_global_topk_indices_and_lens``, Triton, in its CPU interpreter in a child
    process)."""
    code = "from tests.test_vllm_glue_metadata import check_v41_global_topk as c; c()"
    assert "V4.1 batches compared: 8" in vt.run_in_triton_interpreter(code)


def check_v41_global_topk() -> None:
    from vllm.models.deepseek_v41.common.ops import cache_utils

    kernel = vt.vllm_triton_kernel_fn(cache_utils._compute_global_topk_indices_and_lens_kernel)
    config = vt.engine_config()
    compared = 0
    for ratio, param in itertools.product((1, 2), BATCHES[:4]):
        (batch,) = param.values
        gen = torch.Generator().manual_seed(ratio * 100 + len(batch.positions()))
        swa = swa_builder(config).build(0, batch.swa_cm)
        spec = kv_spec.compressed_cache_spec(vt.CACHE_BLOCK, ratio)
        builder = DSV41CompressedMetadataBuilder(spec, ["l"], config, torch.device("cpu"))
        md = builder.build(0, batch.cache_cm)
        assert md.top_k and md.rows_per_block == vt.CACHE_BLOCK // ratio
        picks = _v41_picks(gen, batch, ratio, vt.INDEX_TOPK)
        pages = torch.zeros(1, 1, dtype=torch.uint8)
        T = batch.num_tokens
        _, extra = layer_scopes(swa, md, KVFormat.FP8_DS_MLA, pages, pages, T, local_topk=picks)
        real = len(batch.positions())
        token_req = torch.tensor([r for r, _ in batch.positions()] + [0] * (T - real))
        valid = torch.arange(T) < real
        theirs = torch.full_like(picks, 7)
        their_lens = torch.full((T,), 7, dtype=torch.int32)
        table = batch.cache_block_table
        kernel[(T,)](
            theirs,
            theirs.stride(0),
            their_lens,
            picks,
            picks.stride(0),
            picks.shape[1],
            token_req.int(),
            table,
            table.stride(0),
            vt.CACHE_BLOCK // ratio,
            valid,
            TRITON_BLOCK_SIZE=1024,
        )
        for t in range(T):
            ours = sorted(int(x) for x in extra.indices[t, : int(extra.lens[t])] if x >= 0)
            vllm = sorted(int(x) for x in theirs[t, : int(their_lens[t])] if x >= 0)
            assert ours == vllm, (ratio, t, ours, vllm)
        compared += 1
    print(f"V4.1 batches compared: {compared}")


def test_rows_past_the_block_table_get_no_slot(config):
    """A request whose positions run past its block table row (metadata vLLM should never
    send): those window rows are holes, never a slot of another block table entry."""
    batch = vt.make_batch(torch.Generator().manual_seed(3), [300], [1])
    pages_needed = -(-300 // vt.SWA_BLOCK)
    cm = batch.swa_cm
    narrow = cm.block_table_tensor[:, : pages_needed - 1].clone()  # the last page missing
    cm = type(cm)(**{**cm.__dict__, "block_table_tensor": narrow})
    swa = swa_builder(config).build(0, cm)
    window_rows, window_lens = vt.brute_window(batch)
    got = swa.swa_indices[0].tolist()
    cut = (pages_needed - 1) * vt.SWA_BLOCK  # first position without a page
    first = 300 - window_lens[0]
    want = [row if first + i < cut else -1 for i, row in enumerate(window_rows[0])]
    assert got == want and -1 in got and swa.swa_lens[0] == window_lens[0]


def test_padding_rows_with_stale_slots_stay_invalid(config):
    """CUDA-graph padding: rows past ``query_start_loc[num_reqs]`` are padding whatever
    ``slot_mapping`` holds there (vLLM's persistent buffer may keep an earlier step's slots):
    invalid, with empty lists and no compressed write, the first padding row included."""
    gen = torch.Generator().manual_seed(11)
    batch = vt.make_batch(gen, [300, 5, 40], [1, 1, 1], padding=3)
    real, pad = len(batch.positions()), 3

    def stale(cm):
        slots = cm.slot_mapping.clone()
        slots[real:] = slots[:pad]  # earlier real tokens' slots, all >= 0
        assert bool((slots[real:] >= 0).all())
        return dataclasses.replace(cm, slot_mapping=slots)

    validity = [True] * real + [False] * pad
    swa = swa_builder(config).build(0, stale(batch.swa_cm))
    rows, lens = vt.brute_window(batch)
    assert swa.is_valid_token.tolist() == validity
    assert swa.swa_indices.tolist() == rows and swa.swa_lens.tolist() == lens
    for ratio in (4, 128):
        md = compressed_builder(config, ratio).build(0, stale(batch.cache_cm))
        write_slots = vt.brute_write_slots(batch, ratio)
        assert md.is_valid_token.tolist() == validity
        assert md.slot_mapping.tolist() == write_slots
        assert md.staging_rows.tolist() == [t if s >= 0 else -1 for t, s in enumerate(write_slots)]
        if ratio == 128:
            rows, lens = vt.brute_visible(batch, 128, md.hca_indices.shape[1])
            assert md.hca_indices.tolist() == rows and md.hca_lens.tolist() == lens


def test_hca_counts_never_exceed_the_list_width():
    """HCA lists narrower than the entries a token sees: the first ``width`` entries' slots and
    the count ``min((pos + 1) // ratio, width)``, never a length past the list (the Triton
    kernel's rule too)."""
    ratio, per_block, width = 128, vt.CACHE_BLOCK // 128, 3
    batch = vt.make_batch(torch.Generator().manual_seed(12), [1000, 700, 129, 300], [1, 2, 1, 40])
    T = batch.num_tokens
    token_req = torch.zeros(T, dtype=torch.int32)
    valid = torch.zeros(T, dtype=torch.bool)
    write_slots = torch.full((T,), 7, dtype=torch.int64)
    staging_rows = torch.full((T,), 7, dtype=torch.int64)
    visible_slots = torch.full((T, width), 7, dtype=torch.int32)
    visible_lens = torch.full((T,), 7, dtype=torch.int32)
    metadata.fill_compressed(
        batch.cache_cm,
        per_block,
        ratio,
        token_req=token_req,
        valid=valid,
        write_slots=write_slots,
        staging_rows=staging_rows,
        visible_slots=visible_slots,
        visible_lens=visible_lens,
    )
    want_rows, want_lens = vt.brute_visible(batch, ratio, width)
    assert max((pos + 1) // ratio for _, pos in batch.positions()) > width  # the case at hand
    assert visible_slots.tolist() == want_rows
    assert visible_lens.tolist() == want_lens


@pytest.mark.parametrize("ratio", [4, 128])
def test_a_token_writing_slot_zero_is_staged(config, ratio):
    """Slot 0 (block 0's first entry) is a slot like any other: the token completing it writes
    there and is staged in its own row."""
    seq_lens, query_lens = [50, 200], [1, 200]
    swa_bt = torch.tensor([[6, 7, 8, 9], [10, 11, 12, 13]])
    cache_bt = torch.tensor([[5], [0]])  # the prefill's entries live in block 0
    batch = vt.batch_from_tables(seq_lens, query_lens, swa_bt, cache_bt, padding=2)
    md = compressed_builder(config, ratio).build(0, batch.cache_cm)
    write_slots = vt.brute_write_slots(batch, ratio)
    assert 0 in write_slots  # token of position ratio - 1 of request 1 completes entry 0
    assert md.slot_mapping.tolist() == write_slots
    assert md.staging_rows.tolist() == [t if s >= 0 else -1 for t, s in enumerate(write_slots)]


def test_csa_scope_needs_the_indexer_picks(config):
    batch = vt.make_batch(torch.Generator().manual_seed(1), [10], [1])
    swa = swa_builder(config).build(0, batch.swa_cm)
    csa = compressed_builder(config, 4).build(0, batch.cache_cm)
    pages = torch.zeros(1, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="top-k"):
        layer_scopes(swa, csa, KVFormat.NVFP4, pages, pages, batch.num_tokens)


def test_builders_declare_uniform_batch_cudagraphs(config):
    from vllm.v1.attention.backend import AttentionCGSupport

    spec = kv_spec.swa_cache_spec(vt.SWA_BLOCK, vt.WINDOW)
    for cls in (DSV4SWAMetadataBuilder, DSV4CompressedMetadataBuilder):
        assert cls.get_cudagraph_support(config, spec) == AttentionCGSupport.UNIFORM_BATCH


# ----------------------------------------------------------------------------------------------
# DSpark draft blocks (non-causal windows)
# ----------------------------------------------------------------------------------------------

BLOCK_WIDTH = 192  # vLLM's width for a 128-token window and 3 or 4 draft tokens: cdiv(132, 64) * 64
DRAFT_BLOCKS = {
    # (seq_lens, query_lens): draft blocks of 4 tokens (decodes), then maybe a prefill
    "blocks": ([4, 70, 131, 132, 133, 900], [4] * 6),
    "block_then_prefill": ([300, 9, 700], [4, 4, 200]),
    "short_blocks": ([1, 2, 200], [1, 2, 3]),
}


def brute_block_window(batch: vt.Batch, width: int, block_rows: int):
    """Rows of a draft step: the first ``block_rows`` rows see ``max(0, prefix - window) ..
    seq - 1`` of their request (``prefix = seq - query``), later rows their causal window."""
    causal_rows, causal_lens = vt.brute_window(batch)
    rows, lens = [], []
    token_req = [r for r, _ in batch.positions()]
    for t, (row, n) in enumerate(zip(causal_rows, causal_lens, strict=True)):
        if t >= block_rows or t >= len(token_req):
            rows.append(vt.padded([s for s in row if s >= 0], width))
            lens.append(n)
            continue
        r = token_req[t]
        seq, q = batch.seq_lens[r], batch.query_lens[r]
        span = range(max(0, seq - q - vt.WINDOW), seq)
        rows.append(
            vt.padded([vt.slot(batch.swa_block_table, r, p, vt.SWA_BLOCK) for p in span], width)
        )
        lens.append(len(span))
    return rows, lens


def block_builder(config, monkeypatch, draft_tokens: int = 4) -> DSV4SWAMetadataBuilder:
    """The SWA builder of a server speculating with DSpark (``draft_tokens`` per block)."""
    monkeypatch.setattr(metadata, "dspark_window_width", lambda cfg, window: BLOCK_WIDTH)
    builder = swa_builder(config)
    builder.decode_threshold = draft_tokens  # vLLM's split: a block is a decode
    return builder


def test_dspark_window_width_is_vllms():
    from types import SimpleNamespace

    def config(method, tokens):
        spec = SimpleNamespace(use_dspark=lambda: method == "dspark", num_speculative_tokens=tokens)
        return SimpleNamespace(speculative_config=spec)

    assert metadata.dspark_window_width(config("dspark", 4), 128) == 192
    assert metadata.dspark_window_width(config("dspark", 64), 128) == 192
    assert metadata.dspark_window_width(config("dspark", 65), 128) == 256
    assert metadata.dspark_window_width(config("mtp", 4), 128) == 0
    assert metadata.dspark_window_width(SimpleNamespace(speculative_config=None), 128) == 0


@pytest.mark.parametrize("name", list(DRAFT_BLOCKS))
def test_draft_blocks_see_their_whole_block_after_the_window(config, monkeypatch, name):
    seq_lens, query_lens = DRAFT_BLOCKS[name]
    batch = vt.make_batch(torch.Generator().manual_seed(len(name)), seq_lens, query_lens, padding=3)
    builder = block_builder(config, monkeypatch)
    causal_before = builder.swa_indices.clone()
    md = builder.build(0, dataclasses.replace(batch.swa_cm, causal=False))
    rows, lens = brute_block_window(batch, BLOCK_WIDTH, md.num_decode_tokens)
    assert md.swa_indices.shape == (batch.num_tokens, BLOCK_WIDTH)
    assert md.swa_indices.data_ptr() == builder.block_indices.data_ptr()
    assert md.decode_swa_width == BLOCK_WIDTH
    assert md.swa_indices.tolist() == rows and md.swa_lens.tolist() == lens
    assert torch.equal(builder.swa_indices, causal_before)  # the causal buffer is not touched
    causal = builder.build(0, batch.swa_cm)  # a target step after it: causal, own buffer
    assert causal.swa_indices.shape[1] == vt.WINDOW
    assert causal.swa_indices.tolist() == vt.brute_window(batch)[0]


def test_block_lists_equal_vllms_builder_kernel():
    """vLLM's own non-causal kernel (Triton, run in its CPU interpreter in a child process:
    TRITON_INTERPRET must be set before Triton is imported) on the same batches."""
    pytest.importorskip("triton")
    code = "from tests.test_vllm_glue_metadata import check_vllm_block_kernel as c; c()"
    assert "blocks compared: 3" in vt.run_in_triton_interpreter(code)


def check_vllm_block_kernel() -> None:
    from vllm.v1.attention.backends.mla import sparse_swa

    kernel = vt.vllm_triton_kernel(sparse_swa.ComputeDSparkNoncausalSWAIndicesKernel)

    for name, (seq_lens, query_lens) in DRAFT_BLOCKS.items():
        gen = torch.Generator().manual_seed(len(name))
        batch = vt.make_batch(gen, seq_lens, query_lens, padding=3)
        cm = batch.swa_cm
        T = batch.num_tokens
        tokens = metadata.map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
        ours, our_lens = metadata.block_window_slots(
            tokens,
            cm.query_start_loc,
            cm.seq_lens,
            cm.block_table_tensor,
            vt.SWA_BLOCK,
            vt.WINDOW,
            BLOCK_WIDTH,
        )
        # vLLM's builder runs it over the decode rows (the blocks) only
        T = sum(batch.query_lens[: brute_split(batch, threshold=4)])
        ours, our_lens = ours[:T], our_lens[:T]
        theirs = torch.full((T, 1, BLOCK_WIDTH), 7, dtype=torch.int32)
        their_lens = torch.full((T,), 7, dtype=torch.int32)
        token_req = tokens.req.int()
        kernel[(T,)](
            theirs,
            theirs.stride(0),
            their_lens,
            vt.WINDOW,
            BLOCK_WIDTH,
            cm.query_start_loc,
            cm.seq_lens,
            token_req,
            tokens.valid,
            cm.block_table_tensor,
            cm.block_table_tensor.stride(0),
            vt.SWA_BLOCK,
            0,
            TRITON_BLOCK_SIZE=64,
        )
        assert torch.equal(ours, theirs[:, 0]), name
        assert torch.equal(our_lens, their_lens), name
    print(f"blocks compared: {len(DRAFT_BLOCKS)}")


def test_non_causal_metadata_without_dspark_is_refused(config):
    batch = vt.make_batch(torch.Generator().manual_seed(3), [40], [4])
    with pytest.raises(ValueError, match="no DSpark speculation"):
        swa_builder(config).build(0, dataclasses.replace(batch.swa_cm, causal=False))


@pytest.mark.parametrize("causal", [True, False], ids=["mtp", "dspark"])
def test_a_draft_step_recomputes_its_lists_in_place(config, monkeypatch, causal):
    """vLLM's draft steps: after the runner writes the next draft step into its persistent
    buffers (positions, slots, block tables), ``update_draft_decode_metadata`` leaves in the
    build's own buffers exactly the lists a fresh build of that step gives (the causal window
    for MTP, the non-causal block for DSpark)."""
    gen = torch.Generator().manual_seed(61 + causal)
    first = vt.make_batch(gen, [300, 9, 700, 64], [4] * 4, padding=2)
    second = vt.make_batch(gen, [40, 129, 5, 700], [4] * 4, padding=2)  # same shapes
    builder = block_builder(config, monkeypatch)
    cm = dataclasses.replace(first.swa_cm, causal=causal)
    md = builder.build(0, cm)
    assert builder.supports_draft_decode_metadata_update
    buffers = (
        md.swa_indices.data_ptr(),
        md.swa_lens.data_ptr(),
        md.token_to_req_indices.data_ptr(),
    )
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_table_tensor"):
        getattr(cm, name).copy_(getattr(second.swa_cm, name))
    fresh = block_builder(config, monkeypatch).build(
        0, dataclasses.replace(second.swa_cm, causal=causal)
    )
    assert md.swa_lens.tolist() != fresh.swa_lens.tolist()  # stale until updated
    builder.update_draft_decode_metadata(md)
    assert (
        md.swa_indices.data_ptr(),
        md.swa_lens.data_ptr(),
        md.token_to_req_indices.data_ptr(),
    ) == buffers
    assert md.swa_indices.tolist() == fresh.swa_indices.tolist()
    assert md.swa_lens.tolist() == fresh.swa_lens.tolist()
    assert md.token_to_req_indices.tolist() == fresh.token_to_req_indices.tolist()
    assert md.is_valid_token.tolist() == fresh.is_valid_token.tolist()
    want = brute_block_window(second, BLOCK_WIDTH, 16) if not causal else vt.brute_window(second)
    assert md.swa_lens.tolist() == want[1]
