"""CPU tests of the kernels' bit recipes for dequantization (``dsv4_attn.kernels.dequant``).

The integer parts of the recipes are plain Python operators, so they run here on int64 tensors;
the two PTX steps around them are emulated exactly: ``prmt`` (byte placement) and
``mul.rn.bf16x2`` (an exact product rounded once to bf16; with the power-of-two and 4-bit
significand factors used here the float32 product is exact, so one float32 -> bf16 rounding is
the bf16 rounding). Every FP8 byte the writer can produce times every UE8M0 scale, and every
e2m1 code times every positive e4m3 block scale times a sweep of token scales, must decode to the
bytes ``kv_cache``'s codec decodes them to.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

import torch

from dsv4_attn import kv_cache
from dsv4_attn.kernels import dequant
from dsv4_attn.kv_cache import KVFormat


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def _mul_bf16(a_bits: torch.Tensor, b_bits: torch.Tensor) -> torch.Tensor:
    """One half of ``mul.rn.bf16x2``: 16-bit patterns in, the rounded product's pattern out."""
    product = _bf16_bits_to_float(a_bits) * _bf16_bits_to_float(b_bits)
    return product.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _low_half(word: torch.Tensor) -> torch.Tensor:
    return word & 0xFFFF


def _codec_value(fmt: KVFormat, code, scales_at: dict) -> torch.Tensor:
    """The codec's decode of value 0 of rows whose byte 0 is ``code`` (one row per entry) and
    whose scale row holds ``scales_at`` (byte offset -> per-row bytes), as bf16."""
    layout = kv_cache.page_layout(fmt, 1)
    data = torch.zeros(code.numel(), layout.data_row_bytes, dtype=torch.uint8)
    data[:, 0] = code.to(torch.uint8)
    scales = torch.zeros(code.numel(), layout.scale_row_bytes, dtype=torch.uint8)
    for offset, values in scales_at.items():
        scales[:, offset] = values.to(torch.uint8)
    return kv_cache.decode_rows(data, scales, fmt)[:, 0]


def test_fp8_recipe_matches_the_codec_on_every_byte_and_scale():
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)])  # 0x7F/0xFF are NaN
    exps = torch.arange(1, 255)
    code, e = torch.meshgrid(codes, exps, indexing="ij")
    code, e = code.reshape(-1), e.reshape(-1)
    # prmt(x, 0, 0x1404) puts byte 0 into the high byte of the low half.
    placed = dequant._fp8x2_to_bf16x2_scaled_down(code << 8)
    v = _mul_bf16(_low_half(placed), torch.full_like(placed, dequant.BF16X2_2POW120 & 0xFFFF))
    v = _mul_bf16(v, _low_half(dequant.fp8_block_scale_bf16x2(e)))
    got = v.to(torch.int16).view(torch.bfloat16)

    # The codec's decode of the same bytes: one 64-value block per (code, scale) pair.
    want = _codec_value(KVFormat.FP8_DS_MLA, code, {0: e})
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # Also the other byte of a pair (high half) follows the same bits.
    placed_hi = dequant._fp8x2_to_bf16x2_scaled_down(code << 24) >> 16
    assert torch.equal(placed_hi, _low_half(placed))


def test_fp8_folded_recipe_matches_the_codec_on_every_byte_and_foldable_scale():
    """One multiply by 2^(e - 7) (the kernel's path when every block scale of a warp's keys is at
    most 2^7) gives the codec's bits for every byte and every scale it applies to."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)])
    exps = torch.arange(0, dequant.FP8_FOLDED_MAX_EXP + 1)
    code, e = torch.meshgrid(codes, exps, indexing="ij")
    code, e = code.reshape(-1), e.reshape(-1)
    placed = dequant._fp8x2_to_bf16x2_scaled_down(code << 8)
    factor = _low_half(dequant.fp8_folded_scale_bf16x2(e))
    assert torch.equal(_bf16_bits_to_float(factor), torch.ldexp(torch.ones(e.shape), e - 7.0))
    got = _mul_bf16(_low_half(placed), factor).to(torch.int16).view(torch.bfloat16)
    want = _codec_value(KVFormat.FP8_DS_MLA, code, {0: e})
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # The next exponent no longer folds: 2^(135 - 7) is past bf16's range.
    over = dequant.fp8_folded_scale_bf16x2(torch.tensor(dequant.FP8_FOLDED_MAX_EXP + 1))
    assert not torch.isfinite(_bf16_bits_to_float(_low_half(over)))


def test_nvfp4_recipe_matches_the_codec_on_every_code_and_scale():
    nibbles = torch.arange(16)
    block_codes = torch.arange(0, 0x7F)  # every non-negative e4m3 block scale (0x7F is NaN)
    token_bytes = torch.arange(0, 247)  # the writer's range for finite bf16 rows is 0..244
    nib, sb, u = torch.meshgrid(nibbles, block_codes, token_bytes, indexing="ij")
    nib, sb, u = nib.reshape(-1), sb.reshape(-1), u.reshape(-1)
    # nvfp4_block_scale_bf16x2: e4m3 -> float32 exactly, times 2^118, to bf16 (exact).
    sb_value = sb.to(torch.uint8).view(torch.float8_e4m3fn).float()
    a = torch.ldexp(sb_value, torch.tensor(float(dequant.NVFP4_BLOCK_SCALE_SHIFT)))
    a_bits = a.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(_bf16_bits_to_float(a_bits), a), "s_b * 2^118 is not exact in bf16"
    placed = dequant._e2m1x2_to_bf16x2_scaled_down(nib)
    v = _mul_bf16(_low_half(placed), a_bits)
    v = _mul_bf16(v, _low_half(dequant.nvfp4_token_scale_bf16x2(u)))
    got = v.to(torch.int16).view(torch.bfloat16)

    want = _codec_value(KVFormat.NVFP4, nib, {0: sb, 28: u})
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    placed_hi = dequant._e2m1x2_to_bf16x2_scaled_down(nib << 16) >> 16
    assert torch.equal(placed_hi, _low_half(placed))
