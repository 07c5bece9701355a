"""Register-level dequantization of one 16-value slice of a KV row to bf16 (inside CuTeDSL kernels).

Both cache formats (``dsv4_attn.kv_cache``) decode exactly to bf16, so these helpers are exact:

* FP8 (``fp8_ds_mla``): value = e4m3 * 2^(e - 127), one UE8M0 byte ``e`` per 64 values.
  An e4m3 byte ``s eeee mmm`` is moved bit for bit into a bf16 ``s 0000eeee mmm0000``, which is
  the value times 2^-120 (subnormals included: exponent field 0 stays a bf16 subnormal); one
  bf16 multiply by 2^120 restores it and a second by 2^(e - 127) applies the block scale. Both
  products are exact (powers of two; in range for every scale the writer produces).
* NVFP4: value = e2m1 * s_b * 2^(u - 127), ``s_b`` e4m3 per 16 values, ``u`` UE8M0 per token.
  A nibble ``s eem`` becomes the bf16 ``s 0000000 eem000000``, i.e. the value times 2^-126.
  A first multiply by A = s_b * 2^118 (a normal bf16 for every e4m3 s_b, exact: 4-bit
  significand) gives e2m1 * s_b * 2^-8, a normal bf16 with at most 6 significant bits: exact.
  A second by B = 2^(u - 119) (a power of two, normal for 0 <= u <= 246) rounds once to the
  decoded value, as the codec's float32 product rounded to bf16 does, subnormal results included.
  (Folding s_b and 2^(u - 127) into one bf16 first would round s_b * G when it is a bf16
  subnormal, i.e. for u <= 2.) The writer produces u <= 244 for finite bf16 rows.

Cost per 16 values (one lane): FP8 ~32 integer ops + 16 bf16x2 multiplies (8 when the block scale
is at most 2^7, the 2^120 folded into it: :func:`fp8_folded_scale_bf16x2`); NVFP4 ~26 integer ops
+ 16 multiplies. ``tests/test_dequant.py`` checks both recipes against the codecs on every code
and scale. Plain Python functions: they are traced inline into the calling kernel.
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dsv4_attn.kernels.ptx_ops import bits_to_f32, cvt_bf16x2_f32, mul_bf16x2, prmt

BF16X2_2POW120 = 0x7B807B80  # bf16 2^120 in both halves
NVFP4_BLOCK_SCALE_SHIFT = 118  # A = s_b * 2^118, B = 2^(u - 119): see the module docstring


def fp8_block_scale_bf16x2(e: Uint32) -> Uint32:
    """UE8M0 byte ``e`` -> packed bf16 pair 2^(e-127) (for 1 <= e <= 254)."""
    return (e << 7) | (e << 23)


# 2^(e - 7) = 2^120 * 2^(e - 127) is a normal bf16 while its exponent field e + 120 <= 254.
FP8_FOLDED_MAX_EXP = 134


def fp8_folded_scale_bf16x2(e: Uint32) -> Uint32:
    """UE8M0 byte ``e`` (<= ``FP8_FOLDED_MAX_EXP``) -> packed bf16 pair 2^(e - 7): the recipe's
    two multiplies (2^120, then the block scale) as one. The product (value * 2^-120) * 2^(e - 7)
    is the same real number as the two-step recipe's, whose first product is exact, and is rounded
    once to bf16 either way: the same bits."""
    field = e + 120
    return (field << 7) | (field << 23)


def _fp8x2_to_bf16x2_scaled_down(w: Uint32) -> Uint32:
    """``w`` holds two e4m3 bytes in bits 8-15 and 24-31: bf16 pair (value * 2^-120)."""
    return (w & 0x80008000) | ((w >> 4) & 0x07F007F0)


def dequant_fp8_16(words: tuple, scale2: Uint32, folded: bool = False) -> list:
    """16 e4m3 values (4 little-endian u32 words) -> 8 packed bf16 pairs, times 2^120 and
    ``scale2`` (:func:`fp8_block_scale_bf16x2`), or, ``folded``, times ``scale2`` alone
    (:func:`fp8_folded_scale_bf16x2`: one bf16x2 multiply per pair instead of two)."""
    out = []
    zero = Uint32(0)
    for x in words:
        for selector in (0x1404, 0x3424):  # bytes (0, 1) and (2, 3) into the high byte of halves
            v = _fp8x2_to_bf16x2_scaled_down(prmt(x, zero, selector))
            if not folded:
                v = mul_bf16x2(v, Uint32(BF16X2_2POW120))
            out.append(mul_bf16x2(v, scale2))
    return out


@dsl_user_op
def _e4m3x2_to_f16x2(x: Uint32, *, loc=None, ip=None) -> Uint32:
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Uint32(x).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b16 lo;\n\tcvt.u16.u32 lo, $1;\n\tcvt.rn.f16x2.e4m3x2 $0, lo;\n\t}",
            "=r,r",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def _f16_lo_to_f32(x: Uint32, *, loc=None, ip=None) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Uint32(x).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b16 lo;\n\tcvt.u16.u32 lo, $1;\n\tcvt.f32.f16 $0, lo;\n\t}",
            "=f,r",
            has_side_effects=False,
            is_align_stack=False,
            loc=loc,
            ip=ip,
        )
    )


def nvfp4_block_scale_bf16x2(block_scale: Uint32) -> Uint32:
    """e4m3 byte ``s_b`` (0..0x7E) -> packed bf16 pair s_b * 2^118 (exact, always normal)."""
    sb = _f16_lo_to_f32(_e4m3x2_to_f16x2(block_scale))  # exact, subnormals included
    a = sb * bits_to_f32(Uint32((127 + NVFP4_BLOCK_SCALE_SHIFT) << 23))
    return cvt_bf16x2_f32(a, a)


def nvfp4_token_scale_bf16x2(token_scale: Uint32) -> Uint32:
    """UE8M0 byte ``u`` (0..246) -> packed bf16 pair 2^(u - 119), the factor that turns
    e2m1 * s_b * 2^-8 into e2m1 * s_b * 2^(u - 127)."""
    # e2m1 * s_b * 2^(shift - 126) times 2^(u - 127 - (shift - 126)): bf16 exponent field
    # u - 1 - shift + 127.
    field = token_scale + (126 - NVFP4_BLOCK_SCALE_SHIFT)
    return (field << 7) | (field << 23)


def _e2m1x2_to_bf16x2_scaled_down(w: Uint32) -> Uint32:
    """``w`` holds two e2m1 nibbles in bits 0-3 and 16-19: bf16 pair (value * 2^-126)."""
    return ((w & 0x00070007) << 6) | ((w & 0x00080008) << 12)


def dequant_nvfp4_16(words: tuple, block_scale2: Uint32, token_scale2: Uint32) -> list:
    """16 e2m1 values (2 u32 words, value 2j in the low nibble) -> 8 packed bf16 pairs.

    ``block_scale2`` from :func:`nvfp4_block_scale_bf16x2`, ``token_scale2`` from
    :func:`nvfp4_token_scale_bf16x2` (0 gives a zero row).
    """
    out = []
    for x in words:
        xs = x >> 4
        for k in range(4):
            # Low half takes byte k of x (nibble 2k at bits 0-3); high half byte k of x >> 4
            # (nibble 2k+1 at bits 16-19).
            w = prmt(x, xs, k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12))
            v = mul_bf16x2(_e2m1x2_to_bf16x2_scaled_down(w), block_scale2)
            out.append(mul_bf16x2(v, token_scale2))
    return out
