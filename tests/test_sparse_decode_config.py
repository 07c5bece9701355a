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
    # 4 producer warps x 32 lanes / LANES_PER_KEY keys at a time, ROUNDS times: one 64-key tile.
    assert 4 * 32 // config.LANES_PER_KEY * config.ROUNDS == config.BLOCK_N


@pytest.mark.parametrize(("extra_block_size", "has_extra"), [(0, False), (16, True), (3, True)])
def test_has_extra_follows_the_extra_page_size(extra_block_size, has_extra):
    cfg = config.SparseDecodeConfig("nvfp4", 64, extra_block_size, "int32", "int32", True, False)
    assert cfg.has_extra is has_extra


def test_swizzle_permutes_16_byte_chunks_within_each_row():
    # Every (row, 16-byte chunk) of a 64 x 512 bf16 tile lands on its own 16-byte slot.
    offsets = {config.swizzled_offset(r, c) for r in range(64) for c in range(0, 512, 8)}
    assert len(offsets) == 64 * 64
    assert min(offsets) == 0 and max(offsets) == 64 * 512 * 2 - 16
    assert all(o % 16 == 0 for o in offsets)
