"""Device-side helpers for the Hopper FMHA kernel (:mod:`dsv4_attn.kernels.fmha_sm90`).

Small, self-contained building blocks: tiled MMAs, shared-memory layouts for wgmma operands,
views of a wgmma accumulator as rows x columns, fp32 -> bf16 packing, warpgroup GEMM issue, quad
reductions and a bare mbarrier pair (full/empty) with explicit index and phase.

Conventions (Hopper wgmma, one warpgroup = 128 threads, M = 64 rows per warpgroup):
an fp32 accumulator fragment of an ``m64nN`` MMA has the per-thread shape ``((2, 2, N/8), 1, 1)``:
two adjacent columns, two rows eight apart, and N/8 column groups of eight. Each row of the
64 x N tile is spread over the four threads of a "quad" (lanes 4i..4i+3), so row reductions
finish with two butterfly shuffles.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import LayoutEnum

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------
# Tiled MMAs
# ----------------------------------------------------------------------------------------------
def warpgroup_mma(dtype, n: int, b_major, *, a_in_registers: bool = False, warpgroups: int = 1):
    """A ``dtype`` x ``dtype`` -> fp32 wgmma TiledMma of ``warpgroups`` warpgroups stacked along
    M, each ``64 x n``: A K-major, from registers (RS) or SMEM (SS); B ``b_major`` (K for
    ``Q K^T``, MN for ``P V``)."""
    a_source = warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM
    return sm90_helpers.make_trivial_tiled_mma(
        dtype,
        dtype,
        warpgroup.OperandMajorMode.K,
        b_major,
        Float32,
        (warpgroups, 1, 1),
        (64, n),
        a_source=a_source,
    )


# ----------------------------------------------------------------------------------------------
# Shared-memory layouts
# ----------------------------------------------------------------------------------------------
def smem_layout_rowmajor(dtype, rows: int, cols: int, stages: int | None = None):
    """Swizzled smem layout for a ``rows x cols`` tile whose ``cols`` are contiguous.

    This is the K-major operand layout of wgmma (A = Q or P, B = K) and, read transposed, the
    MN-major layout of V. Atoms of 8 rows x 64 bf16 (128 B swizzle) are stacked down the rows
    first, then across column blocks, then across stages; so a column block of 64 is one
    contiguous ``rows * 128`` B slab and a ``cols``-wide half of a tile is contiguous too.
    """
    atom_kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols)
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a smem tensor (V ``[keys, dv]`` -> ``[dv, keys]`` for PV)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """A view of ``t`` with its modes reordered (no data movement)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


