"""Parameterized fused multi-head attention forward for Hopper (sm_90a), written in CuTeDSL.

One kernel class, :class:`FmhaSm90`, specialised at compile time by head dimension, dense or
index-gathered KV, mask kind (none / causal / causal + sliding window), mainloop and tile shapes.
Every CTA has 3 warpgroups: warpgroup 0 loads (TMA for Q and dense K/V, ``cp.async`` for gathered
rows), warpgroups 1 and 2 compute. Two mainloops share the producer, the masks and the epilogue:

* **row split** (head_dim <= 256, dense only): the FA3 design. The CTA owns ``tile_m = 128``
  query rows, each compute warpgroup 64 of them with the whole ``64 x D`` output in registers.
  ``S = Q K^T`` from shared memory, ``O += P V`` with P straight from registers (RS wgmma).
  Either intra-warpgroup pipelining (the next tile's QK is in flight during this tile's softmax
  and PV) or a strict ping-pong of the two warpgroups on the tensor cores (named barriers).
* **column split** (head_dim 512; docs/design.md §4.2): a ``64 x 512`` fp32 output is half the
  register file and a wgmma has N <= 256, so the CTA owns 64 query rows (dense: positions of one
  head; gather: 64 heads of one token) and each warpgroup owns 256 output columns (multi-PV-tile).
  KV is consumed in steps of two 64-row tiles a and b; warpgroup 1 (the lead) computes ``S_a``,
  warpgroup 2 (the follower) ``S_b``, staggered: the lead's softmax runs against its own running max
  while the follower's QK runs, the follower merges the two maxima while the lead's PV runs; each
  multiplies its own P tile from registers and the other's through shared memory (SMEM-P), both with
  its half of V, and the lead issues the next step's QK behind its last PV. Maxima are lazy (they
  move only by more than 2^8). K and V are the same rows (MQA latent, DeepSeek-V4), so one tile of
  shared memory serves as both; it is split into four 32 KB column halves (aL, aR, bL, bR) with
  their own barriers so that the producer refills a half as soon as its last reader is done.
  Gathered rows come by ``cp.async``, 8 threads per 128-byte swizzle-atom row; Q is loaded
  evict-first and O stored streaming, so K/V rows stay in L2. The gathered kernel is persistent: one
  CTA per SM walks its share of the (token, head block) items, the barrier phases running on across
  them; the next item's Q is loaded as soon as the last QK of the current one is done and its first
  rows stream in during the last PVs, so a CTA's start-up (Q, index lists, first rows) hides behind
  the previous item's end. Its O leaves through each warp's rows of the P tiles, not Q's buffer.

Semantics (checked against ``dsv4_attn.reference``): ``s = scale * <q, k>``; masked or invalid
keys are dropped; ``lse = log(sum exp(s))`` (natural log, sink excluded, ``-inf`` with no valid
key); ``out = sum exp(s) v / (sum exp(s) + exp(sink[h]))``, 0 with no valid key. Causal masks are
bottom-right aligned: query ``i`` of a sequence with ``Sq`` queries and ``Sk`` keys sees key ``j``
iff ``j <= i + Sk - Sq``; a window ``w`` further requires ``j > i + Sk - Sq - w``.
"""

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from dsv4_attn.kernels import fmha_sm90_utils as fu
from dsv4_attn.kernels import ptx_ops

__all__ = ["FmhaSm90"]

# Named barrier ids (0 is __syncthreads).
_BAR_EPILOGUE = 1  # all 256 compute threads
_BAR_SCHED_WG1 = 2  # ping-pong turn of compute warpgroup 1 (row split)
_BAR_SCHED_WG2 = 3  # ping-pong turn of compute warpgroup 2 (row split)
_BAR_MAX_LEAD = 4  # column split: the lead warpgroup published its running row max
_BAR_MAX_FOLLOW = 5  # column split: the follower published the merged row max
_BAR_SUM = 6  # column split: both warpgroups published their row sums
_BAR_P_LEAD = 7  # column split: the lead's P tile is in shared memory
_BAR_P_FOLLOW = 8  # column split: the follower's P tile is in shared memory
# Initial running max of the column split, in log2 units: finite, so exp2(old - new) is 0 or 1,
# never NaN, and far below any score bf16 inputs produce.
_MAX_INIT = -1.0e30
# Lazy rescaling of the column split: the running max moves only when a score passes it by more
# than this (log2 units), so P <= 2^8.
_RESCALE_LOG2 = 8.0

_THREADS_PER_WG = 128
_SPLIT_THREADS = 2 * _THREADS_PER_WG  # the two compute warpgroups (named-barrier count)
_HALF_BYTES = 64 * 256 * 2  # one K/V half of the column split: 64 rows x 256 bf16
_GATHER_ROWS = 64  # rows per gathered KV tile (one warpgroup's S tile)
# Registers per thread at launch: 64K / 384 threads, rounded down to ptxas's granule of 8.
_LAUNCH_REGS = 168


class _SplitOperands(NamedTuple):
    """What both column-split mainloops read and never rebind: MMAs, fragments, barriers."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma  # P from shared memory (the other warpgroup's tile)
    mma_pv_rs: cute.TiledMma  # P from registers (this warpgroup's own tile)
    tSrQ: cute.Tensor
    tSrK: cute.Tensor  # (MMA, N, K, 4 halves)
    tOrP: cute.Tensor  # (MMA, M, K, 2 P tiles)
    tOrV: cute.Tensor  # (MMA, N, K, 4 halves)
    tOrV_rs: cute.Tensor
    copy_p: cute.ThrCopy  # registers -> sP (stmatrix)
    tPsP: cute.Tensor
    t_coord: cute.Tensor  # (row, col) of each S accumulator element
    s_max: cute.Tensor  # [64] fp32: the running max handed between the warpgroups
    mbar_full: cute.Pointer
    mbar_empty: cute.Pointer
    mbar_q_empty: cute.Pointer | None  # gathered: Q's buffer may be refilled


class _RowsOperands(NamedTuple):
    """What both row-split mainloops and their tile step read and never rebind: MMAs, fragments,
    this warpgroup's accumulators (updated in place), barriers and the tile's coordinates."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor  # (MMA, N, K, stage)
    tOrVt: cute.Tensor  # (MMA, N, K, stage)
    acc_o: cute.Tensor  # O, fp32
    shape_s: tuple  # one S tile's accumulator shape
    t_coord: cute.Tensor  # (row, col) of each S accumulator element
    row_max: cute.Tensor
    row_sum: cute.Tensor
    kv_barriers: tuple  # (K full, K empty, V full, V empty) mbarrier arrays
    scale_log2: Float32
    window: Int32  # the sliding window's width (local masks)
    m_block: Int32
    row0: Int32  # first query row of the tile
    seqlen_q: Int32
    seqlen_k: Int32
    wg: Int32  # which 64 rows of the tile this warpgroup owns


