"""Benchmark/test case builders (dsv4_attn/prefill_cases.py): the HCA layout, entry by entry."""

from __future__ import annotations

import pytest

from dsv4_attn.prefill_cases import make_hca_sparse_case


@pytest.mark.parametrize(("tokens", "context"), [(5, 300), (40, 40), (3, 20)])
def test_hca_case_lists_every_visible_entry_then_the_window(tokens, context):
    window, ratio = 8, 16
    case = make_hca_sparse_case(tokens, 2, context, window=window, ratio=ratio, head_dim=32)
    entries = context // ratio
    first_window = max(0, context - tokens - (window - 1))
    assert case.kv.shape[0] == entries + context - first_window
    for i, p in enumerate(range(context - tokens, context)):
        wanted = list(range((p + 1) // ratio))
        wanted += [entries + q - first_window for q in range(max(0, p - window + 1), p + 1)]
        n = int(case.lens[i])
        got = case.indices[i].tolist()
        assert got[:n] == wanted and all(x == -1 for x in got[n:]), p
