"""Index-list validation shared by the sparse entry points."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.index_checks import check_index_lists, check_index_values

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
