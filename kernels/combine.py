"""CuTeDSL kernel: merge split-KV partial attention results and apply the sink once.

Input: per split ``s`` a partial output ``o_s``, already normalized by its own softmax sum and
stored as fp16 ``2^k_s o_s`` (``[S, T, H, 512]``, a power of two per row that puts the row's
largest magnitude near the top of fp16's range), and the fp32 pair (``lse_s``, ``k_s``)
(``[S, T, H, 2]``: its natural-log sum, -inf for a split without keys, whose row is then never
read; the row's scale exponent). Output, per token and head:

    lse = log(sum_s exp(lse_s))          (-inf if every split is empty)
    out = sum_s exp(lse_s - lse) 2^-k_s (2^k_s o_s) * sigmoid(lse - sink)   (0 if lse = -inf)

as bf16 ``[T, H, 512]``, and ``lse`` fp32 ``[T, H]`` (sink excluded).

With the balanced schedule (:mod:`dsv4_attn.kernels.sparse_decode_schedule`) the partials sit
in compact slots (``[slots, H, 512]``, ``[slots, H, 2]``): token ``t`` has ``pieces`` of them from
slot ``first slot`` on (its ``token_plan`` row), and a token of one piece was finished by the
decode kernel, so its rows are left alone.

``warps_per_row`` warps merge one (token, head) row, each lane ``512 / (32 * warps_per_row)``
columns: 4 warps when there are few rows (small batches: more SMs share the work), 1 when there
are many. Every lane first takes one split's weight (lanes over splits); then the loads of
:func:`splits_in_flight` splits are issued together, predicated off for splits without weight,
each weight fetched from its lane by a shuffle. (A loop that loads one split after another waits
one L2 round trip per split: ~0.8 us each on an H100.)

Launched with programmatic dependent launch (PDL): its CTAs may start while the decode grid
before it drains (the decode kernel triggers at its start) and wait in ``griddepcontrol.wait``
until that grid has finished and its writes are visible; after any other kernel, or without PDL
support, the wait returns at once and the launch is an ordinary stream-ordered one. It uses no
shared memory, so its CTAs fit beside a decode CTA (which takes nearly all of an SM's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from dsv4_attn.kernels import ptx_ops

__all__ = ["CTA_THREADS", "CombineConfig", "SplitCombine", "splits_in_flight"]

HEAD_DIM = 512
CTA_THREADS = 128
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class CombineConfig:
    """Every compile-time parameter of one combine variant (the compile-cache key)."""

    has_sink: bool
    balanced: bool = False  # partials in the balanced schedule's slots
    warps_per_row: int = 1  # 1 or 4 (see the module docstring)

    def __post_init__(self):
        if self.warps_per_row not in (1, 4):
            raise ValueError(f"warps_per_row must be 1 or 4, got {self.warps_per_row}")


def splits_in_flight(warps_per_row: int) -> int:
    """Splits whose partial loads a lane issues together. Four warps a row (few rows, latency
    the limit): 16 splits of one 8-byte load each. One warp a row (many rows, bandwidth the
    limit, occupancy matters): 4 splits of two 16-byte loads."""
    return 16 if warps_per_row == 4 else 4


class SplitCombine:
    """Merges ``S`` split-KV partials per (token, head) into the final bf16 output and lse."""

    def __init__(self, config: CombineConfig):
        self.cfg = config
        self.cols_per_lane = HEAD_DIM // (32 * config.warps_per_row)
        self.batch = splits_in_flight(config.warps_per_row)
        self.rows_per_cta = CTA_THREADS // (32 * config.warps_per_row)

    @cute.jit
    def __call__(
        self,
        mOpart: cute.Tensor,  # [S, T, H, 512] fp16, row s scaled by 2^k_s
        mLsePart: cute.Tensor,  # [S, T, H, 2] fp32: (lse_s, k_s)
        mSink: cute.Tensor | None,  # [H] fp32
        mO: cute.Tensor,  # [T, H, 512] bf16
        mLse: cute.Tensor,  # [T, H] fp32
        mTokenPlan: cute.Tensor | None,  # balanced: [T, 5] int32
        stream: cuda.CUstream,
    ):
        """Partials ``[S, T, H, 512]`` / ``[S, T, H, 2]``; balanced ``[slots, H, 512]`` /
        ``[slots, H, 2]`` with ``mTokenPlan``."""
        rows = mO.shape[0] * mO.shape[1]
        grid = ((rows + self.rows_per_cta - 1) // self.rows_per_cta, 1, 1)
        # min_blocks_per_mp: with a launch bound ptxas issues a batch's loads back to back;
        # without one it sinks each load next to its use (a few in flight, 32 registers).
        self.kernel(mOpart, mLsePart, mSink, mO, mLse, mTokenPlan).launch(
            grid=grid, block=(CTA_THREADS, 1, 1), stream=stream, use_pdl=True, min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(
        self,
        mOpart: cute.Tensor,
        mLsePart: cute.Tensor,
        mSink: cute.Tensor | None,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mTokenPlan: cute.Tensor | None,
    ):
        cute.arch.griddepcontrol_wait()  # the decode grid's partials are complete and visible
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx & 31
        warps_per_row = const_expr(self.cfg.warps_per_row)
        row = bidx * self.rows_per_cta + warp // warps_per_row
        column = ((warp % warps_per_row) * 32 + lane) * self.cols_per_lane  # lane's first column
        num_tokens = mO.shape[0]
        num_heads = mO.shape[1]
        # Split s of this row is partial row first + s * split_stride.
        num_splits = Int32(mOpart.shape[0])
        first = Int64(row)
        split_stride = Int64(num_tokens) * num_heads  # rows per split
        if const_expr(self.cfg.balanced):
            token = row // num_heads
            num_splits = Int32(0)
            if row < num_tokens * num_heads:
                num_splits = Int32(mTokenPlan[token, 2])
                first = Int64(mTokenPlan[token, 3]) * num_heads + row % num_heads
            split_stride = Int64(num_heads)
            num_splits = Int32(cutlass.select_(num_splits > 1, num_splits, Int32(0)))
        if (row < num_tokens * num_heads) & (num_splits > 0):
            head = row % num_heads
            lse_part_base = mLsePart.iterator.toint()
            # Max over splits (of lse_s, and of lse_s - k_s in log2 units: the largest split's
            # magnitude, the reference of the merge's weights), then the sum of weights: lanes
            # stride over the splits.
            m = Float32(-math.inf)
            top = Float32(-math.inf)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                pair = lse_part_base + (s * split_stride + first) * 8
                lse_s, k_s = ptx_ops.ld_global_v2_f32(pair)
                m = cute.arch.fmax(m, lse_s)
                top = cute.arch.fmax(top, lse_s * LOG2E - k_s)  # -inf for an empty split
            for offset in cutlass.range_constexpr(5):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1 << offset))
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1 << offset))
            m_safe = Float32(cutlass.select_(m == -math.inf, Float32(0.0), m))
            top = Float32(cutlass.select_(top == -math.inf, Float32(0.0), top))
            total = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                lse_s = ptx_ops.ld_global_f32(lse_part_base + (s * split_stride + first) * 8)
                total = total + ptx_ops.exp2_approx((lse_s - m_safe) * LOG2E)
            for offset in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
            has_keys = total > 0.0
            lse2 = m_safe * LOG2E + ptx_ops.log2_approx(total)  # log2 units
            lse2 = Float32(cutlass.select_(has_keys, lse2, Float32(-math.inf)))
            # Split s weighs exp2(lse_s - lse2) 2^-k_s = exp2(lse_s - k_s - top) exp2(top - lse2):
            # the first factor (<= 1) per split, the second (2^-k of the largest split: normal
            # for k <= PARTIAL_MAX_LOG2 < 126 - log2(splits)) once per row. The sink, applied
            # once to the merged row: sigmoid(lse - sink) (exp2(+inf) = inf makes it 0 for
            # sink = +inf); a row without keys is 0.
            f = ptx_ops.exp2_approx(top - lse2)
            if const_expr(self.cfg.has_sink):
                sink = Float32(mSink[head])
                f = f * ptx_ops.rcp_approx(1.0 + ptx_ops.exp2_approx(sink * LOG2E - lse2))
            factor = Float32(cutlass.select_(has_keys, f, Float32(0.0)))
            if column == 0:
                ptx_ops.st_global_f32(mLse.iterator.toint() + Int64(row) * 4, lse2 * LN2)

            acc = cute.make_rmem_tensor((self.cols_per_lane,), Float32)
            acc.fill(0.0)
            opart_row = mOpart.iterator.toint() + (first * HEAD_DIM + column) * 2
            split_bytes = split_stride * (HEAD_DIM * 2)
            load_bytes = min(self.cols_per_lane * 2, 16)  # a lane's loads: 8 or 2 x 16 bytes
            for chunk in cutlass.range(0, num_splits, 32, unroll=1):
                # Lane l: the weight of split chunk + l relative to the largest split (2^-k
                # folded in); 0 past the last split and for a split without keys (its partial
                # row was never written: it may hold anything).
                weight = Float32(0.0)
                if chunk + lane < num_splits:
                    lse_s, k_s = ptx_ops.ld_global_v2_f32(
                        lse_part_base + ((chunk + lane) * split_stride + first) * 8
                    )
                    if lse_s > -math.inf:
                        weight = ptx_ops.exp2_approx(lse_s * LOG2E - k_s - top)
                in_chunk = cutlass.min(num_splits - chunk, 32)
                for j0 in cutlass.range(0, in_chunk, self.batch, unroll=1):
                    weights = []
                    values = []
                    for k in cutlass.range_constexpr(self.batch):
                        w = cute.arch.shuffle_sync(weight, cutlass.min(j0 + k, 31))
                        w = Float32(cutlass.select_(j0 + k < in_chunk, w, Float32(0.0)))
                        weights.append(w)
                        src = opart_row + Int64(chunk + j0 + k) * split_bytes
                        used = Int32(cutlass.select_(w > 0.0, Int32(1), Int32(0)))
                        loads = self.cols_per_lane * 2 // load_bytes
                        values.append(
                            [
                                word
                                for q in range(loads)
                                for word in ptx_ops.ld_global_vec_if(
                                    src + load_bytes * q, used, load_bytes // 4
                                )
                            ]
                        )
                    # A load without weight left zeros (w * 0 = 0, never w * garbage).
                    for w, words in zip(weights, values, strict=True):
                        for i, word in enumerate(words):
                            lo, hi = ptx_ops.f16x2_to_f32(word)
                            acc[2 * i] = acc[2 * i] + w * lo
                            acc[2 * i + 1] = acc[2 * i + 1] + w * hi
            packed = [
                ptx_ops.cvt_bf16x2_f32(acc[2 * i] * factor, acc[2 * i + 1] * factor)
                for i in range(self.cols_per_lane // 2)
            ]
            dst = mO.iterator.toint() + (Int64(row) * HEAD_DIM + column) * 2
            if const_expr(self.cols_per_lane == 4):
                ptx_ops.st_global_v2_b32(dst, packed[0], packed[1])
            else:
                for q in cutlass.range_constexpr(self.cols_per_lane // 8):
                    ptx_ops.st_global_v4_b32(dst + 16 * q, *packed[4 * q : 4 * q + 4])
