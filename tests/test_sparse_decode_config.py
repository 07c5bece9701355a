"""Tests of the sparse-decode kernel's compile-time configuration (no CuTeDSL needed)."""

from __future__ import annotations

import pytest

from dsv4_attn.kernels import sparse_decode_config as config


def test_register_split_fits_the_cta_pool():
    # setmaxnreg moves registers within what the CTA launched with: 3 x 128 x 168.
    assert config.LAUNCH_REGS == 168
    assert config.WG0_REGS + config.WG1_REGS + config.PRODUCER_REGS <= 3 * config.LAUNCH_REGS
    assert all(r % 8 == 0 for r in (config.WG0_REGS, config.WG1_REGS, config.PRODUCER_REGS))


def test_producer_rounds_cover_a_tile():
    # 4 producer warps x 32 lanes / LANES_PER_KEY keys at a time, ROUNDS times: one tile.
    assert 4 * 32 // config.LANES_PER_KEY * config.ROUNDS == config.BLOCK_N


@pytest.mark.parametrize(("extra_block_size", "has_extra"), [(0, False), (16, True), (3, True)])
def test_has_extra_follows_the_extra_page_size(extra_block_size, has_extra):
    cfg = config.SparseDecodeConfig("nvfp4", 64, extra_block_size, True, False)
    assert cfg.has_extra is has_extra


@pytest.mark.parametrize("rows", [config.BLOCK_H, config.BLOCK_N])
def test_swizzle_permutes_16_byte_chunks_within_each_row(rows):
    # Every (row, 16-byte chunk) of a rows x 512 bf16 tile lands on its own 16-byte slot.
    offsets = {config.swizzled_offset(r, c, rows) for r in range(rows) for c in range(0, 512, 8)}
    assert len(offsets) == rows * 64
    assert min(offsets) == 0 and max(offsets) == rows * 512 * 2 - 16
    assert all(o % 16 == 0 for o in offsets)


def test_raw_ring_and_stages_fit_shared_memory():
    # Q (64 x 512 bf16), the bf16 K/V stages, P and the raw ring, with ~2 KB for barriers,
    # row statistics and alignment, within the 227 KB a Hopper CTA may use.
    q = config.BLOCK_H * config.HEAD_DIM * 2
    stages = config.NUM_STAGES * config.BLOCK_N * config.HEAD_DIM * 2
    p = config.BLOCK_H * config.BLOCK_N * 2 * config.NUM_P_BUFFERS
    raw = config.RAW_STAGES * config.RAW_SLOT_BYTES
    assert q + stages + p + raw + 2048 <= 232448
    # The epilogue stages the output tile (16-bit, padded rows) over Q, K/V and P only.
    assert q + stages + p >= config.BLOCK_H * config.STAGE_ROW_BYTES
