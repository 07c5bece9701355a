"""The prefill path's host-side planning (dsv4_attn/vllm_glue/prefill.py).

Its gather, index lists and attention run end to end, against the float64 reference, in
tests/test_vllm_glue_attention.py (batches with several prefills, forced into small chunks).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm")

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.layer_kind import Compressed
from dsv4_attn.vllm_glue import prefill
from tests import vllm_glue_testing as vt

# The compressed entries of each layer kind the prefill path serves: window only; V4's CSA (the
# top-k of ratio 4) and HCA (every entry: ratio 128, or 8 where rows must stay few); V4.1's
# compressed layers (the top-k of ratio 1 or 2).
WINDOW_ONLY = None
CSA, HCA = Compressed(4, top_k=True), Compressed(128, top_k=False)
V41_R1, V41_R2 = Compressed(1, top_k=True), Compressed(2, top_k=True)
KINDS = [WINDOW_ONLY, CSA, HCA, V41_R1, V41_R2]


def _name(kind: Compressed | None) -> str:
    return "window" if kind is None else f"r{kind.ratio}{'_topk' if kind.top_k else ''}"


def _needs(query_len: int, seq_len: int, kind: Compressed | None, window: int) -> tuple[int, int]:
    entries = seq_len // kind.ratio if kind is not None else 0
    return entries, query_len + min(seq_len - query_len, window - 1)


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@pytest.mark.parametrize("seed", range(6))
def test_chunks_cover_every_prefill_request_within_the_budget(kind, seed):
    gen = torch.Generator().manual_seed(seed)
    window, max_tokens, max_len = 128, 2048, 8192
    num_decodes = int(torch.randint(0, 4, (1,), generator=gen))
    num_prefills = int(torch.randint(1, 12, (1,), generator=gen))
    query_lens = [1] * num_decodes + torch.randint(1, 400, (num_prefills,), generator=gen).tolist()
    seq_lens = [q + int(torch.randint(0, 3000, (1,), generator=gen)) for q in query_lens]
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    full = prefill.rows_budget(max_len, kind, window, max_tokens)
    for budget in (full, 600):
        chunks = prefill.plan_chunks(
            query_start, torch.tensor(seq_lens), num_decodes, num_prefills, kind, window, budget
        )
        assert chunks[0].first_req == num_decodes and chunks[-1].end_req == len(query_lens)
        for a, b in itertools.pairwise(chunks):
            assert a.end_req == b.first_req and a.end_token == b.first_token
        for chunk in chunks:
            reqs = range(chunk.first_req, chunk.end_req)
            needs = [_needs(query_lens[r], seq_lens[r], kind, window) for r in reqs]
            assert chunk.entries == max(e for e, _ in needs)
            assert chunk.rows == chunk.entries + max(g for _, g in needs)
            assert chunk.first_token == int(query_start[chunk.first_req])
            assert chunk.end_token == int(query_start[chunk.end_req])
            # Over the budget only when one request alone needs more (never with the full one).
            assert len(reqs) * chunk.rows <= budget or len(reqs) == 1
            assert chunk.rows <= full
            if chunk.end_req < chunks[-1].end_req:  # closed because the next did not fit
                nxt = _needs(query_lens[chunk.end_req], seq_lens[chunk.end_req], kind, window)
                entries, gather = (
                    max(chunk.entries, nxt[0]),
                    max(chunk.rows - chunk.entries, nxt[1]),
                )
                assert (len(reqs) + 1) * (entries + gather) > budget


def test_peak_workspace_holds_the_largest_chunk():
    window, topk, max_tokens, max_len, heads = 128, 512, 8192, 65536, 64
    for kind in KINDS:
        rows, index, lens, lse = prefill.peak_workspace_shapes(
            max_len, kind, window, topk, max_tokens, heads
        )
        # One request: a whole step of prompt tokens at the end of a max_model_len sequence.
        query_start = torch.tensor([0, max_tokens])
        (chunk,) = prefill.plan_chunks(
            query_start,
            torch.tensor([max_len]),
            0,
            1,
            kind,
            window,
            prefill.rows_budget(max_len, kind, window, max_tokens),
        )
        assert chunk.rows <= rows[0][0] and rows[0][1] == 512
        width = prefill.index_width(kind, topk, chunk.entries, window)
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
    (chunk,) = prefill.plan_chunks(query_start, seq_lens, 0, 1, CSA, window, 10**6)
    topk = torch.randint(-1, seq_len // 4, (query_len, 16), generator=gen, dtype=torch.int32)
    out = (
        torch.full((query_len, 400), 777, dtype=torch.int32),
        torch.full((query_len,), 777, dtype=torch.int32),
    )
    indices, _ = prefill.index_lists(chunk, query_start, seq_lens, window, CSA, topk, out)
    pos = torch.arange(seq_len - query_len, seq_len)
    visible = ((pos + 1) // 4)[:, None]
    hole = (topk < 0) | (topk >= visible)
    assert bool(((topk >= visible) & (topk >= 0)).any())  # some picks from the token's future
    assert torch.equal(indices[:, :16] == -1, hole)
    assert torch.equal(indices[:, :16][~hole], topk[~hole])  # request 0: row = entry


# ----------------------------------------------------------------------------------------------
# Gather + index lists (torch path) against the rows each token should see, position by position
# ----------------------------------------------------------------------------------------------

WINDOW = 8
SWA_BLOCK = 4  # tokens per SWA page
ENTRIES_PER_PAGE = 2  # compressed entries per compressed page
TOPK = 6
# (seq_len, query_len), a decode first as vLLM orders them, then prefills: a chunk after a long
# context (prefix > window - 1), a fresh prompt shorter than the window, a chunk whose prefix is
# exactly the window (the chunk's widest gather), one whose prefix is window - 2.
REQUESTS = [(12, 1), (30, 5), (6, 6), (20, 12), (9, 3)]
NUM_DECODES = 1


@dataclass
class PagedRows:
    """A BF16 paged cache holding a known random row per slot, and its block table."""

    pages: torch.Tensor  # uint8 [num_pages, page_bytes]
    table: torch.Tensor  # int32 [R, width]
    values: torch.Tensor  # bf16 [num_pages * block, 512]: the row at each slot
    block: int

    def row(self, req: int, i: int) -> torch.Tensor:
        """Request ``req``'s ``i``-th row (position or compressed entry), from the table."""
        page = int(self.table[req, i // self.block])
        if not 0 <= page < self.pages.shape[0]:
            return torch.zeros(HEAD_DIM, dtype=torch.bfloat16)
        return self.values[page * self.block + i % self.block]


def paged_rows(gen: torch.Generator, rows_per_req: list[int], block: int) -> PagedRows:
    """Every request's rows on shuffled pages (two spare pages; unused table entries point at
    them, as stale entries would)."""
    need = [-(-n // block) for n in rows_per_req]
    num_pages = sum(need) + 2
    ids = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((len(need), max(max(need), 1)), int(ids[-1]), dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = ids[used : used + n]
        used += n
    pages = kv_cache.allocate(num_pages, block, KVFormat.BF16)
    values = torch.randn(num_pages * block, HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv_cache.write(pages, torch.arange(num_pages * block), values, KVFormat.BF16, block)
    return PagedRows(pages, table, values, block)


def prefill_step(gen: torch.Generator, kind: Compressed | None):
    """The step's host tensors, its SWA cache and (where the kind has one) compressed cache."""
    seq_lens = torch.tensor([s for s, _ in REQUESTS], dtype=torch.int32)
    query_lens = torch.tensor([q for _, q in REQUESTS], dtype=torch.int32)
    query_start = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).int()])
    swa = paged_rows(gen, [s for s, _ in REQUESTS], SWA_BLOCK)
    compressed = None
    if kind is not None:
        compressed = paged_rows(gen, [s // kind.ratio for s, _ in REQUESTS], ENTRIES_PER_PAGE)
    return seq_lens, query_lens, query_start, swa, compressed


def expected_list(pos: int, kind: Compressed | None, topk_row: list[int], entries: int):
    """What a prefill token at ``pos`` of its request reads, column by column: ``("entry", i)``,
    ``("position", p)`` or None (a -1 column), and its length. Top-k kinds: the indexer's picks,
    a pick < 0 or >= (pos + 1) // ratio a hole, then the window; HCA: every entry
    i < (pos + 1) // ratio then the window, packed, -1 after; window only: the window.
    ``entries``: the chunk's N."""
    window = [("position", p) for p in range(max(0, pos - WINDOW + 1), pos + 1)]
    visible = (pos + 1) // kind.ratio if kind is not None else 0
    if kind is not None and kind.top_k:
        picks = [("entry", e) if 0 <= e < visible else None for e in topk_row]
        columns = picks + window + [None] * (WINDOW - len(window))
        return columns, len(topk_row) + len(window)
    seen = [("entry", i) for i in range(visible)] + window
    width = (entries if kind is not None else 0) + WINDOW
    return seen + [None] * (width - len(seen)), len(seen)


def _gather(chunk, seq_lens, query_lens, swa, compressed, kind) -> torch.Tensor:
    """``prefill.gather_rows`` of ``chunk`` (torch path, BF16 pages) into a workspace of 9s."""
    reqs = slice(chunk.first_req, chunk.end_req)
    workspace = torch.full((10**4, HEAD_DIM), 9.0, dtype=torch.bfloat16)
    cc = None
    if compressed is not None:
        cc = (compressed.pages, compressed.table[reqs], ENTRIES_PER_PAGE, kind.ratio)
    return prefill.gather_rows(
        workspace,
        chunk,
        KVFormat.BF16,
        seq_lens[reqs],
        query_lens[reqs],
        WINDOW,
        (swa.pages, swa.table[reqs], SWA_BLOCK),
        cc,
    )


@pytest.mark.parametrize("budget", [10**6, 40], ids=["one_chunk", "small_chunks"])
@pytest.mark.parametrize(
    "kind", [WINDOW_ONLY, CSA, Compressed(8, False), V41_R1, V41_R2], ids=_name
)
def test_prefill_tokens_read_their_own_rows(kind, budget):
    """Gather then index (torch path, a BF16 cache so rows compare exactly): every column of a
    prefill token's list is -1 where the token reads nothing, else a workspace row inside its own
    request's rows holding exactly the cache row of the entry or position it should read;
    lengths as the decode path counts them."""
    ratio = kind.ratio if kind is not None else 0
    gen = torch.Generator().manual_seed(100 + ratio)
    seq_lens, query_lens, query_start, swa, compressed = prefill_step(gen, kind)
    num_reqs = len(REQUESTS)
    num_prefills = num_reqs - NUM_DECODES
    chunks = prefill.plan_chunks(
        query_start, seq_lens, NUM_DECODES, num_prefills, kind, WINDOW, budget
    )
    assert (len(chunks) == 1) if budget == 10**6 else (len(chunks) > 1)
    T = int(query_start[-1])
    # The indexer's picks: entries the token sees, ones it does not yet, and -1 holes.
    most = REQUESTS[1][0] // max(ratio, 1) + 3
    picks = torch.randint(-1, most, (T, TOPK), generator=gen, dtype=torch.int32)
    checked_holes = 0
    for chunk in chunks:
        rows = _gather(chunk, seq_lens, query_lens, swa, compressed, kind)
        flat = rows.reshape(-1, HEAD_DIM)
        out = (
            torch.full((T, 64), 777, dtype=torch.int32),
            torch.full((T,), 777, dtype=torch.int32),
        )
        top_k = kind is not None and kind.top_k
        local = picks[chunk.first_token : chunk.end_token] if top_k else None
        qs = query_start[chunk.first_req : chunk.end_req + 1]
        reqs = slice(chunk.first_req, chunk.end_req)
        indices, lens = prefill.index_lists(chunk, qs, seq_lens[reqs], WINDOW, kind, local, out)
        for t in range(chunk.first_token, chunk.end_token):
            req = next(r for r in range(num_reqs) if query_start[r + 1] > t)
            c = req - chunk.first_req
            seq, q = REQUESTS[req]
            pos = seq - q + (t - int(query_start[req]))
            columns, length = expected_list(pos, kind, picks[t].tolist(), chunk.entries)
            i = t - chunk.first_token
            assert indices.shape[1] == len(columns)
            assert int(lens[i]) == length, (t, pos)
            for j, want in enumerate(columns):
                got = int(indices[i, j])
                if want is None:
                    assert got == -1, (t, pos, j)
                    checked_holes += c > 0
                    continue
                assert c * chunk.rows <= got < (c + 1) * chunk.rows, (t, pos, j, got)
                source = compressed if want[0] == "entry" else swa
                assert torch.equal(flat[got], source.row(req, want[1])), (t, pos, want)
    if any(chunk.end_req - chunk.first_req > 1 for chunk in chunks):
        assert checked_holes > 0  # holes of a request that is not its chunk's first


def test_gather_lens_count_window_minus_one_rows_before_the_query():
    """A request gathers its query tokens and the ``window - 1`` positions before the first
    (fewer when it has fewer): what its first token's window needs."""
    window = 128
    cases = [(1, 1), (5, 5), (1, 500), (300, 1500), (10, 137), (10, 138), (10, 139), (4, 130)]
    query_lens = torch.tensor([q for q, _ in cases], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in cases], dtype=torch.int32)
    got = prefill.gather_lens(query_lens, seq_lens, window)
    assert got.dtype == torch.int32
    assert got.tolist() == [q + min(s - q, window - 1) for q, s in cases]


def test_gather_reads_zeros_from_pages_outside_the_cache():
    """A block-table entry that names no page of the cache (= its number of pages, or -1): the
    rows it would hold gather as zeros (the Triton gather's rule), every other row as laid out
    (request c: entries 0 .. seq // ratio at rows 0 .., positions seq - gather_len .. seq at rows
    N ..; zeros past them)."""
    kind = Compressed(8, top_k=False)
    ratio = kind.ratio
    gen = torch.Generator().manual_seed(7)
    seq_lens, query_lens, query_start, swa, compressed = prefill_step(gen, kind)
    outside_swa = swa.pages.shape[0]
    outside_entries = compressed.pages.shape[0]
    swa.table[3, 2] = outside_swa  # request 3's positions 8 .. 11, in its gather
    swa.table[1, 5] = -1  # request 1's positions 20 .. 23
    compressed.table[1, 0] = outside_entries  # request 1's entries 0 and 1
    (chunk,) = prefill.plan_chunks(
        query_start, seq_lens, NUM_DECODES, len(REQUESTS) - NUM_DECODES, kind, WINDOW, 10**6
    )
    rows = _gather(chunk, seq_lens, query_lens, swa, compressed, kind)
    zero = torch.zeros(HEAD_DIM, dtype=torch.bfloat16)
    N, M = chunk.entries, chunk.rows
    zeros_seen = 0
    for c, req in enumerate(range(chunk.first_req, chunk.end_req)):
        seq, q = REQUESTS[req]
        gather = q + min(seq - q, WINDOW - 1)
        want = [compressed.row(req, i) for i in range(seq // ratio)]
        want += [zero] * (N - len(want))
        want += [swa.row(req, p) for p in range(seq - gather, seq)]
        want += [zero] * (M - len(want))
        for i, row in enumerate(want):
            assert torch.equal(rows[c, i], row), (req, i)
        zeros_seen += sum(
            1
            for i in range(N, N + gather)
            if swa.table[req, (seq - gather + i - N) // SWA_BLOCK] in (-1, outside_swa)
        )
    assert zeros_seen == 8  # both missing SWA pages lie inside their requests' gathers


# ----------------------------------------------------------------------------------------------
# V4.1's compressed layers: the same rows as vLLM's own V4.1 prefill lists
# ----------------------------------------------------------------------------------------------


def test_v41_lists_read_the_rows_vllms_v41_lists_read():
    """For V4.1's ratio-1 and ratio-2 layers, each prefill token's list names the same workspace
    rows, as a multiset, as vLLM's own V4.1 kernel (``combine_topk_swa_indices``, Triton, run
    in its CPU interpreter in a child process: TRITON_INTERPRET must be set before Triton is
    imported) on the same chunk and indexer picks."""
    pytest.importorskip("triton")
    code = "from tests.test_vllm_glue_prefill import check_v41_combine as c; c()"
    assert "V4.1 chunks compared: 6" in vt.run_in_triton_interpreter(code)


def _indexer_picks(gen: torch.Generator, positions: list[int], ratio: int, k: int):
    """What V4.1's indexer writes per token: ``min((pos + 1) // ratio, k)`` distinct entries it
    sees, in its first columns (one of them -1 now and then: a failed candidate), -1 after."""
    picks = torch.full((len(positions), k), -1, dtype=torch.int32)
    for t, pos in enumerate(positions):
        visible = (pos + 1) // ratio
        count = min(visible, k)
        picks[t, :count] = torch.randperm(visible, generator=gen)[:count].int()
        if count and int(torch.randint(0, 4, (1,), generator=gen)) == 0:
            picks[t, int(torch.randint(0, count, (1,), generator=gen))] = -1
    return picks


def check_v41_combine() -> None:
    from vllm.models.deepseek_v41.common.ops import cache_utils

    kernel = vt.vllm_triton_kernel(cache_utils.CombineTopkSwaIndicesKernel)
    window, k, compared = 8, 16, 0
    for ratio, seed in itertools.product((1, 2), range(3)):
        gen = torch.Generator().manual_seed(1000 * ratio + seed)
        C = int(torch.randint(1, 4, (1,), generator=gen))
        query_lens = torch.randint(1, 40, (C,), generator=gen)
        seq_lens = (query_lens + torch.randint(0, 90, (C,), generator=gen)).int()
        query_start = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).int()
        positions = [
            p
            for q, n in zip(query_lens.tolist(), seq_lens.tolist(), strict=True)
            for p in range(n - q, n)
        ]
        T = len(positions)
        kind = Compressed(ratio, top_k=True)
        (chunk,) = prefill.plan_chunks(query_start, seq_lens, 0, C, kind, window, 1 << 30)
        picks = _indexer_picks(gen, positions, ratio, k)
        width = prefill.index_width(kind, k, chunk.entries, window)
        ours = torch.full((T, width), 777, dtype=torch.int32)
        our_lens = torch.full((T,), 777, dtype=torch.int32)
        prefill._index_lists_torch(
            chunk, query_start, seq_lens, window, kind, picks, ours, our_lens
        )
        glens = prefill.gather_lens(query_lens.int(), seq_lens, window)
        theirs = torch.full((T, k + window), -1, dtype=torch.int32)
        their_lens = torch.full((T,), 777, dtype=torch.int32)
        kernel[(C, 4)](
            theirs,
            theirs.stride(0),
            their_lens,
            picks,
            picks.stride(0),
            query_start,
            seq_lens,
            glens,
            chunk.rows,
            chunk.entries,
            TOP_K=k,
            COMPRESS_RATIO=ratio,
            WINDOW_SIZE=window,
            PADDED_TOP_K=k,
        )
        for t in range(T):
            mine = sorted(int(x) for x in ours[t, : int(our_lens[t])] if x >= 0)
            vllm = sorted(int(x) for x in theirs[t, : int(their_lens[t])] if x >= 0)
            assert mine == vllm, (ratio, seed, t, positions[t], mine, vllm)
        compared += 1
    print(f"V4.1 chunks compared: {compared}")
