"""The batched torch fallback against the float64 reference, on CPU and (marked gpu) CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_attn import fallback, kv_cache, reference
from dsv4_attn.scope import KVScope
from dsv4_attn.testing import DecodeCase, assert_rows_close, make_decode_case

# Per-row bound on a bf16 output against the float64 reference: bf16 rounding moves a row by at
# most 2^-8 (0.39%) of its norm and the fallback's float32 softmax adds ~1e-6; the worst row of
# the CPU cases here and in test_ops is at 0.23 of it.
ROW_TOL = 1e-2


def rows_of(scope: KVScope) -> torch.Tensor:
    """Every slot of ``scope``'s cache dequantized: bf16 ``[num_blocks * block_size, 512]``."""
    slots = torch.arange(scope.cache.shape[0] * scope.block_size, device=scope.cache.device)
    return kv_cache.read(scope.cache, slots, scope.fmt, scope.block_size)


def reference_on_rows(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on the dequantized cache, built here without ops' own plumbing."""
    window, extra = case.window, case.extra
    extra_args = () if extra is None else (rows_of(extra), extra.indices, extra.lens)
    return reference.sparse_attention(
        case.q, rows_of(window), window.indices, window.lens, case.sink, case.scale, *extra_args
    )


def naive_attention(
    q: torch.Tensor,
    scopes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    sink: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention contract written out token by token, in float64, independently of
    ``dsv4_attn.reference`` and of ``dsv4_attn.index_checks``.

    Token t attends to the entries k of each scope ``(rows [N, D], indices [T, K], lens [T])``
    with ``k < clamp(lens[t], 0, K)`` and ``0 <= indices[t, k] < N`` (anything else is a hole);
    ``lse`` is the log-sum-exp of ``scale * <q, row>`` over them, and the output is their
    softmax-weighted rows times ``sigmoid(lse - sink)`` (1 without a sink). Returns ``(out
    [T, H, D], lse [T, H])`` float64: 0 and -inf for a token without entries.
    """
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        keys = []
        for rows, indices, lens in scopes:
            ids = indices[t].cpu().long()
            K = ids.shape[0]
            count = min(max(int(lens[t]), 0), K)
            keep = (torch.arange(K) < count) & (ids >= 0) & (ids < rows.shape[0])
            keys.append(rows.cpu().double()[ids[keep]])
        kv = torch.cat(keys)  # [n, D]
        if kv.shape[0] == 0:
            continue
        scores = (q[t].cpu().double() @ kv.T) * scale  # [H, n]
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ kv
        if sink is not None:
            out[t] *= torch.sigmoid(lse[t] - sink.cpu().double())[:, None]
    return out, lse


def naive_on_cache(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`naive_attention` on ``case``'s dequantized caches and its lists as they are."""
    scopes = [case.window] + ([case.extra] if case.extra is not None else [])
    return naive_attention(
        case.q, [(rows_of(s), s.indices, s.lens) for s in scopes], case.sink, case.scale
    )


def assert_matches_reference(out, lse, ref_out, ref_lse, tol=1e-2, row_tol=ROW_TOL):
    """bf16 ``out`` and float32 ``lse`` against float64 ``ref_out`` / ``ref_lse``: whole-tensor
    relative error within ``tol``, every (token, head) row within ``row_tol`` of its own norm
    (:func:`~dsv4_attn.testing.assert_rows_close`), zero rows and -inf lse where the reference
    has them, finite lse within 1e-5 relative."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all(), "NaN/inf in output"
    rel = (out.double() - ref_out).norm() / ref_out.norm().clamp(min=1e-30)
    assert rel <= tol, f"relative error {rel:.3e}"
    assert_rows_close(out, ref_out, row_tol, name="out")
    zero_rows = ref_out.abs().amax(-1) == 0
    assert torch.all(out[zero_rows] == 0), "rows with no valid key (or sink=+inf) must be 0"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.all(lse[~finite] == float("-inf"))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-4)


CASES = [
    # T, H, fmt, window, extra, lens, sink, holes
    (5, 8, "nvfp4", 128, None, "random", "finite", 0.2),
    (5, 8, "fp8_ds_mla", 128, 64, "random", "mixed", 0.2),
    (3, 16, "bf16", 17, 5, "full", None, 0.0),
    (4, 64, "nvfp4", 128, 0, "full", "-inf", 0.1),
    (2, 128, "fp8_ds_mla", 128, 96, "random", "inf", 0.3),
]


def run_case(params, device, seed):
    T, H, fmt, window, extra, lens, sink, holes = params
    case = make_decode_case(
        T,
        H,
        fmt,
        window,
        extra,
        seed=seed,
        device=device,
        lens=lens,
        sink=sink,
        hole_rate=holes,
        distinct=False,
    )
    torch.manual_seed(seed)
    out, lse = fallback.sparse_attention(*case.args())
    assert_matches_reference(out, lse, *reference_on_rows(case))


@pytest.mark.parametrize("params", CASES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_fallback_matches_reference_cpu(params, seed):
    run_case(params, "cpu", seed)


@pytest.mark.parametrize(
    ("window_fmt", "extra_fmt"),
    [("mxfp8_ds", "nvfp4_ds"), ("fp8_ds_mla", "nvfp4"), ("nvfp4_ds", "mxfp8_ds")],
)
def test_fallback_reads_each_scope_in_its_own_format(window_fmt, extra_fmt):
    """DeepSeek-V4.1's nvfp4_ds_mla (an MXFP8 window beside NVFP4_DS compressed entries), V4's
    window-in-8-bit split, and the pair swapped: each scope's rows are decoded in its own
    format (one decoder for both would read the other's bytes as garbage)."""
    case = make_decode_case(
        5, 16, window_fmt, 24, 40, seed=4, lens="random", hole_rate=0.1, extra_fmt=extra_fmt
    )
    assert case.window.fmt.value == window_fmt and case.extra.fmt.value == extra_fmt
    out, lse = fallback.sparse_attention(*case.args())
    assert_matches_reference(out, lse, *reference_on_rows(case))


def test_fallback_every_row_at_a_serving_shape():
    """128 tokens of 128 heads (a decode batch of V4-Pro's heads on one rank), short lists:
    every (token, head) row against the reference. At this size a whole-tensor bound alone
    passes an output with one row zeroed (under 1% of the tensor's norm)."""
    case = make_decode_case(128, 128, "nvfp4", 16, 8, seed=9, lens="random", distinct=False)
    out, lse = fallback.sparse_attention(*case.args())
    assert_matches_reference(out, lse, *reference_on_rows(case))


def test_fallback_chunks_tokens(monkeypatch):
    """Force one token per chunk: results must not depend on the chunking."""
    case = make_decode_case(
        6, 8, "nvfp4", 32, 16, seed=3, lens="random", hole_rate=0.2, distinct=False
    )
    whole = fallback.sparse_attention(*case.args())
    monkeypatch.setattr(fallback, "_CHUNK_BYTES", 1)
    chunked = fallback.sparse_attention(*case.args())
    torch.testing.assert_close(whole, chunked, rtol=0, atol=0)
    assert_matches_reference(*chunked, *reference_on_rows(case))


def test_an_inf_sink_zeroes_rows_whose_logits_overflow_exp():
    """sink = +inf makes the output exactly 0 (the reference's ``sigmoid(lse - inf)``) also when
    the token's logits pass float32's exp range (> 88.7): each query is its first key's row
    times 4, so its logits are about 4 * |row|^2 / sqrt(512), 140 to 171 here. The sink column
    must be clamped to a finite maximum: an unclamped +inf leaves no finite row maximum to
    subtract, and exp(logit) overflows to inf / inf = NaN. The finite-sink heads of the same
    case check the peaked softmax against the reference."""
    T, H = 4, 8
    case = make_decode_case(T, H, "nvfp4", 16, 8, seed=3, sink="mixed", distinct=False)
    rows = rows_of(case.window)  # [slots, 512]
    first_keys = rows[case.window.indices[:, 0].long()]  # [T, 512]
    q = (first_keys[:, None, :] * 4).expand(T, H, -1).to(torch.bfloat16).contiguous()
    big = DecodeCase(q, case.window, case.sink, case.scale, case.extra)
    ref_out, ref_lse = reference_on_rows(big)
    assert ref_lse.min() > 100  # every logit row reaches past exp's float32 range
    out, lse = fallback.sparse_attention(*big.args())
    inf_heads = torch.isinf(case.sink) & (case.sink > 0)
    assert bool(inf_heads.any())
    assert torch.all(out[:, inf_heads] == 0)
    assert_matches_reference(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("sink", [None, "-inf", "finite", "inf", "mixed"])
@pytest.mark.parametrize("empty", ["lens_zero", "all_holes"])
def test_tokens_without_keys_give_zero_and_minus_inf_lse(sink, empty):
    """A token with no valid key in either scope (lengths 0 in both, or every entry a hole) has
    no finite logit except perhaps its sink: the output must be exactly 0, lse -inf, no NaN,
    whatever the sink; checked against the reference and the naive loop on a case whose other
    tokens have keys."""
    case = make_decode_case(4, 8, "nvfp4", 16, 8, seed=4, sink=sink, distinct=False)
    scopes = []
    for scope in (case.window, case.extra):
        indices, lens = scope.indices.clone(), scope.lens.clone()
        if empty == "lens_zero":
            lens[1:3] = 0
        else:
            indices[1:3] = -1
        scopes.append(dataclasses.replace(scope, indices=indices, lens=lens))
    emptied = DecodeCase(case.q, scopes[0], case.sink, case.scale, scopes[1])
    out, lse = fallback.sparse_attention(*emptied.args())
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    assert torch.all(out[1:3] == 0)
    assert torch.all(lse[1:3] == float("-inf"))
    ref_out, ref_lse = reference_on_rows(emptied)
    assert torch.all(ref_lse[1:3] == float("-inf"))  # the case does what it says
    assert torch.isfinite(ref_lse[[0, 3]]).all()
    assert_matches_reference(out, lse, ref_out, ref_lse)
    assert_matches_reference(out, lse, *naive_on_cache(emptied))


@pytest.mark.gpu
@pytest.mark.parametrize("params", CASES, ids=str)
def test_fallback_matches_reference_cuda(params):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for seed in range(3):
        run_case(params, "cuda", seed)


@pytest.mark.parametrize("params", CASES, ids=str)
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_unchecked_poisoned_lists_read_nothing_outside_and_mean_the_sanitized_lists(
    params, backend
):
    """``check_values=False`` (what serving passes) with lengths outside ``[0, K]`` and slot ids
    outside the cache: no error and no read outside the cache; the result is the reference's on
    the same lists with those lengths clamped and those ids as holes. The ``"reference"``
    backend sanitizes as the clean lists were made (``index_checks.sanitized_lists``), so it is
    checked against :func:`naive_attention`'s own reading of the poisoned lists instead."""
    from dsv4_attn import ops
    from dsv4_attn.testing import poisoned_scope

    T, H, fmt, window, extra, lens, sink, holes = params
    case = make_decode_case(
        T, H, fmt, window, extra, seed=7, lens=lens, sink=sink, hole_rate=holes, distinct=False
    )
    gen = torch.Generator().manual_seed(11)
    poisoned_window, clean_window = poisoned_scope(case.window, gen)
    poisoned_extra = clean_extra = None
    if case.extra is not None:
        poisoned_extra, clean_extra = poisoned_scope(case.extra, gen)
    assert not torch.equal(poisoned_window.indices, clean_window.indices)  # something poisoned
    with pytest.raises(ValueError, match="must lie in"):
        ops.sparse_attention(case.q, poisoned_window, case.sink, case.scale, poisoned_extra)
    out, lse = ops.sparse_attention(
        case.q,
        poisoned_window,
        case.sink,
        case.scale,
        poisoned_extra,
        backend=backend,
        check_values=False,
    )
    assert ops.last_dispatch() == ops.Dispatch(backend, None)
    if backend == "reference":
        poisoned = DecodeCase(case.q, poisoned_window, case.sink, case.scale, poisoned_extra)
        expected = naive_on_cache(poisoned)
    else:
        expected = reference_on_rows(
            DecodeCase(case.q, clean_window, case.sink, case.scale, clean_extra)
        )
    assert_matches_reference(out, lse, *expected)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_nan_sink_propagates_as_in_the_reference(backend):
    """A NaN sink logit makes its head's output NaN wherever the token has keys (the reference's
    ``sigmoid(lse - sink)``), 0 where it has none; lse and the other heads are unaffected. The
    ``"reference"`` backend is checked against :func:`naive_attention` (not itself)."""
    from dsv4_attn import ops

    case = make_decode_case(6, 8, "nvfp4", 32, 16, seed=5, lens="random", distinct=False)
    sink = case.sink.clone()
    sink[3] = float("nan")
    out, lse = ops.sparse_attention(
        case.q, case.window, sink, case.scale, case.extra, backend=backend
    )
    assert ops.last_dispatch() == ops.Dispatch(backend, None)
    nan_case = DecodeCase(case.q, case.window, sink, case.scale, case.extra)
    expected = naive_on_cache if backend == "reference" else reference_on_rows
    ref_out, ref_lse = expected(nan_case)
    has_keys = torch.isfinite(ref_lse[:, 3])
    assert bool(has_keys.any()) and bool((~has_keys).any())  # both kinds of token
    assert torch.isnan(out[has_keys, 3].float()).all()
    assert (out[~has_keys, 3] == 0).all()
    others = [h for h in range(8) if h != 3]
    assert_matches_reference(out[:, others], lse[:, others], ref_out[:, others], ref_lse[:, others])
