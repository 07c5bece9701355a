"""Microbenchmark kernel: how fast the Hopper tensor pipe runs one bf16 wgmma shape.

The decode kernel's QK is a chain of m64n32k16 wgmmas (64 heads x 32 keys, K from SMEM, Q from
registers); whether so narrow an N keeps the tensor pipe busy decides the tile width. Here
each CTA (one per SM) runs ``warpgroups`` warpgroups; each issues ``rounds`` groups of
:data:`GROUP` m64nNk16 wgmmas (K = 512 per group, as QK over 448 + 64 columns), committing and
waiting after every group as QK does. B (N x 128, K-major, 128-byte swizzle) is read from SMEM
four times per group; A (64 x 128) from SMEM (SS) or, loaded once by ``ldmatrix``, from
registers (RS). ``python -m dsv4_attn.bench wgmma-rate`` turns the time into TFLOP/s against the
measured bf16 matmul ceiling.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup

from dsv4_attn.kernels.fmha_sm90_utils import smem_layout_rowmajor, warpgroup_mma

__all__ = ["GROUP", "K_TILE", "M", "WgmmaRate", "build_wgmma_rate_kernel"]

M = 64  # wgmma M: one warpgroup's rows
K_TILE = 128  # columns of A and B in SMEM (two 128-byte swizzle atoms)
GROUP = 32  # wgmmas per commit / wait group: K = 512


class WgmmaRate:
    """``rounds`` groups of :data:`GROUP` m64{n}k16 bf16 wgmmas per warpgroup, ``warpgroups``
    warpgroups per CTA; A from registers if ``a_in_registers`` else from SMEM."""

    def __init__(self, n: int, a_in_registers: bool, warpgroups: int, rounds: int):
        if n % 8 or not 8 <= n <= 256:
            raise ValueError(f"wgmma N must be a multiple of 8 in [8, 256], got {n}")
        if warpgroups not in (1, 2, 3):
            raise ValueError(f"warpgroups must be 1, 2 or 3, got {warpgroups}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.n = n
        self.a_in_registers = a_in_registers
        self.warpgroups = warpgroups
        self.rounds = rounds

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        """``mSrc``: bf16, >= (64 + n) * 128 values (A then B, finite, not all zero);
        ``mOut``: fp32, one value per thread of the grid (a checksum of its accumulators).
        The grid is ``mOut``'s length / threads per CTA."""
        sA_layout = smem_layout_rowmajor(BFloat16, M, K_TILE)
        sB_layout = smem_layout_rowmajor(BFloat16, self.n, K_TILE)
        tiled_mma = warpgroup_mma(
            BFloat16, self.n, OperandMajorMode.K, a_in_registers=self.a_in_registers
        )

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]

        threads = 128 * self.warpgroups
        self.kernel(mSrc, mOut, sA_layout, sB_layout, tiled_mma, SharedStorage).launch(
            grid=(mOut.shape[0] // threads, 1, 1), block=(threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mSrc: cute.Tensor,
        mOut: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        threads = 128 * self.warpgroups
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        # Fill A and B from the source (row-major logical views; the swizzle is in the layout).
        for i in cutlass.range(tidx, M * K_TILE, threads, unroll=1):
            sA[i // K_TILE, i % K_TILE] = mSrc[i]
        for i in cutlass.range(tidx, self.n * K_TILE, threads, unroll=1):
            sB[i // K_TILE, i % K_TILE] = mSrc[M * K_TILE + i]
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        wg_tidx = tidx % 128
        thr = tiled_mma.get_slice(wg_tidx)
        tCrB = thr.make_fragment_B(thr.partition_B(sB))
        if const_expr(self.a_in_registers):
            tCrA = thr.make_fragment_A(thr.partition_shape_A((M, K_TILE)))
            a_load = cute.make_tiled_copy_A(
                cute.make_copy_atom(
                    warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16
                ),
                tiled_mma,
            ).get_slice(wg_tidx)
            cute.copy(a_load, a_load.partition_S(sA), a_load.retile(tCrA))
        else:
            tCrA = thr.make_fragment_A(thr.partition_A(sA))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((M, self.n)), Float32)
        acc.fill(0.0)
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        k_blocks = cute.size(tCrA.shape[2])
        for _ in cutlass.range(self.rounds, unroll=1):
            warpgroup.fence()
            for g in cutlass.range_constexpr(GROUP):
                k = g % k_blocks
                cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
        checksum = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc)):
            checksum = checksum + acc[i]
        mOut[bidx * threads + tidx] = checksum


def build_wgmma_rate_kernel(n: int, a_in_registers: bool, warpgroups: int, rounds: int):
    """Compile one variant against fake tensors (no GPU needed)."""
    from dsv4_attn.kernels.compile_cache import compile_tvm_ffi

    src = cute.runtime.make_fake_tensor(BFloat16, (cute.sym_int(),), stride=(1,), assumed_align=16)
    out = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(),), stride=(1,), assumed_align=16)
    return compile_tvm_ffi(WgmmaRate(n, a_in_registers, warpgroups, rounds), src, out)
