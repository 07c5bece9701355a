"""Compile-time configuration of the Hopper sparse-decode kernel (no CuTeDSL import needed).

:class:`SparseDecodeConfig` is a kernel variant's compile-cache key; the constants fix the tile
geometry, the cache row formats (``dsv4_attn.kv_cache``), the named barriers and the register
split between the three warpgroups (:mod:`dsv4_attn.kernels.sparse_decode_sm90` explains the
roles); :func:`swizzled_offset` is the SMEM address map the producer stores K/V rows through.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SparseDecodeConfig", "swizzled_offset"]

HEAD_DIM = 512
NOPE_DIM = 448
BLOCK_H = 64  # query heads per CTA (wgmma M)
BLOCK_N = 32  # keys per tile
MIN_SPLIT_TILES = max(1, 64 // BLOCK_N)  # least tiles a split of a token takes (64 keys)
NUM_STAGES = 2  # bf16 K/V stages (what the MMA warpgroups read)
KEYS_PER_PRODUCER_WARP = BLOCK_N // 4
NUM_P_BUFFERS = 1  # P / row-factor buffers between WG0 and WG1
LANES_PER_KEY = 4  # producer lanes that share one key's rows
ROUNDS = KEYS_PER_PRODUCER_WARP * LANES_PER_KEY // 32  # keys a producer lane stages per tile

# Raw (still quantized) rows of the next tiles, copied by cp.async into a ring in SMEM so that
# RAW_STAGES tiles of bytes are in flight per CTA without holding registers. A producer lane
# copies and later reads only its own quarter of a key, so its own cp.async groups order the
# ring (no barrier). Chunk-major slots: 16-byte unit (chunk c, producer thread p) at
# (c * 128 + p) * 16; chunks 0..6 nope (FP8 16 B, NVFP4 8 B), 7..8 RoPE, 9..10 the key's whole
# scale row (FP8 8 B, NVFP4 32 B: every lane of the key holds it, no shuffles).
RAW_STAGES = 4
RAW_CHUNKS = 11
RAW_SLOT_BYTES = RAW_CHUNKS * 128 * 16
# Slot ids travel the same way, one tile further ahead: each producer thread cp.asyncs its key's
# 4-byte id (int32: the launcher narrows int64 lists) of tile t + 2 RAW_STAGES into a ring of
# 2 RAW_STAGES tiles, in the cp.async group of tile t's rows; it reads the id back (LDS) when it
# copies that tile's rows, RAW_STAGES tiles later, and once more when it stages them. No
# register ever waits on a global load inside the tile loop.
ID_STAGES = 2 * RAW_STAGES
ID_BYTES = 4  # one slot id (int32) in the index lists
ID_SLOT_BYTES = 128 * ID_BYTES

# Per-format row geometry (bytes), as documented in dsv4_attn.kv_cache.
FP8_DATA_ROW = 576
FP8_SCALE_ROW = 8
NVFP4_DATA_ROW = 352
NVFP4_SCALE_ROW = 32
NVFP4_NOPE_BYTES = 224

# Named barrier ids (0 is __syncthreads; 1 unused: Q arrives by TMA on an mbarrier).
BAR_P_FULL = 2  # + buffer
BAR_P_EMPTY = BAR_P_FULL + NUM_P_BUFFERS  # + buffer
BAR_STATS = BAR_P_EMPTY + NUM_P_BUFFERS
# Both MMA warpgroups: past their last MMA / output tile staged in SMEM.
BAR_EPILOGUE = BAR_STATS + 1
# Balanced schedule: all 384 threads between two tokens of one CTA (the output staging, over Q
# and the K/V stages, has been stored before the next Q and rows land there).
BAR_ITEM = BAR_EPILOGUE + 1
CTA_THREADS = 384
MMA_THREADS = 256

# Output staging (epilogue): the 64 x 512 output tile goes through SMEM (over Q, K/V and P, free
# after the last MMA) so global stores are whole 16-byte chunks. Both outputs are 16-bit (bf16
# final rows, fp16 split partials); rows are padded by 16 B so the accumulator fragments' stores
# hit 32 distinct banks.
STAGE_ROW_BYTES = HEAD_DIM * 2 + 16

# Split partials: fp16 rows scaled by a power of two per row, 2^k with k chosen so the row's
# largest magnitude lands in [2^PARTIAL_TOP_LOG2, 2^(PARTIAL_TOP_LOG2 + 1)) (fp16's 11-bit
# significand and its range both used; the combine divides by 2^k exactly). k is clamped to
# [PARTIAL_MIN_LOG2, PARTIAL_MAX_LOG2]: the low end still maps the largest float below fp16's
# limit; the high end keeps 2^-k normal in fp32 after the combine's division by up to 32
# splits (rows below 2^-106 keep fewer fp16 bits: the bf16 output there is near its
# subnormals anyway).
# Half the bytes of fp32 partials at the same accuracy: merged, their worst error is 1.00-1.04x
# the bf16 rounding (fp32 partials 1.0x, bf16 partials 1.5-1.9x; a CPU emulation of the merge).
PARTIAL_TOP_LOG2 = 14
PARTIAL_MIN_LOG2 = -113
PARTIAL_MAX_LOG2 = 120

# Output columns per MMA warpgroup. WG0 (QK, softmax) keeps Q's nope columns in registers
# (448 bf16 = 112 a thread) beside its O columns; WG1 holds the rest of O. Each WG1 tile is one
# MMA (offset, width): wgmma N <= 256, a multiple of 64 here (the 128B-swizzle atom of V).
WG0_COLS = 128
WG1_TILES = ((128, 128), (256, 256))
assert WG0_COLS + sum(width for _, width in WG1_TILES) == HEAD_DIM
# Highest register used (nvdisasm, over the variants): WG0 ~220, WG1 215, the producer ~53
# (48 spills one register with page sizes that are not powers of two); with WG1 at 216 ptxas
# spills WG1's accumulators and serializes the wgmma pipelines.
WG0_REGS, WG1_REGS, PRODUCER_REGS = 224, 224, 56
# Registers each thread starts with: 64 K / 384 threads, rounded down to a multiple of 8. The
# CTA's register pool is what it launched with (3 x 128 x 168), so the three counts may sum to at
# most 3 x 168 = 504 (more and setmaxnreg.inc waits forever); setmaxnreg.dec may only lower and
# setmaxnreg.inc only raise a warpgroup's count.
LAUNCH_REGS = (65536 // 384) // 8 * 8
assert WG0_REGS + WG1_REGS + PRODUCER_REGS <= 3 * LAUNCH_REGS
assert PRODUCER_REGS <= LAUNCH_REGS <= WG0_REGS


@dataclass(frozen=True)
class SparseDecodeConfig:
    """Every compile-time parameter of one kernel variant (the compile-cache key)."""

    fmt: str  # "fp8_ds_mla" or "nvfp4"
    block_size: int  # tokens per page of the window cache
    extra_block_size: int  # tokens per page of the extra cache; 0 = no extra scope
    has_sink: bool
    write_partial: bool  # True: (scaled fp16) partials for the combine kernel; False: final bf16
    # True: persistent CTAs, each a share of the balanced schedule
    # (:mod:`~dsv4_attn.kernels.sparse_decode_schedule`), writing final outputs and compact
    # partials (``write_partial`` must be False); False: one CTA per (token, split).
    balanced: bool = False

    def __post_init__(self):
        if self.balanced and self.write_partial:
            raise ValueError("a balanced variant writes both outputs: write_partial must be False")

    @property
    def has_extra(self) -> bool:
        return self.extra_block_size > 0


def swizzled_offset(row, col, rows: int = BLOCK_H):
    """Byte offset of bf16 element (row, col) in a ``rows`` x 512 K-major 128B-swizzled tile.

    The tile is the CuTe layout ``tile_to_shape(K_SW128 atom (8 x 64), (rows, 512))``: 1 KB
    atoms of 8 rows x 128 B, stacked down the rows first, then across the columns (64 columns
    per atom column, ``rows * 128`` bytes apart); inside an atom the 16-byte chunk index is
    XORed with the row index (Swizzle<3,4,3>). ``col`` must be a multiple of 8 (one 16-byte
    chunk); ``rows`` a multiple of 8 (Q: 64 heads, a K/V stage: ``BLOCK_N`` keys).
    """
    r0 = row & 7
    chunk = (col >> 3) & 7
    return ((row >> 3) << 10) + (col >> 6) * (rows * 128) + (r0 << 7) + ((chunk ^ r0) << 4)
