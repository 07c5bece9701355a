"""The batched torch fallback against the float64 reference, on CPU and (marked gpu) CUDA."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn import fallback, kv_cache, reference
from dsv4_attn.testing import DecodeCase, make_decode_case


def reference_on_rows(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on the dequantized cache, built here without ops' own plumbing."""

    def rows_of(scope):
        slots = torch.arange(scope.cache.shape[0] * scope.block_size, device=scope.cache.device)
        return kv_cache.read(scope.cache, slots, scope.fmt, scope.block_size)

    window, extra = case.window, case.extra
    extra_args = () if extra is None else (rows_of(extra), extra.indices, extra.lens)
    return reference.sparse_attention(
        case.q, rows_of(window), window.indices, window.lens, case.sink, case.scale, *extra_args
    )


def assert_matches_reference(out, lse, ref_out, ref_lse, tol=1e-2):
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all(), "NaN/inf in output"
    rel = (out.double() - ref_out).norm() / ref_out.norm().clamp(min=1e-30)
    assert rel <= tol, f"relative error {rel:.3e}"
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
    the same lists with those lengths clamped and those ids as holes."""
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
    clean = DecodeCase(case.q, clean_window, case.sink, case.scale, clean_extra)
    assert_matches_reference(out, lse, *reference_on_rows(clean))


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_nan_sink_propagates_as_in_the_reference(backend):
    """A NaN sink logit makes its head's output NaN wherever the token has keys (the reference's
    ``sigmoid(lse - sink)``), 0 where it has none; lse and the other heads are unaffected."""
    from dsv4_attn import ops

    case = make_decode_case(6, 8, "nvfp4", 32, 16, seed=5, lens="random", distinct=False)
    sink = case.sink.clone()
    sink[3] = float("nan")
    out, lse = ops.sparse_attention(
        case.q, case.window, sink, case.scale, case.extra, backend=backend
    )
    ref_out, ref_lse = reference_on_rows(
        DecodeCase(case.q, case.window, sink, case.scale, case.extra)
    )
    has_keys = torch.isfinite(ref_lse[:, 3])
    assert bool(has_keys.any()) and bool((~has_keys).any())  # both kinds of token
    assert torch.isnan(out[has_keys, 3].float()).all()
    assert (out[~has_keys, 3] == 0).all()
    others = [h for h in range(8) if h != 3]
    assert_matches_reference(out[:, others], lse[:, others], ref_out[:, others], ref_lse[:, others])
