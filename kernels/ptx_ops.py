"""Small inline-PTX operations the CuTeDSL kernels use (Hopper, sm_90a).

Each function emits one or a few PTX instructions through ``llvm.inline_asm``. Global addresses
are 64-bit integers (``Int64``, from ``Pointer.toint()``), shared-memory addresses 32-bit
(``Int32``). Loads are marked free of side effects so the compiler may schedule them freely;
stores are side-effecting so they stay ordered with fences and barriers. Shared-memory loads
are side-effecting too, so they stay after the waits and barriers that publish the data.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _u32(v, loc=None, ip=None):
    return Uint32(v).ir_value(loc=loc, ip=ip)


def _i32(v, loc=None, ip=None):
    return Int32(v).ir_value(loc=loc, ip=ip)


def _i64(v, loc=None, ip=None):
    return Int64(v).ir_value(loc=loc, ip=ip)


def _f32(v, loc=None, ip=None):
    return Float32(v).ir_value(loc=loc, ip=ip)


def _asm(result_type, operands, asm: str, constraints: str, side_effects: bool, loc, ip):
    return llvm.inline_asm(
        result_type,
        operands,
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        loc=loc,
        ip=ip,
    )


def _statement(operands, asm: str, constraints: str, loc, ip) -> None:
    """An instruction with no result, kept in program order (stores, copies, prefetches)."""
    _asm(None, operands, asm, constraints, True, loc, ip)


def _scalar(wrap, ty, operands, asm, constraints, loc, ip, side_effects=False):
    """An instruction with one result register of type ``ty``, wrapped as ``wrap``."""
    return wrap(_asm(ty, operands, asm, constraints, side_effects, loc, ip))


def _vector(wrap, ty, n: int, operands, asm, constraints, loc, ip, side_effects=False):
    """An instruction with ``n`` result registers of type ``ty``: a tuple of ``wrap``."""
    struct_type = llvm.StructType.get_literal([ty] * n)
    out = _asm(struct_type, operands, asm, constraints, side_effects, loc, ip)
    return tuple(wrap(llvm.extractvalue(ty, out, [i], loc=loc, ip=ip)) for i in range(n))


# ---------------------------------------------------------------------------------------------
# Global memory
# ---------------------------------------------------------------------------------------------


@dsl_user_op
def ld_global_nc_b32_if(addr: Int64, pred: Int32, default: int, *, loc=None, ip=None) -> Int32:
    """32-bit read-only load of ``addr`` where ``pred`` != 0, else ``default`` (no access).

    One predicated load writes the result register, so nothing waits for the value until its
    first use (a load inside a traced ``if`` joins through a select that waits at once).
    """
    return _scalar(
        Int32,
        T.i32(),
        [_i64(addr, loc, ip), _i32(pred, loc, ip)],
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\tmov.b32 $0, "
        f"{default};\n\t@p ld.global.nc.b32 $0, [$1];\n\t}}",
        "=r,l,r",
        loc,
        ip,
    )


@dsl_user_op
def ld_global_nc_u8(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """One byte, zero-extended to u32 (read-only path)."""
    return _scalar(
        Uint32, T.i32(), [_i64(addr, loc, ip)], "ld.global.nc.u8 $0, [$1];", "=r,l", loc, ip
    )


@dsl_user_op
def ld_global_v2_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """8-byte global load of two floats (data written by an earlier kernel: coherent path)."""
    return _vector(
        Float32,
        T.f32(),
        2,
        [_i64(addr, loc, ip)],
        "ld.global.v2.f32 {$0, $1}, [$2];",
        "=f,=f,l",
        loc,
        ip,
    )


@dsl_user_op
def ld_global_vec_if(
    addr: Int64, pred: Int32, words: int, *, loc=None, ip=None
) -> tuple[Uint32, ...]:
    """A ``4 * words``-byte global load (``words`` 2 or 4, the address aligned to it) where
    ``pred`` != 0, else zeros (no access): one predicated load writes the result registers."""
    if words not in (2, 4):
        raise ValueError(f"words must be 2 or 4, got {words}")
    dst = ", ".join(f"${i}" for i in range(words))
    zeros = "".join(f"\n\tmov.b32 ${i}, 0;" for i in range(words))
    return _vector(
        Uint32,
        T.i32(),
        words,
        [_i64(addr, loc, ip), _i32(pred, loc, ip)],
        f"{{\n\t.reg .pred p;\n\tsetp.ne.b32 p, ${words + 1}, 0;{zeros}"
        f"\n\t@p ld.global.v{words}.b32 {{{dst}}}, [${words}];\n\t}}",
        ",".join(["=r"] * words + ["l", "r"]),
        loc,
        ip,
    )


@dsl_user_op
def ld_global_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    return _scalar(
        Float32, T.f32(), [_i64(addr, loc, ip)], "ld.global.f32 $0, [$1];", "=f,l", loc, ip
    )


@dsl_user_op
def prefetch_bulk_l2(addr: Int64, size: Int32, *, loc=None, ip=None) -> None:
    """Bulk prefetch of ``size`` bytes (multiple of 16, 16-byte aligned address) into L2."""
    _statement(
        [_i64(addr, loc, ip), _i32(size, loc, ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        "l,r",
        loc,
        ip,
    )


@dsl_user_op
def prefetch_l1(addr: Int64, *, loc=None, ip=None) -> None:
    """Prefetch the line holding ``addr`` into L1 (a later load of it waits less)."""
    _statement([_i64(addr, loc, ip)], "prefetch.global.L1 [$0];", "l", loc, ip)


@dsl_user_op
def st_global_b32(addr: Int64, v: Uint32, *, loc=None, ip=None) -> None:
    _statement([_i64(addr, loc, ip), _u32(v, loc, ip)], "st.global.b32 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def st_global_v2_b32(addr: Int64, a: Uint32, b: Uint32, *, loc=None, ip=None) -> None:
    _statement(
        [_i64(addr, loc, ip), _u32(a, loc, ip), _u32(b, loc, ip)],
        "st.global.v2.b32 [$0], {$1, $2};",
        "l,r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_global_v4_b32(
    addr: Int64, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None
) -> None:
    _statement(
        [_i64(addr, loc, ip)] + [_u32(x, loc, ip) for x in (a, b, c, d)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_global_cs_v4_b32(
    addr: Int64, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None
) -> None:
    """16-byte store marked streaming (``.cs``: likely read once, evicted first from L2)."""
    _statement(
        [_i64(addr, loc, ip)] + [_u32(x, loc, ip) for x in (a, b, c, d)],
        "st.global.cs.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def l2_policy_evict_first(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy (for ``.L2::cache_hint`` operands) that evicts the data first."""
    return _scalar(
        Int64, T.i64(), [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l", loc, ip
    )


@dsl_user_op
def st_global_f32(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    _statement([_i64(addr, loc, ip), _f32(v, loc, ip)], "st.global.f32 [$0], $1;", "l,f", loc, ip)


@dsl_user_op
def st_global_v2_f32(addr: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    _statement(
        [_i64(addr, loc, ip), _f32(a, loc, ip), _f32(b, loc, ip)],
        "st.global.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        loc,
        ip,
    )


# ---------------------------------------------------------------------------------------------
# Global -> shared copies and shared memory
# ---------------------------------------------------------------------------------------------


def _cp_async(dst, src, src_bytes, size: int, cache: str, loc, ip, suffix: str = "") -> None:
    """``size``-byte global -> shared ``cp.async`` (``cache``: ``cg`` = L2 only, 16 bytes only;
    ``ca``); bytes past ``src_bytes`` are zero-filled (none read when it is 0)."""
    _statement(
        [_i32(dst, loc, ip), _i64(src, loc, ip), _i32(src_bytes, loc, ip)],
        f"cp.async.{cache}.shared.global{suffix} [$0], [$1], {size}, $2;",
        "r,l,r",
        loc,
        ip,
    )


@dsl_user_op
def cp_async_16(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """16-byte global -> shared async copy (L2 only); bytes past ``src_bytes`` are zero-filled."""
    _cp_async(dst, src, src_bytes, 16, "cg", loc, ip)


@dsl_user_op
def cp_async_16_prefetch_256(
    dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None
) -> None:
    """:func:`cp_async_16` that also has L2 fetch the whole 256-byte block around ``src`` from
    DRAM on a miss (``.L2::256B``: the neighbouring chunks of a row come next)."""
    _cp_async(dst, src, src_bytes, 16, "cg", loc, ip, suffix=".L2::256B")


@dsl_user_op
def cp_async_8(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """8-byte global -> shared async copy; bytes past ``src_bytes`` are zero-filled."""
    _cp_async(dst, src, src_bytes, 8, "ca", loc, ip)


@dsl_user_op
def cp_async_4(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """4-byte global -> shared async copy; bytes past ``src_bytes`` are zero-filled."""
    _cp_async(dst, src, src_bytes, 4, "ca", loc, ip)


@dsl_user_op
def ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """4-byte shared-memory load (ordered after earlier shared stores and waits)."""
    return _scalar(
        Int32,
        T.i32(),
        [_i32(addr, loc, ip)],
        "ld.shared.b32 $0, [$1];",
        "=r,r",
        loc,
        ip,
        side_effects=True,
    )


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    """Close this thread's current group of ``cp.async`` copies (an empty group is allowed)."""
    _statement([], "cp.async.commit_group;", "", loc, ip)


@dsl_user_op
def cp_async_wait_group(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most ``pending`` (a constant) of this thread's newest ``cp.async`` groups
    are still in flight."""
    _statement([], f"cp.async.wait_group {int(pending)};", "", loc, ip)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """Wait for all of this thread's ``cp.async`` copies."""
    _statement([], "cp.async.wait_all;", "", loc, ip)


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """16-byte shared-memory load (ordered after earlier shared stores and waits)."""
    return _vector(
        Uint32,
        T.i32(),
        4,
        [_i32(addr, loc, ip)],
        "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        loc,
        ip,
        side_effects=True,
    )


@dsl_user_op
def ld_shared_v2(addr: Int32, *, loc=None, ip=None) -> tuple[Uint32, Uint32]:
    """8-byte shared-memory load (ordered after earlier shared stores and waits)."""
    return _vector(
        Uint32,
        T.i32(),
        2,
        [_i32(addr, loc, ip)],
        "ld.shared.v2.u32 {$0, $1}, [$2];",
        "=r,=r,r",
        loc,
        ip,
        side_effects=True,
    )


@dsl_user_op
def ld_shared_u8(addr: Int32, *, loc=None, ip=None) -> Uint32:
    """One shared-memory byte, zero-extended."""
    return _scalar(
        Uint32,
        T.i32(),
        [_i32(addr, loc, ip)],
        "ld.shared.u8 $0, [$1];",
        "=r,r",
        loc,
        ip,
        side_effects=True,
    )


@dsl_user_op
def st_shared_v4(addr: Int32, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None):
    """16-byte shared-memory store."""
    _statement(
        [_i32(addr, loc, ip)] + [_u32(x, loc, ip) for x in (a, b, c, d)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def st_shared_b32(addr: Int32, v: Uint32, *, loc=None, ip=None):
    """4-byte shared-memory store."""
    _statement([_i32(addr, loc, ip), _u32(v, loc, ip)], "st.shared.b32 [$0], $1;", "r,r", loc, ip)


# ---------------------------------------------------------------------------------------------
# Arithmetic and bit manipulation
# ---------------------------------------------------------------------------------------------


@dsl_user_op
def packed_slot_or_hole(slot: Int32, limit: Int32, is_extra: Int32, *, loc=None, ip=None) -> Int32:
    """``slot * 2 + is_extra`` if ``0 <= slot < limit``, else -1: one unsigned compare and a
    select, in PTX so that no compiler reasoning about the doubled id (a signed multiply it may
    assume does not overflow) can turn an id outside the range into a slot."""
    return _scalar(
        Int32,
        T.i32(),
        [_i32(slot, loc, ip), _i32(limit, loc, ip), _i32(is_extra, loc, ip)],
        "{\n\t.reg .pred p;\n\t.reg .b32 t;\n\tsetp.lt.u32 p, $1, $2;\n\t"
        "mad.lo.s32 t, $1, 2, $3;\n\tselp.b32 $0, t, -1, p;\n\t}",
        "=r,r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def prmt(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """Byte permute: result byte i = byte ``selector`` nibble i of {b, a} (a = bytes 0..3)."""
    return _scalar(
        Uint32,
        T.i32(),
        [_u32(a, loc, ip), _u32(b, loc, ip)],
        f"prmt.b32 $0, $1, $2, {selector:#x};",
        "=r,r,r",
        loc,
        ip,
    )


@dsl_user_op
def mul_bf16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Lane-wise bf16 product of two packed bf16 pairs (round to nearest; subnormals kept)."""
    return _scalar(
        Uint32,
        T.i32(),
        [_u32(a, loc, ip), _u32(b, loc, ip)],
        "mul.rn.bf16x2 $0, $1, $2;",
        "=r,r,r",
        loc,
        ip,
    )


def _cvt_pair(kind: str, lo: Float32, hi: Float32, loc, ip) -> Uint32:
    """Two floats packed as a 16-bit ``kind`` pair (``bf16x2`` or ``f16x2``), ``lo`` low."""
    return _scalar(
        Uint32,
        T.i32(),
        [_f32(hi, loc, ip), _f32(lo, loc, ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;",
        "=r,f,f",
        loc,
        ip,
    )


@dsl_user_op
def cvt_bf16x2_f32(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Pack two floats as bf16 (round to nearest even): ``lo`` in the low half."""
    return _cvt_pair("bf16x2", lo, hi, loc, ip)


@dsl_user_op
def cvt_f16x2_f32(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Pack two floats as fp16 (round to nearest even, overflow to inf): ``lo`` in the low half."""
    return _cvt_pair("f16x2", lo, hi, loc, ip)


@dsl_user_op
def f16x2_to_f32(pair: Uint32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """The two fp16 halves of ``pair`` as floats (exact): (low half, high half)."""
    return _vector(
        Float32,
        T.f32(),
        2,
        [_u32(pair, loc, ip)],
        "{\n\t.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, $2;\n\tcvt.f32.f16 $0, lo;"
        "\n\tcvt.f32.f16 $1, hi;\n\t}",
        "=f,=f,r",
        loc,
        ip,
    )


@dsl_user_op
def max_abs(acc: Float32, x: Float32, *, loc=None, ip=None) -> Float32:
    """max(acc, |x|) (one FMNMX with an absolute-value operand; a NaN ``x`` is dropped)."""
    return _scalar(
        Float32,
        T.f32(),
        [_f32(acc, loc, ip), _f32(x, loc, ip)],
        "{\n\t.reg .f32 t;\n\tabs.f32 t, $2;\n\tmax.f32 $0, $1, t;\n\t}",
        "=f,f,f",
        loc,
        ip,
    )


@dsl_user_op
def bits_to_f32(v: Uint32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), _u32(v, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def f32_to_bits(v: Float32, *, loc=None, ip=None) -> Uint32:
    return Uint32(llvm.bitcast(T.i32(), _f32(v, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def exp2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x (``ex2.approx.ftz``; exact for x = -inf -> 0, +inf -> inf)."""
    return _scalar(
        Float32, T.f32(), [_f32(x, loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f", loc, ip
    )


@dsl_user_op
def log2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """log2(x) (``lg2.approx.ftz``; 0 -> -inf)."""
    return _scalar(
        Float32, T.f32(), [_f32(x, loc, ip)], "lg2.approx.ftz.f32 $0, $1;", "=f,f", loc, ip
    )


@dsl_user_op
def rcp_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    return _scalar(
        Float32, T.f32(), [_f32(x, loc, ip)], "rcp.approx.ftz.f32 $0, $1;", "=f,f", loc, ip
    )
