"""CI tests of the Hopper sparse-decode kernel module (no GPU: compile for sm_90a, fake tensors).

Every code path of the kernel compiles for sm_90a without register spills (a spill shows as a
non-zero local-memory frame in the cubin), and the hand-written SMEM swizzle the producer stores
through agrees with the CuTe layout the wgmma descriptors are built from.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

import cutlass.cute as cute
from cutlass import BFloat16

from dsv4_attn.kernels import compile_cache, sass, sparse_decode
from dsv4_attn.kernels.fmha_sm90_utils import smem_layout_rowmajor
from dsv4_attn.kernels.precompile import decode_variants
from dsv4_attn.kernels.resource_usage import read_resources
from dsv4_attn.kernels.sparse_decode_config import (
    BLOCK_H,
    BLOCK_N,
    LAUNCH_REGS,
    SparseDecodeConfig,
    swizzled_offset,
)

# Every code path (format x extra scope x sink x output kind) with the usual page sizes, plus
# page sizes that are not powers of two (division path) for one format.
VARIANTS = [*decode_variants(), SparseDecodeConfig("nvfp4", 48, 3, True, False)]


@pytest.fixture(scope="module")
def cubin_of(tmp_path_factory):
    """``cubin_of(config)``: the cubin of ``config``, compiled once per module (the spill, wgmma
    and divergence checks read the same probe variants)."""
    cubins = {}

    def get(config):
        if config not in cubins:
            cubins[config] = compile_cache.compile_keeping_cubin(
                lambda: sparse_decode.build_decode_kernel(config), tmp_path_factory.mktemp("cubin")
            )
        return cubins[config]

    return get


@pytest.fixture(scope="module")
def nvdisasm():
    tool = sass.find_cuda_tool("nvdisasm")
    if tool is None:
        pytest.skip("nvdisasm is not installed")
    return tool


@pytest.mark.parametrize("config", VARIANTS, ids=repr)
def test_variant_compiles_for_sm90a_without_spills(config, cubin_of):
    (kernel,) = read_resources(cubin_of(config))
    assert kernel.frame_bytes == 0, f"ptxas spilled: {kernel.frame_bytes} B stack frame"
    assert kernel.stack_bytes == 0
    # 384 threads and one CTA per SM: the launch budget is 168 registers a thread.
    assert 0 < kernel.registers <= LAUNCH_REGS


# One variant per (format, output kind), with the extra scope: the code paths the MMA warpgroups
# differ in.
PIPELINE_PROBES = [
    SparseDecodeConfig(fmt, 64, 16, True, partial)
    for fmt in ("fp8_ds_mla", "nvfp4")
    for partial in (False, True)
]


@pytest.mark.parametrize("config", PIPELINE_PROBES, ids=repr)
def test_wgmma_pipeline_is_not_serialized(config, cubin_of, nvdisasm):
    """ptxas serializes a wgmma pipeline it cannot prove safe (a wait after every HGMMA, and
    only a "Potential Performance Loss" note CuTeDSL does not show): count the waits."""
    hgmma, waits = sass.wgmma_counts(cubin_of(config), nvdisasm)
    # QK (32 k-steps), WG0's and WG1's PV, each issued from one copy per K/V stage: every
    # group of HGMMAs is waited for once, so waits are a small fraction of the HGMMAs (a
    # serialized pipeline has one wait per HGMMA).
    assert hgmma >= 16, hgmma
    assert waits <= hgmma // 8, (
        f"{waits} wgmma waits for {hgmma} HGMMAs: ptxas serialized the pipeline"
    )


@pytest.mark.parametrize("config", PIPELINE_PROBES, ids=repr)
def test_wgmma_descriptors_stay_in_uniform_registers(config, cubin_of, nvdisasm):
    """With a runtime K/V stage index ptxas builds every wgmma B descriptor in regular registers
    and moves it over (R2UR) before each HGMMA, which paces a 64x32x16 QK HGMMA at ~27 cycles
    instead of 16 (v11: 119 R2UR, each next to its HGMMA). The kernel issues its wgmmas from one
    copy per stage so the descriptors are uniform-register immediates: the few R2UR moves left
    make per-CTA values uniform in the roles' prologues, none near an HGMMA."""
    cubin = cubin_of(config)
    assert sass.moves_before_wgmma(cubin, nvdisasm) == 0
    counts = sass.opcode_counts(cubin, nvdisasm)
    r2ur = sum(n for op, n in counts.items() if op.split(".")[0] == "R2UR")
    assert r2ur <= 32, f"{r2ur} R2UR moves: wgmma descriptors left the uniform datapath"


def test_swizzled_offset_matches_the_cute_layout():
    """The producer's byte offsets equal CuTe's K-major SW128 layout with its byte swizzle."""
    probes = []

    # Rows probed per tile height, chosen outside the traced function (its ``if`` is traced).
    row_sets = {
        rows: [r for r in (0, 1, 5, 7, 8, 13, 31, 63) if r < rows] for rows in (BLOCK_H, BLOCK_N)
    }

    @cute.jit
    def evaluate():
        for rows, probe_rows in row_sets.items():  # Q / output staging, a K/V stage
            layout = smem_layout_rowmajor(BFloat16, rows, 512, 2)
            for r in probe_rows:
                for c in (0, 8, 56, 64, 200, 256, 440, 448, 504):
                    for s in (0, 1):
                        probes.append(((rows, r, c, s), cute.crd2idx((r, c, s), layout.outer)))

    evaluate()
    assert len(probes) == 2 * 9 * sum(len(r) for r in row_sets.values())
    for (rows, r, c, s), element in probes:
        byte = 2 * element  # bf16
        swizzled = byte ^ ((byte >> 3) & 0x70)  # Swizzle<3,4,3> on byte addresses
        assert swizzled == s * rows * 512 * 2 + swizzled_offset(r, c, rows), (rows, r, c, s)


def test_unknown_format_is_rejected():
    from dsv4_attn.kernels.sparse_decode_sm90 import SparseDecodeSm90

    with pytest.raises(ValueError, match="fmt must be"):
        SparseDecodeSm90(SparseDecodeConfig("bf16", 64, 0, False, False))


@pytest.mark.parametrize("config", PIPELINE_PROBES, ids=repr)
def test_no_warp_collective_behind_a_divergent_branch(config, cubin_of, nvdisasm):
    """ptxas guards a warp-collective instruction (ELECT of a TMA copy, a shuffle) that it cannot
    prove warp-converged with ``BRA.DIV``; issued from a divergent branch (one thread) such an
    ELECT never completes and the kernel hangs. The decode kernel has none."""
    counts = sass.opcode_counts(cubin_of(config), nvdisasm)
    assert counts["BRA.DIV"] == 0, f"{counts['BRA.DIV']} divergence-guarded collectives"
