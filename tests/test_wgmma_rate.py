"""The wgmma-rate microbenchmark kernel (``dsv4_attn.kernels.wgmma_rate``): compiled for sm_90a
on the CPU (its SASS is the pattern it claims to time), run on the GPU against float64."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from dsv4_attn.kernels import compile_cache, sass
from dsv4_attn.kernels.resource_usage import read_resources
from dsv4_attn.kernels.wgmma_rate import GROUP, WgmmaRate, build_wgmma_rate_kernel


@pytest.mark.parametrize("a_in_registers", [True, False], ids=["RS", "SS"])
def test_one_group_of_wgmmas_per_round_and_one_wait(tmp_path, a_in_registers):
    """Each round issues GROUP HGMMAs back to back and waits once, as the decode kernel's QK
    does; no spills, no descriptor moves (R2UR) between them."""
    tool = sass.find_cuda_tool("nvdisasm")
    if tool is None:
        pytest.skip("nvdisasm is not installed")
    cubin = compile_cache.compile_keeping_cubin(
        lambda: build_wgmma_rate_kernel(32, a_in_registers, 2, 10), tmp_path
    )
    counts = sass.opcode_counts(cubin, tool)
    assert counts["HGMMA.64x32x16.F32.BF16"] == GROUP, counts
    hgmma, waits = sass.wgmma_counts(cubin, tool)
    assert (hgmma, waits) == (GROUP, 1)
    assert sum(n for op, n in counts.items() if op.startswith("R2UR")) == 0
    (kernel,) = read_resources(cubin)
    assert kernel.frame_bytes == 0


@pytest.mark.parametrize(
    ("n", "warpgroups", "rounds", "message"),
    [
        (12, 1, 1, "multiple of 8"),
        (264, 1, 1, "multiple of 8"),
        (64, 4, 1, "warpgroups"),
        (64, 1, 0, "rounds"),
    ],
)
def test_rejects_shapes_it_cannot_time(n, warpgroups, rounds, message):
    with pytest.raises(ValueError, match=message):
        WgmmaRate(n, True, warpgroups, rounds)


@pytest.mark.gpu
def test_rate_bench_checksums_match_float64():
    """Every variant's accumulators sum to rounds x SMs x warpgroups x the float64 sum of A B^T
    (``run`` raises otherwise); the rates are positive and below the pipe's peak."""
    from dsv4_attn.bench.wgmma_rate import run

    rows, ceilings = run([32, 256], [1, 2], reps=3)
    assert len(rows) == 8
    for row in rows:
        assert row["checksum_rel_err"] < 1e-3
        assert 0 < row["tflops"] < 1.5 * ceilings.bf16_tflops, row
