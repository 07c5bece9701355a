"""Index-list validation shared by the sparse entry points."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.index_checks import (
    check_index_lists,
    check_index_values,
    counted_entries,
    int32_lists,
)

CPU = torch.device("cpu")


def test_accepts_valid_lists_and_ignores_entries_past_lens():
    indices = torch.tensor([[0, 7, 99], [-1, 3, -5]], dtype=torch.int32)
    lens = torch.tensor([2, 2])
    check_index_lists("", indices, lens, 2, CPU)
    check_index_values("", indices, lens, 8, "slot", "8")


@pytest.mark.parametrize(
    ("indices", "lens", "message"),
    [
        (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32), "indices must be an int32/int64"),
        (
            torch.zeros(2, 3, dtype=torch.int64),
            [1, 1],
            "lens must be an int32/int64 tensor, got list",
        ),
        (torch.zeros(3, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), r"\[T=2, K\]"),
        (
            torch.zeros(2, 3, dtype=torch.int64),
            torch.zeros(3, dtype=torch.int64),
            r"lens must be \[T=2\]",
        ),
    ],
)
def test_list_errors_name_the_value(indices, lens, message):
    with pytest.raises(ValueError, match=message):
        check_index_lists("extra_", indices, lens, 2, CPU)


@pytest.mark.parametrize(
    ("indices", "lens", "message"),
    [
        ([[0, 1]], [3], r"extra_lens must lie in \[0, K=2\], got values from 3 to 3"),
        ([[0, 8]], [2], r"extra_indices hold row 8: rows must lie in \[-1, N=8\), -1 meaning skip"),
        ([[-2, 0]], [1], r"hold row -2"),
    ],
)
def test_value_errors_name_the_value(indices, lens, message):
    with pytest.raises(ValueError, match=message):
        check_index_values("extra_", torch.tensor(indices), torch.tensor(lens), 8, "row", "N=8")


def test_int32_lists_make_every_id_past_int32_a_hole_not_its_low_word():
    """int64 ids whose low 32 bits name a slot (2^32 + 5, -2^32 + 3, int64's extremes) are
    holes once narrowed; ids inside int32 keep their value; int64 lengths are clamped."""
    big = [2**32 + 5, -(2**32) + 3, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]
    indices = torch.tensor([[5, -1, 7, -9, *big]], dtype=torch.int64)
    lens = torch.tensor([2**32 + 3], dtype=torch.int64)
    narrow, narrow_lens = int32_lists(indices, lens)
    assert narrow.dtype == narrow_lens.dtype == torch.int32
    assert narrow.tolist() == [[5, -1, 7, -9, *[-1] * len(big)]]
    assert narrow_lens.tolist() == [indices.shape[1]]
    lens = torch.tensor([-(2**40), 3, 2**40], dtype=torch.int64)
    assert int32_lists(torch.zeros(3, 4, dtype=torch.int64), lens)[1].tolist() == [0, 3, 4]


def test_int32_lists_keep_the_entries_that_count():
    """Narrowing keeps exactly the entries :func:`counted_entries` counts, on random int64
    lists with a fifth of the ids beyond int32 (low words inside the cache)."""
    gen = torch.Generator().manual_seed(7)
    limit = 1000
    indices = torch.randint(-3, limit + 3, (64, 48), generator=gen)
    wide = torch.rand(64, 48, generator=gen) < 0.2
    shift = torch.randint(1, 2**20, (64, 48), generator=gen) * 2**32
    indices = torch.where(wide, indices + shift * torch.where(indices % 2 == 0, 1, -1), indices)
    lens = torch.randint(-5, 60, (64,), generator=gen)
    narrow, narrow_lens = int32_lists(indices, lens)
    assert wide.any() and torch.equal(
        counted_entries(narrow, narrow_lens, limit), counted_entries(indices, lens, limit)
    )


def test_int32_lists_return_int32_inputs_as_they_are():
    indices = torch.tensor([[3, 2**31 - 1]], dtype=torch.int32)
    lens = torch.tensor([9], dtype=torch.int32)
    narrow, narrow_lens = int32_lists(indices, lens)
    assert narrow is indices and narrow_lens is lens
