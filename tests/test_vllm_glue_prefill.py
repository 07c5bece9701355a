"""The prefill path's host-side planning (dsv4_attn/vllm_glue/prefill.py).

Its gather, index lists and attention run end to end, against the float64 reference, in
tests/test_vllm_glue_attention.py (batches with several prefills, forced into small chunks).
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("vllm")

from dsv4_attn.vllm_glue import prefill


def _needs(query_len: int, seq_len: int, ratio: int, window: int) -> tuple[int, int]:
    entries = seq_len // ratio if ratio > 1 else 0
    return entries, query_len + min(seq_len - query_len, window - 1)


@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("seed", range(6))
def test_chunks_cover_every_prefill_request_within_the_budget(ratio, seed):
    gen = torch.Generator().manual_seed(seed)
    window, max_tokens, max_len = 128, 2048, 8192
    num_decodes = int(torch.randint(0, 4, (1,), generator=gen))
    num_prefills = int(torch.randint(1, 12, (1,), generator=gen))
    query_lens = [1] * num_decodes + torch.randint(1, 400, (num_prefills,), generator=gen).tolist()
    seq_lens = [q + int(torch.randint(0, 3000, (1,), generator=gen)) for q in query_lens]
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    full = prefill.rows_budget(max_len, ratio, window, max_tokens)
    for budget in (full, 600):
        chunks = prefill.plan_chunks(
            query_start, torch.tensor(seq_lens), num_decodes, num_prefills, ratio, window, budget
        )
        assert chunks[0].first_req == num_decodes and chunks[-1].end_req == len(query_lens)
        for a, b in itertools.pairwise(chunks):
            assert a.end_req == b.first_req and a.end_token == b.first_token
        for chunk in chunks:
            reqs = range(chunk.first_req, chunk.end_req)
            needs = [_needs(query_lens[r], seq_lens[r], ratio, window) for r in reqs]
            assert chunk.entries == max(e for e, _ in needs)
            assert chunk.rows == chunk.entries + max(g for _, g in needs)
            assert chunk.first_token == int(query_start[chunk.first_req])
            assert chunk.end_token == int(query_start[chunk.end_req])
            # Over the budget only when one request alone needs more (never with the full one).
            assert len(reqs) * chunk.rows <= budget or len(reqs) == 1
            assert chunk.rows <= full
            if chunk.end_req < chunks[-1].end_req:  # closed because the next did not fit
                nxt = _needs(query_lens[chunk.end_req], seq_lens[chunk.end_req], ratio, window)
                entries, gather = (
                    max(chunk.entries, nxt[0]),
                    max(chunk.rows - chunk.entries, nxt[1]),
                )
                assert (len(reqs) + 1) * (entries + gather) > budget


def test_peak_workspace_holds_the_largest_chunk():
    window, topk, max_tokens, max_len, heads = 128, 512, 8192, 65536, 64
    for ratio in (1, 4, 128):
        rows, index, lens, lse = prefill.peak_workspace_shapes(
            max_len, ratio, window, topk, max_tokens, heads
        )
        # One request: a whole step of prompt tokens at the end of a max_model_len sequence.
        query_start = torch.tensor([0, max_tokens])
        (chunk,) = prefill.plan_chunks(
            query_start,
            torch.tensor([max_len]),
            0,
            1,
            ratio,
            window,
            prefill.rows_budget(max_len, ratio, window, max_tokens),
        )
        assert chunk.rows <= rows[0][0] and rows[0][1] == 512
        width = prefill.index_width(ratio, topk, chunk.entries, window)
        assert index[0] == (max_tokens, width) and lens[0] == (max_tokens,)
        assert lse == ((max_tokens, heads), torch.float32)


def test_csa_picks_the_token_does_not_see_yet_are_holes():
    """A prefill token's indexer picks at or past its visible entries ``(pos + 1) // 4`` (the
    indexer never makes them; garbage if it did) are holes, the decode path's rule: a chunk's
    later positions must not leak into its earlier tokens."""
    gen = torch.Generator().manual_seed(4)
    window, query_len, seq_len = 128, 40, 100
    query_start = torch.tensor([0, query_len], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    (chunk,) = prefill.plan_chunks(query_start, seq_lens, 0, 1, 4, window, 10**6)
    topk = torch.randint(-1, seq_len // 4, (query_len, 16), generator=gen, dtype=torch.int32)
    out = (
        torch.full((query_len, 400), 777, dtype=torch.int32),
        torch.full((query_len,), 777, dtype=torch.int32),
    )
    indices, _ = prefill.index_lists(chunk, query_start, seq_lens, window, 4, topk, out)
    pos = torch.arange(seq_len - query_len, seq_len)
    visible = ((pos + 1) // 4)[:, None]
    hole = (topk < 0) | (topk >= visible)
    assert bool(((topk >= visible) & (topk >= 0)).any())  # some picks from the token's future
    assert torch.equal(indices[:, :16] == -1, hole)
    assert torch.equal(indices[:, :16][~hole], topk[~hole])  # request 0: row = entry
