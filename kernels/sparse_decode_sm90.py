"""Hopper (sm_90a) CuTeDSL kernel: DeepSeek-V4 sparse MQA decode over a paged, quantized KV cache.

One CTA computes, for one decode token ``t``, one block of 64 query heads and one split of the
token's key list, the softmax-weighted sum of the KV rows it gathers. The key list of a token is
its ``lens[t]`` window slots followed by its ``extra_lens[t]`` compressed slots (one softmax over
both, no de-duplication); ``-1`` slots are skipped. Grid: ``(head_blocks, num_splits, T)``.

Math per CTA (heads are the M dimension of every MMA, as in MQA all heads share each KV row):
    S = Q K^T            Q: 64 x 512 bf16, K: 32 keys x 512 bf16 (SMEM); the 448 nope columns
                         with Q from WG0's registers (RS wgmma), the 64 RoPE columns from SMEM
    P = exp2(S * scale * log2(e) - m)   online softmax in registers (running max m, sum l);
                         m moves only when a tile's scores pass it by 2^8 (lazy rescaling)
    O += P V             V = K (the same rows), 512 wide: WG0 columns 0..127, WG1 128..511

Warp roles (384 threads, ``setmaxnreg`` per warpgroup):
    WG0 (threads 0..127,   224 regs): Q's nope columns loaded once into wgmma A fragments;
                                      S = QK^T, mask, online softmax, P -> registers and SMEM,
                                      O[:, 0:128] += P V[:, 0:128] (RS wgmma, P from registers)
    WG1 (threads 128..255, 224 regs): O[:, 128:512] += P V[:, 128:512] (two SS wgmmas, N = 128
                                      and 256, P from SMEM: "SMEM-P"), rescaling by the row
                                      factor WG0 publishes
    WG2 (threads 256..383,  56 regs): producer: four lanes per key, eight keys per warp (one
                                      32-key tile per iteration); each lane copies a quarter of
                                      the key's nope bytes, its scale row and 16 RoPE values into
                                      its column of a raw SMEM slot by cp.async, RAW_STAGES (4)
                                      tiles ahead, then reads them back, dequantizes 112 values
                                      to bf16 into the K/V stage (swizzled) and stores the RoPE
                                      values beside them; slot ids cp.async'd into their own
                                      SMEM ring 2 x RAW_STAGES tiles ahead (no register waits)
    224 + 224 + 56 = 504 = 3 x 168, the registers the CTA launches with (64 K / 384 threads).
    Register use per thread: WG0 holds Q's nope columns (64x448 bf16 / 128 = 112), O[:, :128]
    (64), S (16), P (8); WG1 holds O[:, 128:] (192); the producer one chunk of raw words at a
    time (rows in flight live in the raw ring, not in registers). Why Q in registers: with Q
    and K both from SMEM a 64x32x16 wgmma reads 3 KB per 16 tensor cycles (SMEM-bound at
    N = 32, and WG0's QK is the loop's critical path); with Q in registers it reads 1 KB.
    Every wgmma is issued from one copy per K/V stage (the tile loops branch on the stage), so
    its B descriptors are immediates in uniform registers: with a runtime stage index ptxas
    moves each descriptor over from regular registers (R2UR) right before its HGMMA.

Shared memory (bytes): Q 65,536 (nope columns read once, RoPE columns every tile) | K/V 2 stages x
    32,768 | P 4,096 | raw ring 4 x 22,528 | slot ids 8 x 512 | key bias, row factors, row stats,
    mbarriers ~1 K = ~231 K of the 232,448 a CTA may use. The producer fills stage i % 2 while both
    MMA warpgroups read the other; up to four tiles of quantized rows (FP8 ~75 KB) are in flight
    per CTA, enough to cover DRAM latency at this SM's share of bandwidth. After the last MMA the
    output tile is staged over Q, K/V and P (padded rows) and stored in 16-byte chunks.

Synchronisation: mbarrier ``q_full`` (Q's one TMA copy, issued by warp 0 before anything else),
``full[s]`` (128 producer arrivals) / ``empty[s]`` (256 MMA arrivals) per K/V stage; named barriers
between WG0 and WG1 for P and the row factors (``P_FULL``, ``P_EMPTY``), one for the final row
statistics, one for the epilogue's staging.

Modules: :mod:`~dsv4_attn.kernels.sparse_decode_config` (the variant key, geometry, barriers,
register split, the SMEM swizzle), :mod:`~dsv4_attn.kernels.sparse_decode_producer` (WG2),
:mod:`~dsv4_attn.kernels.dequant` (the bit recipes); this module holds the launch, the MMA
warpgroups and the epilogue.

Outputs: with one split, ``out`` bf16 ``[T, H, 512]`` (sink applied) and ``lse`` fp32 ``[T, H]``;
with several, partials ``[S, T, H, 512]`` normalized per split, stored as fp16 times a power of
two 2^k per row (the row's largest magnitude in [2^14, 2^15): fp32's accuracy at half its bytes,
which the epilogue's stores and the combine's loads are bound by), and fp32 pairs
``[S, T, H, 2]`` = (natural-log lse, -inf for an empty split; k), merged by
:mod:`dsv4_attn.kernels.combine`.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup

from dsv4_attn.kernels import ptx_ops
from dsv4_attn.kernels.fmha_sm90_utils import (
    quad_max,
    quad_sum,
    smem_layout_rowmajor,
    warpgroup_mma,
)
from dsv4_attn.kernels.sparse_decode_config import (
    BAR_EPILOGUE,
    BAR_ITEM,
    BAR_P_EMPTY,
    BAR_P_FULL,
    BAR_STATS,
    BLOCK_H,
    BLOCK_N,
    CTA_THREADS,
    FP8_DATA_ROW,
    FP8_SCALE_ROW,
    HEAD_DIM,
    ID_BYTES,
    ID_SLOT_BYTES,
    ID_STAGES,
    LAUNCH_REGS,
    MIN_SPLIT_TILES,
    MMA_THREADS,
    NOPE_DIM,
    NUM_P_BUFFERS,
    NUM_STAGES,
    NVFP4_DATA_ROW,
    NVFP4_SCALE_ROW,
    PARTIAL_MAX_LOG2,
    PARTIAL_MIN_LOG2,
    PARTIAL_TOP_LOG2,
    PRODUCER_REGS,
    RAW_SLOT_BYTES,
    RAW_STAGES,
    STAGE_ROW_BYTES,
    WG0_COLS,
    WG0_REGS,
    WG1_REGS,
    WG1_TILES,
    SparseDecodeConfig,
)
from dsv4_attn.kernels.sparse_decode_producer import SparseDecodeProducer

__all__ = ["SparseDecodeSm90"]

# The tile loops issue their wgmmas from one copy per K/V stage (:func:`_on_stage`), and WG1
# reads P buffer ``stage % NUM_P_BUFFERS`` there as a constant: so the buffers must divide the
# stages.
assert NUM_STAGES % NUM_P_BUFFERS == 0, (NUM_STAGES, NUM_P_BUFFERS)

LOG2E = math.log2(math.e)
# The running max moves only past this many log2 units (so P <= 2^RESCALE_LOG2): see softmax.
RESCALE_LOG2 = 8.0
LN2 = math.log(2.0)
# Columns of the per-row statistics in SMEM: the final softmax sum and max (WG0 -> WG1), and,
# for split partials, each MMA warpgroup's largest |output| (the row's fp16 scale).
STAT_SUM, STAT_MAX, STAT_ABSMAX = 0, 1, 2
ROW_STATS = STAT_ABSMAX + 2


def _largest_magnitude(values: list, chains: int = 8) -> Float32:
    """max |v| over ``values`` (floats; 0 for none), as ``chains`` independent running maxima
    and then a tree: one dependent chain through every value would cost its length in FMNMX
    latencies. (A plain function: traced inline, its Python loops unrolled.)"""
    maxima = [Float32(0.0)] * chains
    for i, x in enumerate(values):
        maxima[i % chains] = ptx_ops.max_abs(maxima[i % chains], x)
    while len(maxima) > 1:
        maxima = [cute.arch.fmax(a, b) for a, b in zip(maxima[::2], maxima[1::2], strict=True)]
    return maxima[0]


def _scale_rows(accs: list, f0: Float32, f1: Float32) -> None:
    """Multiply a thread's wgmma accumulators by its two rows' factors: register 4j + 2h + v
    holds row row0 + 8h (``f0`` for h = 0, ``f1`` for h = 1). (A plain function: traced
    inline.)"""
    for acc in accs:
        for i in range(cute.size(acc)):
            acc[i] = acc[i] * (f0 if (i // 2) % 2 == 0 else f1)


@cute.jit
def _on_stage(stage: Int32, issue, s: cutlass.Constexpr[int] = 0):
    """``issue(stage)`` with ``stage`` (0 .. NUM_STAGES - 1) as a compile-time constant: an
    if / else chain, one copy of ``issue`` per stage (see :meth:`SparseDecodeSm90.qk`)."""
    if const_expr(s == NUM_STAGES - 1):
        issue(s)
    else:
        if stage == s:
            issue(s)
        else:
            _on_stage(stage, issue, s + 1)


class SparseDecodeSm90(SparseDecodeProducer):
    """The split-KV sparse decode kernel for one :class:`SparseDecodeConfig`."""

    def __init__(self, config: SparseDecodeConfig):
        if config.fmt not in ("fp8_ds_mla", "nvfp4"):
            raise ValueError(f"fmt must be 'fp8_ds_mla' or 'nvfp4', got {config.fmt!r}")
        self.cfg = config
        self.is_fp8 = config.fmt == "fp8_ds_mla"
        self.data_row = FP8_DATA_ROW if self.is_fp8 else NVFP4_DATA_ROW
        self.scale_row = FP8_SCALE_ROW if self.is_fp8 else NVFP4_SCALE_ROW

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, H, 512] bf16
        mCache: cute.Tensor,  # [num_blocks, page_bytes] uint8
        mIdx: cute.Tensor,  # [T, K] int
        mLens: cute.Tensor,  # [T] int
        mECache: cute.Tensor | None,
        mEIdx: cute.Tensor | None,
        mELens: cute.Tensor | None,
        mSink: cute.Tensor | None,  # [H] fp32
        mO: cute.Tensor,  # final: [T, H, 512] bf16; partial: [S, T, H, 512] fp16 (scaled)
        mLse: cute.Tensor,  # final: [T, H] fp32; partial: [S, T, H, 2] fp32 (lse, k)
        mOpart: cute.Tensor | None,  # balanced: [slots, H, 512] fp16 (scaled)
        mLsePart: cute.Tensor | None,  # balanced: [slots, H, 2] fp32 (lse, k)
        mPartPlan: cute.Tensor | None,  # balanced: [num_parts, 4] int32
        mTokenPlan: cute.Tensor | None,  # balanced: [T, 5] int32
        scale_log2: Float32,  # softmax scale * log2(e)
        num_splits: Int32,  # balanced: unused (the grid has one CTA per part)
        tiles_per_split: Int32,
        stream: cuda.CUstream,
    ):
        sQ_layout = smem_layout_rowmajor(BFloat16, BLOCK_H, HEAD_DIM)
        # Q by TMA: a CTA's 64 heads of one token are one (64, 512) box of the (H, 512, T) view;
        # heads past H read as zeros (out of bounds), the box's bytes always arrive in full.
        q_view = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q_view, sQ_layout, (BLOCK_H, HEAD_DIM)
        )
        sK_layout = smem_layout_rowmajor(BFloat16, BLOCK_N, HEAD_DIM, NUM_STAGES)
        sP_layout = smem_layout_rowmajor(BFloat16, BLOCK_H, BLOCK_N, NUM_P_BUFFERS)
        # QK: the nope columns with Q from WG0's registers (RS), the RoPE columns with Q from
        # SMEM (SS); both accumulate into the same 64 x 32 S tile.
        mma_qk_rs = warpgroup_mma(BFloat16, BLOCK_N, OperandMajorMode.K, a_in_registers=True)
        mma_qk_ss = warpgroup_mma(BFloat16, BLOCK_N, OperandMajorMode.K)
        # PV: WG0 its WG0_COLS columns with P from registers; WG1 the rest with P from SMEM,
        # as one MMA per entry of WG1_TILES.
        mma_pv_wg0 = warpgroup_mma(BFloat16, WG0_COLS, OperandMajorMode.MN, a_in_registers=True)
        mma_pv_wg1 = [warpgroup_mma(BFloat16, width, OperandMajorMode.MN) for _, width in WG1_TILES]

        @cute.struct
        class SharedStorage:
            q_full_bar: cute.struct.MemRange[Int64, 1]
            full_bar: cute.struct.MemRange[Int64, NUM_STAGES]
            empty_bar: cute.struct.MemRange[Int64, NUM_STAGES]
            key_bias: cute.struct.MemRange[Float32, BLOCK_N * NUM_STAGES]
            row_factor: cute.struct.MemRange[Float32, BLOCK_H * NUM_P_BUFFERS]
            row_stats: cute.struct.MemRange[Float32, BLOCK_H * ROW_STATS]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            # After P: the output staging of the epilogue (from sQ on) never reaches it.
            sRaw: cute.struct.Align[cute.struct.MemRange[Uint8, RAW_STAGES * RAW_SLOT_BYTES], 128]
            sIds: cute.struct.Align[cute.struct.MemRange[Uint8, ID_STAGES * ID_SLOT_BYTES], 16]

        # 227 KB: the most dynamic shared memory a Hopper CTA may use.
        assert SharedStorage.size_in_bytes() <= 232448, SharedStorage.size_in_bytes()
        # The epilogue stages the output over Q, the K/V stages and P (not the raw ring, where
        # the producer's last copies may still land).
        staged = BLOCK_H * STAGE_ROW_BYTES
        assert staged <= 2 * (
            cute.cosize(sQ_layout) + cute.cosize(sK_layout) + cute.cosize(sP_layout)
        ), staged
        num_heads = mQ.shape[1]
        grid = ((num_heads + BLOCK_H - 1) // BLOCK_H, num_splits, mQ.shape[0])
        if const_expr(self.cfg.balanced):
            grid = ((num_heads + BLOCK_H - 1) // BLOCK_H, mPartPlan.shape[0], 1)
        self.kernel(
            tma_q,
            tma_atom_q,
            mCache,
            mIdx,
            mLens,
            mECache,
            mEIdx,
            mELens,
            mSink,
            mO,
            mLse,
            mOpart,
            mLsePart,
            mPartPlan,
            mTokenPlan,
            scale_log2,
            tiles_per_split,
            sQ_layout,
            sK_layout,
            sP_layout,
            mma_qk_rs,
            mma_qk_ss,
            mma_pv_wg0,
            *mma_pv_wg1,
            SharedStorage,
        ).launch(grid=grid, block=(384, 1, 1), stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        mCache: cute.Tensor,
        mIdx: cute.Tensor,
        mLens: cute.Tensor,
        mECache: cute.Tensor | None,
        mEIdx: cute.Tensor | None,
        mELens: cute.Tensor | None,
        mSink: cute.Tensor | None,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mOpart: cute.Tensor | None,
        mLsePart: cute.Tensor | None,
        mPartPlan: cute.Tensor | None,
        mTokenPlan: cute.Tensor | None,
        scale_log2: Float32,
        tiles_per_split: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        mma_qk_rs: cute.TiledMma,
        mma_qk_ss: cute.TiledMma,
        mma_pv_wg0: cute.TiledMma,
        mma_pv_mid: cute.TiledMma,
        mma_pv_right: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        # split: the part of the balanced schedule when balanced (token then unused)
        head_block, split, token = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        balanced = const_expr(self.cfg.balanced)
        if const_expr(self.cfg.write_partial or balanced):
            # The combine kernel is launched as a programmatic dependent (PDL): let its CTAs be
            # scheduled on SMs this grid leaves idle; they wait for this grid's writes anyway.
            cute.arch.griddepcontrol_launch_dependents()

        if const_expr(not balanced):  # noqa: SIM102 (a compile-time, then a runtime test)
            if tidx == 256:
                self.prefetch_first_ids(mIdx, mEIdx, token, split, tiles_per_split)
                # Every role reads the token's lengths first (key_range): start that miss now.
                for lens in (mLens, mELens) if const_expr(self.cfg.has_extra) else (mLens,):
                    width = lens.element_type.width // 8
                    ptx_ops.prefetch_l1(lens.iterator.toint() + Int64(token) * width)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_full_bar = storage.q_full_bar.data_ptr()
        full_bar = storage.full_bar.data_ptr()
        empty_bar = storage.empty_bar.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        if tidx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cute.arch.mbarrier_init(q_full_bar, 1)
            for s in cutlass.range_constexpr(NUM_STAGES):
                cute.arch.mbarrier_init(full_bar + s, 128)
                cute.arch.mbarrier_init(empty_bar + s, MMA_THREADS)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if const_expr(not balanced):  # noqa: SIM102 (a compile-time, then a runtime test)
            if tidx < 32:
                # Q first, before any KV row is asked for: the MMA warpgroups can start no
                # sooner. A whole warp issues it (the TMA copy elects one lane; under a divergent
                # branch of one thread that election hangs).
                self.load_q(tma_q, tma_atom_q, sQ, q_full_bar, token, head_block)

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sRaw = storage.sRaw.get_tensor(cute.make_layout(RAW_STAGES * RAW_SLOT_BYTES))
        sIds = storage.sIds.get_tensor(cute.make_layout(ID_STAGES * ID_SLOT_BYTES))
        key_bias = storage.key_bias.get_tensor(cute.make_layout((BLOCK_N, NUM_STAGES)))
        row_factor = storage.row_factor.get_tensor(cute.make_layout((BLOCK_H, NUM_P_BUFFERS)))
        row_stats = storage.row_stats.get_tensor(cute.make_layout((BLOCK_H, ROW_STATS)))

        # Each role computes its own values after its register reconfiguration, so nothing stays
        # live across the three roles' different register budgets. Every role walks the same
        # items (one (token, key range) without the balanced schedule; the tokens of this CTA's
        # part with it) and counts the same tiles, so K/V stage and mbarrier phase follow one
        # running tile count ``g0`` across items.
        outputs = (mO, mLse, mOpart, mLsePart)
        lists = (mLens, mELens, mIdx, mEIdx)  # lengths, and the index rows bounding them
        items = (lists, mPartPlan, mTokenPlan, split, token, tiles_per_split)
        if wg == 2:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)

            def produce(t, n_window, key_begin, key_end, n_tiles, slot, g0, done):
                self.producer(
                    mCache,
                    mIdx,
                    mECache,
                    mEIdx,
                    sK,
                    sRaw,
                    sIds,
                    key_bias,
                    full_bar,
                    empty_bar,
                    t,
                    n_window,
                    key_begin,
                    key_end,
                    n_tiles,
                    tidx - 256,
                    g0,
                    done,
                )

            self.for_each_item(*items, produce)
        elif wg == 0:
            cute.arch.setmaxregister_increase(WG0_REGS)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

            def softmax(t, n_window, key_begin, key_end, n_tiles, slot, g0, done):
                if const_expr(balanced):
                    if done > 0:
                        cute.arch.barrier(barrier_id=BAR_ITEM, number_of_threads=CTA_THREADS)
                    if tidx < 32:
                        self.load_q(tma_q, tma_atom_q, sQ, q_full_bar, t, head_block)
                cute.arch.mbarrier_wait(q_full_bar, done % 2)
                self.consumer_softmax(
                    outputs,
                    mSink,
                    sQ,
                    sK,
                    sP,
                    key_bias,
                    row_factor,
                    row_stats,
                    full_bar,
                    empty_bar,
                    mma_qk_rs,
                    mma_qk_ss,
                    mma_pv_wg0,
                    scale_log2,
                    (t, head_block, split, slot),
                    g0,
                    n_tiles,
                    tidx,
                )

            self.for_each_item(*items, softmax)
        else:
            if const_expr(WG1_REGS > LAUNCH_REGS):
                cute.arch.setmaxregister_increase(WG1_REGS)
            else:
                cute.arch.setmaxregister_decrease(WG1_REGS)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

            def right(t, n_window, key_begin, key_end, n_tiles, slot, g0, done):
                if const_expr(balanced):  # noqa: SIM102 (a compile-time, then a runtime test)
                    if done > 0:
                        cute.arch.barrier(barrier_id=BAR_ITEM, number_of_threads=CTA_THREADS)
                cute.arch.mbarrier_wait(q_full_bar, done % 2)
                self.consumer_right(
                    outputs,
                    mSink,
                    sK,
                    sP,
                    row_factor,
                    row_stats,
                    full_bar,
                    empty_bar,
                    (mma_pv_mid, mma_pv_right),
                    (t, head_block, split, slot),
                    g0,
                    n_tiles,
                    tidx - 128,
                    sQ,
                )

            self.for_each_item(*items, right)

    @cute.jit
    def for_each_item(self, lists, mPartPlan, mTokenPlan, split, token, tiles_per_split, body):
        """``body(token, n_window, key_begin, key_end, n_tiles, slot, g0, done)`` for each item
        of this CTA: its (token, split) without the balanced schedule; with it, each token of its
        part it holds tiles of. ``g0``: tiles of the earlier items (K/V stage and mbarrier phase
        run on across items); ``done``: items before this one; ``slot``: a cut token's partial
        slot, -1 for a final output."""
        if const_expr(not self.cfg.balanced):
            n_window, key_begin, key_end, n_tiles = self.key_range(
                lists, token, split, tiles_per_split
            )
            body(token, n_window, key_begin, key_end, n_tiles, Int32(-1), Int32(0), Int32(0))
        else:
            first = Int32(mPartPlan[split, 2])
            last = Int32(mPartPlan[split, 3])
            g0 = Int32(0)
            done = Int32(0)
            for t in cutlass.range(first, last + 1, unroll=1):
                present, n_window, key_begin, key_end, n_tiles, slot = self.item(
                    lists, mPartPlan, mTokenPlan, t, split
                )
                if present:
                    body(t, n_window, key_begin, key_end, n_tiles, slot, g0, done)
                    g0 = g0 + n_tiles
                    done = done + 1

    @cute.jit
    def item(self, lists, mPartPlan, mTokenPlan, token, part):
        """Part ``part``'s work on token ``token`` (balanced schedule): (present, n_window,
        key_begin, key_end, tiles, slot). ``present`` is False when the part holds none of the
        token's tiles; ``slot`` is the partial slot of a cut token's piece, -1 for a final
        output."""
        lo = Int32(mPartPlan[part, 0])
        hi = Int32(mPartPlan[part, 1])
        at = Int32(mTokenPlan[token, 0])
        tiles = Int32(mTokenPlan[token, 1])
        pieces = Int32(mTokenPlan[token, 2])
        j_begin = cutlass.min(cutlass.max(lo - at, Int32(0)), tiles)
        j_end = cutlass.min(cutlass.max(hi - at, Int32(0)), tiles)
        n_window, key_begin, key_end, n_tiles = self.keys_between(
            lists, token, j_begin * BLOCK_N, j_end * BLOCK_N
        )
        slot = Int32(-1)
        if pieces > 1:
            slot = Int32(mTokenPlan[token, 3]) + part - Int32(mTokenPlan[token, 4])
        return j_end > j_begin, n_window, key_begin, key_end, n_tiles, slot

    @cute.jit
    def key_range(self, lists, token, split, tiles_per_split):
        """This CTA's share of the token's key list: (n_window, begin, end, number of tiles).

        The token's own tiles (not the launch's capacity, which sized the grid) spread over the
        grid's splits, at least MIN_SPLIT_TILES and at most ``tiles_per_split`` per split: a
        list much shorter than the capacity still keeps every split of its token busy."""
        _, n_total = self.token_keys(lists, token)
        share = self.split_share(n_total, tiles_per_split)
        share = cute.arch.make_warp_uniform(share)  # keeps the tile loop's values uniform
        key_begin = split * share * BLOCK_N
        return self.keys_between(lists, token, key_begin, key_begin + share * BLOCK_N)

    @cute.jit
    def split_share(self, n_keys, tiles_per_split):
        """Tiles each split of the grid takes of a list of ``n_keys`` keys: its tiles spread over
        the grid's splits, at least MIN_SPLIT_TILES and at most ``tiles_per_split``."""
        _, num_splits, _ = cute.arch.grid_dim()
        token_tiles = (n_keys + BLOCK_N - 1) // BLOCK_N
        share = (token_tiles + Int32(num_splits) - 1) // Int32(num_splits)
        return cutlass.min(cutlass.max(share, Int32(MIN_SPLIT_TILES)), tiles_per_split)

    @cute.jit
    def prefetch_first_ids(self, mIdx, mEIdx, token, split, tiles_per_split):
        """Ask L2 for the slot ids of this CTA's first RAW_STAGES tiles, placed as if the
        token's list were full (the common case), before anything else: the producer can ask
        for them only after the token's lengths have arrived (:meth:`key_range`), one DRAM
        round trip later, and the first tile's rows wait for them."""
        window_cap = Int32(mIdx.shape[1])
        capacity = window_cap
        if const_expr(self.cfg.has_extra):
            capacity = capacity + Int32(mEIdx.shape[1])
        first = split * self.split_share(capacity, tiles_per_split) * BLOCK_N
        span = RAW_STAGES * BLOCK_N
        window_ids, extra_ids = self.id_rows(mIdx, mEIdx, token)
        self.prefetch_id_range(window_ids, first, first + span, window_cap)
        if const_expr(self.cfg.has_extra):
            self.prefetch_id_range(
                extra_ids, first - window_cap, first - window_cap + span, Int32(mEIdx.shape[1])
            )

    @cute.jit
    def prefetch_id_range(self, ids_row, lo, hi, width):
        """L2 prefetch of ids ``lo .. hi`` (clamped to ``0 .. width``) of a row at ``ids_row``:
        the whole 16-byte units inside (never a byte outside the row; the sectors of the cut
        ends come along anyway)."""
        elem = ID_BYTES
        lo = cutlass.max(lo, Int32(0))
        hi = cutlass.min(hi, width)
        start = (ids_row + Int64(lo) * elem + 15) & Int64(-16)
        end = (ids_row + Int64(hi) * elem) & Int64(-16)
        if end > start:
            ptx_ops.prefetch_bulk_l2(start, Int32(end - start))

    @cute.jit
    def token_keys(self, lists, token):
        """(window keys, all keys) of the token's list. Each length is clamped into ``0 ..`` its
        list's width, so no length makes the kernel read past an index row."""
        mLens, mELens, mIdx, mEIdx = lists
        n_window = self.clamped_len(mLens, mIdx, token)
        n_total = n_window
        if const_expr(self.cfg.has_extra):
            n_total = n_window + self.clamped_len(mELens, mEIdx, token)
        return n_window, n_total

    @staticmethod
    @cute.jit
    def clamped_len(mLens, mIdx, token) -> Int32:
        """``lens[token]`` clamped into ``0 .. K`` (``K``: the index rows' width), compared in
        the lengths' own type before it narrows to 32 bits."""
        width = mIdx.shape[1]
        length = cutlass.min(cutlass.max(mLens[token], 0), width)
        return Int32(length)

    @cute.jit
    def keys_between(self, lists, token, key_begin, key_limit):
        """Keys ``key_begin .. key_limit`` of the token's list, cut at its length: (n_window,
        begin, end, number of tiles)."""
        n_window, n_total = self.token_keys(lists, token)
        key_end = cutlass.min(n_total, key_limit)
        n_tiles = Int32(0)
        if key_end > key_begin:
            n_tiles = (key_end - key_begin + BLOCK_N - 1) // BLOCK_N
        return n_window, key_begin, key_end, n_tiles

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_q(self, tma_q, tma_atom_q, sQ, q_full_bar, token: Int32, head_block: Int32):
        """One TMA copy of this CTA's 64 x 512 query tile into sQ (swizzled as wgmma reads it);
        ``q_full_bar`` completes when all 64 KB have landed."""
        gQ = cute.local_tile(tma_q[None, None, token], (BLOCK_H, HEAD_DIM), (head_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q,
            0,
            cute.make_layout(1),
            cute.group_modes(sQ, 0, 2),
            cute.group_modes(gQ, 0, 2),
        )
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(q_full_bar, BLOCK_H * HEAD_DIM * 2)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=q_full_bar)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer_softmax(
        self,
        outputs: tuple,
        mSink: cute.Tensor | None,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sP: cute.Tensor,
        key_bias: cute.Tensor,
        row_factor: cute.Tensor,
        row_stats: cute.Tensor,
        full_bar,
        empty_bar,
        mma_qk_rs: cute.TiledMma,
        mma_qk_ss: cute.TiledMma,
        mma_pv: cute.TiledMma,
        scale_log2: Float32,
        out_at: tuple,
        g0: Int32,
        n_tiles: Int32,
        tidx: Int32,
    ):
        """WG0: S = QK^T (Q's nope columns from registers), online softmax, P to SMEM for WG1,
        O[:, :WG0_COLS] += P V[:, :WG0_COLS]. ``outputs``: (mO, mLse, mOpart, mLsePart), see
        :meth:`epilogue`; tile ``tile`` of this item is the CTA's ``g0 + tile``-th."""
        rope_dim = HEAD_DIM - NOPE_DIM
        # The nope columns of Q: loaded once into wgmma A fragments (112 registers a thread),
        # so the tile loop's QK reads only K from SMEM for them.
        thr_qk = mma_qk_rs.get_slice(tidx)
        sQ_nope = cute.local_tile(sQ, (BLOCK_H, NOPE_DIM), (0, 0))
        sK_nope = cute.local_tile(sK, (BLOCK_N, NOPE_DIM, NUM_STAGES), (0, 0, 0))
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_shape_A((BLOCK_H, NOPE_DIM)))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK_nope))
        q_load = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16),
            mma_qk_rs,
        ).get_slice(tidx)
        cute.copy(q_load, q_load.partition_S(sQ_nope), q_load.retile(tSrQ))
        # The RoPE columns: Q from SMEM (the registers do not stretch to them).
        thr_qk_rope = mma_qk_ss.get_slice(tidx)
        sQ_rope = cute.local_tile(sQ, (BLOCK_H, rope_dim), (0, NOPE_DIM // rope_dim))
        sK_rope = cute.local_tile(sK, (BLOCK_N, rope_dim, NUM_STAGES), (0, NOPE_DIM // rope_dim, 0))
        tSrQ_rope = thr_qk_rope.make_fragment_A(thr_qk_rope.partition_A(sQ_rope))
        tSrK_rope = thr_qk_rope.make_fragment_B(thr_qk_rope.partition_B(sK_rope))
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        t_cs = thr_qk.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N)))

        thr_pv = mma_pv.get_slice(tidx)
        sVt = cute.composition(
            sK, cute.make_ordered_layout((HEAD_DIM, BLOCK_N, NUM_STAGES), order=(1, 0, 2))
        )
        sV_left = cute.local_tile(sVt, (WG0_COLS, BLOCK_N, NUM_STAGES), (0, 0, 0))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV_left))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((BLOCK_H, BLOCK_N)))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, WG0_COLS)), Float32)
        acc_o.fill(0.0)

        p_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16),
            mma_qk_rs,
        ).get_slice(tidx)
        tPsP = p_store.partition_D(sP)
        tPrP = p_store.retile(tOrP)

        row_m = cute.make_rmem_tensor((2,), Float32)
        row_l = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(2):
            row_m[i] = -math.inf
            row_l[i] = 0.0
        lane = tidx & 31
        row0 = (tidx >> 5) * 16 + (lane >> 2)

        for tile in cutlass.range(n_tiles, unroll=1):
            g = g0 + tile
            stage = g % NUM_STAGES
            pbuf = g % NUM_P_BUFFERS
            cute.arch.mbarrier_wait(full_bar + stage, (g // NUM_STAGES) % 2)
            # ---- S = Q K^T, one copy per stage (see qk)
            warpgroup.fence()
            _on_stage(
                stage,
                lambda s: self.qk(mma_qk_rs, mma_qk_ss, acc_s, tSrQ, tSrK, tSrQ_rope, tSrK_rope, s),
            )
            # ---- online softmax (log2 domain); invalid keys carry a -inf bias
            tile_max = cute.make_rmem_tensor((2,), Float32)
            tile_max[0] = -math.inf
            tile_max[1] = -math.inf
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                x = acc_s[i] * scale_log2 + key_bias[t_cs[i][1], stage]
                acc_s[i] = x
                half = (i // 2) % 2
                tile_max[half] = cute.arch.fmax(tile_max[half], x)
            # Lazy rescaling: the running max m only moves when some score of this warp's rows
            # passes it by more than RESCALE_LOG2 (log2 units); otherwise P <= 2^RESCALE_LOG2
            # (as exact in bf16, summed in fp32), no quad reduction, and O keeps its scale
            # (factor 1). Any m gives the same softmax as long as P, l and O use the same one.
            scale_row = cute.make_rmem_tensor((2,), Float32)
            m_use = cute.make_rmem_tensor((2,), Float32)
            grows = (tile_max[0] > row_m[0] + RESCALE_LOG2) | (
                tile_max[1] > row_m[1] + RESCALE_LOG2
            )
            rescale = cute.arch.vote_any_sync(grows)
            for h in cutlass.range_constexpr(2):
                scale_row[h] = 1.0
                m_use[h] = Float32(cutlass.select_(row_m[h] == -math.inf, Float32(0.0), row_m[h]))
            if rescale:
                for h in cutlass.range_constexpr(2):
                    m_new = cute.arch.fmax(row_m[h], quad_max(tile_max[h]))
                    m_safe = Float32(cutlass.select_(m_new == -math.inf, Float32(0.0), m_new))
                    m_use[h] = m_safe
                    scale_row[h] = ptx_ops.exp2_approx(row_m[h] - m_safe)
                    row_m[h] = m_new
            tile_sum = cute.make_rmem_tensor((2,), Float32)
            tile_sum[0] = 0.0
            tile_sum[1] = 0.0
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                half = (i // 2) % 2
                p = ptx_ops.exp2_approx(acc_s[i] - m_use[half])
                acc_s[i] = p
                tile_sum[half] = tile_sum[half] + p
            for h in cutlass.range_constexpr(2):
                row_l[h] = row_l[h] * scale_row[h] + tile_sum[h]
            # ---- P as bf16 (registers for PV-left, SMEM for WG1)
            tOrP_u32 = cute.recast_tensor(tOrP, Uint32)
            for i in cutlass.range_constexpr(cute.size(tOrP_u32)):
                tOrP_u32[i] = ptx_ops.cvt_bf16x2_f32(acc_s[2 * i], acc_s[2 * i + 1])
            if tile >= NUM_P_BUFFERS:
                cute.arch.barrier(barrier_id=BAR_P_EMPTY + pbuf, number_of_threads=MMA_THREADS)
            cute.copy(p_store, tPrP, tPsP[None, None, None, pbuf])
            if (lane & 3) == 0:
                row_factor[row0, pbuf] = scale_row[0]
                row_factor[row0 + 8, pbuf] = scale_row[1]
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=BAR_P_FULL + pbuf, number_of_threads=MMA_THREADS)
            # ---- O_left = O_left * scale + P V_left
            if rescale:
                _scale_rows([acc_o], scale_row[0], scale_row[1])
            warpgroup.fence()
            _on_stage(stage, lambda s: self.pv([mma_pv], [acc_o], [tOrP], [tOrV], s))
            cute.arch.mbarrier_arrive(empty_bar + stage)

        # ---- final row statistics, shared with WG1
        for h in cutlass.range_constexpr(2):
            row_l[h] = quad_sum(row_l[h])
        if (lane & 3) == 0:
            for h in cutlass.range_constexpr(2):
                row_stats[row0 + 8 * h, STAT_SUM] = row_l[h]
                row_stats[row0 + 8 * h, STAT_MAX] = row_m[h]
        cute.arch.barrier_arrive(barrier_id=BAR_STATS, number_of_threads=MMA_THREADS)
        self.epilogue(
            outputs,
            mSink,
            [(acc_o, 0)],
            tidx,
            0,
            row_l,
            row_m,
            row_stats,
            out_at,
            sQ,
            True,
        )

    @cute.jit
    def qk(
        self,
        mma_qk_rs,
        mma_qk_ss,
        acc_s,
        tSrQ,
        tSrK,
        tSrQ_rope,
        tSrK_rope,
        stage: cutlass.Constexpr[int],
    ):
        """S = Q K^T over K/V stage ``stage``, then waits. ``stage`` is a constant (the loop
        branches on it) so every B descriptor is an immediate in uniform registers: with a
        runtime stage ptxas builds each descriptor in regular registers and moves it over
        (R2UR) before every HGMMA, which paced QK at ~27 cycles per 64x32x16 HGMMA against
        16 of tensor work (measured with ncu)."""
        atom_qk = cute.make_mma_atom(mma_qk_rs.op)
        atom_qk_rope = cute.make_mma_atom(mma_qk_ss.op)
        atom_qk.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
            cute.gemm(atom_qk, acc_s, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_s)
            atom_qk.set(warpgroup.Field.ACCUMULATE, True)
        atom_qk_rope.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tSrQ_rope.shape[2])):
            cute.gemm(
                atom_qk_rope,
                acc_s,
                tSrQ_rope[None, None, k],
                tSrK_rope[None, None, k, stage],
                acc_s,
            )
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def pv(self, mma_pv, accs, tOrP, tOrV, stage: cutlass.Constexpr[int]):
        """O += P V for each (MMA, accumulator, P fragment, V fragment) of a warpgroup, V from
        K/V stage ``stage`` (a constant, for the same reason as :meth:`qk`); then waits."""
        for t in cutlass.range_constexpr(len(accs)):
            atom_pv = cute.make_mma_atom(mma_pv[t].op)
            atom_pv.set(warpgroup.Field.ACCUMULATE, True)
            for k in cutlass.range_constexpr(cute.size(tOrP[t].shape[2])):
                cute.gemm(
                    atom_pv, accs[t], tOrP[t][None, None, k], tOrV[t][None, None, k, stage], accs[t]
                )
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer_right(
        self,
        outputs: tuple,
        mSink: cute.Tensor | None,
        sK: cute.Tensor,
        sP: cute.Tensor,
        row_factor: cute.Tensor,
        row_stats: cute.Tensor,
        full_bar,
        empty_bar,
        mma_pv: tuple,
        out_at: tuple,
        g0: Int32,
        n_tiles: Int32,
        tidx: Int32,
        sQ_staging: cute.Tensor,
    ):
        """WG1: O[:, WG0_COLS:] = O * factor + P V[:, WG0_COLS:] (one MMA per WG1_TILES
        entry), with P and the factors from WG0."""
        sVt = cute.composition(
            sK, cute.make_ordered_layout((HEAD_DIM, BLOCK_N, NUM_STAGES), order=(1, 0, 2))
        )
        tOrV = []
        tOrP = []
        accs = []
        for (offset, width), mma in zip(WG1_TILES, mma_pv, strict=True):
            thr_pv = mma.get_slice(tidx)
            sV_part = cute.local_tile(sVt, (width, BLOCK_N, NUM_STAGES), (offset // width, 0, 0))
            tOrV.append(thr_pv.make_fragment_B(thr_pv.partition_B(sV_part)))
            tOrP.append(thr_pv.make_fragment_A(thr_pv.partition_A(sP)))
            acc = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, width)), Float32)
            acc.fill(0.0)
            accs.append(acc)
        lane = tidx & 31
        row0 = (tidx >> 5) * 16 + (lane >> 2)

        for tile in cutlass.range(n_tiles, unroll=1):
            g = g0 + tile
            stage = g % NUM_STAGES
            pbuf = g % NUM_P_BUFFERS
            cute.arch.mbarrier_wait(full_bar + stage, (g // NUM_STAGES) % 2)
            cute.arch.barrier(barrier_id=BAR_P_FULL + pbuf, number_of_threads=MMA_THREADS)
            f0 = row_factor[row0, pbuf]
            f1 = row_factor[row0 + 8, pbuf]
            # WG0 moves its running max only now and then (lazy rescaling): in most tiles every
            # factor of this warp's rows is 1, and 192 multiplies a thread would only take issue
            # slots from the producer and WG0 on the same schedulers.
            if cute.arch.vote_any_sync((f0 != 1.0) | (f1 != 1.0)):
                _scale_rows(accs, f0, f1)
            warpgroup.fence()
            _on_stage(
                stage,
                lambda s: self.pv(
                    mma_pv, accs, [p[None, None, None, s % NUM_P_BUFFERS] for p in tOrP], tOrV, s
                ),
            )
            cute.arch.mbarrier_arrive(empty_bar + stage)
            if tile + NUM_P_BUFFERS < n_tiles:
                cute.arch.barrier_arrive(
                    barrier_id=BAR_P_EMPTY + pbuf, number_of_threads=MMA_THREADS
                )

        cute.arch.barrier(barrier_id=BAR_STATS, number_of_threads=MMA_THREADS)
        row_l = cute.make_rmem_tensor((2,), Float32)
        row_m = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            row_l[h] = row_stats[row0 + 8 * h, STAT_SUM]
            row_m[h] = row_stats[row0 + 8 * h, STAT_MAX]
        self.epilogue(
            outputs,
            mSink,
            list(zip(accs, [o for o, _ in WG1_TILES], strict=True)),
            tidx,
            1,
            row_l,
            row_m,
            row_stats,
            out_at,
            sQ_staging,
            False,
        )

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(
        self,
        outputs: tuple,
        mSink: cute.Tensor | None,
        accs: list,
        tidx: Int32,
        wg: cutlass.Constexpr[int],
        row_l: cute.Tensor,
        row_m: cute.Tensor,
        row_stats: cute.Tensor,
        out_at: tuple,
        sQ_staging: cute.Tensor,
        write_lse: cutlass.Constexpr[bool],
    ):
        """Normalize this warpgroup's output columns (``accs``: (accumulator, first column)
        pairs), stage them in SMEM, then both MMA warpgroups (``wg`` 0, 1) store the 64 x 512
        tile (and WG0 the lse) in 16-byte chunks: to the final output (bf16, sink applied) or to
        a partial (fp16 rows scaled by 2^k, ``[lse, k]`` beside them: split ``split`` of
        ``[S, T, H]``, or, balanced, slot ``slot`` of ``[slots, H]`` when ``slot`` >= 0).
        ``outputs``: (mO, mLse, mOpart, mLsePart); ``out_at``: (token, head block, split, slot)
        of this item, as the consumers get it."""
        mO, mLse, mOpart, mLsePart = outputs
        token, head_block, split, slot = out_at
        tile = (mSink, accs, tidx, wg, row_l, row_m, row_stats, head_block, sQ_staging, write_lse)
        if const_expr(self.cfg.balanced):
            # Both warpgroups take the same branch: the slot is the CTA's.
            if slot >= 0:
                self.store_output(mOpart, mLsePart, mOpart.shape[1], Int64(slot), True, tile)
            else:
                self.store_output(mO, mLse, mO.shape[1], Int64(token), False, tile)
        elif const_expr(self.cfg.write_partial):
            # Output row of head h: out_token * num_heads + h (split-major [S, T, H]).
            out_token = Int64(split) * mO.shape[1] + token
            self.store_output(mO, mLse, mO.shape[2], out_token, True, tile)
        else:
            self.store_output(mO, mLse, mO.shape[1], Int64(token), False, tile)

    @cute.jit
    def store_output(
        self,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        num_heads: Int32,
        out_token: Int64,
        partial: cutlass.Constexpr[bool],
        tile: tuple,
    ):
        """The body of :meth:`epilogue` for one destination: head h of this CTA goes to row
        ``out_token * num_heads + h`` of ``mO`` (and ``mLse``); ``partial``: fp16 scaled rows,
        ``[lse, k]`` pairs, no sink. ``tile``: the rest of :meth:`epilogue`'s arguments, as it
        packs them."""
        (mSink, accs, tidx, wg, row_l, row_m, row_stats, head_block, sQ_staging, write_lse) = tile
        lane = tidx & 31
        row0 = (tidx >> 5) * 16 + (lane >> 2)
        out_base = mO.iterator.toint()
        factor = cute.make_rmem_tensor((2,), Float32)
        lse_nat = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            l_val = row_l[h]
            has_keys = l_val > 0.0
            lse2 = row_m[h] + ptx_ops.log2_approx(l_val)
            lse2 = Float32(cutlass.select_(has_keys, lse2, Float32(-math.inf)))
            lse_nat[h] = lse2 * LN2
            f = Float32(cutlass.select_(has_keys, ptx_ops.rcp_approx(l_val), Float32(0.0)))
            if const_expr(self.cfg.has_sink and not partial):
                head = head_block * BLOCK_H + row0 + 8 * h
                sink = Float32(mSink[cutlass.min(head, num_heads - 1)])
                # out = o_real * sigmoid(lse - sink); exp2(+inf) = inf gives 0 for sink = +inf.
                f = f * ptx_ops.rcp_approx(1.0 + ptx_ops.exp2_approx(sink * LOG2E - lse2))
                f = Float32(cutlass.select_(has_keys, f, Float32(0.0)))
            factor[h] = f
        if const_expr(partial):
            # This warpgroup's largest |normalized output| per row, for the row's scale: over
            # eight independent maxima (not one chain of 32-96 dependent FMNMX), and only in
            # warps holding rows of real heads (a warp's 16 rows: all or none padding;
            # the test is the warp's, so its quad shuffles need no divergence guard).
            warp_row0 = cute.arch.make_warp_uniform((tidx >> 5) * 16)
            if head_block * BLOCK_H + warp_row0 < num_heads:
                for h in cutlass.range_constexpr(2):
                    values = [
                        acc_o[j * 4 + h * 2 + v]
                        for acc_o, _ in accs
                        for j in range(cute.size(acc_o) // 4)
                        for v in range(2)
                    ]
                    absmax = quad_max(_largest_magnitude(values)) * factor[h]
                    if (lane & 3) == 0:
                        row_stats[row0 + 8 * h, STAT_ABSMAX + wg] = absmax
        elif const_expr(write_lse):
            self.store_lse(mLse, num_heads, out_token, head_block, row0, lane, lse_nat, None)

        # The staging area overlaps Q and the K/V stages: wait until both warpgroups are past
        # their last MMA (and have published their row maxima), write the fragments, wait until
        # the whole tile is in SMEM.
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=MMA_THREADS)
        if const_expr(partial):
            # Row scale 2^k: the row's largest magnitude to [2^TOP, 2^(TOP + 1)) (exponent bits,
            # exact), k clamped (see sparse_decode_config); a row of zeros takes the top k.
            k_row = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                absmax = cute.arch.fmax(
                    row_stats[row0 + 8 * h, STAT_ABSMAX], row_stats[row0 + 8 * h, STAT_ABSMAX + 1]
                )
                biased = Int32((ptx_ops.f32_to_bits(absmax) >> 23) & 0xFF)
                k_exp = Int32(127 + PARTIAL_TOP_LOG2) - biased
                k_exp = cutlass.min(
                    cutlass.max(k_exp, Int32(PARTIAL_MIN_LOG2)), Int32(PARTIAL_MAX_LOG2)
                )
                k_row[h] = Float32(k_exp)
                factor[h] = factor[h] * ptx_ops.bits_to_f32(Uint32(k_exp + 127) << 23)
            if const_expr(write_lse):
                self.store_lse(mLse, num_heads, out_token, head_block, row0, lane, lse_nat, k_row)
        staging = sQ_staging.iterator.toint()  # Q, then the K/V stages and P: ~200 KB
        # wgmma accumulator layout: register 4j + 2h + v holds row (row0 + 8h), column
        # 8j + 2 (lane % 4) + v of the accumulator's columns.
        # Only the rows of real heads (fewer than 64 with tensor-parallel shards) are staged
        # and copied.
        for acc_o, col_offset in accs:
            for h in cutlass.range_constexpr(2):
                if head_block * BLOCK_H + row0 + 8 * h < num_heads:
                    row_at = staging + (row0 + 8 * h) * STAGE_ROW_BYTES
                    for j in cutlass.range_constexpr(cute.size(acc_o) // 4):
                        idx = j * 4 + h * 2
                        v0 = acc_o[idx] * factor[h]
                        v1 = acc_o[idx + 1] * factor[h]
                        col = col_offset + 8 * j + 2 * (lane & 3)
                        if const_expr(partial):
                            pair = ptx_ops.cvt_f16x2_f32(v0, v1)
                        else:
                            pair = ptx_ops.cvt_bf16x2_f32(v0, v1)
                        ptx_ops.st_shared_b32(row_at + col * 2, pair)
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=MMA_THREADS)

        # 16-byte chunks, a warp's 32 consecutive chunks along one row. A partial row without
        # keys stays unwritten: the combine gives it weight 0 from lse = -inf, never reads it.
        chunks_per_row = HEAD_DIM * 2 // 16
        copy_tid = tidx + wg * 128
        rows = cutlass.min(num_heads - head_block * BLOCK_H, Int32(BLOCK_H))
        copies = (rows * chunks_per_row + MMA_THREADS - 1) // MMA_THREADS
        for i in cutlass.range(copies, unroll=1):
            chunk = copy_tid + i * MMA_THREADS
            row = chunk // chunks_per_row
            k = chunk % chunks_per_row
            out_head = head_block * BLOCK_H + row
            if out_head < num_heads:
                write = True
                if const_expr(partial):
                    write = row_stats[row, STAT_SUM] > 0.0
                if write:
                    row_index = out_token * num_heads + out_head
                    words = ptx_ops.ld_shared_v4(staging + row * STAGE_ROW_BYTES + k * 16)
                    row_addr = out_base + row_index * (chunks_per_row * 16)
                    ptx_ops.st_global_v4_b32(row_addr + k * 16, *words)

    @cute.jit
    def store_lse(self, mLse, num_heads, out_token, head_block, row0, lane, lse_nat, k_row):
        """WG0: this thread's two rows' lse (natural log) to ``mLse``: one float per row, or,
        for a partial (``k_row`` given), the pair (lse, k) of the row's fp16 scale 2^k."""
        lse_base = mLse.iterator.toint()
        for h in cutlass.range_constexpr(2):
            head = head_block * BLOCK_H + row0 + 8 * h
            if head < num_heads:  # noqa: SIM102
                if (lane & 3) == 0:
                    row_index = out_token * num_heads + head
                    if const_expr(k_row is None):
                        ptx_ops.st_global_f32(lse_base + row_index * 4, lse_nat[h])
                    else:
                        ptx_ops.st_global_v2_f32(lse_base + row_index * 8, lse_nat[h], k_row[h])