class FmhaSm90:
    """Compile-time configuration of one FMHA kernel variant.

    Args:
        head_dim: D = Dv, one of 64, 128, 192, 256 (row split) or 512 (column split).
        gather: KV rows come from ``kv[indices[t, :lens[t]]]`` (sparse prefill, MQA) instead of
            dense ``[total_k, Hk, D]`` tensors. Needs ``head_dim == 512``.
        kv_shared: K and V are the same tensor (column split only; always true for gather).
        causal: bottom-right aligned causal mask (dense only).
        local: sliding window on top of the causal mask (dense only; window size at run time).
        tile_m: query rows per CTA (128 row split, 64 column split).
        tile_n: keys per KV tile (per warpgroup S tile in the column split: 64).
        num_stages: K/V pipeline depth of the row split.
        intra_wg_overlap: row split only: issue the next tile's QK before this tile's PV so a
            warpgroup's softmax overlaps its own PV (FA3's intra-warpgroup pipelining). When
            off, the two warpgroups strictly alternate on the tensor cores (ping-pong).
    """

    def __init__(
        self,
        head_dim: int,
        *,
        gather: bool = False,
        kv_shared: bool = False,
        causal: bool = False,
        local: bool = False,
        tile_m: int | None = None,
        tile_n: int | None = None,
        num_stages: int = 2,
        intra_wg_overlap: bool = True,
    ):
        if head_dim not in (64, 128, 192, 256, 512):
            raise ValueError(f"head_dim must be 64, 128, 192, 256 or 512, got {head_dim}")
        self.head_dim = head_dim
        self.split_cols = head_dim > 256
        if gather and not self.split_cols:
            raise ValueError("the gathered (sparse) kernel needs head_dim 512")
        if gather and (causal or local):
            raise ValueError("the gathered kernel takes no causal/window mask")
        if local and not causal:
            raise ValueError("a sliding window is defined on top of the causal mask")
        if self.split_cols and not (kv_shared or gather):
            raise ValueError("head_dim 512 needs K and V to be the same tensor")
        self.gather = gather
        self.kv_shared = kv_shared or gather
        self.causal = causal
        self.local = local
        if self.split_cols:
            self.tile_m = 64 if tile_m is None else tile_m
            self.tile_n = _GATHER_ROWS if tile_n is None else tile_n
            if (self.tile_m, self.tile_n) != (64, 64):
                raise ValueError("the column-split kernel uses 64 x 64 tiles")
            self.num_stages = 1
        else:
            default_n = {64: 128, 128: 128, 192: 112, 256: 80}[head_dim]
            self.tile_m = 128 if tile_m is None else tile_m
            self.tile_n = default_n if tile_n is None else tile_n
            if self.tile_m != 128:
                raise ValueError("the row-split kernel uses tile_m = 128 (2 x 64 rows)")
            if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
                raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {tile_n}")
            self.num_stages = num_stages
        self.intra_wg_overlap = intra_wg_overlap and not self.split_cols
        # Ping-pong scheduling between the compute warpgroups (row split). With the overlap it
        # only pays for small head dims (FA3/FA4 heuristics).
        self.use_sched_barrier = not self.split_cols and (
            not self.intra_wg_overlap or head_dim <= 128
        )
        self.dtype = cutlass.BFloat16
        self.num_threads = 3 * _THREADS_PER_WG
        # Register split between the producer and the two compute warpgroups. setmaxnreg moves
        # registers within the CTA's pool, which holds what the launch allotted (384 threads x
        # 168, ptxas's count at one CTA per SM), not the SM's 64K: mma + mma + producer must
        # not exceed 3 x 168 = 504. Past that, setmaxnreg.inc waits forever for registers no
        # warp releases (the gathered variant once asked for 2 x 224 + 64 = 512 and hung).
        if self.split_cols:
            # The cp.async gather needs more producer registers than TMA does.
            self.regs_mma, self.regs_producer = (224, 56) if gather else (232, 40)
        else:
            self.regs_mma, self.regs_producer = 240, 24
        pool = (self.num_threads // _THREADS_PER_WG) * _LAUNCH_REGS
        if 2 * self.regs_mma + self.regs_producer > pool:
            raise ValueError(
                f"setmaxnreg split 2 x {self.regs_mma} + {self.regs_producer} exceeds the "
                f"{pool} (3 warpgroups x {_LAUNCH_REGS} registers at launch)"
            )

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor | None,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSink: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mIndices: cute.Tensor | None,
        mLens: cute.Tensor | None,
        softmax_scale: Float32,
        window: Int32,
        max_seqlen_q: Int32,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        """Build layouts and TMA descriptors, then launch.

        Dense: ``mQ``/``mO`` ``[total_q, H, D]``, ``mK``/``mV`` ``[total_k, Hk, D]`` (``mV`` None
        when ``kv_shared``), ``mLSE`` ``[total_q, H]`` fp32, cumulative sequence offsets
        ``mCuSeqlensQ``/``mCuSeqlensK`` ``[B + 1]`` int32, ``max_seqlen_q`` sizes the grid.
        Gather: ``mQ``/``mO`` ``[T, H, 512]``, ``mK`` = kv ``[N, 512]``, ``mLSE`` ``[T, H]``,
        ``mIndices`` ``[T, K]`` int32 (-1 = skip), ``mLens`` ``[T]`` int32; ``max_ctas`` caps
        the grid (one CTA per SM: each walks its share of the (token, head block) items;
        ignored when dense).
        ``mSink`` ``[H]`` fp32 (``-inf`` = no sink). bf16 data, fp32 LSE.
        """
        D = self.head_dim
        if const_expr(self.gather):
            # Rows of a Q tile are the heads of one token: (H, D, T).
            q3 = fu.select_modes(mQ, [1, 2, 0])
            o3 = fu.select_modes(mO, [1, 2, 0])
            lse2 = fu.select_modes(mLSE, [1, 0])
            k3 = mK
            v3 = None
        else:
            # Rows of a Q tile are positions of one head: (total_q, D, H).
            q3 = fu.select_modes(mQ, [0, 2, 1])
            o3 = fu.select_modes(mO, [0, 2, 1])
            lse2 = mLSE
            k3 = fu.select_modes(mK, [0, 2, 1])
            v3 = None if const_expr(self.kv_shared) else fu.select_modes(mV, [0, 2, 1])

        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        sQ_layout = fu.smem_layout_rowmajor(self.dtype, self.tile_m, D)
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(tma_op, q3, sQ_layout, (self.tile_m, D))

        if const_expr(self.split_cols):
            # KV: 2 tiles x (64 rows x 512) as 4 buffers of one column half (64 x 256) each.
            sKV_half_layout = fu.smem_layout_rowmajor(self.dtype, self.tile_n, D // 2, 4)
            sP_layout = fu.smem_layout_rowmajor(self.dtype, self.tile_m, self.tile_n, 2)
            tma_atom_k, tma_k = None, None
            if const_expr(not self.gather):
                tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
                    tma_op,
                    k3,
                    cute.select(sKV_half_layout, mode=[0, 1]),
                    (self.tile_n, D // 2),
                )
            tma_atom_v, tma_v = None, None
            tiled_mma_qk = fu.warpgroup_mma(self.dtype, self.tile_n, warpgroup.OperandMajorMode.K)
            tiled_mma_pv = fu.warpgroup_mma(self.dtype, D // 2, warpgroup.OperandMajorMode.MN)
            # The warpgroup's own P tile goes straight from registers (RS); the other one
            # comes through shared memory (SS, above).
            tiled_mma_pv_rs = fu.warpgroup_mma(
                self.dtype, D // 2, warpgroup.OperandMajorMode.MN, a_in_registers=True
            )
            SharedStorage = self._shared_storage_split(sQ_layout, sKV_half_layout, sP_layout)
            sK_layout = sV_layout = sKV_half_layout  # sV_layout: unused by the split
        else:
            sK_layout = fu.smem_layout_rowmajor(self.dtype, self.tile_n, D, self.num_stages)
            sV_layout = sK_layout
            sP_layout = None
            tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
                tma_op, k3, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, D)
            )
            tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
                tma_op, v3, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, D)
            )
            warpgroups = self.tile_m // 64
            tiled_mma_qk = fu.warpgroup_mma(
                self.dtype, self.tile_n, warpgroup.OperandMajorMode.K, warpgroups=warpgroups
            )
            tiled_mma_pv = fu.warpgroup_mma(
                self.dtype,
                D,
                warpgroup.OperandMajorMode.MN,
                a_in_registers=True,
                warpgroups=warpgroups,
            )
            tiled_mma_pv_rs = None
            SharedStorage = self._shared_storage_rows(sQ_layout, sK_layout, sV_layout)

        # Dynamic shared memory of the launch (read by the interface's resource checks).
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.k_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))

        if const_expr(self.gather):
            # Persistent: CTA c takes items c, c + grid, ... (item = token * head blocks + head
            # block, so the head blocks of a token, which read the same KV rows, are neighbours
            # and run at the same time).
            num_heads = cute.size(mQ.shape[1])
            num_items = cute.size(mQ.shape[0]) * cute.ceil_div(num_heads, self.tile_m)
            grid = (cutlass.min(num_items, max_ctas), 1, 1)
        else:
            grid = (
                cute.ceil_div(max_seqlen_q, self.tile_m),
                cute.size(mQ.shape[1]),
                cute.size(mCuSeqlensQ.shape[0]) - 1,
            )
        scale_log2 = softmax_scale * fu.LOG2_E
        self.kernel(
            tma_q,
            tma_k,
            tma_v,
            k3,
            o3,
            lse2,
            mSink,
            mCuSeqlensQ,
            mCuSeqlensK,
            mIndices,
            mLens,
            tma_atom_q,
            tma_atom_k,
            tma_atom_v,
            scale_log2,
            window,
            sQ_layout,
            sK_layout,
            sV_layout,
            sP_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            tiled_mma_pv_rs,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _shared_storage_rows(self, sQ_layout, sK_layout, sV_layout):
        stages = self.num_stages

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_k_full: cute.struct.MemRange[cutlass.Int64, stages]
            mbar_k_empty: cute.struct.MemRange[cutlass.Int64, stages]
            mbar_v_full: cute.struct.MemRange[cutlass.Int64, stages]
            mbar_v_empty: cute.struct.MemRange[cutlass.Int64, stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        return SharedStorage

    def _shared_storage_split(self, sQ_layout, sKV_half_layout, sP_layout):
        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_q_empty: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_kv_full: cute.struct.MemRange[cutlass.Int64, 4]
            mbar_kv_empty: cute.struct.MemRange[cutlass.Int64, 4]
            row_max: cute.struct.MemRange[Float32, 64]
            # [row, warpgroup, item parity]: a CTA's next item may publish its sums before the
            # other warpgroup has read this item's.
            row_sum: cute.struct.MemRange[Float32, 2 * 2 * 64]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sKV_half_layout)], 1024
            ]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        return SharedStorage

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor | None,
        mV: cute.Tensor | None,
        mKV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSink: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mIndices: cute.Tensor | None,
        mLens: cute.Tensor | None,
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom | None,
        tma_atom_v: cute.CopyAtom | None,
        scale_log2: Float32,
        window: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout | None,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tiled_mma_pv_rs: cute.TiledMma | None,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, bidz = cute.arch.block_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            if const_expr(tma_atom_k is not None):
                cpasync.prefetch_descriptor(tma_atom_k)
            if const_expr(tma_atom_v is not None):
                cpasync.prefetch_descriptor(tma_atom_v)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        mbar_q = storage.mbar_q.data_ptr()
        if const_expr(self.split_cols):
            mbar_full = storage.mbar_kv_full.data_ptr()
            mbar_empty = storage.mbar_kv_empty.data_ptr()
            mbar_q_empty = storage.mbar_q_empty.data_ptr()
            if warp_idx == 0:
                fu.mbar_init(mbar_q, 1, 1)
                # Gathered: Q's buffer is free again once the 8 compute warps' last QK is done.
                fu.mbar_init(mbar_q_empty, 1, 8)
                # gather: every producer thread arrives through cp.async; TMA: one thread.
                fu.mbar_init(mbar_full, 4, _THREADS_PER_WG if self.gather else 1)
                # Each half is released by the 4 warps of the one warpgroup that reads it last.
                fu.mbar_init(mbar_empty, 4, 4)
        else:
            mbar_k_full = storage.mbar_k_full.data_ptr()
            mbar_k_empty = storage.mbar_k_empty.data_ptr()
            mbar_v_full = storage.mbar_v_full.data_ptr()
            mbar_v_empty = storage.mbar_v_empty.data_ptr()
            kv_barriers = (mbar_k_full, mbar_k_empty, mbar_v_full, mbar_v_empty)
            if warp_idx == 0:
                fu.mbar_init(mbar_q, 1, 1)
                fu.mbar_init(mbar_k_full, self.num_stages, 1)
                fu.mbar_init(mbar_v_full, self.num_stages, 1)
                # Both compute warpgroups read every stage: 8 warps release it.
                fu.mbar_init(mbar_k_empty, self.num_stages, 8)
                fu.mbar_init(mbar_v_empty, self.num_stages, 8)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if const_expr(self.gather):
            # Persistent CTAs: the items of this CTA are walked inside the roles.
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.regs_producer)
                self._produce_gather(
                    (mQ, mKV, mIndices, mLens),
                    tma_atom_q,
                    (sQ, storage, sK_layout),
                    (mbar_q, mbar_q_empty, mbar_full, mbar_empty),
                    warp_idx,
                    tidx,
                )
            else:
                cute.arch.setmaxregister_increase(self.regs_mma)
                # No dense tile: the items (token, head block) come from the lists.
                self._consume_split(
                    (tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs),
                    (sQ, storage, sK_layout, sP_layout),
                    (mbar_q, mbar_q_empty, mbar_full, mbar_empty),
                    (mO, mLSE, mSink),
                    ((mIndices, Int32(mKV.shape[0])), mLens),
                    scale_log2,
                    window,
                    None,
                    tidx - _THREADS_PER_WG,
                )
        else:
            # ---- this CTA's tile and KV range (identical in every thread) --------------------
            # Longest (causal) tiles first: reverse the m order.
            m_block = cute.arch.grid_dim()[0] - 1 - bidx
            head = bidy
            batch = bidz
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
            row_limit = seqlen_q - m_block * self.tile_m
            q_row0 = offset_q + m_block * self.tile_m
            q_l = head
            head_kv = head // (cute.size(mO.shape[2]) // cute.size(mKV.shape[2]))
            n_min, n_max = self._kv_block_range(m_block, seqlen_q, seqlen_k, window)
            dense_tile = (m_block, q_row0, q_l, row_limit, seqlen_q, seqlen_k, n_min, n_max)
            if row_limit > 0:
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.regs_producer)
                    if const_expr(self.split_cols):
                        self._produce_split(
                            (mQ, mK),
                            (tma_atom_q, tma_atom_k),
                            (sQ, storage, sK_layout),
                            (mbar_q, mbar_full, mbar_empty),
                            (q_row0, q_l, offset_k, head_kv, n_min, n_max),
                            warp_idx,
                        )
                    else:
                        self._produce_rows(
                            (mQ, mK, mV),
                            (tma_atom_q, tma_atom_k, tma_atom_v),
                            (sQ, storage, sK_layout, sV_layout),
                            (mbar_q, kv_barriers),
                            (q_row0, q_l, offset_k, head_kv, n_min, n_max),
                            warp_idx,
                        )
                else:
                    cute.arch.setmaxregister_increase(self.regs_mma)
                    ctidx = tidx - _THREADS_PER_WG
                    if const_expr(self.split_cols):
                        self._consume_split(
                            (tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs),
                            (sQ, storage, sK_layout, sP_layout),
                            (mbar_q, None, mbar_full, mbar_empty),
                            (mO, mLSE, mSink),
                            ((None, None), mLens),
                            scale_log2,
                            window,
                            dense_tile,
                            ctidx,
                        )
                    else:
                        self._consume_rows(
                            (tiled_mma_qk, tiled_mma_pv),
                            (sQ, storage, sK_layout, sV_layout),
                            (mbar_q, kv_barriers),
                            (mO, mLSE, mSink),
                            scale_log2,
                            window,
                            dense_tile,
                            ctidx,
                        )

    # ---- KV range and masks ------------------------------------------------------------------
    @cute.jit
    def _kv_block_range(self, m_block, seqlen_q, seqlen_k, window):
        """``[n_min, n_max)`` KV tiles the query rows of ``m_block`` can see (may be empty)."""
        n_max = cute.ceil_div(seqlen_k, self.tile_n)
        n_min = Int32(0)
        if const_expr(self.causal):
            # Last key visible to the last row of the tile, exclusive.
            last = (m_block + 1) * self.tile_m + seqlen_k - seqlen_q
            last = cutlass.min(last, seqlen_k)
            n_max = cute.ceil_div(cutlass.max(last, 0), self.tile_n)
        if const_expr(self.local):
            first = m_block * self.tile_m + seqlen_k - seqlen_q - window + 1
            n_min = cutlass.max(first, 0) // self.tile_n
        return n_min, n_max

    @cute.jit
    def _block_needs_mask(self, m_block, n_block, seqlen_q, seqlen_k, window) -> Boolean:
        """Whether KV tile ``n_block`` holds any key some row of ``m_block`` must not see."""
        key_end = (n_block + 1) * self.tile_n
        needs = key_end > seqlen_k
        if const_expr(self.causal):
            # The first row of the tile sees keys up to m_block*tile_m + off.
            first_row_last_key = m_block * self.tile_m + seqlen_k - seqlen_q
            needs = needs or (key_end - 1 > first_row_last_key)
        if const_expr(self.local):
            last_row_first_key = (m_block + 1) * self.tile_m - 1 + seqlen_k - seqlen_q - window + 1
            needs = needs or (n_block * self.tile_n < last_row_first_key)
        return needs

    @cute.jit
    def _apply_mask(self, acc_s, t_coord, row0, col0, seqlen_q, seqlen_k, window):
        """Set masked scores to -inf. ``t_coord``: identity partition (row, col) in the tile;
        ``row0``/``col0``: position of the tile's first query row / key in the sequence."""
        acc_mn = fu.acc_as_mn(acc_s)
        c_mn = fu.acc_as_mn(t_coord)
        off = seqlen_k - seqlen_q
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            row = row0 + c_mn[r, 0][0]
            col_end = seqlen_k
            if const_expr(self.causal):
                col_end = cutlass.min(col_end, row + off + 1)
            col_begin = Int32(0)
            if const_expr(self.local):
                col_begin = row + off - window + 1
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                col = col0 + c_mn[0, c][1]
                if col >= col_end or col < col_begin:
                    acc_mn[r, c] = -Float32.inf

    # ---- producers ---------------------------------------------------------------------------
    @cute.jit
    def _tile_needs_mask(self, ops: _RowsOperands, n_block) -> Boolean:
        """:meth:`_block_needs_mask` for KV tile ``n_block`` of the row split's tile ``ops``."""
        return self._block_needs_mask(ops.m_block, n_block, ops.seqlen_q, ops.seqlen_k, ops.window)

    @cute.jit
    def _mask_tile(self, ops: _RowsOperands, acc_s, n_block):
        """:meth:`_apply_mask` of S tile ``acc_s`` against KV tile ``n_block``."""
        self._apply_mask(
            acc_s,
            ops.t_coord,
            ops.row0,
            n_block * self.tile_n,
            ops.seqlen_q,
            ops.seqlen_k,
            ops.window,
        )

    @cute.jit
    def _load_q(self, mQ, tma_atom_q, sQ, mbar_q, q_row0, q_l):
        gQ = cute.local_tile(
            cute.domain_offset((q_row0, 0), mQ[None, None, q_l]),
            (self.tile_m, self.head_dim),
            (0, 0),
        )
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q,
            0,
            cute.make_layout(1),
            cute.group_modes(sQ, 0, 2),
            cute.group_modes(gQ, 0, 2),
        )
        fu.mbar_expect_tx(mbar_q, 0, self.q_bytes)
        # Q is read by this CTA only: evict it first, so that the K/V rows other CTAs read again
        # stay in L2.
        cute.copy(
            tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=mbar_q, cache_policy=ptx_ops.l2_policy_evict_first()
        )

    @cute.jit
    def _produce_rows(self, inputs, tma_atoms, smem, barriers, coords, warp_idx):
        """TMA producer of the row split: Q once, then K and V tiles from ``n_max - 1`` down.
        ``inputs``: (mQ, mK, mV); ``tma_atoms``: theirs; ``smem``: (sQ, storage, sK layout, sV
        layout); ``barriers``: (Q's, (K full, K empty, V full, V empty)); ``coords``: (q_row0,
        q_l, offset_k, head_kv, n_min, n_max)."""
        mQ, mK, mV = inputs
        tma_atom_q, tma_atom_k, tma_atom_v = tma_atoms
        sQ, storage, sK_layout, sV_layout = smem
        mbar_q, kv_barriers = barriers
        q_row0, q_l, offset_k, head_kv, n_min, n_max = coords
        mbar_k_full, mbar_k_empty, mbar_v_full, mbar_v_empty = kv_barriers
        if warp_idx == 0:
            self._load_q(mQ, tma_atom_q, sQ, mbar_q, q_row0, q_l)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            tile = (self.tile_n, self.head_dim)
            gK = cute.local_tile(
                cute.domain_offset((offset_k, 0), mK[None, None, head_kv]), tile, (None, 0)
            )
            gV = cute.local_tile(
                cute.domain_offset((offset_k, 0), mV[None, None, head_kv]), tile, (None, 0)
            )
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom_k,
                0,
                cute.make_layout(1),
                cute.group_modes(sK, 0, 2),
                cute.group_modes(gK, 0, 2),
            )
            tVsV, tVgV = cpasync.tma_partition(
                tma_atom_v,
                0,
                cute.make_layout(1),
                cute.group_modes(sV, 0, 2),
                cute.group_modes(gV, 0, 2),
            )
            for i in cutlass.range(n_max - n_min, unroll=1):
                n_block = n_max - 1 - i
                stage = i % self.num_stages
                phase = (i // self.num_stages) & 1
                fu.mbar_wait(mbar_k_empty, stage, phase ^ 1)
                fu.mbar_expect_tx(mbar_k_full, stage, self.k_bytes)
                cute.copy(
                    tma_atom_k,
                    tKgK[None, n_block],
                    tKsK[None, stage],
                    tma_bar_ptr=mbar_k_full + stage,
                )
                fu.mbar_wait(mbar_v_empty, stage, phase ^ 1)
                fu.mbar_expect_tx(mbar_v_full, stage, self.k_bytes)
                cute.copy(
                    tma_atom_v,
                    tVgV[None, n_block],
                    tVsV[None, stage],
                    tma_bar_ptr=mbar_v_full + stage,
                )

    # ---- row-split consumer --------------------------------------------------------------------
    @cute.jit
    def _consume_rows(self, mmas, smem, barriers, outputs, scale_log2, window, tile, ctidx):
        """Both MMA warpgroups of the row split on the CTA's ``tile`` (``(m_block, q_row0, q_l,
        row_limit, seqlen_q, seqlen_k, n_min, n_max)``): the mainloop over its KV tiles, then
        the epilogue. ``mmas``: (QK, PV) tiled MMAs; ``smem``: (sQ, storage, sK layout, sV
        layout); ``barriers``: (Q's, (K full, K empty, V full, V empty)); ``outputs``: (mO,
        mLSE, mSink)."""
        tiled_mma_qk, tiled_mma_pv = mmas
        sQ, storage, sK_layout, sV_layout = smem
        mbar_q, kv_barriers = barriers
        mO, mLSE, mSink = outputs
        m_block, q_row0, q_l, row_limit, seqlen_q, seqlen_k, n_min, n_max = tile
        wg = cute.arch.make_warp_uniform(ctidx // _THREADS_PER_WG)  # which 64 rows of the tile
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sVt = fu.transpose_view(sV)
        thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * _THREADS_PER_WG)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * _THREADS_PER_WG)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        shape_s = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_o = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32
        )
        t_coord = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        num_rows = cute.size(fu.acc_as_mn(acc_o).shape[0])
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc_o.fill(0.0)

        num_blocks = n_max - n_min
        # Always wait for Q: the epilogue reuses its buffer, and the producer always loads it.
        fu.mbar_wait(mbar_q, 0, 0)
        if num_blocks > 0:
            ops = _RowsOperands(
                mma_qk=tiled_mma_qk,
                mma_pv=tiled_mma_pv,
                tSrQ=tSrQ,
                tSrK=tSrK,
                tOrVt=tOrVt,
                acc_o=acc_o,
                shape_s=shape_s,
                t_coord=t_coord,
                row_max=row_max,
                row_sum=row_sum,
                kv_barriers=kv_barriers,
                scale_log2=scale_log2,
                window=window,
                m_block=m_block,
                row0=m_block * self.tile_m,
                seqlen_q=seqlen_q,
                seqlen_k=seqlen_k,
                wg=wg,
            )
            if const_expr(self.intra_wg_overlap):
                self._mainloop_rows_overlap(ops, n_max, num_blocks)
            else:
                self._mainloop_rows_pingpong(ops, n_max, num_blocks)

        # ---- epilogue: normalise, write LSE and O ---------------------------------------------
        for r in cutlass.range_constexpr(num_rows):
            row_sum[r] = fu.quad_sum(row_sum[r])
        sink_log2 = cute.make_rmem_tensor(num_rows, Float32)
        sink_log2.fill(mSink[q_l] * fu.LOG2_E)
        lse = self._finalize(acc_o, row_max, row_sum, sink_log2, scale_log2)
        self._store_lse(mLSE, lse, thr_mma_qk, q_row0, q_l, row_limit)
        sO = sQ  # Q is dead once this warpgroup's last QK finished; rows do not overlap.
        self._store_o(tiled_mma_pv, acc_o, sO, mO, q_row0, q_l, row_limit, ctidx, ctidx)

    @cute.jit
    def _mainloop_rows_pingpong(self, ops: _RowsOperands, n_max, num_blocks):
        """Tiles ``n_max - 1`` down to ``n_max - num_blocks``; warpgroups alternate strictly:
        each issues [PV of tile i, QK of tile i + 1] while the other runs its softmax."""
        wg = ops.wg
        # Warpgroup 1 takes the first turn.
        if wg == 0:
            cute.arch.barrier_arrive(
                barrier_id=_BAR_SCHED_WG1, number_of_threads=2 * _THREADS_PER_WG
            )
        self._sched_wait(wg)
        self._rows_block(ops, Int32(0), n_max - 1, True, True)
        for i in cutlass.range(1, num_blocks, unroll=1):
            n_block = n_max - 1 - i
            self._rows_block(ops, i, n_block, self._tile_needs_mask(ops, n_block), False)
        # Hand warpgroup 2 its turn for its last PV (warpgroup 1 always moves first).
        if wg == 0:
            self._sched_arrive_other(wg)

    @cute.jit
    def _mainloop_rows_overlap(self, ops: _RowsOperands, n_max, num_blocks):
        """Intra-warpgroup pipelining: S of tile i + 1 is computed while P_i V_i runs, so the
        softmax of tile i + 1 overlaps this warpgroup's own PV. O starts at zero and always
        accumulates; it is rescaled to the new row max once PV_i has completed."""
        mbar_k_full, mbar_k_empty, mbar_v_full, mbar_v_empty = ops.kv_barriers
        # First tile: QK and softmax only; its PV is issued with the next tile's QK.
        acc_s = cute.make_rmem_tensor(ops.shape_s, Float32)
        fu.mbar_wait(mbar_k_full, 0, 0)
        fu.wgmma(ops.mma_qk, acc_s, ops.tSrQ, ops.tSrK[None, None, None, 0], True)
        warpgroup.wait_group(0)
        fu.mbar_arrive_one_per_warp(mbar_k_empty, 0)
        self._mask_tile(ops, acc_s, n_max - 1)
        self._online_softmax(acc_s, ops.row_max, ops.row_sum, ops.scale_log2, True)
        acc_p = fu.acc_as_operand_a(acc_s)
        tOrP = cute.make_rmem_tensor(acc_p.layout.shape, self.dtype)
        fu.convert_to_bf16(acc_p, tOrP)
        if const_expr(self.use_sched_barrier):  # noqa: SIM102 - static outer, dynamic inner
            if ops.wg == 0:
                cute.arch.barrier_arrive(
                    barrier_id=_BAR_SCHED_WG1, number_of_threads=2 * _THREADS_PER_WG
                )
        for i in cutlass.range(1, num_blocks, unroll=1):
            n_block = n_max - 1 - i
            stage = i % self.num_stages
            phase = (i // self.num_stages) & 1
            prev = (i - 1) % self.num_stages
            prev_phase = ((i - 1) // self.num_stages) & 1
            fu.mbar_wait(mbar_k_full, stage, phase)
            if const_expr(self.use_sched_barrier):
                self._sched_wait(ops.wg)
            acc_next = cute.make_rmem_tensor(ops.shape_s, Float32)
            fu.wgmma(ops.mma_qk, acc_next, ops.tSrQ, ops.tSrK[None, None, None, stage], True)
            fu.mbar_wait(mbar_v_full, prev, prev_phase)
            fu.wgmma(ops.mma_pv, ops.acc_o, tOrP, ops.tOrVt[None, None, None, prev], False)
            if const_expr(self.use_sched_barrier):  # noqa: SIM102 - static outer, dynamic inner
                # Warpgroup 2 skips its last hand-over: no turn follows it.
                if ops.wg == 0 or i < num_blocks - 1:
                    self._sched_arrive_other(ops.wg)
            warpgroup.wait_group(1)
            fu.mbar_arrive_one_per_warp(mbar_k_empty, stage)
            needs_mask = self._tile_needs_mask(ops, n_block)
            if needs_mask:
                self._mask_tile(ops, acc_next, n_block)
            row_scale = self._online_softmax(
                acc_next, ops.row_max, ops.row_sum, ops.scale_log2, False
            )
            warpgroup.wait_group(0)
            fu.mbar_arrive_one_per_warp(mbar_v_empty, prev)
            fu.convert_to_bf16(fu.acc_as_operand_a(acc_next), tOrP)
            self._rescale_rows(ops.acc_o, row_scale)
        # Last tile's PV.
        last = (num_blocks - 1) % self.num_stages
        last_phase = ((num_blocks - 1) // self.num_stages) & 1
        fu.mbar_wait(mbar_v_full, last, last_phase)
        fu.wgmma(ops.mma_pv, ops.acc_o, tOrP, ops.tOrVt[None, None, None, last], False)
        warpgroup.wait_group(0)
        fu.mbar_arrive_one_per_warp(mbar_v_empty, last)

    @cute.jit
    def _sched_wait(self, wg):
        cute.arch.barrier(barrier_id=_BAR_SCHED_WG1 + wg, number_of_threads=2 * _THREADS_PER_WG)

    @cute.jit
    def _sched_arrive_other(self, wg):
        cute.arch.barrier_arrive(
            barrier_id=_BAR_SCHED_WG1 + (1 - wg), number_of_threads=2 * _THREADS_PER_WG
        )

    @cute.jit
    def _rows_block(
        self,
        ops: _RowsOperands,
        i,
        n_block,
        needs_mask,
        is_first: cutlass.Constexpr[bool],
    ):
        """One KV tile of the row split: S = Q K^T, mask, online softmax, O += P V.

        On entry this warpgroup holds the tensor-core turn (it waited on its scheduler
        barrier); it hands the turn over after issuing QK and takes it back before PV.
        """
        mbar_k_full, mbar_k_empty, mbar_v_full, mbar_v_empty = ops.kv_barriers
        stage = i % self.num_stages
        phase = (i // self.num_stages) & 1
        acc_s = cute.make_rmem_tensor(ops.shape_s, Float32)
        fu.mbar_wait(mbar_k_full, stage, phase)
        fu.wgmma(ops.mma_qk, acc_s, ops.tSrQ, ops.tSrK[None, None, None, stage], True)
        self._sched_arrive_other(ops.wg)
        warpgroup.wait_group(0)
        fu.mbar_arrive_one_per_warp(mbar_k_empty, stage)
        if needs_mask:
            self._mask_tile(ops, acc_s, n_block)
        row_scale = self._online_softmax(acc_s, ops.row_max, ops.row_sum, ops.scale_log2, is_first)
        # P in the A-operand register layout of the PV wgmma.
        acc_p = fu.acc_as_operand_a(acc_s)
        tOrP = cute.make_rmem_tensor(acc_p.layout.shape, self.dtype)
        fu.convert_to_bf16(acc_p, tOrP)
        if const_expr(not is_first):
            self._rescale_rows(ops.acc_o, row_scale)
        fu.mbar_wait(mbar_v_full, stage, phase)
        self._sched_wait(ops.wg)
        fu.wgmma(ops.mma_pv, ops.acc_o, tOrP, ops.tOrVt[None, None, None, stage], is_first)
        warpgroup.wait_group(0)
        fu.mbar_arrive_one_per_warp(mbar_v_empty, stage)

    @cute.jit
    def _online_softmax(self, acc_s, row_max, row_sum, scale_log2, is_first: cutlass.Constexpr):
        """Update running max/sum with tile ``acc_s`` (scores -> probabilities in place).

        Returns the per-row factor by which the old output must be rescaled. Row sums stay
        per-thread partial (reduced across the quad once, in the epilogue).
        """
        acc_mn = fu.acc_as_mn(acc_s)
        row_scale = cute.make_rmem_tensor(cute.size(row_max), Float32)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            m_old = row_max[r]
            m_new = fu.quad_max(fu.row_max(acc_mn[r, None].load(), m_old))
            row_max[r] = m_new
            # A row with no valid key so far keeps max -inf; use 0 so exp2 gives 0, not NaN.
            m_safe = 0.0 if m_new == -Float32.inf else m_new
            m_scaled = m_safe * scale_log2
            p = cute.math.exp2(acc_mn[r, None].load() * scale_log2 - m_scaled, fastmath=True)
            acc_mn[r, None].store(p)
            s = p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            if const_expr(is_first):
                row_scale[r] = 1.0
                row_sum[r] = s
            else:
                scale = cute.math.exp2((m_old - m_safe) * scale_log2, fastmath=True)
                row_scale[r] = scale
                row_sum[r] = row_sum[r] * scale + s
        return row_scale

    @cute.jit
    def _rescale_rows(self, acc, row_scale):
        acc_mn = fu.acc_as_mn(acc)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])

    @cute.jit
    def _finalize(self, acc_o, row_max, row_sum, sink_log2, scale_log2):
        """Normalise O in place with the sink; return the natural-log LSE per row (no sink).

        ``row_sum`` must already hold the full row sum; ``sink_log2`` is ``sink * log2(e)`` per
        row (``-inf`` for no sink, ``+inf`` zeroes the row).
        """
        num_rows = cute.size(row_max)
        lse = cute.make_rmem_tensor(num_rows, Float32)
        scale = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            total = row_sum[r]
            if total > 0.0:
                m_scaled = row_max[r] * scale_log2
                denom = total + cute.math.exp2(sink_log2[r] - m_scaled, fastmath=True)
                scale[r] = cute.arch.rcp_approx(denom)
                lse[r] = (m_scaled + cute.math.log2(total, fastmath=True)) * fu.LN_2
            else:
                scale[r] = 0.0
                lse[r] = -Float32.inf
        self._rescale_rows(acc_o, scale)
        return lse

    @cute.jit
    def _store_lse(self, mLSE, lse, thr_mma, q_row0, q_l, row_limit):
        """Write LSE for the valid rows; the thread holding column 0 of each row writes it."""
        rows = self.tile_m if const_expr(not self.split_cols) else 64
        t_coord = fu.acc_as_mn(thr_mma.partition_C(cute.make_identity_tensor((rows, self.tile_n))))
        if t_coord[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = t_coord[r, 0][0]
                if row < row_limit:
                    mLSE[q_row0 + row, q_l] = lse[r]

    @cute.jit
    def _store_o(self, tiled_mma_pv, acc_o, sO, mO, q_row0, q_l, row_limit, ctidx, mma_tidx):
        """Registers -> shared (stmatrix) -> global with 16-byte stores on valid rows only."""
        r_o = cute.make_rmem_tensor(acc_o.layout.shape, self.dtype)
        fu.convert_to_bf16(acc_o, r_o)
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_copy = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(mma_tidx)
        cute.copy(thr_copy, thr_copy.retile(r_o), thr_copy.partition_D(sO))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=2 * _THREADS_PER_WG)
        self._copy_o_to_global(sO, mO, q_row0, q_l, row_limit, ctidx)

    @cute.jit
    def _copy_o_to_global(self, sO, mO, q_row0, q_l, row_limit, ctidx):
        vec = 8  # bf16 per 16-byte store
        threads_per_row = 64 // vec  # one 128-byte swizzle atom row
        copy_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128
        )
        thr_layout = cute.make_ordered_layout(
            (2 * _THREADS_PER_WG // threads_per_row, threads_per_row), order=(1, 0)
        )
        tiled_copy = cute.make_tiled_copy_tv(copy_atom, thr_layout, cute.make_layout((1, vec)))
        thr_copy = tiled_copy.get_slice(ctidx)
        gO = cute.local_tile(
            cute.domain_offset((q_row0, 0), mO[None, None, q_l]),
            (self.tile_m, self.head_dim),
            (0, 0),
        )
        tOsO = thr_copy.partition_S(sO)
        tOgO = thr_copy.partition_D(gO)
        t_coord = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        r_o = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, r_o)
        r_o_words = cute.recast_tensor(r_o, cutlass.Uint32)
        for m in cutlass.range_constexpr(cute.size(tOsO.shape[1])):
            if t_coord[0, m, 0][0] < row_limit:
                # Streaming stores: O is not read again by this kernel (keep K/V in L2).
                for k in cutlass.range_constexpr(cute.size(tOsO.shape[2])):
                    w = r_o_words[None, m, k]
                    ptx_ops.st_global_cs_v4_b32(
                        tOgO[None, m, k].iterator.toint(), w[0], w[1], w[2], w[3]
                    )

    # ---- column split (head_dim 512) ---------------------------------------------------------
    # KV halves of a step: 0 = tile a cols 0..255, 1 = a 256..511, 2 = b 0..255, 3 = b
    # 256..511. Warpgroup w computes S for tile w and the output columns of half w. Readers:
    # half 0 = wg0 (QK, PV), 1 = wg0 (QK) + wg1 (PV), 2 = wg1 (QK) + wg0 (PV), 3 = wg1 (QK,
    # PV). The PV reader releases a half; its QK reader finished before the reader's PV could
    # start (half 1: wg0's QK before it handed P_a over; half 2: wg1's QK before it published
    # its max).
    #
    # Halves 0 and 3 are released mid-step (after each warpgroup's own PV), 1 and 2 at its end
    # (after the PVs with the other's P). Tile a of the next step is what wg0 multiplies first,
    # so it goes into the buffers released mid-step: half 1 and half 3 trade buffers every step
    # (buffer of half h at step parity p: _HALF_BUFFERS[p][h]), and the buffers refilled last
    # are the ones wg1 needs, whose QK runs beside wg0's softmax. Producer order: tile a, then
    # half 3 (its buffer freed by wg1's last PV), then half 2 (by wg0's).
    _HALF_BUFFERS = ((0, 1, 2, 3), (0, 3, 2, 1))
    _HALF_ORDER = ((0, 0, 0), (1, 0, 1), (3, 1, 1), (2, 1, 0))  # (half, tile of step, column half)

    @cute.jit
    def _half_buffer(self, half: cutlass.Constexpr[int], phase):
        """Shared-memory buffer of KV half ``half`` at a step of parity ``phase``."""
        even, odd = self._HALF_BUFFERS[0][half], self._HALF_BUFFERS[1][half]
        buffer = Int32(even)
        if const_expr(even != odd):
            buffer = cutlass.select_(phase == 0, Int32(even), Int32(odd))
        return buffer

    @cute.jit
    def _produce_split(self, inputs, tma_atoms, smem, barriers, coords, warp_idx):
        """Dense column split: one warp loads Q, then the KV halves by TMA. ``inputs``: (mQ,
        mK); ``tma_atoms``: theirs; ``smem``: (sQ, storage, the KV half layout); ``barriers``:
        (Q's, KV full, KV empty); ``coords``: (q_row0, q_l, offset_k, head_kv, n_min, n_max)."""
        mQ, mK = inputs
        tma_atom_q, tma_atom_k = tma_atoms
        sQ, storage, sKV_half_layout = smem
        mbar_q, mbar_full, mbar_empty = barriers
        q_row0, q_l, offset_k, head_kv, n_min, n_max = coords
        if warp_idx == 0:
            self._load_q(mQ, tma_atom_q, sQ, mbar_q, q_row0, q_l)
            sKVh = storage.sKV.get_tensor(sKV_half_layout.outer, swizzle=sKV_half_layout.inner)
            gK = cute.local_tile(
                cute.domain_offset((offset_k, 0), mK[None, None, head_kv]),
                (self.tile_n, self.head_dim // 2),
                (None, None),
            )
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom_k,
                0,
                cute.make_layout(1),
                cute.group_modes(sKVh, 0, 2),
                cute.group_modes(gK, 0, 2),
            )
            for step in cutlass.range(cute.ceil_div(n_max - n_min, 2), unroll=1):
                phase = step & 1
                for j in cutlass.range_constexpr(4):
                    half, tile_in_step, col_half = self._HALF_ORDER[j]
                    # A tile past the end (odd count) reads zeros or other keys; masked.
                    tile = n_min + 2 * step + tile_in_step
                    buffer = self._half_buffer(half, phase)
                    fu.mbar_wait(mbar_empty, buffer, phase ^ 1)
                    fu.mbar_expect_tx(mbar_full, buffer, self.k_bytes)
                    cute.copy(
                        tma_atom_k,
                        tKgK[None, tile, col_half],
                        tKsK[None, buffer],
                        tma_bar_ptr=mbar_full + buffer,
                    )

    def _num_gather_items(self, mQ):
        """(token, head block) work items of the gathered kernel (``mQ``: Q or O as ``(H, D,
        T)``); CTA ``c`` takes items ``c, c + grid, ...``."""
        return cute.size(mQ.shape[2]) * cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m)

    @cute.jit
    def _gather_item(self, mQ, mLens, width, item):
        """``(token, first head, heads in the block, keys)`` of gathered work item ``item``
        (``mQ``: Q as ``(H, D, T)``); the token's length clamped into ``0 .. width``, the
        lists' width, so no length runs the kernel past its index row."""
        num_heads = cute.size(mQ.shape[0])
        head_blocks = cute.ceil_div(num_heads, self.tile_m)
        token = item // head_blocks
        q_row0 = (item - token * head_blocks) * self.tile_m
        num_keys = cutlass.min(cutlass.max(Int32(mLens[token]), Int32(0)), Int32(width))
        return token, q_row0, num_heads - q_row0, num_keys

    @cute.jit
    def _produce_gather(self, inputs, tma_atom_q, smem, barriers, warp_idx, tidx):
        """Producer of the persistent gathered kernel: for each item of this CTA, Q by TMA (as
        soon as the previous item's last QK is done) and the rows of its lists by ``cp.async``
        (as soon as a half is free: the next item's first rows stream in during the last PVs).
        Barrier phases run on across items (``steps_done``). ``inputs``: (mQ, mKV, mIndices,
        mLens); ``smem``: (sQ, storage, the KV half layout); ``barriers``: (Q full, Q empty, KV
        full, KV empty)."""
        mQ, mKV, mIndices, mLens = inputs
        sQ, storage, sKV_half_layout = smem
        mbar_q, mbar_q_empty, mbar_full, mbar_empty = barriers
        sKVh = storage.sKV.get_tensor(sKV_half_layout.outer, swizzle=sKV_half_layout.inner)
        # 16 groups of 8 threads: a group copies the 128-byte atom rows (8 x 16 B) of rows
        # group + 16 i (i < 4) of a tile, for each of the 4 atoms of a 256-column half. Every
        # row of a group has the same swizzle (row % 8 = group % 8), so a thread's shared
        # offsets are one constant plus compile-time steps.
        chunk = tidx % 8
        group = tidx // 8
        dst_thread = (
            sKVh.iterator.toint()
            + ((group >> 3) << 10)
            + ((group & 7) << 7)
            + ((chunk ^ (group & 7)) << 4)
        )
        src_chunk = mKV.iterator.toint() + Int64(chunk * 16)
        row_bytes = Int64(mKV.stride[0] * 2)
        width = cute.size(mIndices.shape[1])
        num_rows = Int32(mKV.shape[0])
        num_items = self._num_gather_items(mQ)
        steps_done = Int32(0)
        parity = Int32(0)
        for item in cutlass.range(
            cute.arch.block_idx()[0], num_items, cute.arch.grid_dim()[0], unroll=1
        ):
            token, q_row0, _, num_keys = self._gather_item(mQ, mLens, width, item)
            if warp_idx == 0:
                fu.mbar_wait(mbar_q_empty, 0, parity ^ 1)
                self._load_q(mQ, tma_atom_q, sQ, mbar_q, q_row0, token)
            entry_base = mIndices.iterator.toint() + Int64(token) * Int64(mIndices.stride[0]) * 4
            # This thread's 8 rows of the step (2 tiles x 4), loaded a step ahead. The loads
            # are bounded by the list's width, not the token's length, so that the first ones
            # leave together with the length's load instead of after it.
            rows = self._gather_rows(entry_base, width, num_rows, 0, group)
            num_steps = cute.ceil_div(num_keys, 2 * self.tile_n)
            for step in cutlass.range(num_steps, unroll=1):
                phase = (steps_done + step) & 1
                rows_next = self._gather_rows(entry_base, width, num_rows, 2 * step + 2, group)
                for j in cutlass.range_constexpr(4):
                    half, tile_in_step, col_half = self._HALF_ORDER[j]
                    buffer = self._half_buffer(half, phase)
                    fu.mbar_wait(mbar_empty, buffer, phase ^ 1)
                    dst_half = dst_thread + buffer * _HALF_BYTES
                    for i in cutlass.range_constexpr(4):
                        row = rows[4 * tile_in_step + i]
                        entry = (2 * step + tile_in_step) * self.tile_n + group + 16 * i
                        # A hole (-1) or an entry past the token's keys: zeros, nothing read.
                        live = (row >= 0) & (entry < num_keys)
                        nbytes = Int32(cutlass.select_(live, Int32(16), Int32(0)))
                        src = (
                            src_chunk
                            + Int64(cutlass.select_(live, row, Int32(0))) * row_bytes
                            + col_half * (self.head_dim // 2) * 2
                        )
                        for atom in cutlass.range_constexpr(4):
                            ptx_ops.cp_async_16_prefetch_256(
                                dst_half + i * 2048 + atom * 8192,
                                src + atom * 128,
                                nbytes,
                            )
                    cute.arch.cp_async_mbarrier_arrive_noinc(mbar_full + buffer)
                rows = rows_next
            steps_done += num_steps
            parity ^= 1
        # Do not retire with copies in flight (the consumers wait on them anyway).
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _consume_split(
        self, mmas, smem, barriers, outputs, gather, scale_log2, window, dense_tile, ctidx
    ):
        """Compute warpgroups of the column split: set up, then per item (gathered: each item
        of this persistent CTA; dense: the CTA's tile) the staggered mainloop and the store.

        ``mmas``: (QK, PV, PV with P from registers) tiled MMAs; ``smem``: (sQ, storage, the KV
        half layout, sP layout); ``barriers``: (Q full, Q empty (gathered) or None, KV full, KV
        empty); ``outputs``: (mO, mLSE, mSink); ``gather``: ((mIndices, KV rows) or (None,
        None), mLens); ``dense_tile``: ``(m_block, q_row0, q_l, row_limit, seqlen_q, seqlen_k,
        n_min, n_max)`` of the CTA's tile (dense), None (gathered). The running row max lives
        in log2 units (``score * scale_log2``) and starts at the finite :data:`_MAX_INIT`, so
        that rescale factors never meet ``-inf - -inf``.
        """
        tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs = mmas
        sQ, storage, sKV_half_layout, sP_layout = smem
        mbar_q, mbar_q_empty, mbar_full, mbar_empty = barriers
        mO, mLSE, mSink = outputs
        gather_lists, mLens = gather
        wtidx = ctidx % _THREADS_PER_WG
        rows = 64
        sKVh = storage.sKV.get_tensor(sKV_half_layout.outer, swizzle=sKV_half_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        thr_mma_qk = tiled_mma_qk.get_slice(wtidx)
        thr_mma_pv = tiled_mma_pv.get_slice(wtidx)
        sVt = fu.transpose_view(sKVh)
        thr_mma_pv_rs = tiled_mma_pv_rs.get_slice(wtidx)
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_copy_p = cute.make_tiled_copy_C(st_atom, tiled_mma_qk).get_slice(wtidx)
        ops = _SplitOperands(
            mma_qk=tiled_mma_qk,
            mma_pv=tiled_mma_pv,
            mma_pv_rs=tiled_mma_pv_rs,
            tSrQ=thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ)),
            tSrK=thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sKVh)),
            tOrP=thr_mma_pv.make_fragment_A(thr_mma_pv.partition_A(sP)),
            tOrV=thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt)),
            tOrV_rs=thr_mma_pv_rs.make_fragment_B(thr_mma_pv_rs.partition_B(sVt)),
            copy_p=thr_copy_p,
            tPsP=thr_copy_p.partition_D(sP),  # (CPY, M, N, 2 tiles)
            t_coord=thr_mma_qk.partition_C(cute.make_identity_tensor((rows, self.tile_n))),
            s_max=storage.row_max.get_tensor(cute.make_layout(rows)),
            mbar_full=mbar_full,
            mbar_empty=mbar_empty,
            mbar_q_empty=mbar_q_empty,
        )
        acc_o = cute.make_rmem_tensor(
            thr_mma_pv.partition_shape_C((rows, self.head_dim // 2)), Float32
        )
        acc_s = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((rows, self.tile_n)), Float32)
        num_rows = cute.size(fu.acc_as_mn(acc_o).shape[0])
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        s_sum = storage.row_sum.get_tensor(cute.make_layout((rows, 2, 2)))
        item_args = (
            ops,
            (acc_s, acc_o, row_max, row_sum, s_sum),
            (thr_mma_qk, st_atom, sQ, sP, mbar_q),
            (mO, mLSE, mSink, gather_lists),
            scale_log2,
            window,
        )
        if const_expr(self.gather):
            num_items = self._num_gather_items(mO)
            width = cute.size(gather_lists[0].shape[1])
            steps_done = Int32(0)
            parity = Int32(0)
            for item in cutlass.range(
                cute.arch.block_idx()[0], num_items, cute.arch.grid_dim()[0], unroll=1
            ):
                token, item_row0, item_rows, num_keys = self._gather_item(mO, mLens, width, item)
                num_steps = cute.ceil_div(num_keys, 2 * self.tile_n)
                where = (Int32(0), item_row0, token, item_rows, Int32(0), num_keys, Int32(0))
                self._split_item(*item_args, where, (num_steps, steps_done), parity, ctidx)
                steps_done += num_steps
                parity ^= 1
        else:
            m_block, q_row0, q_l, row_limit, seqlen_q, seqlen_k, n_min, n_max = dense_tile
            where = (m_block, q_row0, q_l, row_limit, seqlen_q, seqlen_k, n_min)
            steps = (cute.ceil_div(n_max - n_min, 2), Int32(0))
            self._split_item(*item_args, where, steps, Int32(0), ctidx)

    @cute.jit
    def _split_item(
        self, ops, state, shared, outputs, scale_log2, window, where, steps, parity, ctidx
    ):
        """One 64-row output tile: wait for its Q, run the mainloop (barrier phases continue
        from ``steps_done``), combine the row sums, normalise and store O and the LSE.
        ``state``: (acc_s, acc_o, row_max, row_sum, s_sum); ``shared``: (thr_mma_qk, st_atom,
        sQ, sP, mbar_q); ``outputs``: (mO, mLSE, mSink, gather_lists); ``where``: (m_block,
        q_row0, q_l, row_limit, seqlen_q, seqlen_k, n_min); ``steps``: (num_steps,
        steps_done)."""
        acc_s, acc_o, row_max, row_sum, s_sum = state
        thr_mma_qk, st_atom, sQ, sP, mbar_q = shared
        mO, mLSE, mSink, gather_lists = outputs
        m_block, q_row0, q_l, row_limit, seqlen_q, seqlen_k, n_min = where
        num_steps, steps_done = steps
        wg = cute.arch.make_warp_uniform(ctidx // _THREADS_PER_WG)
        wtidx = ctidx % _THREADS_PER_WG
        lane = cute.arch.lane_idx()
        rows = 64
        c_mn = fu.acc_as_mn(ops.t_coord)
        num_rows = cute.size(row_max)
        row_max.fill(_MAX_INIT)
        row_sum.fill(0.0)
        acc_o.fill(0.0)

        fu.mbar_wait(mbar_q, 0, parity)
        if const_expr(self.gather):  # noqa: SIM102 - static outer, dynamic inner
            if num_steps == 0:  # no QK: Q's buffer is free at once
                fu.mbar_arrive_one_per_warp(ops.mbar_q_empty, 0)
        loop_args = (
            ops,
            (acc_s, acc_o, row_max, row_sum),
            gather_lists,
            scale_log2,
            window,
            (m_block * rows, q_l, seqlen_q, seqlen_k, n_min),
            (num_steps, steps_done),
            lane,
        )
        if wg == 0:
            self._split_mainloop_lead(*loop_args)
        else:
            self._split_mainloop_follow(*loop_args)

        # ---- epilogue: combine the two warpgroups' row sums, normalise, store ------------------
        # Both warpgroups end on the same running max (the follower's merge of the last step).
        for r in cutlass.range_constexpr(num_rows):
            row_sum[r] = fu.quad_sum(row_sum[r])
            if lane % 4 == 0:
                s_sum[c_mn[r, 0][0], wg, parity] = row_sum[r]
        cute.arch.barrier(barrier_id=_BAR_SUM, number_of_threads=2 * _THREADS_PER_WG)
        sink_log2 = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = c_mn[r, 0][0]
            row_sum[r] = s_sum[row, 0, parity] + s_sum[row, 1, parity]
            if const_expr(self.gather):
                # Rows are heads; padding rows past H must not read the sink.
                sink_log2[r] = -Float32.inf
                if row < row_limit:
                    sink_log2[r] = mSink[q_row0 + row] * fu.LOG2_E
            else:
                sink_log2[r] = mSink[q_l] * fu.LOG2_E
        lse = self._finalize(acc_o, row_max, row_sum, sink_log2, Float32(1.0))
        if wg == 0:
            self._store_lse(mLSE, lse, thr_mma_qk, q_row0, q_l, row_limit)
        if const_expr(self.gather):
            # Not through Q's buffer: it already holds the next item's Q.
            self._store_o_half_staged(ops, acc_o, sP, mO, q_row0, q_l, row_limit, wg, wtidx)
        else:
            # O halves -> shared (the Q buffer). Every QK has finished: the leader's last one
            # before it handed over its last P tile, the follower's before it published its
            # last max.
            sO = sQ
            sO_half = cute.local_tile(sO, (rows, self.head_dim // 2), (0, wg))
            r_o = cute.make_rmem_tensor(acc_o.layout.shape, self.dtype)
            fu.convert_to_bf16(acc_o, r_o)
            thr_copy_o = cute.make_tiled_copy_C(st_atom, ops.mma_pv).get_slice(wtidx)
            cute.copy(thr_copy_o, thr_copy_o.retile(r_o), thr_copy_o.partition_D(sO_half))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=2 * _THREADS_PER_WG)
            self._copy_o_to_global(sO, mO, q_row0, q_l, row_limit, ctidx)

    @cute.jit
    def _store_o_half_staged(self, ops, acc_o, sP, mO, q_row0, q_l, row_limit, wg, wtidx):
        """Warpgroup ``wg``'s 64 x 256 half of O (``mO``: ``(H, D, T)``) to global memory, 64
        columns at a time through the warpgroup's own P tile, each warp through its own 16
        rows of it (no barrier but the warp's): stmatrix, then 16-byte loads and streaming
        stores of whole 128-byte row pieces, rows below ``row_limit`` only.

        The P tiles are free here: the last PV that read them completed before the row-sum
        barrier, and the next item writes them only after this warpgroup's next softmax.
        """
        warp = wtidx // 32
        lane = wtidx % 32
        chunk = lane % 8  # 16-byte piece of a 128-byte row
        tile_base = sP.iterator.toint() + wg * (64 * self.tile_n * 2)
        row_stride = Int64(mO.stride[0])
        o_base = (
            mO.iterator.toint()
            + (Int64(q_l) * Int64(mO.stride[2]) + Int64(q_row0) * row_stride) * 2
            + wg * self.head_dim
            + chunk * 16
        )
        r_chunk = cute.make_rmem_tensor(ops.t_coord.shape, self.dtype)
        words = cute.recast_tensor(r_chunk, Int32)
        per_chunk = cute.size(r_chunk)  # a thread's part of 64 x 64
        for j in cutlass.range_constexpr(self.head_dim // 2 // self.tile_n):
            for i in cutlass.range_constexpr(per_chunk // 2):
                words[i] = fu.cvt_bf16x2(
                    acc_o[j * per_chunk + 2 * i], acc_o[j * per_chunk + 2 * i + 1]
                )
            cute.copy(ops.copy_p, ops.copy_p.retile(r_chunk), ops.tPsP[None, None, None, wg])
            cute.arch.sync_warp()
            for i in cutlass.range_constexpr(4):
                row = 16 * warp + 4 * i + lane // 8
                v = ptx_ops.ld_shared_v4(tile_base + row * 128 + ((chunk ^ (row % 8)) << 4))
                if row < row_limit:
                    ptx_ops.st_global_cs_v4_b32(
                        o_base + Int64(row) * row_stride * 2 + j * self.tile_n * 2,
                        v[0],
                        v[1],
                        v[2],
                        v[3],
                    )
            cute.arch.sync_warp()  # the next chunk's stmatrix overwrites these rows

    # The two compute warpgroups run staggered so that one's softmax overlaps the other's MMAs:
    #
    #   lead (wg0):   softmax(S_a) | PV own P_a, aL | wait merged max, rescale P_a, hand it over
    #                 | wait P_b | PV P_b, bL | QK of the next step's tile a (aL, aR)
    #   follow (wg1): QK of tile b (bR, bL) | wait lead's max, softmax(S_b), publish the merged
    #                 max | PV own P_b, bR | hand P_b over | wait P_a | PV P_a, aR
    #
    # The lead multiplies its own P tile before the merged max exists (against its own running
    # max) and rescales O, the row sum and the P tile it hands over once the follower has merged.
    @cute.jit
    def _split_mainloop_lead(
        self, ops, state, gather_lists, scale_log2, window, where, steps, lane
    ):
        """Warpgroup 0 of the column split: S of tile a, output columns 0..255 (halves 0, 2)."""
        acc_s, acc_o, row_max, row_sum = state
        row0, q_l, seqlen_q, seqlen_k, n_min = where
        num_steps, steps_done = steps
        num_rows = cute.size(row_max)
        c_mn = fu.acc_as_mn(ops.t_coord)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        entries = self._split_entries(gather_lists, q_l, n_min, lane)
        if num_steps > 0:  # no rows are coming otherwise
            self._split_qk(ops, acc_s, 0, steps_done & 1)
            self._split_qk(ops, acc_s, 1, steps_done & 1)
            warpgroup.wait_group(0)
            if num_steps == 1:
                self._release_q(ops)
        for step in cutlass.range(num_steps, unroll=1):
            phase = (steps_done + step) & 1
            tile = n_min + 2 * step
            entries_next = self._split_entries(gather_lists, q_l, tile + 2, lane)
            self._split_mask(acc_s, entries, ops.t_coord, row0, tile, seqlen_q, seqlen_k, window)
            self._split_softmax(acc_s, row_max, row_max, row_sum, row_scale, scale_log2)
            if lane % 4 == 0:
                for r in cutlass.range_constexpr(num_rows):
                    ops.s_max[c_mn[r, 0][0]] = row_max[r]
            cute.arch.barrier_arrive(barrier_id=_BAR_MAX_LEAD, number_of_threads=_SPLIT_THREADS)
            self._rescale_rows_if_moved(acc_o, row_scale)
            r_p = cute.make_rmem_tensor(acc_s.layout.shape, self.dtype)
            fu.convert_to_bf16(acc_s, r_p)
            self._split_pv_own(ops, acc_o, r_p, 0, phase)
            warpgroup.wait_group(0)  # r_p is rewritten below
            fu.mbar_arrive_one_per_warp(ops.mbar_empty, self._half_buffer(0, phase))

            # The follower's merged max: rescale O, the sum and P_a to it; hand P_a over.
            cute.arch.barrier(barrier_id=_BAR_MAX_FOLLOW, number_of_threads=_SPLIT_THREADS)
            for r in cutlass.range_constexpr(num_rows):
                m_merged = ops.s_max[c_mn[r, 0][0]]
                scale = cute.math.exp2(row_max[r] - m_merged, fastmath=True)
                row_scale[r] = scale
                row_sum[r] = row_sum[r] * scale
                row_max[r] = m_merged
            self._rescale_rows_if_moved(acc_s, row_scale)
            fu.convert_to_bf16(acc_s, r_p)
            cute.copy(ops.copy_p, ops.copy_p.retile(r_p), ops.tPsP[None, None, None, 0])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=_BAR_P_LEAD, number_of_threads=_SPLIT_THREADS)
            self._rescale_rows_if_moved(acc_o, row_scale)
            cute.arch.barrier(barrier_id=_BAR_P_FOLLOW, number_of_threads=_SPLIT_THREADS)
            self._split_pv_other(ops, acc_o, 1, 2, phase)
            if step + 1 < num_steps:
                # The next step's S_a runs behind this PV; half 2 is free once the PV is done.
                self._split_qk(ops, acc_s, 0, phase ^ 1)
                warpgroup.wait_group(1)
                fu.mbar_arrive_one_per_warp(ops.mbar_empty, self._half_buffer(2, phase))
                self._split_qk(ops, acc_s, 1, phase ^ 1)
                warpgroup.wait_group(0)
                if step + 2 == num_steps:
                    self._release_q(ops)
            else:
                warpgroup.wait_group(0)
                fu.mbar_arrive_one_per_warp(ops.mbar_empty, self._half_buffer(2, phase))
            entries = entries_next

    @cute.jit
    def _split_mainloop_follow(
        self, ops, state, gather_lists, scale_log2, window, where, steps, lane
    ):
        """Warpgroup 1 of the column split: S of tile b, output columns 256..511 (halves 3, 1)."""
        acc_s, acc_o, row_max, row_sum = state
        row0, q_l, seqlen_q, seqlen_k, n_min = where
        num_steps, steps_done = steps
        num_rows = cute.size(row_max)
        c_mn = fu.acc_as_mn(ops.t_coord)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        m_lead = cute.make_rmem_tensor(num_rows, Float32)
        entries = self._split_entries(gather_lists, q_l, n_min + 1, lane)
        for step in cutlass.range(num_steps, unroll=1):
            phase = (steps_done + step) & 1
            tile = n_min + 2 * step + 1
            entries_next = self._split_entries(gather_lists, q_l, tile + 2, lane)
            self._split_qk(ops, acc_s, 3, phase)
            self._split_qk(ops, acc_s, 2, phase)
            warpgroup.wait_group(0)
            if step + 1 == num_steps:
                self._release_q(ops)
            self._split_mask(acc_s, entries, ops.t_coord, row0, tile, seqlen_q, seqlen_k, window)

            # Merge with the lead's running max (never below this warpgroup's own).
            cute.arch.barrier(barrier_id=_BAR_MAX_LEAD, number_of_threads=_SPLIT_THREADS)
            for r in cutlass.range_constexpr(num_rows):
                m_lead[r] = ops.s_max[c_mn[r, 0][0]]
            cute.arch.sync_warp()  # the quad leaders overwrite what their quads just read
            self._split_softmax(acc_s, m_lead, row_max, row_sum, row_scale, scale_log2)
            if lane % 4 == 0:
                for r in cutlass.range_constexpr(num_rows):
                    ops.s_max[c_mn[r, 0][0]] = row_max[r]
            cute.arch.barrier_arrive(barrier_id=_BAR_MAX_FOLLOW, number_of_threads=_SPLIT_THREADS)
            self._rescale_rows_if_moved(acc_o, row_scale)
            r_p = cute.make_rmem_tensor(acc_s.layout.shape, self.dtype)
            fu.convert_to_bf16(acc_s, r_p)
            self._split_pv_own(ops, acc_o, r_p, 3, phase)
            cute.copy(ops.copy_p, ops.copy_p.retile(r_p), ops.tPsP[None, None, None, 1])
            cute.arch.barrier(barrier_id=_BAR_P_LEAD, number_of_threads=_SPLIT_THREADS)
            self._split_pv_other(ops, acc_o, 0, 1, phase)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=_BAR_P_FOLLOW, number_of_threads=_SPLIT_THREADS)
            warpgroup.wait_group(1)
            fu.mbar_arrive_one_per_warp(ops.mbar_empty, self._half_buffer(3, phase))
            warpgroup.wait_group(0)
            fu.mbar_arrive_one_per_warp(ops.mbar_empty, self._half_buffer(1, phase))
            entries = entries_next

    @cute.jit
    def _release_q(self, ops):
        """Gathered: this warpgroup's last QK of the item is done; Q's buffer may be refilled."""
        if const_expr(self.gather):
            fu.mbar_arrive_one_per_warp(ops.mbar_q_empty, 0)

    @cute.jit
    def _on_half_buffer(self, half: cutlass.Constexpr[int], phase, issue: cutlass.Constexpr):
        """``issue(buffer)`` with the buffer of KV half ``half`` at a step of parity ``phase``
        as a compile-time constant: one copy of the issue per buffer the half can be in, so
        that every wgmma descriptor is an immediate."""
        even, odd = self._HALF_BUFFERS[0][half], self._HALF_BUFFERS[1][half]
        if const_expr(even == odd):
            issue(even)
        else:
            if phase == 0:  # static outer, dynamic inner
                issue(even)
            else:
                issue(odd)

    @cute.jit
    def _split_qk(self, ops, acc_s, half: cutlass.Constexpr[int], phase):
        """Issue the 256-column half ``half`` of ``S = Q K^T`` for the tile stored in it (one
        wgmma group, after waiting for its rows). Halves 0 and 3 start the tiles' sums."""
        self._wait_kv_half(ops.mbar_full, self._half_buffer(half, phase), phase)
        k_half = self.head_dim // 32  # k-blocks (of 16) per 256 columns
        col_half = half % 2

        def issue(buffer):
            fu.wgmma(
                ops.mma_qk,
                acc_s,
                ops.tSrQ,
                ops.tSrK[None, None, None, buffer],
                half in (0, 3),
                col_half * k_half,
                (col_half + 1) * k_half,
                b_shift=-col_half * k_half,
            )

        self._on_half_buffer(half, phase, issue)

    @cute.jit
    def _split_pv_own(self, ops, acc_o, r_p, half: cutlass.Constexpr[int], phase):
        """Issue ``O += P V[half]`` with this warpgroup's bf16 P tile from registers (RS)."""

        def issue(buffer):
            fu.wgmma(
                ops.mma_pv_rs,
                acc_o,
                fu.acc_as_operand_a(r_p),
                ops.tOrV_rs[None, None, None, buffer],
                False,
            )

        self._on_half_buffer(half, phase, issue)

    @cute.jit
    def _split_pv_other(
        self, ops, acc_o, p_tile: cutlass.Constexpr[int], half: cutlass.Constexpr[int], phase
    ):
        """Issue ``O += P V[half]`` with the other warpgroup's P tile from shared memory (SS)."""

        def issue(buffer):
            fu.wgmma(
                ops.mma_pv,
                acc_o,
                ops.tOrP[None, None, None, p_tile],
                ops.tOrV[None, None, None, buffer],
                False,
            )

        self._on_half_buffer(half, phase, issue)

    @cute.jit
    def _split_entries(self, gather_lists, token, tile, lane):
        """Gathered: this lane's two index entries of ``tile`` (validity bits for the mask);
        ``gather_lists``: (indices, rows of kv)."""
        entries = (Int32(-1), Int32(-1))
        if const_expr(self.gather):
            entries = self._gather_entries(*gather_lists, token, tile, lane)
        return entries

    @cute.jit
    def _split_mask(self, acc_s, entries, t_coord, row0, tile, seqlen_q, seqlen_k, window):
        """Set the scores of keys this warpgroup's tile must not see to ``-inf``."""
        if const_expr(self.gather):
            acc_mn = fu.acc_as_mn(acc_s)
            c_mn = fu.acc_as_mn(t_coord)
            # Validity of the tile's 64 gathered entries, one bit per column (2 words): not a
            # hole and before the token's length (``seqlen_k``).
            entry = tile * self.tile_n + cute.arch.lane_idx()
            valid_lo = cute.arch.vote_ballot_sync((entries[0] >= 0) & (entry < seqlen_k))
            valid_hi = cute.arch.vote_ballot_sync((entries[1] >= 0) & (entry + 32 < seqlen_k))
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                col = c_mn[0, c][1]
                bits = valid_lo if col < 32 else valid_hi
                if ((bits >> (col % 32)) & 1) == 0:
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        acc_mn[r, c] = -Float32.inf
        else:
            self._apply_mask(acc_s, t_coord, row0, tile * self.tile_n, seqlen_q, seqlen_k, window)

    @cute.jit
    def _split_softmax(self, acc_s, m_floor, row_max, row_sum, row_scale, scale_log2):
        """Scores -> probabilities in place, against a running max ``m_new >= m_floor``.

        Maxima in log2 units. Lazy: ``m_new`` moves past ``m_floor`` (to the tile's row max)
        only when some score of this warp's rows passes ``m_floor`` by more than
        :data:`_RESCALE_LOG2`; otherwise P <= 2^_RESCALE_LOG2 (as exact in bf16, summed in
        fp32). Any max gives the same softmax as long as P, the sums and O share it. Writes
        ``exp2(row_max - m_new)`` (the factor for what was summed before) to ``row_scale``,
        folds it into ``row_sum`` and adds the tile's sum (this thread's columns only);
        ``row_max`` becomes ``m_new``.
        """
        acc_mn = fu.acc_as_mn(acc_s)
        num_rows = cute.size(row_max)
        m_tile = cute.make_rmem_tensor(num_rows, Float32)
        grows = Boolean(False)
        for r in cutlass.range_constexpr(num_rows):
            m_tile[r] = fu.row_max(acc_mn[r, None].load(), -Float32.inf) * scale_log2
            grows = grows | (m_tile[r] > m_floor[r] + _RESCALE_LOG2)
        moves = cute.arch.vote_any_sync(grows)
        for r in cutlass.range_constexpr(num_rows):
            m_new = m_floor[r]
            if moves:
                m_new = cute.arch.fmax(m_floor[r], fu.quad_max(m_tile[r]))
            p = cute.math.exp2(acc_mn[r, None].load() * scale_log2 - m_new, fastmath=True)
            acc_mn[r, None].store(p)
            scale = cute.math.exp2(row_max[r] - m_new, fastmath=True)
            row_scale[r] = scale
            row_sum[r] = row_sum[r] * scale + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            row_max[r] = m_new

    @cute.jit
    def _rescale_rows_if_moved(self, acc, row_scale):
        """:meth:`_rescale_rows`, skipped when every factor of the warp's rows is exactly 1."""
        moved = Boolean(False)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            moved = moved | (row_scale[r] != 1.0)
        if cute.arch.vote_any_sync(moved):
            self._rescale_rows(acc, row_scale)

    @cute.jit
    def _wait_kv_half(self, mbar_full, half, phase):
        """Wait until KV half ``half`` is loaded for ``phase``.

        Gathered rows arrive through ``cp.async``, which writes shared memory in the generic
        proxy, while wgmma reads it through the async proxy: each reader fences the proxies
        once it has seen the data land (TMA writes are async-proxy already; no fence).
        """
        fu.mbar_wait(mbar_full, half, phase)
        if const_expr(self.gather):
            cute.arch.fence_view_async_shared()

    @cute.jit
    def _gather_rows(self, entry_base, width, num_rows, tile, group):
        """KV rows of entries ``64 t + group + 16 i`` (i < 4) of tiles ``t = tile, tile + 1``
        (-1 past the list's ``width`` and for ids outside ``0 .. num_rows``; entries past the
        token's length are the caller's to drop), as 8 predicated loads nobody waits for until
        they are read."""
        out = []
        for t in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(4):
                entry = (tile + t) * self.tile_n + group + 16 * i
                present = Int32(cutlass.select_(entry < width, Int32(1), Int32(0)))
                row = ptx_ops.ld_global_nc_b32_if(entry_base + Int64(entry) * 4, present, -1)
                out.append(self._row_or_hole(row, num_rows))
        return tuple(out)

    @cute.jit
    def _gather_entries(self, mIndices, num_rows, token, tile, lane):
        """Index entries ``64*tile + lane`` and ``+ 32`` of ``token`` (-1 past the list's width
        and for ids outside ``0 .. num_rows``; the token's length is applied by the mask), as
        loaded: one predicated load each, so nothing waits for them until they are read, not
        even for the length."""
        row = mIndices.iterator.toint() + Int64(token) * Int64(mIndices.stride[0]) * 4
        width = cute.size(mIndices.shape[1])
        out = []
        for half in cutlass.range_constexpr(2):
            entry = tile * self.tile_n + lane + 32 * half
            present = Int32(cutlass.select_(entry < width, Int32(1), Int32(0)))
            loaded = ptx_ops.ld_global_nc_b32_if(row + Int64(entry) * 4, present, -1)
            out.append(self._row_or_hole(loaded, num_rows))
        return out[0], out[1]

    @staticmethod
    @cute.jit
    def _row_or_hole(row: Int32, num_rows: Int32) -> Int32:
        """``row`` if it is a row of kv, else -1 (a hole): producer and mask agree, and no id
        makes the kernel read outside kv (one unsigned compare covers negative ids)."""
        return Int32(cutlass.select_(Uint32(row) < Uint32(num_rows), row, Int32(-1)))
