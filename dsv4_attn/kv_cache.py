"""Paged KV-cache formats for DeepSeek-V4 attention rows, and torch codecs for them.

A DeepSeek-V4 KV row is 512 values: 448 "nope" values followed by 64 RoPE values (docs/design.md
§2). A cache is a ``uint8`` tensor ``[num_blocks, page_bytes_or_more]`` (row stride may exceed the
page size, as in vLLM's packed pages); slot ``s`` is token ``s % block_size`` of block ``s //
block_size``. Every format keeps a page as *all data rows first, then all scale rows*, so a kernel
can bulk-copy the data rows of a tile and, separately, their scales.

``FP8_DS_MLA`` (584 B/token) — byte-for-byte vLLM's ``fp8_ds_mla`` (FlashMLA "MODEL1"):
    data row, 576 B:  [0, 448)    448 x float8_e4m3fn, nope value i / 2^(e_{i//64} - 127)
                      [448, 576)  64 x bfloat16 RoPE values, little-endian, unquantized
    scale row, 8 B:   [0, 7)      7 x UE8M0 exponent byte per 64-value block b:
                                  e_b = ceil(log2(max(amax_b, 1e-4) / 448)) + 127,
                                  amax_b over the bf16 inputs of the block
                      [7]         0 (padding)
    page:             block_size data rows, then block_size scale rows, padded to a
                      multiple of 576 B.
    Nope values are x / 2^(e_b - 127) rounded to nearest-even e4m3 (never beyond +-448).

``NVFP4`` (384 B/token) — this backend's default:
    data row, 352 B:  [0, 224)    448 x e2m1 packed two per byte: value 2j in the low nibble,
                                  2j+1 in the high nibble; nibble = sign << 3 | magnitude
                                  code, codes 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}
                      [224, 352)  64 x bfloat16 RoPE values, unquantized
    scale row, 32 B:  [0, 28)     28 x float8_e4m3fn block scale s_b, one per 16 nope values
                      [28]        UE8M0 token scale byte u: the token scale is G = 2^(u - 127)
                      [29, 32)    0 (padding)
    page:             block_size data rows, then block_size scale rows (always a multiple of 128 B).
    Decoded value i = e2m1_i * s_{i//16} * G. Every such product of magnitude >= 2^-126 is
    exact in bfloat16 (a 2-bit times a 4-bit significand), so kernels may dequantize in bf16
    without rounding; a smaller one rounds to bf16's subnormal grid (steps of 2^-133).

    Scale rule (chosen so no element ever saturates, and the e4m3 scales use their full range),
    in exact arithmetic (no rounded quotient decides anything, so every implementation - torch on
    CPU or CUDA, the Triton writers - produces the same bytes):
      * G = 2^e, e = ceil(log2(amax_token / (6 * 448))) clamped to [-127, 127], with amax_token
        over the 448 nope values (e = 0 for an all-zero row). This per-token power of two is the
        "global" scale of NVFP4, kept per token because a paged cache is written a token at a time.
      * s_b = the smallest e4m3 value with 6 * s_b * G >= amax_b (so |x / (s_b G)| <= 6).
      * e2m1_i = x_i / (s_b G) rounded to the nearest e2m1 value, ties to the even code; the sign
        bit is the sign of x_i (a negative value that rounds to 0 keeps it).
    Error bound per nope value (finite inputs, |x| < 2^127):
      |x - x_hat| <= max(|x| / 4, s_b * G / 4), with s_b * G <= 1.125 * amax_b / 6 + 2^-9 * G,
      plus 2^-134 (the subnormal rounding above) where x_hat is decoded to bf16.

``BF16`` (1024 B/token): 512 x bfloat16, no scale rows; a lossless format for tests and for
    checking a model path without quantization.

DeepSeek-V4.1's own records (vLLM's ``nvfp4_ds_mla`` cache mode, written by its SM100 kernels):
each quantizes all 512 values, RoPE values included (the writer rotates them first), and keeps
its scales at the end of its own row (no scale rows; a page is ``block_size`` records).

``MXFP8_DS`` (528 B/token) — V4.1's window record:
    [0, 512)    512 x float8_e4m3fn, value i / 2^(e_{i//32} - 127)
    [512, 528)  16 x UE8M0 exponent byte per 32-value block b:
                e_b = ceil(log2(max(amax_b, 1e-4) / 448)) + 127 (clamped to [0, 255])
    Values are x / 2^(e_b - 127) rounded to nearest-even e4m3 (never beyond +-448).

``NVFP4_DS`` (288 B/token) — V4.1's compressed record:
    [0, 256)    512 x e2m1 packed two per byte, value 2j in the low nibble (as ``NVFP4``)
    [256, 288)  32 x float8_e4m3fn scale s_b per 16-value block b, no token scale:
                s_b = amax_b * f32(1/6) clamped to [2^-9, 448], rounded to nearest-even e4m3
    e2m1_i = the float32 quotient x_i / s_b (rounded to nearest), then rounded to the nearest
    e2m1 value, ties to the even code, saturating at 6 (PTX ``cvt.rn.satfinite``: the quotient
    is rounded twice, as vLLM's writer rounds it; with an e4m3 divisor the float32 quotient lies
    on an e2m1 midpoint only where the exact one does, so the two steps give the exactly
    rounded code); decoded value i = e2m1_i * s_{i//16}.

FP8_DS_MLA round-trip error bound per nope value: |x - x_hat| <= 2^-4 |x| + 2^-10 * 2^(e_b - 127).
RoPE values round-trip exactly in every format of this backend (not in V4.1's records).

The codecs here are the reference implementation of the formats (vectorized torch, CPU or CUDA);
``write`` and ``read`` validate their inputs and are not meant for a serving hot path.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

__all__ = [
    "HEAD_DIM",
    "NOPE_DIM",
    "ROPE_DIM",
    "KVFormat",
    "PageLayout",
    "allocate",
    "bytes_per_token",
    "decode_rows",
    "encode_rows",
    "page_layout",
    "read",
    "read_unchecked",
    "write",
    "write_unchecked",
]

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64

FP8_MAX = 448.0  # largest float8_e4m3fn
FP8_QUANT_BLOCK = 64  # nope values per UE8M0 scale in fp8_ds_mla
FP8_AMAX_FLOOR = 1e-4  # vLLM/FlashMLA clamp amax before taking the scale
NVFP4_QUANT_BLOCK = 16  # nope values per e4m3 scale in NVFP4 (all values in NVFP4_DS)
MXFP8_QUANT_BLOCK = 32  # values per UE8M0 scale in MXFP8_DS
E2M1_MAX = 6.0
UE8M0_BIAS = 127


class KVFormat(enum.Enum):
    """KV-cache formats this package reads and writes. Values are vLLM-style dtype names."""

    FP8_DS_MLA = "fp8_ds_mla"
    NVFP4 = "nvfp4"
    BF16 = "bf16"
    MXFP8_DS = "mxfp8_ds"  # DeepSeek-V4.1's window record
    NVFP4_DS = "nvfp4_ds"  # DeepSeek-V4.1's compressed record

    # Members are singletons compared by identity, so the identity hash (in C) is theirs: every
    # cache keyed on a format in an eager call skips Enum's Python __hash__ (~0.25 us each).
    __hash__ = object.__hash__

    @classmethod
    def parse(cls, fmt: KVFormat | str) -> KVFormat:
        """Accept a member or its value/name (case-insensitive); ValueError lists the options."""
        if isinstance(fmt, KVFormat):
            return fmt
        if isinstance(fmt, str):
            key = fmt.strip().lower()
            for member in cls:
                if key in (member.value, member.name.lower()):
                    return member
        options = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown KV-cache format {fmt!r}; expected one of: {options}")


@dataclass(frozen=True)
class PageLayout:
    """Byte geometry of one cache page (block) of ``block_size`` tokens."""

    block_size: int
    data_row_bytes: int  # bytes per token in the data area
    scale_row_bytes: int  # bytes per token in the scale area
    page_bytes: int  # minimum row stride of the cache tensor (padded)

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first scale row within a page."""
        return self.block_size * self.data_row_bytes


