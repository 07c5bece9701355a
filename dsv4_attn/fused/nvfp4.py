"""NVFP4 row encoding as Triton device functions (the byte layout of :mod:`dsv4_attn.kv_cache`).

:func:`store_nvfp4_row` encodes one 512-value KV row and writes its 352-byte data row and 32-byte
scale row into a paged cache. It follows the exact-arithmetic scale rule of
:mod:`dsv4_attn.kv_cache` step by step (integer exponent, binary search over the e4m3 codes,
comparisons against exact midpoints), so its bytes equal :func:`dsv4_attn.kv_cache.encode_rows`'
on every input, whatever the device's division or FMA behaviour.

:func:`store_nvfp4_ds_record` encodes 512 float32 values as DeepSeek-V4.1's 288-byte
``NVFP4_DS`` record (:func:`dsv4_attn.kv_cache.encode_rows`' rule on float32 inputs), with
software e4m3 and e2m1 rounding: it compiles for sm_90, which has no e2m1 conversion.

Register tiles: the 448 nope values of a row as two ``[32, 8]`` float32 tiles, ``even[b, p]`` =
value ``16 b + 2 p`` and ``odd[b, p]`` = value ``16 b + 2 p + 1`` (blocks ``b >= 28`` are padding,
loaded as 0); the 64 RoPE values as two ``[32]`` bf16 tiles of the even and odd positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "bf16_rne",
    "e4m3_code_rne",
    "e4m3_value",
    "load_nope_pairs",
    "store_nvfp4_ds_record",
    "store_nvfp4_row",
]

# Byte geometry of an NVFP4 row (dsv4_attn.kv_cache), as compile-time constants of the kernels.
NOPE_BLOCKS = tl.constexpr(28)  # e4m3 scales per row (448 / 16)
DATA_ROW_BYTES = tl.constexpr(352)
SCALE_ROW_BYTES = tl.constexpr(32)
NOPE_BYTES = tl.constexpr(224)
DS_SCALE_OFFSET = tl.constexpr(256)  # NVFP4_DS: 256 bytes of e2m1 pairs, then 32 e4m3 scales


@triton.jit
def bf16_rne(x):
    """float32 -> bfloat16, round to nearest even, spelled out in integer ops (finite ``x``): the
    same bits on a GPU and in Triton's CPU interpreter, whose own cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def load_nope_pairs(row_ptr):
    """The nope values of the bf16 row at ``row_ptr`` as ``(even, odd)`` float32 ``[32, 8]``."""
    block = tl.arange(0, 32)[:, None]
    pair = tl.arange(0, 8)[None, :]
    offset = block * 16 + pair * 2
    mask = block < NOPE_BLOCKS
    even = tl.load(row_ptr + offset, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(row_ptr + offset + 1, mask=mask, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def e4m3_value(code):
    """float32 value of non-negative e4m3 codes (int32 0..126), from bits."""
    exponent = code >> 3
    mantissa = code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    return tl.where(exponent > 0, normal, mantissa.to(tl.float32) * 0.001953125)


@triton.jit
def e4m3_code_rne(x):
    """float8_e4m3fn code (int32 1..126) of float32 ``x`` in [2^-9, 448], rounded to nearest
    even (as ``cvt.rn.satfinite``), in integer ops: Triton's CPU interpreter has no e4m3 cast.

    ``x = 1.f * 2^E``: the 24-bit significand keeps 3 fraction bits for ``E >= -6`` (normal
    e4m3), fewer below (subnormal e4m3, steps of 2^-9); a carry out of the kept bits moves into
    the exponent field by plain addition.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    significand = (bits & 0x7FFFFF) | 0x800000
    shift = 14 - tl.minimum(exponent, -6)
    kept = significand >> shift
    rest = significand - (kept << shift)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    return ((tl.maximum(exponent, -6) + 6) << 3) + kept + up.to(tl.int32)


@triton.jit
def _e2m1_nibbles(x, step):
    """Nearest e2m1 (ties to the even code) of x / step, by exact comparisons; sign << 3 | code."""
    mag = tl.abs(x)
    nonzero = mag > 0.0
    code = (mag > 0.25 * step).to(tl.int32)
    code += (nonzero & (mag >= 0.75 * step)).to(tl.int32)
    code += (mag > 1.25 * step).to(tl.int32)
    code += (nonzero & (mag >= 1.75 * step)).to(tl.int32)
    code += (mag > 2.5 * step).to(tl.int32)
    code += (nonzero & (mag >= 3.5 * step)).to(tl.int32)
    code += (mag > 5.0 * step).to(tl.int32)
    return code | ((x < 0.0).to(tl.int32) << 3)


@triton.jit
def store_nvfp4_row(cache_ptr, page_stride, block_size, slot, even, odd, rope_even, rope_odd):
    """Encode one row (nope pairs ``even``/``odd``, RoPE ``rope_even``/``rope_odd`` bf16 ``[32]``)
    and store it at cache slot ``slot`` (>= 0) of a ``uint8`` paged cache with pages
    ``page_stride`` bytes apart and ``block_size`` rows per page."""
    block_amax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)  # [32]
    amax = tl.max(block_amax, axis=0)
    # e = ceil(log2(amax / 2688)) exactly (2688 = 1.3125 * 2^11), clamped to [-127, 127].
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 138 + ((bits & 0x7FFFFF) > 0x280000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(amax > 0.0, e, 0)
    g_bits = tl.where(e >= -126, (e + 127) << 23, 1 << 22)  # 2^-127 is subnormal
    token_scale = g_bits.to(tl.float32, bitcast=True)
    # s_b: the smallest e4m3 code with 6 * s_b * G >= amax_b (binary search over 0..126).
    lo = tl.zeros([32], dtype=tl.int32)
    hi = tl.full([32], 126, dtype=tl.int32)
    for _ in tl.static_range(7):
        mid = (lo + hi) >> 1
        enough = e4m3_value(mid) * token_scale * 6.0 >= block_amax
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    step = (e4m3_value(lo) * token_scale)[:, None]
    packed = _e2m1_nibbles(even, step) | (_e2m1_nibbles(odd, step) << 4)

    slot = slot.to(tl.int64)
    page = cache_ptr + (slot // block_size) * page_stride
    row = slot % block_size
    data = page + row * DATA_ROW_BYTES
    block = tl.arange(0, 32)
    byte = block[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(data + byte, packed.to(tl.uint8), mask=block[:, None] < NOPE_BLOCKS)
    rope = (data + NOPE_BYTES).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope + 2 * block, rope_even)
    tl.store(rope + 2 * block + 1, rope_odd)
    scale_byte = tl.where(block < NOPE_BLOCKS, lo, tl.where(block == NOPE_BLOCKS, e + 127, 0))
    scales = page + block_size * DATA_ROW_BYTES + row * SCALE_ROW_BYTES
    tl.store(scales + block, scale_byte.to(tl.uint8))


@triton.jit
def store_nvfp4_ds_record(record_ptr, even, odd):
    """Encode 512 float32 values as DeepSeek-V4.1's 288-byte ``NVFP4_DS`` record at
    ``record_ptr`` (``uint8``), as vLLM's SM100 writer does.

    ``even[b, p]`` / ``odd[b, p]`` (float32 ``[32, 8]``) are values ``16 b + 2 p`` and
    ``16 b + 2 p + 1``. Scale ``s_b = e4m3(clamp(amax_b * f32(1/6), 2^-9, 448))``; each value's
    nibble is the nearest e2m1 (ties to the even code, saturating at 6) of the correctly rounded
    float32 quotient ``x / s_b`` -- rounded twice, as vLLM's ``div_rn`` + ``cvt.rn.satfinite``.
    """
    amax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)  # [32]
    sixth = tl.full([32], 0x3E2AAAAB, tl.int32).to(tl.float32, bitcast=True)  # f32(1/6)
    code = e4m3_code_rne(tl.minimum(tl.maximum(amax * sixth, 0.001953125), 448.0))
    scale = tl.broadcast_to(e4m3_value(code)[:, None], (32, 8))
    packed = _e2m1_nibbles(tl.math.div_rn(even, scale), 1.0) | (
        _e2m1_nibbles(tl.math.div_rn(odd, scale), 1.0) << 4
    )
    block = tl.arange(0, 32)
    byte = block[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(record_ptr + byte, packed.to(tl.uint8))
    tl.store(record_ptr + DS_SCALE_OFFSET + block, code.to(tl.uint8))
