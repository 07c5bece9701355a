"""The CuTeDSL FMHA kernel (``dsv4_attn.kernels.fmha``).

CPU (CI): every variant the ops layer can launch compiles for sm_90a without a GPU, with no
register spills and shared memory within Hopper's 227 KB; the cubin reader agrees with
``cuobjdump`` where that tool exists; the support checks give reasons.

GPU (``pytest -m gpu`` on a Hopper machine): the kernel, called directly with outputs poisoned
with NaN, matches the float64 references on random shapes: every head dim, masks none / causal /
causal + window 128, Sq = 1, Sq != Sk both ways, odd and empty sequences, H in {8, 64, 128},
sinks including +-inf; sparse prefill with holes, ragged lengths and K up to 2048. When
``FMHA_GPU_RESULTS`` names a directory, each case's errors are written there as JSON lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import pytest
import torch

from dsv4_attn import reference
from dsv4_attn.kernels import fmha, sass
from dsv4_attn.kernels.resource_usage import read_resources
from dsv4_attn.prefill_cases import (
    SparseCase,
    make_dense_case,
    make_random_sparse_case,
    make_v4_sparse_case,
)
from dsv4_attn.testing import assert_rows_close

try:
    import cutlass  # noqa: F401

    HAVE_DSL = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_DSL = False

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed")


# ----------------------------------------------------------------------------------------------
# CPU: compile every variant, check resources
# ----------------------------------------------------------------------------------------------
@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("variant", fmha.all_variants(), ids=lambda v: v.label)
def test_variant_compiles_for_sm90a_without_spills(variant):
    res = fmha.resources(variant)
    assert len(res.kernels) == 1
    kernel = res.kernels[0]
    assert not res.spills, f"local memory in use: {kernel}"
    # Launch count for 384 threads; the compute warpgroups raise theirs with setmaxnreg.
    assert 0 < kernel.registers <= 168
    # setmaxnreg only moves registers inside the CTA's launch allotment: asking for more makes
    # setmaxnreg.inc wait forever (how the gathered variant hung on its first H100 run).
    k = variant.make_kernel()
    assert 2 * k.regs_mma + k.regs_producer <= 3 * kernel.registers
    assert 0 < res.smem_bytes <= fmha.SMEM_LIMIT


@needs_dsl
def test_cubin_reader_agrees_with_cuobjdump():
    tool = sass.find_cuda_tool("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump is not installed")
    variant = fmha.FmhaVariant(head_dim=64)
    with tempfile.TemporaryDirectory() as tmp:
        fn, _ = fmha._compile(variant, f"--keep-cubin --dump-dir {tmp}")
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(fn.artifacts.CUBIN)
        text = subprocess.run(
            [tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    (mine,) = read_resources(fn.artifacts.CUBIN)
    assert f"Function {mine.name}:" in text
    assert f"REG:{mine.registers} " in text
    assert f"STACK:{mine.stack_bytes} " in text
    assert f"LOCAL:{mine.frame_bytes} " in text


@needs_dsl
@pytest.mark.parametrize("label", ["sparse-d512", "d512-causal-kv", "d128-causal-ov1"])
def test_wgmma_pipeline_is_not_serialized(label):
    """ptxas serializes a wgmma pipeline it cannot prove safe (a wait after every HGMMA, and
    only a note CuTeDSL does not show): count the waits."""
    tool = sass.find_cuda_tool("nvdisasm")
    if tool is None:
        pytest.skip("nvdisasm is not installed")
    (variant,) = [v for v in fmha.all_variants() if v.label == label]
    with tempfile.TemporaryDirectory() as tmp:
        fn, _ = fmha._compile(variant, f"--keep-cubin --dump-dir {tmp}")
        hgmma, waits = sass.wgmma_counts(fn.artifacts.CUBIN, tool)
    assert hgmma >= 16, hgmma
    assert waits <= 8, f"{waits} wgmma waits for {hgmma} HGMMAs: ptxas serialized the pipeline"


def test_support_checks_give_reasons_on_cpu():
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert "cpu" in fmha.dense_unsupported_reason(q, q, q, True, None)
    assert "bfloat16" in fmha.dense_unsupported_reason(q.float(), q.float(), q.float(), False, None)
    assert "head_dim 96" in fmha.dense_unsupported_reason(
        q[..., :96], q[..., :96], q[..., :96], 0, None
    )
    k = torch.zeros(4, 2, 512, dtype=torch.bfloat16)
    assert "same tensor" in fmha.dense_unsupported_reason(k, k, k.clone(), False, None)
    strided = torch.zeros(4, 2, 256, dtype=torch.bfloat16)[..., ::2]
    assert "contiguous" in fmha.dense_unsupported_reason(strided, strided, strided, False, None)
    kv = torch.zeros(10, 512, dtype=torch.bfloat16)
    idx = torch.zeros(4, 3, dtype=torch.int32)
    assert "head_dim 512" in fmha.sparse_unsupported_reason(q, kv[:, :128], idx)
    assert "cpu" in fmha.sparse_unsupported_reason(k, kv, idx)


# ----------------------------------------------------------------------------------------------
# GPU: kernel vs float64 references, poisoned outputs
# ----------------------------------------------------------------------------------------------
def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
OUT_TOL = 1e-2  # max |out - ref| / max |ref|
LSE_TOL = 1e-2  # |lse - ref| / max(1, |ref|)
# ||out_row - ref_row|| / ||ref_row|| of every (token, head) row (assert_rows_close): the
# whole-tensor bound above lets one wrong row through. bf16 output and bf16 P each round by at
# most 2^-8.
ROW_TOL = 2e-2


def _record(name: str, **fields) -> None:
    folder = os.environ.get("FMHA_GPU_RESULTS")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "fmha_gpu_cases.jsonl"), "a") as f:
            f.write(json.dumps({"case": name, **fields}) + "\n")


def _check(name, out, lse, ref_out, ref_lse, seconds):
    ref_out = ref_out.double()
    ref_lse = ref_lse.double()
    scale = ref_out.abs().max().item() if ref_out.numel() else 0.0
    err = (out.double() - ref_out).abs().max().item() if ref_out.numel() else 0.0
    out_rel = err / scale if scale > 0 else err
    same_inf = torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    lse_rel = (
        ((lse.double()[finite] - ref_lse[finite]).abs() / ref_lse[finite].abs().clamp(min=1.0))
        .max()
        .item()
        if finite.any()
        else 0.0
    )
    ok = bool(out_rel <= OUT_TOL and lse_rel <= LSE_TOL and same_inf)
    _record(
        name,
        out_rel_err=out_rel,
        lse_rel_err=lse_rel,
        neg_inf_match=same_inf,
        ok=ok,
        kernel_s=seconds,
    )
    assert same_inf, "lse = -inf where the reference has keys (or the reverse)"
    assert out_rel <= OUT_TOL, f"out rel err {out_rel:.3g}"
    assert lse_rel <= LSE_TOL, f"lse rel err {lse_rel:.3g}"
    assert_rows_close(out, ref_out, ROW_TOL, name=name)


DENSE_SHAPES = {
    # name: (seqlens, H, Hk, packed)
    "A": ([(257, 257)] * 2, 8, 8, False),  # odd length, several tiles
    "B": ([(1, 300)], 64, 8, False),  # Sq = 1, GQA 8:1
    "C": ([(1, 1), (130, 391), (300, 129), (0, 17), (64, 0)], 8, 1, True),  # ragged, MQA
    "D": ([(200, 200)], 128, 128, False),  # H = 128
}
MASKS = {"none": (False, None), "causal": (True, None), "window": (True, 128)}
SINKS = {"A": "random", "B": None, "C": "inf", "D": "random"}


def _dense_params():
    for d in fmha.HEAD_DIMS:
        for mask in MASKS:
            for shape in DENSE_SHAPES:
                # Both row-split mainloops (head_dim <= 256); the column split has one.
                for overlap in (True, False) if d <= 256 else (False,):
                    name = f"dense-d{d}-{mask}-{shape}-ov{int(overlap)}"
                    yield pytest.param(d, mask, shape, overlap, id=name)


@gpu
@needs_hopper
@pytest.mark.parametrize("d, mask, shape, overlap", list(_dense_params()))
def test_gpu_dense_kernel_matches_reference(d, mask, shape, overlap):
    seqlens, h, hk, packed = DENSE_SHAPES[shape]
    causal, window = MASKS[mask]
    case = make_dense_case(
        seqlens,
        h,
        hk,
        d,
        causal,
        window,
        SINKS[shape],
        packed=packed,
        kv_shared=(d == 512),
        device="cuda",
        seed=d + h,
    )
    if packed:
        q, k, v = case.q, case.k, case.v
        cu_q, cu_k, max_q = case.cu_seqlens_q, case.cu_seqlens_k, case.max_seqlen_q
    else:
        b, sq, _, _ = case.q.shape
        sk = case.k.shape[1]
        q = case.q.reshape(b * sq, h, d)
        k = case.k.reshape(b * sk, hk, d)
        v = k if case.v is case.k else case.v.reshape(b * sk, hk, d)
        cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32) * sq
        cu_k = torch.arange(b + 1, device="cuda", dtype=torch.int32) * sk
        max_q = sq
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    start = time.perf_counter()
    fmha.run_dense(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        causal,
        window,
        case.sink,
        case.scale,
        out=out,
        lse=lse,
        intra_wg_overlap=overlap,
    )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref_out, ref_lse = reference.dense_attention(
        q, k, v, causal, window, case.sink, case.scale, cu_q, cu_k
    )
    _check(f"dense-d{d}-{mask}-{shape}-ov{int(overlap)}", out, lse, ref_out, ref_lse, seconds)


SPARSE_SHAPES = {
    # name: (T, N, K, lens, sink)
    "tiny": (1, 1, 1, "full", None),
    "ragged": (33, 5000, 640, "random", "random"),
    "wide": (17, 20000, 2048, "random", "inf"),
    "empty": (5, 100, 70, "zero", "random"),
    # More (token, head block) items than SMs: each persistent CTA walks several, of 0 to 5
    # steps, its barrier phases running on across them.
    "many": (700, 3000, 600, "random", "random"),
}


@gpu
@needs_hopper
@pytest.mark.parametrize("heads", [8, 64, 128])
@pytest.mark.parametrize("shape", list(SPARSE_SHAPES))
def test_gpu_sparse_kernel_matches_reference(heads, shape):
    tokens, rows, width, lens, sink = SPARSE_SHAPES[shape]
    case = make_random_sparse_case(
        tokens, heads, rows, width, lens=lens, sink=sink, device="cuda", seed=heads + width
    )
    _run_sparse_and_check(f"sparse-h{heads}-{shape}", case)


@gpu
@needs_hopper
@pytest.mark.parametrize("heads", [8, 64, 128])
def test_gpu_sparse_kernel_with_poisoned_lists(heads):
    """Lengths outside ``[0, K]`` and row ids outside ``kv`` (as serving passes them,
    unchecked): nothing read outside ``kv`` (``compute-sanitizer`` runs this test), and the
    reference's result with those lengths clamped and those ids as holes."""
    from dsv4_attn.index_checks import sanitized_lists
    from dsv4_attn.testing import poison_lists

    case = make_random_sparse_case(90, heads, 3000, 600, device="cuda", seed=heads)
    poisoned = poison_lists(
        case.indices, case.lens, case.kv.shape[0], torch.Generator().manual_seed(heads)
    )
    clean = sanitized_lists(*poisoned, case.kv.shape[0])
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), device="cuda")
    fmha.run_sparse(case.q, case.kv, *poisoned, case.sink, case.scale, out=out, lse=lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.sparse_attention(case.q, case.kv, *clean, case.sink, case.scale)
    _check(f"sparse-poisoned-h{heads}", out, lse, ref_out, ref_lse, 0.0)


@gpu
@needs_hopper
@pytest.mark.parametrize("heads, topk", [(64, 512), (128, 1024)])
def test_gpu_sparse_kernel_v4_layout(heads, topk):
    case = make_v4_sparse_case(300, heads, topk, device="cuda", seed=topk)
    _run_sparse_and_check(f"sparse-v4-h{heads}-k{topk}", case)


# Row scale of the kv rows of each 64-entry tile (20 tiles): the scores of a tile grow with it,
# so the running max jumps in the last tile, climbs ~5 log2 units per tile, or only falls.
MAX_PROFILES = {
    "jump": [1.0] * 19 + [12.0],
    "climb": [1.0 + 0.5 * t for t in range(20)],
    "fall": [10.0 - 0.45 * t for t in range(20)],
}


@gpu
@needs_hopper
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("profile", list(MAX_PROFILES))
def test_gpu_sparse_running_max_that_moves_after_the_first_tile(heads, profile):
    """The column split keeps a running max per row, handed between its two warpgroups and
    moved only when scores pass it by a margin; scores that grow late must still rescale O."""
    tiles = MAX_PROFILES[profile]
    tokens, width = 3, 64 * len(tiles)
    g = torch.Generator().manual_seed(len(profile) + heads)
    row_scale = torch.tensor(tiles).repeat_interleave(64)
    kv = torch.randn(tokens * width, 512, generator=g) * row_scale.repeat(tokens)[:, None]
    q = torch.randn(tokens, heads, 512, generator=g)
    indices = torch.arange(tokens * width).view(tokens, width)
    indices[torch.rand(tokens, width, generator=g) < 0.1] = -1
    lens = torch.tensor([width, width - 37, 64 * 7 + 5])
    case = SparseCase(
        q.to("cuda", torch.bfloat16),
        kv.to("cuda", torch.bfloat16),
        indices.to("cuda", torch.int32),
        lens.to("cuda", torch.int32),
        torch.randn(heads, generator=g).to("cuda"),
        512**-0.5,
    )
    _run_sparse_and_check(f"sparse-max-{profile}-h{heads}", case)


def _run_sparse_and_check(name, case):
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), device="cuda")
    start = time.perf_counter()
    fmha.run_sparse(
        case.q, case.kv, case.indices, case.lens, case.sink, case.scale, out=out, lse=lse
    )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref_out, ref_lse = reference.sparse_attention(*case.args())
    _check(name, out, lse, ref_out, ref_lse, seconds)
