"""CuTeDSL kernel: merge split-KV partial attention results and apply the sink once.

Input: per split ``s`` a partial output ``o_s`` (fp32 ``[S, T, H, 512]``, already normalized by
its own softmax sum) and its natural-log sum ``lse_s`` (fp32 ``[S, T, H]``, -inf for a split
without keys, whose ``o_s`` is then never read). Output, per token and head:

    lse = log(sum_s exp(lse_s))          (-inf if every split is empty)
    out = sum_s exp(lse_s - lse) o_s * sigmoid(lse - sink)      (0 if lse = -inf)

as bf16 ``[T, H, 512]``, and ``lse`` fp32 ``[T, H]`` (sink excluded).

With the balanced schedule (:mod:`dsv4_attn.kernels.sparse_decode_schedule`) the partials sit
in compact slots (``[slots, H, 512]``, ``[slots, H]``): token ``t`` has ``pieces`` of them from
slot ``first slot`` on (its ``token_plan`` row), and a token of one piece was finished by the
decode kernel, so its rows are left alone.

One warp per (token, head): lane ``l`` owns columns 16l..16l+15 (four 16-byte loads per split,
coalesced across the warp). 128 threads per CTA, four rows.

Launched with programmatic dependent launch (PDL): its CTAs may start while the decode grid
before it drains (the decode kernel triggers at its start) and wait in ``griddepcontrol.wait``
until that grid has finished and its writes are visible; after any other kernel, or without PDL
support, the wait returns at once and the launch is an ordinary stream-ordered one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from dsv4_attn.kernels import ptx_ops

__all__ = ["CombineConfig", "SplitCombine"]

HEAD_DIM = 512
ROWS_PER_CTA = 4
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class CombineConfig:
    """Every compile-time parameter of one combine variant (the compile-cache key)."""

    has_sink: bool
    balanced: bool = False  # partials in the balanced schedule's slots


class SplitCombine:
    """Merges ``S`` split-KV partials per (token, head) into the final bf16 output and lse."""

    def __init__(self, config: CombineConfig):
        self.cfg = config

    @cute.jit
    def __call__(
        self,
        mOpart: cute.Tensor,  # [S, T, H, 512] fp32
        mLsePart: cute.Tensor,  # [S, T, H] fp32
        mSink: cute.Tensor | None,  # [H] fp32
        mO: cute.Tensor,  # [T, H, 512] bf16
        mLse: cute.Tensor,  # [T, H] fp32
        mTokenPlan: cute.Tensor | None,  # balanced: [T, 5] int32
        stream: cuda.CUstream,
    ):
        """Partials ``[S, T, H, 512]`` / ``[S, T, H]``; balanced ``[slots, H, 512]`` /
        ``[slots, H]`` with ``mTokenPlan``."""
        rows = mO.shape[0] * mO.shape[1]
        grid = ((rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1)
        self.kernel(mOpart, mLsePart, mSink, mO, mLse, mTokenPlan).launch(
            grid=grid, block=(32 * ROWS_PER_CTA, 1, 1), stream=stream, use_pdl=True
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
        lane = tidx & 31
        row = bidx * ROWS_PER_CTA + cute.arch.make_warp_uniform(tidx // 32)
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
            opart_base = mOpart.iterator.toint()
            # Max over splits, then the sum of weights: lanes stride over the splits.
            m = Float32(-math.inf)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                m = cute.arch.fmax(
                    m, ptx_ops.ld_global_f32(lse_part_base + (s * split_stride + first) * 4)
                )
            for offset in cutlass.range_constexpr(5):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1 << offset))
            m_safe = Float32(cutlass.select_(m == -math.inf, Float32(0.0), m))
            total = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                lse_s = ptx_ops.ld_global_f32(lse_part_base + (s * split_stride + first) * 4)
                total = total + ptx_ops.exp2_approx((lse_s - m_safe) * LOG2E)
            for offset in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
            has_keys = total > 0.0
            lse2 = m_safe * LOG2E + ptx_ops.log2_approx(total)  # log2 units
            lse2 = Float32(cutlass.select_(has_keys, lse2, Float32(-math.inf)))

            acc = cute.make_rmem_tensor((16,), Float32)
            acc.fill(0.0)
            for s in cutlass.range(num_splits, unroll=1):
                lse_s = ptx_ops.ld_global_f32(lse_part_base + (s * split_stride + first) * 4)
                if lse_s > -math.inf:
                    w = ptx_ops.exp2_approx(lse_s * LOG2E - lse2)
                    src = opart_base + ((s * split_stride + first) * HEAD_DIM + lane * 16) * 4
                    for q in cutlass.range_constexpr(4):
                        a, b, c, d = ptx_ops.ld_global_v4_f32(src + q * 16)
                        acc[4 * q + 0] = acc[4 * q + 0] + w * a
                        acc[4 * q + 1] = acc[4 * q + 1] + w * b
                        acc[4 * q + 2] = acc[4 * q + 2] + w * c
                        acc[4 * q + 3] = acc[4 * q + 3] + w * d
            factor = Float32(cutlass.select_(has_keys, Float32(1.0), Float32(0.0)))
            if const_expr(self.cfg.has_sink):
                sink = Float32(mSink[head])
                # sigmoid(lse - sink); exp2(+inf) = inf makes it 0 for sink = +inf.
                f = ptx_ops.rcp_approx(1.0 + ptx_ops.exp2_approx(sink * LOG2E - lse2))
                factor = Float32(cutlass.select_(has_keys, f, Float32(0.0)))
            packed = [ptx_ops.cvt_bf16x2_f32(acc[2 * i] * factor, acc[2 * i + 1] * factor)
                      for i in range(8)]  # fmt: skip
            dst = mO.iterator.toint() + (Int64(row) * HEAD_DIM + lane * 16) * 2
            ptx_ops.st_global_v4_b32(dst, packed[0], packed[1], packed[2], packed[3])
            ptx_ops.st_global_v4_b32(dst + 16, packed[4], packed[5], packed[6], packed[7])
            if lane == 0:
                ptx_ops.st_global_f32(mLse.iterator.toint() + Int64(row) * 4, lse2 * LN2)