# data row bytes, scale row bytes, page alignment
_GEOMETRY: dict[KVFormat, tuple[int, int, int]] = {
    KVFormat.FP8_DS_MLA: (NOPE_DIM + 2 * ROPE_DIM, 8, 576),
    KVFormat.NVFP4: (NOPE_DIM // 2 + 2 * ROPE_DIM, 32, 128),
    KVFormat.BF16: (2 * HEAD_DIM, 0, 1),
    KVFormat.MXFP8_DS: (HEAD_DIM + HEAD_DIM // 32, 0, 1),
    KVFormat.NVFP4_DS: (HEAD_DIM // 2 + HEAD_DIM // 16, 0, 1),
}


def bytes_per_token(fmt: KVFormat | str) -> int:
    """Bytes one token occupies (data row + scale row), before page padding."""
    data, scale, _ = _GEOMETRY[KVFormat.parse(fmt)]
    return data + scale


def page_layout(fmt: KVFormat | str, block_size: int) -> PageLayout:
    """Geometry of a page of ``block_size`` tokens in format ``fmt``."""
    fmt = KVFormat.parse(fmt)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return _page_layout(fmt, block_size)


@functools.lru_cache(maxsize=64)
def _page_layout(fmt: KVFormat, block_size: int) -> PageLayout:
    # One object per (format, block size): an eager call pays a lookup, not a dataclass.
    data, scale, align = _GEOMETRY[fmt]
    raw = block_size * (data + scale)
    return PageLayout(block_size, data, scale, -(-raw // align) * align)


def allocate(
    num_blocks: int,
    block_size: int,
    fmt: KVFormat | str,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zero-filled cache: ``uint8 [num_blocks, page_bytes]``."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    layout = page_layout(fmt, block_size)
    return torch.zeros(num_blocks, layout.page_bytes, dtype=torch.uint8, device=device)


# --------------------------------------------------------------------------------------------
# Bit-exact helpers
# --------------------------------------------------------------------------------------------


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite float32 ``x``, as int32."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact 2^exponent as float32 for int ``exponent`` in [-127, 127], built from its bits."""
    e = exponent.to(torch.int32)
    normal_bits = (e + UE8M0_BIAS).clamp(min=1) << 23
    bits = torch.where(e >= -126, normal_bits, torch.full_like(e, 1 << 22))  # 2^-127 is subnormal
    return bits.view(torch.float32)


def _e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """float32 value of non-negative float8_e4m3fn codes (int32, 0..126), built from bits."""
    exponent, mantissa = code >> 3, code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).view(torch.float32)
    return torch.where(exponent > 0, normal, mantissa.to(torch.float32) * 2.0**-9)


def _nvfp4_token_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 e = ceil(log2(amax / 2688)) exactly, clamped to [-127, 127]; 0 where amax == 0.

    2688 = 6 * 448 = 1.3125 * 2^11: for amax = 1.m * 2^(E - 127), amax <= 2688 * 2^e holds from
    e = E - 138 on when 1.m <= 1.3125, from E - 137 otherwise. Subnormal amax clamps to -127.
    """
    bits = amax.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    e = (exponent - 138 + (mantissa > 0x280000).to(torch.int32)).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    return torch.where(amax > 0, e, 0)


def _nvfp4_block_scale_codes(block_amax: torch.Tensor, token_scale: torch.Tensor) -> torch.Tensor:
    """int32 e4m3 codes: the smallest s_b with 6 * s_b * G >= amax_b, by exact binary search over
    the codes 0..126 (6 * s_b * G is exact in float32)."""
    lo = torch.zeros_like(block_amax, dtype=torch.int32)
    hi = torch.full_like(lo, 126)
    for _ in range(7):  # 127 candidates
        mid = (lo + hi) >> 1
        enough = _e4m3_value(mid) * token_scale * E2M1_MAX >= block_amax
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, mid + 1)
    return lo


# e2m1 magnitudes by code; ties in rounding go to the even code.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive codes, and whether a tie there rounds up (to an even code).
_E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def _e2m1_encode(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles (sign << 3 | code, uint8) of float32 ``x / step`` (|x| <= 6 step), rounded to
    nearest, ties to the even code, by exact comparisons: midpoint * step is exact in float32."""
    mag = x.abs()
    nonzero = mag > 0
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        bound = midpoint * step
        code += (nonzero & (mag >= bound) if tie_up else mag > bound).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def _e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, 2 * bytes]`` values of e2m1 pairs packed ``[n, bytes]`` (value 2j in the low
    nibble of byte j)."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return _e2m1_decode(nibbles).view(packed.shape[0], 2 * packed.shape[1])


def _e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=nibbles.device)
    values = lut[(nibbles & 7).long()]
    return torch.where((nibbles & 8) != 0, -values, values)


# --------------------------------------------------------------------------------------------
# Row codecs: bf16 rows [N, 512] <-> (data rows [N, data_row_bytes], scale rows [N, scale_row])
# --------------------------------------------------------------------------------------------


def _ue8m0_e4m3_encode(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [n, m]`` as e4m3 bytes ``uint8 [n, m]`` and one UE8M0 exponent byte per
    ``block`` values ``uint8 [n, m / block]``: e = ceil(log2(max(amax, 1e-4) / 448)), values
    divided by 2^e and rounded to nearest-even e4m3 (fp8_ds_mla's nope values, MXFP8_DS)."""
    n, m = values.shape
    x = values.float().view(n, m // block, block)
    amax = x.abs().amax(dim=-1).clamp(min=FP8_AMAX_FLOOR)
    exponent = _ceil_log2(amax / FP8_MAX)
    scaled = (x / _pow2(exponent)[..., None]).clamp(-FP8_MAX, FP8_MAX)
    fp8 = scaled.to(torch.float8_e4m3fn).view(torch.uint8).view(n, m)
    return fp8, (exponent + UE8M0_BIAS).clamp(0, 255).to(torch.uint8)


def _ue8m0_e4m3_decode(fp8: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, m]`` of :func:`_ue8m0_e4m3_encode`'s bytes."""
    (n, m), blocks = fp8.shape, exponents.shape[1]
    values = fp8.contiguous().view(torch.float8_e4m3fn).float().view(n, blocks, m // blocks)
    return (values * _pow2(exponents.to(torch.int32) - UE8M0_BIAS)[..., None]).view(n, m)


def _encode_fp8_ds_mla(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows.shape[0]
    fp8, exponents = _ue8m0_e4m3_encode(rows[:, :NOPE_DIM], FP8_QUANT_BLOCK)
    rope = rows[:, NOPE_DIM:].contiguous().view(torch.uint8)
    scales = torch.zeros(n, 8, dtype=torch.uint8, device=rows.device)
    scales[:, :7] = exponents
    return torch.cat([fp8, rope], dim=1), scales


def _decode_fp8_ds_mla(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    nope = _ue8m0_e4m3_decode(data[:, :NOPE_DIM], scales[:, :7])
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(torch.bfloat16), rope], dim=1)


def _encode_nvfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows.shape[0]
    blocks = NOPE_DIM // NVFP4_QUANT_BLOCK
    nope = rows[:, :NOPE_DIM].float().view(n, blocks, NVFP4_QUANT_BLOCK)
    block_amax = nope.abs().amax(dim=-1)  # [n, 28]
    token_exp = _nvfp4_token_exponent(block_amax.amax(dim=-1))  # [n]
    token_scale = _pow2(token_exp)[:, None]  # [n, 1]
    block_scale_codes = _nvfp4_block_scale_codes(block_amax, token_scale)
    step = _e4m3_value(block_scale_codes) * token_scale  # [n, 28] dequant multiplier per block
    nibbles = _e2m1_encode(nope, step[..., None]).view(n, NOPE_DIM // 2, 2)
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    rope = rows[:, NOPE_DIM:].contiguous().view(torch.uint8)
    scales = torch.zeros(n, 32, dtype=torch.uint8, device=rows.device)
    scales[:, :blocks] = block_scale_codes.to(torch.uint8)
    scales[:, blocks] = (token_exp + UE8M0_BIAS).to(torch.uint8)
    return torch.cat([packed, rope], dim=1), scales


def _decode_nvfp4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = data.shape[0]
    blocks = NOPE_DIM // NVFP4_QUANT_BLOCK
    values = _e2m1_unpack(data[:, : NOPE_DIM // 2]).view(n, blocks, NVFP4_QUANT_BLOCK)
    block_scale = scales[:, :blocks].contiguous().view(torch.float8_e4m3fn).float()
    token_scale = _pow2(scales[:, blocks].to(torch.int32) - UE8M0_BIAS)
    nope = values * (block_scale * token_scale[:, None])[..., None]
    rope = data[:, NOPE_DIM // 2 :].contiguous().view(torch.bfloat16)
    return torch.cat([nope.view(n, NOPE_DIM).to(torch.bfloat16), rope], dim=1)


def _encode_mxfp8_ds(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fp8, exponents = _ue8m0_e4m3_encode(rows, MXFP8_QUANT_BLOCK)
    return torch.cat([fp8, exponents], dim=1), rows.new_zeros((rows.shape[0], 0), dtype=torch.uint8)


def _decode_mxfp8_ds(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _ue8m0_e4m3_decode(data[:, :HEAD_DIM], data[:, HEAD_DIM:]).to(torch.bfloat16)


def _encode_nvfp4_ds(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows.shape[0]
    x = rows.float().view(n, HEAD_DIM // NVFP4_QUANT_BLOCK, NVFP4_QUANT_BLOCK)
    sixth = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32, device=rows.device)
    amax = x.abs().amax(dim=-1)
    scale = (amax * sixth).clamp(2.0**-9, FP8_MAX).to(torch.float8_e4m3fn)
    quotient = x / scale.float()[..., None]  # rounded once here, again to e2m1 (as vLLM)
    one = torch.ones((), dtype=torch.float32, device=rows.device)
    nibbles = _e2m1_encode(quotient, one).view(n, HEAD_DIM // 2, 2)
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scales = scale.view(torch.uint8)
    return torch.cat([packed, scales], dim=1), rows.new_zeros((n, 0), dtype=torch.uint8)


def _decode_nvfp4_ds(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = data.shape[0]
    blocks = HEAD_DIM // NVFP4_QUANT_BLOCK
    values = _e2m1_unpack(data[:, : HEAD_DIM // 2]).view(n, blocks, NVFP4_QUANT_BLOCK)
    scale = data[:, HEAD_DIM // 2 :].contiguous().view(torch.float8_e4m3fn).float()
    return (values * scale[..., None]).view(n, HEAD_DIM).to(torch.bfloat16)


def _encode_bf16(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    data = rows.contiguous().view(torch.uint8)
    return data, data.new_zeros(rows.shape[0], 0)


def _decode_bf16(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return data.contiguous().view(torch.bfloat16)


_ENCODERS = {
    KVFormat.FP8_DS_MLA: _encode_fp8_ds_mla,
    KVFormat.NVFP4: _encode_nvfp4,
    KVFormat.BF16: _encode_bf16,
    KVFormat.MXFP8_DS: _encode_mxfp8_ds,
    KVFormat.NVFP4_DS: _encode_nvfp4_ds,
}
_DECODERS = {
    KVFormat.FP8_DS_MLA: _decode_fp8_ds_mla,
    KVFormat.NVFP4: _decode_nvfp4,
    KVFormat.BF16: _decode_bf16,
    KVFormat.MXFP8_DS: _decode_mxfp8_ds,
    KVFormat.NVFP4_DS: _decode_nvfp4_ds,
}


def _check_rows(rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bfloat16:
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"rows must be a bfloat16 tensor, got {got}")
    if rows.dim() != 2 or rows.shape[1] != HEAD_DIM:
        raise ValueError(f"rows must be [N, {HEAD_DIM}], got shape {tuple(rows.shape)}")


def encode_rows(rows: torch.Tensor, fmt: KVFormat | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize bf16 rows ``[N, 512]`` to ``(data uint8 [N, data_row_bytes], scales uint8
    [N, scale_row_bytes])`` in format ``fmt`` (module docstring gives the byte layout)."""
    _check_rows(rows)
    return _ENCODERS[KVFormat.parse(fmt)](rows)


def decode_rows(data: torch.Tensor, scales: torch.Tensor, fmt: KVFormat | str) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: bf16 ``[N, 512]``."""
    fmt = KVFormat.parse(fmt)
    data_bytes, scale_bytes, _ = _GEOMETRY[fmt]
    n = data.shape[0] if data.dim() == 2 else -1
    if data.dtype != torch.uint8 or data.shape != (n, data_bytes):
        raise ValueError(
            f"data must be uint8 [N, {data_bytes}], got {data.dtype} {tuple(data.shape)}"
        )
    if scales.dtype != torch.uint8 or scales.shape != (n, scale_bytes):
        raise ValueError(
            f"scales must be uint8 [N={n}, {scale_bytes}], got {scales.dtype} {tuple(scales.shape)}"
        )
    return _DECODERS[fmt](data, scales)


# --------------------------------------------------------------------------------------------
# Paged cache access
# --------------------------------------------------------------------------------------------


def _check_cache(cache: torch.Tensor, layout: PageLayout) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 2:
        got = f"{cache.dtype} {tuple(cache.shape)}" if isinstance(cache, torch.Tensor) else cache
        raise ValueError(f"cache must be a uint8 tensor [num_blocks, page_bytes], got {got}")
    if cache.shape[1] < layout.page_bytes or cache.stride()[1] != 1:
        raise ValueError(
            f"cache rows must hold a page of {layout.page_bytes} contiguous bytes "
            f"(block_size={layout.block_size}), got shape {tuple(cache.shape)} "
            f"strides {cache.stride()}"
        )


def _check_slots(slots: torch.Tensor, n: int | None, num_slots: int, device: torch.device) -> None:
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64):
        got = slots.dtype if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots must be an int32 or int64 tensor, got {got}")
    if slots.dim() != 1 or (n is not None and slots.shape[0] != n):
        raise ValueError(f"slots must be [N={n}], got shape {tuple(slots.shape)}")
    if slots.device != device:
        raise ValueError(f"slots are on {slots.device} but the cache is on {device}")
    bad = slots[(slots < -1) | (slots >= num_slots)]
    if bad.numel():
        raise ValueError(
            f"slot {int(bad[0])} is out of range: slots must lie in [-1, {num_slots}) "
            f"(num_blocks * block_size), -1 meaning skip"
        )


def _row_views(cache: torch.Tensor, layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``[num_blocks, block_size, data_row_bytes]`` and ``[..., scale_row_bytes]`` of the
    data and scale areas of every page (no copy; any row stride of ``cache``)."""
    num_blocks, stride = cache.shape[0], cache.stride(0)
    base = cache.storage_offset()
    shape = (num_blocks, layout.block_size)
    data = cache.as_strided(
        (*shape, layout.data_row_bytes), (stride, layout.data_row_bytes, 1), base
    )
    scales = cache.as_strided(
        (*shape, layout.scale_row_bytes),
        (stride, layout.scale_row_bytes, 1),
        base + layout.scale_offset,
    )
    return data, scales


def write_unchecked(
    cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    fmt: KVFormat,
    block_size: int,
) -> None:
    """:func:`write` without validation and without a host sync (fixed shapes, graph-safe).

    Same bytes as :func:`write`. Rows whose slot is -1 are not dropped (that would need a
    data-dependent shape): they rewrite the target of the first valid row with that row's own
    bytes, or, when no slot is valid, slot 0 with its current bytes, so nothing changes.
    Valid slots must lie in ``[0, num_blocks * block_size)`` and must not repeat.
    """
    if slots.numel() == 0:
        return
    layout = page_layout(fmt, block_size)
    data, scales = _ENCODERS[fmt](rows)
    valid = slots >= 0
    first = torch.argmax(valid.to(torch.int32))  # 0 when no slot is valid
    any_valid = valid.any()
    target = torch.where(valid, slots, torch.where(any_valid, slots[first], 0)).long()
    block, pos = target // block_size, target % block_size
    for area, values in zip(_row_views(cache, layout), (data, scales), strict=True):
        if area.shape[-1] == 0:
            continue
        fill = torch.where(any_valid, values[first], area[0, 0])
        area[block, pos] = torch.where(valid[:, None], values, fill[None, :])


def write(
    cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    fmt: KVFormat | str,
    block_size: int,
) -> None:
    """Quantize ``rows`` (bf16 ``[N, 512]``) into ``cache`` at ``slots`` (int ``[N]``), in place.

    Slot -1 is skipped. Only the bytes of the written slots change. Raises ValueError on a wrong
    dtype or shape, a slot outside ``[-1, num_blocks * block_size)``, a slot given twice, or a
    cache too small for ``block_size`` pages.
    """
    fmt = KVFormat.parse(fmt)
    layout = page_layout(fmt, block_size)
    _check_cache(cache, layout)
    _check_rows(rows)
    if rows.device != cache.device:
        raise ValueError(f"rows are on {rows.device} but the cache is on {cache.device}")
    _check_slots(slots, rows.shape[0], cache.shape[0] * block_size, cache.device)
    valid_slots = slots[slots >= 0]
    if valid_slots.numel() != torch.unique(valid_slots).numel():
        raise ValueError("slots must not repeat within one write (the result would be undefined)")
    write_unchecked(cache, slots, rows, fmt, block_size)


def read_unchecked(
    cache: torch.Tensor, slots: torch.Tensor, fmt: KVFormat, block_size: int
) -> torch.Tensor:
    """:func:`read` without validation (no host sync): for callers that validated already."""
    layout = page_layout(fmt, block_size)
    valid = slots >= 0
    safe = slots.clamp(min=0).long()
    block, pos = safe // block_size, safe % block_size
    data_rows, scale_rows = _row_views(cache, layout)
    rows = _DECODERS[fmt](data_rows[block, pos], scale_rows[block, pos])
    return torch.where(valid[:, None], rows, torch.zeros_like(rows))


def read(
    cache: torch.Tensor, slots: torch.Tensor, fmt: KVFormat | str, block_size: int
) -> torch.Tensor:
    """Dequantize the rows at ``slots`` (int ``[N]``): bf16 ``[N, 512]``; slot -1 reads as zeros."""
    fmt = KVFormat.parse(fmt)
    layout = page_layout(fmt, block_size)
    _check_cache(cache, layout)
    _check_slots(slots, None, cache.shape[0] * block_size, cache.device)
    return read_unchecked(cache, slots, fmt, block_size)