# ----------------------------------------------------------------------------------------------
# Accumulator views
# ----------------------------------------------------------------------------------------------
def _acc_layout_mn(acc_layout: cute.Layout) -> cute.Layout:
    """``((2, 2, V), M, N)`` accumulator layout -> ``((2, M), (2, V, N))`` rows x columns."""
    col_major = cute.make_layout(acc_layout.shape)
    shape = (
        (col_major.shape[0][1], col_major.shape[1]),
        (col_major.shape[0][0], *col_major.shape[0][2:], col_major.shape[2]),
    )
    stride = (
        (col_major.stride[0][1], col_major.stride[1]),
        (col_major.stride[0][0], *col_major.stride[0][2:], col_major.stride[2]),
    )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_as_mn(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator fragment (or its identity/coordinate partition) as rows x cols."""
    return cute.make_tensor(acc.iterator, _acc_layout_mn(acc.layout))


def _acc_layout_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """``((2, 2, N/8), M, N_mma)`` accumulator -> ``((2, 2, 2), M, (N/16, N_mma))`` A operand.

    The fp32 accumulator of one MMA and the bf16 A-operand fragment of the next hold the same
    elements in the same threads (the FA3 trick), only grouped by k-blocks of 16.
    """
    div = 2 if const_expr(acc_layout.shape[0][2] % 2 == 0) else 1
    lay = cute.logical_divide(acc_layout, ((None, None, div), None, None))
    return cute.make_layout(
        (
            (lay.shape[0][0], lay.shape[0][1], lay.shape[0][2][0]),
            lay.shape[1],
            (lay.shape[0][2][1], lay.shape[2]),
        ),
        stride=(
            (lay.stride[0][0], lay.stride[0][1], lay.stride[0][2][0]),
            lay.stride[1],
            (lay.stride[0][2][1], lay.stride[2]),
        ),
    )


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an fp32 accumulator with the layout of the A operand of a register-sourced wgmma."""
    return cute.make_tensor(acc.iterator, _acc_layout_as_operand_a(acc.layout))


# ----------------------------------------------------------------------------------------------
# Conversions and reductions
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def cvt_bf16x2(a: Float32, b: Float32, *, loc=None, ip=None) -> Int32:
    """Pack two fp32 into one 32-bit register of two bf16 (round to nearest even); a is low."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $2, $1;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_to_bf16(src: cute.Tensor, dst: cute.Tensor) -> None:
    """Elementwise fp32 -> bf16 of two same-size register tensors, two values per instruction."""
    dst_u32 = cute.recast_tensor(dst, Int32)
    for i in cutlass.range(cute.size(dst_u32), unroll_full=True):
        dst_u32[i] = cvt_bf16x2(src[2 * i], src[2 * i + 1])


@cute.jit
def row_max(row: cute.TensorSSA, init: Float32) -> Float32:
    """Max over a thread's part of one row, seeded with ``init`` (4 independent chains)."""
    vals = cute.make_rmem_tensor(row.shape, Float32)
    vals.store(row)
    n = cute.size(row.shape)
    acc = [init, vals[0], vals[1], vals[2]] if const_expr(n >= 4) else [init]
    start = 3 if const_expr(n >= 4) else 0
    for i in cutlass.range_constexpr(start, n):
        acc[i % len(acc)] = cute.arch.fmax(acc[i % len(acc)], vals[i])
    res = acc[0]
    for j in cutlass.range_constexpr(1, len(acc)):
        res = cute.arch.fmax(res, acc[j])
    return res


@cute.jit
def quad_max(x: Float32) -> Float32:
    """Max over the four threads that share a row of a wgmma accumulator."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


@cute.jit
def quad_sum(x: Float32) -> Float32:
    """Sum over the four threads that share a row of a wgmma accumulator."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


# ----------------------------------------------------------------------------------------------
# Warpgroup GEMM issue
# ----------------------------------------------------------------------------------------------
@cute.jit
def wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    frag_a: cute.Tensor,
    frag_b: cute.Tensor,
    zero_init,
    k_begin: cutlass.Constexpr[int] = 0,
    k_end: cutlass.Constexpr[int] = -1,
    b_shift: cutlass.Constexpr[int] = 0,
) -> None:
    """Issue ``acc (+)= A[:, k_begin:k_end] @ B[:, k_begin + b_shift:k_end + b_shift]`` as one
    wgmma group (``b_shift``: B holds only part of the K range, e.g. one column half).

    ``frag_a``/``frag_b`` are ``(MMA, M, K)`` / ``(MMA, N, K)`` fragments of one warpgroup;
    ``zero_init`` (bool, static or dynamic) drops the old accumulator on the first k-block.
    Does not wait: the caller pairs it with ``warpgroup.wait_group``.
    """
    num_k = cute.size(frag_a.shape[2])
    stop = num_k if const_expr(k_end < 0) else k_end
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated in the loop.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(k_begin, stop):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k + b_shift], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


# ----------------------------------------------------------------------------------------------
# mbarriers with explicit index and phase
# ----------------------------------------------------------------------------------------------
@cute.jit
def mbar_init(base: cute.Pointer, count: int, arrive_count: int) -> None:
    """Initialise ``count`` consecutive mbarriers (call from one warp; elects one thread)."""
    with cute.arch.elect_one():
        for i in cutlass.range_constexpr(count):
            cute.arch.mbarrier_init(base + i, arrive_count)


@cute.jit
def mbar_wait(base: cute.Pointer, index, phase) -> None:
    cute.arch.mbarrier_wait(base + index, phase)


@cute.jit
def mbar_arrive_one_per_warp(base: cute.Pointer, index) -> None:
    """Lane 0 of the calling warp arrives (barrier counts warps)."""
    if cute.arch.lane_idx() == 0:
        cute.arch.mbarrier_arrive(base + index)


@cute.jit
def mbar_expect_tx(base: cute.Pointer, index, num_bytes: int) -> None:
    """One elected thread of the calling warp arrives and announces ``num_bytes`` of TMA data."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(base + index, num_bytes)
