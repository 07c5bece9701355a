"""Helpers of ``dsv4_attn.testing`` that the other tests' verdicts rest on: the per-row bound."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.testing import assert_rows_close


def _output(T: int, H: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 "reference" ``[T, H, D]`` of random rows whose norms spread over two orders of
    magnitude (as sinks spread attention outputs), and its bf16 rounding (an output as close to
    it as a bf16 kernel can be)."""
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    ref = ref * torch.exp(2.3 * torch.rand(T, H, 1, generator=gen, dtype=torch.float64))
    return ref.to(torch.bfloat16), ref


def _whole_tensor_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The bound the tests used before the per-row one: ``||actual - expected|| / ||expected||``
    over the whole tensor."""
    return float((actual.double() - expected).norm() / expected.norm())


def test_a_correct_output_passes():
    """bf16 rounding moves a row by at most 2^-8 of its norm: within a 1e-2 bound."""
    out, ref = _output(16, 8, 512, seed=1)
    assert_rows_close(out, ref, 1e-2)


def test_one_zeroed_row_fails_where_the_whole_tensor_bound_passes():
    """One (token, head) row of a ``[128, 128, 512]`` output zeroed: the whole-tensor relative
    error stays under 1e-2 (the bound the tests used), the per-row bound names that row."""
    _, ref = _output(128, 128, 512, seed=2)
    # The row zeroed holds the root mean square of the row norms: its share of the whole
    # tensor's norm is 1/128 (0.78%), under 1e-2 even with the bf16 rounding added.
    rms = ref.norm(dim=-1).square().mean().sqrt()
    ref[37, 101] *= rms / ref[37, 101].norm()
    out = ref.to(torch.bfloat16)
    out[37, 101] = 0
    assert _whole_tensor_rel_err(out, ref) <= 1e-2
    with pytest.raises(AssertionError, match=r"1 of 16384 rows .* worst row \(37, 101\)"):
        assert_rows_close(out, ref, 1e-2)


def test_nan_fails():
    out, ref = _output(4, 8, 64, seed=3)
    out[2, 5, 17] = float("nan")
    with pytest.raises(AssertionError, match=r"worst row \(2, 5\)"):
        assert_rows_close(out, ref, 1e-2)


def test_a_tiny_row_is_held_to_the_floor_not_to_its_own_norm():
    """A row a million times smaller than the rest (a sink near +inf) may miss its own norm's
    bound by far, as long as its error is within ``tol * floor * rms`` of the row norms; past
    that it fails."""
    out, ref = _output(4, 8, 64, seed=4)
    ref[1, 3] *= 1e-6
    rms = float(ref.norm(dim=-1).square().mean().sqrt())
    direction = torch.ones(64, dtype=torch.float64) / 8.0  # unit norm
    # Error 0.5 * tol * floor * rms: far past 1e-2 of the row's own norm (~1e-5 of rms).
    out[1, 3] = (ref[1, 3] + 0.5 * 1e-2 * 1e-3 * rms * direction).to(out.dtype)
    assert float((out[1, 3].double() - ref[1, 3]).norm()) > 1e-2 * float(ref[1, 3].norm())
    assert_rows_close(out, ref, 1e-2, floor=1e-3)
    # Four times that error: past the floor's bound.
    out[1, 3] = (ref[1, 3] + 2.0 * 1e-2 * 1e-3 * rms * direction).to(out.dtype)
    with pytest.raises(AssertionError, match=r"worst row \(1, 3\)"):
        assert_rows_close(out, ref, 1e-2, floor=1e-3)


def test_all_zero_reference_must_be_matched_exactly():
    """With every reference row zero the floor is zero too: any nonzero value fails."""
    ref = torch.zeros(3, 2, 16, dtype=torch.float64)
    assert_rows_close(torch.zeros(3, 2, 16, dtype=torch.bfloat16), ref, 1e-2)
    out = torch.zeros(3, 2, 16, dtype=torch.bfloat16)
    out[2, 1, 4] = 1e-30
    with pytest.raises(AssertionError, match=r"worst row \(2, 1\)"):
        assert_rows_close(out, ref, 1e-2)


def test_shapes_must_agree():
    out, ref = _output(4, 8, 64, seed=5)
    with pytest.raises(AssertionError, match="shape"):
        assert_rows_close(out[:, :4], ref, 1e-2, name="out")
