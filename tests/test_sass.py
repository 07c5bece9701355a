"""Tests of the SASS opcode counter (kernels/sass.py)."""

from __future__ import annotations

import pytest

from dsv4_attn.kernels import sass

# nvdisasm -c layout: address comment, optional predicate, opcode with modifiers, operands,
# encoding comment; labels, directives and blank lines carry no instruction.
_LISTING = """
        .text.kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 BRA `(.L_x_2) ;                        /* 0x0000000000008947 */
.L_x_2:
        /*0020*/                   WARPGROUP.ARRIVE ;                     /* 0x00000000000079c8 */
        /*0030*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0040*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0050*/               @P1 HGMMA.64x256x16.F32.BF16 R88, R4, gdesc[UR16].tnspB, R88 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;        /* 0x00000000000079af */
        /*0070*/             @!UP0 USETMAXREG.DEALLOC.CTAPOOL 0x88 ;      /* 0x00000088000079c8 */
"""


def test_counts_opcodes_with_modifiers_and_drops_predicates():
    counts = sass.count_opcodes(_LISTING)
    assert counts["HGMMA.64x32x16.F32.BF16"] == 2
    assert counts["HGMMA.64x256x16.F32.BF16"] == 1
    assert counts["BRA"] == 1 and counts["LDC"] == 1
    assert counts["WARPGROUP.DEPBAR.LE"] == 1 and counts["WARPGROUP.ARRIVE"] == 1
    assert counts["USETMAXREG.DEALLOC.CTAPOOL"] == 1
    assert sum(counts.values()) == 8  # the label and the section name are not instructions


def test_wgmma_counts_sum_every_shape_and_wait(monkeypatch):
    listing = sass.count_opcodes(_LISTING)
    monkeypatch.setattr(sass, "opcode_counts", lambda cubin, tool=None: listing)
    assert sass.wgmma_counts(b"") == (3, 1)


def test_missing_tool_is_reported(monkeypatch):
    monkeypatch.setattr(sass, "find_cuda_tool", lambda name: None)
    with pytest.raises(FileNotFoundError, match="nvdisasm"):
        sass.opcode_counts(b"\x7fELF")


def test_moves_before_wgmma_counts_only_moves_next_to_an_mma():
    move = "        /*0000*/                   R2UR UR8, R2 ;\n"
    other = "        /*0000*/                   IADD3 R4, R4, 0x1, RZ ;\n"
    mma = "        /*0000*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24 ;\n"
    assert sass.count_moves_before_wgmma(move + other * 3 + mma, window=4) == 1
    assert sass.count_moves_before_wgmma(move + other * 4 + mma, window=4) == 0  # outside
    assert sass.count_moves_before_wgmma((move + mma) * 3 + move) == 3  # the last one: no MMA
    assert sass.count_moves_before_wgmma(_LISTING) == 0
