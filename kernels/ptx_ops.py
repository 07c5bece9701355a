"""Small inline-PTX operations the CuTeDSL kernels use (Hopper, sm_90a).

Each function emits one or a few PTX instructions through ``llvm.inline_asm``. Global addresses
are 64-bit integers (``Int64``, from ``Pointer.toint()``), shared-memory addresses 32-bit
(``Int32``). Loads are marked free of side effects so the compiler may schedule them freely;
stores are side-effecting so they stay ordered with fences and barriers.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _u32(v, loc=None, ip=None):
    return Uint32(v).ir_value(loc=loc, ip=ip)


def _unpack(struct_val, n: int, ty, wrap, loc=None, ip=None):
    return tuple(wrap(llvm.extractvalue(ty, struct_val, [i], loc=loc, ip=ip)) for i in range(n))


@dsl_user_op
def ld_global_nc_v4(addr: Int64, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """16-byte read-only global load that skips L1 (data read once): 4 x u32."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        has_side_effects=False,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )
    return _unpack(out, 4, T.i32(), Uint32, loc, ip)


@dsl_user_op
def ld_global_nc_v2(addr: Int64, *, loc=None, ip=None) -> tuple[Uint32, Uint32]:
    """8-byte read-only global load that skips L1: 2 x u32."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.L1::no_allocate.v2.u32 {$0, $1}, [$2];",
        "=r,=r,l",
        has_side_effects=False,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )
    return _unpack(out, 2, T.i32(), Uint32, loc, ip)


@dsl_user_op
def ld_global_nc_u8(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """One byte, zero-extended to u32 (read-only path)."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Int64(addr).ir_value(loc=loc, ip=ip)],
            "ld.global.nc.u8 $0, [$1];",
            "=r,l",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def ld_global_v2_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """8-byte global load of two floats (data written by an earlier kernel: coherent path)."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 2),
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.v2.f32 {$0, $1}, [$2];",
        "=f,=f,l",
        has_side_effects=False,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )
    return _unpack(out, 2, T.f32(), Float32, loc, ip)


@dsl_user_op
def ld_global_v4_f32(
    addr: Int64, *, loc=None, ip=None
) -> tuple[Float32, Float32, Float32, Float32]:
    """16-byte global load of four floats."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,l",
        has_side_effects=False,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )
    return _unpack(out, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def ld_global_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Int64(addr).ir_value(loc=loc, ip=ip)],
            "ld.global.f32 $0, [$1];",
            "=f,l",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def prefetch_l2(addr: Int64, *, loc=None, ip=None) -> None:
    """Prefetch the cache line holding ``addr`` into L2."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "prefetch.global.L2 [$0];",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def prefetch_bulk_l2(addr: Int64, size: int, *, loc=None, ip=None) -> None:
    """Bulk prefetch of ``size`` bytes (multiple of 16, 16-byte aligned address) into L2."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        f"cp.async.bulk.prefetch.L2.global [$0], {size};",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def cp_async_16(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """16-byte global -> shared async copy (L2 only); bytes past ``src_bytes`` are zero-filled."""
    llvm.inline_asm(
        None,
        [
            Int32(dst).ir_value(loc=loc, ip=ip),
            Int64(src).ir_value(loc=loc, ip=ip),
            Int32(src_bytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def cp_async_8(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """8-byte global -> shared async copy; bytes past ``src_bytes`` are zero-filled."""
    llvm.inline_asm(
        None,
        [
            Int32(dst).ir_value(loc=loc, ip=ip),
            Int64(src).ir_value(loc=loc, ip=ip),
            Int32(src_bytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.ca.shared.global [$0], [$1], 8, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """16-byte shared-memory load (ordered after earlier shared stores and waits)."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )
    return _unpack(out, 4, T.i32(), Uint32, loc, ip)


@dsl_user_op
def ld_shared_u8(addr: Int32, *, loc=None, ip=None) -> Uint32:
    """One shared-memory byte, zero-extended."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Int32(addr).ir_value(loc=loc, ip=ip)],
            "ld.shared.u8 $0, [$1];",
            "=r,r",
            has_side_effects=True,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """Wait for all of this thread's ``cp.async`` copies."""
    llvm.inline_asm(
        None, [], "cp.async.wait_all;", "", has_side_effects=True, is_align_stack=False,
        loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def st_shared_v4(addr: Int32, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None):
    """16-byte shared-memory store."""
    llvm.inline_asm(
        None,
        [Int32(addr).ir_value(loc=loc, ip=ip)] + [_u32(x, loc, ip) for x in (a, b, c, d)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_b32(addr: Int64, v: Uint32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip), _u32(v, loc, ip)],
        "st.global.b32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_v4_b32(
    addr: Int64, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None
) -> None:
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)] + [_u32(x, loc, ip) for x in (a, b, c, d)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_f32(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
        "st.global.f32 [$0], $1;",
        "l,f",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_v2_f32(addr: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [
            Int64(addr).ir_value(loc=loc, ip=ip),
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
        ],
        "st.global.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def prmt(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """Byte permute: result byte i = byte ``selector`` nibble i of {b, a} (a = bytes 0..3)."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [_u32(a, loc, ip), _u32(b, loc, ip)],
            f"prmt.b32 $0, $1, $2, {selector:#x};",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def mul_bf16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Lane-wise bf16 product of two packed bf16 pairs (round to nearest; subnormals kept)."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [_u32(a, loc, ip), _u32(b, loc, ip)],
            "mul.rn.bf16x2 $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def cvt_bf16x2_f32(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Pack two floats as bf16 (round to nearest even): ``lo`` in the low half."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def bits_to_f32(v: Uint32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), _u32(v, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def f32_to_bits(v: Float32, *, loc=None, ip=None) -> Uint32:
    return Uint32(llvm.bitcast(T.i32(), Float32(v).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def exp2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x (``ex2.approx.ftz``; exact for x = -inf -> 0, +inf -> inf)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "ex2.approx.ftz.f32 $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def log2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """log2(x) (``lg2.approx.ftz``; 0 -> -inf)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "lg2.approx.ftz.f32 $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def rcp_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "rcp.approx.ftz.f32 $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )
