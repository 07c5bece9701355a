"""``fmha`` and ``sparse_prefill``: validation, dispatch, the torch fallback vs float64 references.

CPU tests (CI) check the fallback against ``reference.dense_attention`` (itself checked
against ``reference.sparse_attention``) and ``reference.sparse_attention``. GPU tests (``-m gpu``,
Hopper) check that ``auto`` runs the CuTeDSL kernel and that its results match the references.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn import dispatch_log, fmha_ops, reference
from dsv4_attn.prefill_cases import DenseCase, make_dense_case, make_random_sparse_case
from dsv4_attn.testing import assert_rows_close
from tests.test_fallback import naive_attention

# Per-row bounds (dsv4_attn.testing.assert_rows_close) against the float64 references. bf16:
# the output's rounding moves a row by at most 2^-8 of its norm (the CPU cases' worst row is at
# 0.25 of ROW_TOL_BF16). float32: the fallback's float32 softmax and matmuls (worst row 0.03 of
# ROW_TOL_FP32). The kernels (GPU) also round P to bf16: ROW_TOL_GPU.
ROW_TOL_BF16 = 1e-2
ROW_TOL_FP32 = 1e-5
ROW_TOL_GPU = 2e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 when both are all zero)."""
    ref = ref.double()
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return err / scale if scale > 0 else err


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Same -inf positions; elsewhere |lse - ref| <= tol * max(1, |ref|)."""
    ref = ref.double()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    bound = tol * ref[finite].abs().clamp(min=1.0)
    assert torch.all((lse.double()[finite] - ref[finite]).abs() <= bound)


def dense_reference(case):
    return reference.dense_attention(case.q, case.k, case.v, **case.kwargs())


def naive_dense(case: DenseCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of an unpacked ``case`` written out query by query in float64,
    independently of ``dsv4_attn.reference``: query ``i`` of ``Sq`` sees key ``j`` of ``Sk`` iff
    ``j <= i + Sk - Sq`` (causal) and ``j > i + Sk - Sq - window``; query head ``h`` reads key
    head ``h // (H // Hk)``; a sink scales by ``sigmoid(lse - sink)``. Returns ``(out
    [B, Sq, H, Dv], lse [B, Sq, H])``, 0 and -inf for a query that sees no key."""
    assert case.cu_seqlens_q is None, "unpacked cases only"
    B, Sq, H, _ = case.q.shape
    Sk, Hk, Dv = case.v.shape[1], case.v.shape[2], case.v.shape[3]
    out = torch.zeros(B, Sq, H, Dv, dtype=torch.float64)
    lse = torch.full((B, Sq, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for i in range(Sq):
            diag = i + Sk - Sq
            last = diag if case.causal else Sk - 1
            first = 0 if case.window is None else diag - case.window + 1
            keys = list(range(max(first, 0), min(last, Sk - 1) + 1))
            if not keys:
                continue
            for h in range(H):
                kh = h // (H // Hk)
                k = case.k[b, keys, kh].double()
                scores = (k @ case.q[b, i, h].double()) * case.scale  # [n]
                lse[b, i, h] = torch.logsumexp(scores, dim=0)
                out[b, i, h] = torch.softmax(scores, dim=0) @ case.v[b, keys, kh].double()
                if case.sink is not None:
                    out[b, i, h] *= torch.sigmoid(lse[b, i, h] - float(case.sink[h]))
    return out, lse


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """The computations ``fmha_ops`` runs, in order (``"dense-sdpa"``, ``"sparse-sdpa"``,
    ``"dense-reference"``, ``"sparse-reference"``): the module keeps no dispatch record (as
    ``ops.last_dispatch`` does for decode), so its torch fallbacks and the references it calls
    are wrapped to say when they run. Clear it before the call under test."""
    calls: list[str] = []

    def spy(owner, attr: str, label: str) -> None:
        real = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            calls.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, attr, wrapped)

    spy(fmha_ops, "_dense_torch", "dense-sdpa")
    spy(fmha_ops, "_sparse_torch", "sparse-sdpa")
    spy(fmha_ops.reference, "dense_attention", "dense-reference")
    spy(fmha_ops.reference, "sparse_attention", "sparse-reference")
    return calls


# ----------------------------------------------------------------------------------------------
# CPU: the torch fallback against the references
# ----------------------------------------------------------------------------------------------
DENSE_CPU_CASES = [
    # (seqlens, H, Hk, D, causal, window, sink, packed)
    ([(7, 7)] * 2, 4, 4, 32, False, None, None, False),
    ([(7, 7)] * 2, 4, 4, 32, True, None, "random", False),
    ([(1, 13)], 8, 1, 64, True, None, "random", False),  # Sq = 1, MQA
    ([(5, 11)] * 3, 6, 2, 16, True, 4, "inf", False),  # Sq < Sk, GQA, window
    ([(11, 5)], 2, 2, 16, True, None, None, False),  # Sq > Sk: rows with no key
    ([(3, 4), (0, 2), (9, 9), (2, 0)], 4, 2, 24, True, 3, "random", True),  # packed, empties
    ([(6, 10), (5, 3)], 4, 1, 48, False, None, "random", True),
]


@pytest.mark.parametrize("case_args", DENSE_CPU_CASES, ids=lambda a: f"{a[0][0]}x{len(a[0])}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_fallback_matches_reference(case_args, dtype):
    seqlens, h, hk, d, causal, window, sink, packed = case_args
    case = make_dense_case(
        seqlens, h, hk, d, causal, window, sink, packed=packed, dtype=dtype, seed=len(seqlens)
    )
    out, lse = fmha_ops.fmha(case.q, case.k, case.v, backend="sdpa", **case.kwargs())
    ref_out, ref_lse = dense_reference(case)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    # bf16 output rounding is 2^-9 relative; fp32 math on exact products is far tighter.
    assert rel_err(out, ref_out) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert_rows_close(out, ref_out, ROW_TOL_FP32 if dtype == torch.float32 else ROW_TOL_BF16)
    assert_lse_close(lse, ref_lse, 1e-5)
    # The fallback and the reference share reference.visible_mask: the naive loop states the
    # mask rule on its own, so a wrong rule cannot pass both comparisons.
    if case.cu_seqlens_q is None:
        naive_out, naive_lse = naive_dense(case)
        tol = ROW_TOL_FP32 if dtype == torch.float32 else ROW_TOL_BF16
        assert_rows_close(out, naive_out, tol)
        assert_lse_close(lse, naive_lse, 1e-5)


def test_dense_fallback_k_is_v_head_dim_512():
    case = make_dense_case([(9, 9)], 4, 1, 512, causal=True, kv_shared=True, seed=7)
    assert case.v is case.k
    out, lse = fmha_ops.fmha(case.q, case.k, case.v, backend="sdpa", **case.kwargs())
    ref_out, ref_lse = dense_reference(case)
    assert rel_err(out, ref_out) <= 1e-2
    assert_rows_close(out, ref_out, ROW_TOL_BF16)
    assert_lse_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("lens", ["random", "full", "zero"])
@pytest.mark.parametrize("sink", [None, "random", "inf"])
def test_sparse_fallback_matches_reference(lens, sink):
    case = make_random_sparse_case(9, 4, 50, 37, head_dim=64, lens=lens, sink=sink, seed=2)
    out, lse = fmha_ops.sparse_prefill(*case.args(), backend="sdpa")
    ref_out, ref_lse = reference.sparse_attention(*case.args())
    assert out.shape == (9, 4, 64) and out.dtype == torch.bfloat16
    assert rel_err(out, ref_out) <= 1e-2
    assert_rows_close(out, ref_out, ROW_TOL_BF16)
    assert_lse_close(lse, ref_lse, 1e-5)


def _naive_sparse(q, kv, indices, lens, sink, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~tests.test_fallback.naive_attention` on one scope of rows ``kv``."""
    return naive_attention(q, [(kv, indices, lens)], sink, scale)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_sparse_writes_into_out_and_lse(backend, ran):
    """``out``/``lse`` given: the backend asked for runs (and only it), writes them in place and
    returns them; the values are the float64 reference's (the fallback) or a loop of this
    test's own (the reference backend, not compared with itself)."""
    case = make_random_sparse_case(9, 4, 50, 37, head_dim=64, sink="random", seed=5)
    out = torch.full((9, 4, 64), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((9, 4), float("nan"))
    got, got_lse = fmha_ops.sparse_prefill(*case.args(), backend=backend, out=out, lse=lse)
    assert ran == [f"sparse-{backend}"]
    assert got is out and got_lse is lse
    expected = _naive_sparse if backend == "reference" else reference.sparse_attention
    ref_out, ref_lse = expected(*case.args())
    assert_rows_close(out, ref_out, ROW_TOL_BF16)
    assert_lse_close(lse, ref_lse, 1e-5)


def test_reference_backends_run_the_references(ran):
    """``backend="reference"`` runs the float64 references and no fallback; their results,
    rounded to q's dtype, are dense and sparse attention as loops of this test's own compute
    them."""
    case = make_dense_case([(4, 6)], 2, 1, 16, causal=True, sink="random", seed=3)
    out, lse = fmha_ops.fmha(case.q, case.k, case.v, backend="reference", **case.kwargs())
    assert ran == ["dense-reference"]
    ref_out, ref_lse = naive_dense(case)
    assert out.dtype == case.q.dtype and lse.dtype == torch.float32
    assert_rows_close(out, ref_out, ROW_TOL_BF16)
    assert_lse_close(lse, ref_lse, 1e-6)
    sp = make_random_sparse_case(3, 2, 10, 5, head_dim=32, seed=4)
    ran.clear()
    out, lse = fmha_ops.sparse_prefill(*sp.args(), backend="reference")
    assert ran == ["sparse-reference"]
    ref_out, ref_lse = _naive_sparse(*sp.args())
    assert_rows_close(out, ref_out, ROW_TOL_BF16)
    assert_lse_close(lse, ref_lse, 1e-6)


def test_auto_on_cpu_falls_back_and_logs_each_reason_once(dsv4_logs):
    dispatch_log.logged_reasons.clear()
    case = make_dense_case([(3, 3)], 2, 2, 64, seed=1)
    for _ in range(3):
        fmha_ops.fmha(case.q, case.k, case.v, **case.kwargs())
    messages = [
        r.getMessage() for r in dsv4_logs.records if "fmha uses the SDPA fallback" in r.message
    ]
    assert len(messages) == 1 and "cpu" in messages[0]


def test_cutedsl_backend_on_cpu_names_the_reason():
    case = make_dense_case([(3, 3)], 2, 2, 64, seed=1)
    with pytest.raises(ValueError, match=r"backend='cutedsl' cannot run this case: .*cpu"):
        fmha_ops.fmha(case.q, case.k, case.v, backend="cutedsl", **case.kwargs())
    sp = make_random_sparse_case(2, 2, 4, 3, seed=1)
    with pytest.raises(ValueError, match="backend='cutedsl' cannot run this case"):
        fmha_ops.sparse_prefill(*sp.args(), backend="cutedsl")


# ----------------------------------------------------------------------------------------------
# CPU: validation
# ----------------------------------------------------------------------------------------------
def _dense_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 4, 16, generator=g)
    k = torch.randn(2, 5, 2, 16, generator=g)
    v = torch.randn(2, 5, 2, 16, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][0]), "q/k/v must be"),
        (lambda a: a.update(k=a["k"][:, :, :, :8]), "k head_dim must equal"),
        (
            lambda a: a.update(
                k=a["k"][:, :, :1].expand(2, 5, 3, 16).contiguous(),
                v=a["v"][:, :, :1].expand(2, 5, 3, 16).contiguous(),
            ),
            "multiple of k/v heads",
        ),
        (lambda a: a.update(v=a["v"][:1]), "batch sizes differ"),
        (lambda a: a.update(q=a["q"].to(torch.int32)), "must be bfloat16, float16 or float32"),
        (lambda a: a.update(q=a["q"].double()), "must be bfloat16, float16 or float32"),
        (lambda a: a.update(k=a["k"].half()), "share a dtype"),
        (lambda a: a.update(window=4), "window needs causal=True"),
        (lambda a: a.update(window=0, causal=True), "window must be a positive int"),
        (lambda a: a.update(causal=1), "causal must be a bool"),
        (lambda a: a.update(sink=torch.zeros(3)), r"sink must be a \[H=4\] tensor"),
        (lambda a: a.update(sink=torch.zeros(4, dtype=torch.int32)), "sink must be a float"),
        (lambda a: a.update(scale=0.0), "scale must be a positive finite float"),
        (lambda a: a.update(scale=math.inf), "scale must be a positive finite float"),
        (lambda a: a.update(backend="triton"), "backend must be one of"),
        (lambda a: a.update(cu_seqlens_q=torch.tensor([0, 4])), "must be given together"),
    ],
)
def test_dense_rejects_bad_input(change, message):
    q, k, v = _dense_inputs()
    args = dict(q=q, k=k, v=v, causal=False)
    change(args)
    with pytest.raises(ValueError, match=message):
        fmha_ops.fmha(**args)


@pytest.mark.parametrize(
    "cu_q, cu_k, message",
    [
        ([0, 3, 8], [0, 2, 5], "cu_seqlens_q must run from 0 to 7"),
        ([0, 5, 7], [0, 4, 2], "cu_seqlens_k must run from 0 to 5"),
        ([0, 5, 7], [1, 2, 5], "cu_seqlens_k must run from 0 to 5"),
        ([0, 6, 5, 7], [0, 1, 2, 5], "cu_seqlens_q must be non-decreasing"),
        ([0, 7], [0, 2, 5], "must both be"),
    ],
)
def test_packed_rejects_bad_offsets(cu_q, cu_k, message):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(7, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g), None
    v = torch.randn(5, 2, 8, generator=g)
    with pytest.raises(ValueError, match=message):
        fmha_ops.fmha(q, k, v, cu_seqlens_q=torch.tensor(cu_q), cu_seqlens_k=torch.tensor(cu_k))


def test_packed_rejects_short_max_seqlen_q():
    case = make_dense_case([(3, 3), (6, 6)], 2, 2, 16, packed=True, seed=1)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(4\) is below the longest .* \(6\)"):
        fmha_ops.fmha(case.q, case.k, case.v, max_seqlen_q=4, **case.kwargs())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][0]), r"q must be \[T, H, D\]"),
        (lambda a: a.update(kv=a["kv"][:, :8]), r"kv must be \[N, D=16\]"),
        (lambda a: a.update(indices=a["indices"].float()), "indices must be an int32/int64"),
        (lambda a: a.update(indices=a["indices"][:2]), r"indices must be \[T=3, K\]"),
        (lambda a: a.update(lens=a["lens"][:2]), r"lens must be \[T=3\]"),
        (lambda a: a.update(lens=a["lens"] + 10), r"lens must lie in \[0, K=4\]"),
        (
            lambda a: a.update(indices=torch.full_like(a["indices"], 6)),
            r"rows must lie in \[-1, N=6\)",
        ),
        (lambda a: a.update(indices=torch.full_like(a["indices"], -2)), r"rows must lie in \[-1"),
        (lambda a: a.update(sink=torch.zeros(5)), r"sink must be a \[H=2\] tensor"),
        (lambda a: a.update(scale=-1.0), "scale must be a positive finite float"),
        (lambda a: a.update(out=torch.empty(3, 2, 8)), r"out must be a contiguous \(3, 2, 16\)"),
        (lambda a: a.update(out=torch.empty(3, 2, 16, dtype=torch.bfloat16)), "out must be"),
        (lambda a: a.update(lse=torch.empty(3, 3)), r"lse must be a contiguous \(3, 2\)"),
        (lambda a: a.update(lse=torch.empty(3, 2, dtype=torch.float64)), "lse must be"),
        (lambda a: a.update(lse=torch.empty(2, 3).t()), "lse must be a contiguous"),
    ],
)
def test_sparse_rejects_bad_input(change, message):
    g = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(3, 2, 16, generator=g),
        kv=torch.randn(6, 16, generator=g),
        indices=torch.randint(-1, 6, (3, 4), generator=g),
        lens=torch.tensor([0, 2, 4]),
    )
    change(args)
    with pytest.raises(ValueError, match=message):
        fmha_ops.sparse_prefill(**args)


# ----------------------------------------------------------------------------------------------
# GPU: auto runs the kernel; results match the references
# ----------------------------------------------------------------------------------------------
def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


@gpu
@needs_hopper
@pytest.mark.parametrize(
    "seqlens, h, hk, d, causal, window, packed",
    [
        ([(128, 128)] * 2, 8, 8, 128, True, None, False),
        ([(77, 200)], 16, 2, 64, True, 32, False),
        ([(33, 40), (0, 5), (130, 130)], 8, 1, 256, True, None, True),
        ([(65, 65)], 8, 1, 512, True, None, False),  # K = V, head_dim 512
    ],
)
def test_gpu_fmha_auto_uses_kernel(seqlens, h, hk, d, causal, window, packed):
    case = make_dense_case(
        seqlens,
        h,
        hk,
        d,
        causal,
        window,
        "random",
        packed=packed,
        kv_shared=(d == 512),
        device="cuda",
        seed=11,
    )
    # backend="cutedsl" raises instead of falling back, so this runs the kernel.
    out, lse = fmha_ops.fmha(case.q, case.k, case.v, backend="cutedsl", **case.kwargs())
    ref_out, ref_lse = dense_reference(case)
    assert rel_err(out, ref_out) <= 1e-2
    assert_rows_close(out, ref_out, ROW_TOL_GPU)
    assert_lse_close(lse, ref_lse, 1e-2)


@gpu
@needs_hopper
@pytest.mark.parametrize("heads", [8, 64, 128])
def test_gpu_sparse_prefill_auto_uses_kernel(heads):
    case = make_random_sparse_case(21, heads, 3000, 700, seed=heads, device="cuda")
    out, lse = fmha_ops.sparse_prefill(*case.args(), backend="cutedsl")
    ref_out, ref_lse = reference.sparse_attention(*case.args())
    assert rel_err(out, ref_out) <= 1e-2
    assert_rows_close(out, ref_out, ROW_TOL_GPU)
    assert_lse_close(lse, ref_lse, 1e-2)
    into = torch.full_like(out, float("nan"))
    lse_into = torch.full_like(lse, float("nan"))
    got, got_lse = fmha_ops.sparse_prefill(*case.args(), backend="cutedsl", out=into, lse=lse_into)
    assert got is into and torch.equal(into, out)
    assert got_lse is lse_into and torch.equal(lse_into, lse)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_unchecked_poisoned_sparse_lists_mean_the_sanitized_lists(backend, index_dtype, ran):
    """``sparse_prefill(check_values=False)`` with lengths outside ``[0, K]`` and row ids
    outside ``kv``: no error, no read outside ``kv``, the reference's result on the sanitized
    lists (lengths clamped, those ids as holes). The ``"reference"`` backend sanitizes as the
    expected lists are made (``index_checks.sanitized_lists``), so it is checked against a
    loop that reads the poisoned lists by the rule itself."""
    from dsv4_attn.index_checks import sanitized_lists
    from dsv4_attn.testing import poison_lists

    case = make_random_sparse_case(9, 4, 300, 40, head_dim=64, seed=5)
    gen = torch.Generator().manual_seed(3)
    indices, lens = case.indices.to(index_dtype), case.lens.to(index_dtype)
    poisoned = poison_lists(indices, lens, case.kv.shape[0], gen)
    clean = sanitized_lists(*poisoned, case.kv.shape[0])
    with pytest.raises(ValueError):
        fmha_ops.sparse_prefill(case.q, case.kv, *poisoned, case.sink, case.scale)
    ran.clear()
    out, lse = fmha_ops.sparse_prefill(
        case.q, case.kv, *poisoned, case.sink, case.scale, backend=backend, check_values=False
    )
    assert ran == [f"sparse-{backend}"]
    if backend == "reference":
        ref_out, ref_lse = _naive_sparse(case.q, case.kv, *poisoned, case.sink, case.scale)
    else:
        ref_out, ref_lse = reference.sparse_attention(
            case.q, case.kv, *clean, case.sink, case.scale
        )
    torch.testing.assert_close(out.double(), ref_out.to(out.dtype).double(), rtol=2e-2, atol=2e-2)
    assert_rows_close(out, ref_out, ROW_TOL_BF16)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-4, atol=1e-4)
