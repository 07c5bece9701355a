"""The exact reference against a brute-force dense softmax with an explicit mask, and its
compressed entries against a loop-by-loop derivation of DeepSeek-V4's compressor."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from dsv4_attn import reference
from dsv4_attn.reference import dense_attention, sparse_attention, visible_mask

INF = float("inf")


def dense_brute_force(q, kv, indices, lens, sink, scale, extra=None):
    """Softmax over *all* rows of kv (and extra kv) with an explicit multiplicity mask.

    A candidate row that is picked c times contributes c * exp(s); the sink is an extra logit
    column whose value row is zero. Written independently of the code under test: no gather,
    no chunking, no sigmoid.
    """
    q = q.double()
    tables = [(kv.double(), indices, lens)]
    if extra is not None:
        tables.append((extra[0].double(), extra[1], extra[2]))
    all_rows = torch.cat([t[0] for t in tables])
    T, H, _ = q.shape
    counts = torch.zeros(T, all_rows.shape[0], dtype=torch.float64)
    offset = 0
    for rows, idx, ln in tables:
        for t in range(T):
            for j in range(int(ln[t])):
                if int(idx[t, j]) >= 0:
                    counts[t, offset + int(idx[t, j])] += 1
        offset += rows.shape[0]
    logits = torch.einsum("thd,nd->thn", q, all_rows) * scale
    logits = torch.where(counts[:, None, :] > 0, logits + counts.log()[:, None, :], -INF)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.zeros(T, H, all_rows.shape[1], dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            column = logits[t, h]
            if sink is not None:
                column = torch.cat([column, sink[h].double().view(1)])
            if torch.isinf(column).all() and (column < 0).all():
                continue  # nothing to attend to: out stays 0
            if sink is not None and math.isinf(float(sink[h])) and float(sink[h]) > 0:
                continue  # the sink takes all the mass
            probs = torch.softmax(column, dim=0)[: all_rows.shape[0]]
            out[t, h] = probs @ all_rows
    return out, lse


def random_case(gen, T, H, D, N, K, hole_rate=0.2, n_extra=None, K_extra=None):
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(N, D, generator=gen, dtype=torch.float64)
    indices = torch.randint(0, N, (T, K), generator=gen)
    indices[torch.rand(T, K, generator=gen) < hole_rate] = -1
    lens = torch.randint(0, K + 1, (T,), generator=gen)
    extra = None
    if n_extra is not None:
        ekv = torch.randn(n_extra, D, generator=gen, dtype=torch.float64)
        eidx = torch.randint(0, n_extra, (T, K_extra), generator=gen)
        eidx[torch.rand(T, K_extra, generator=gen) < hole_rate] = -1
        elens = torch.randint(0, K_extra + 1, (T,), generator=gen)
        extra = (ekv, eidx, elens)
    return q, kv, indices, lens, extra


SINKS = {
    "none": None,
    "finite": lambda gen, H: torch.randn(H, generator=gen) * 2,
    "mixed_inf": lambda gen, H: torch.tensor([INF, -INF, 0.5, -3.0] * (H // 4)),
}


@pytest.mark.parametrize("sink_kind", list(SINKS))
@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_matches_dense_brute_force(sink_kind, with_extra, seed):
    gen = torch.Generator().manual_seed(1000 * seed + 7)
    T, H, D, N, K = 9, 8, 32, 40, 24
    q, kv, indices, lens, extra = random_case(
        gen, T, H, D, N, K, n_extra=30 if with_extra else None, K_extra=12
    )
    lens[0] = 0  # at least one token with an empty window
    sink = SINKS[sink_kind](gen, H) if SINKS[sink_kind] else None
    scale = D**-0.5
    args = (extra[0], extra[1], extra[2]) if extra else ()
    out, lse = sparse_attention(q, kv, indices, lens, sink, scale, *args)
    ref_out, ref_lse = dense_brute_force(q, kv, indices, lens, sink, scale, extra)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_duplicates_count_twice():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 8, generator=gen, dtype=torch.float64)
    kv = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    once, lse_once = sparse_attention(q, kv, torch.tensor([[0, 1]]), torch.tensor([2]), None, 1.0)
    twice, lse_twice = sparse_attention(
        q,
        kv,
        torch.tensor([[0, 1]]),
        torch.tensor([2]),
        None,
        1.0,
        kv,
        torch.tensor([[1]]),
        torch.tensor([1]),
    )
    s = (q[0] @ kv[:2].T).double()  # [H, 2]
    expected_lse = torch.logsumexp(torch.stack([s[:, 0], s[:, 1] + math.log(2)], -1), -1)
    torch.testing.assert_close(lse_twice[0], expected_lse)
    assert not torch.allclose(once, twice)
    assert torch.all(lse_twice > lse_once)


def test_edge_cases_no_key_and_infinite_sinks():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 16, generator=gen, dtype=torch.float64)
    kv = torch.randn(10, 16, generator=gen, dtype=torch.float64)
    indices = torch.tensor([[-1, -1, 3], [1, 2, 3], [4, -1, 5]])
    lens = torch.tensor([2, 0, 3])  # token 0: only holes; token 1: nothing counted
    sink = torch.tensor([INF, -INF, 0.0, 1.0])
    out, lse = sparse_attention(q, kv, indices, lens, sink, 0.25)
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == -INF)
    assert torch.all(out[2, 0] == 0), "sink = +inf must zero the output"
    assert torch.isfinite(lse[2]).all(), "the sink never enters lse"
    no_sink, lse_no_sink = sparse_attention(q, kv, indices, lens, None, 0.25)
    torch.testing.assert_close(out[2, 1], no_sink[2, 1], rtol=0, atol=0)  # -inf sink = no sink
    torch.testing.assert_close(lse, lse_no_sink, rtol=0, atol=0)
    # finite sink: o = o_real * sigmoid(lse - sink), independently computed
    factor = 1.0 / (1.0 + math.exp(1.0 - float(lse[2, 3])))
    torch.testing.assert_close(out[2, 3], no_sink[2, 3] * factor)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"indices": torch.tensor([[0, 10]])}, "must lie in \\[-1, N=10\\)"),
        ({"indices": torch.tensor([[0, -2]])}, "got -2"),
        ({"lens": torch.tensor([3])}, "lens must lie in \\[0, K=2\\]"),
        ({"lens": torch.tensor([-1])}, "lens must lie"),
        ({"sink": torch.zeros(3)}, "sink must be \\[H=2\\]"),
        ({"scale": 0.0}, "scale must be a positive finite"),
        ({"scale": INF}, "scale must be a positive finite"),
        ({"indices": torch.tensor([[0.0, 1.0]])}, "int32 or int64"),
        ({"extra_kv": torch.zeros(4, 8, dtype=torch.float64)}, "given together"),
    ],
)
def test_bad_input_names_the_value(kwargs, message):
    args = {
        "q": torch.randn(1, 2, 8, dtype=torch.float64),
        "kv": torch.randn(10, 8, dtype=torch.float64),
        "indices": torch.tensor([[0, 1]]),
        "lens": torch.tensor([2]),
        "sink": None,
        "scale": 1.0,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        sparse_attention(**args)


def test_out_of_range_index_beyond_lens_is_ignored():
    q = torch.randn(1, 2, 8, dtype=torch.float64)
    kv = torch.randn(10, 8, dtype=torch.float64)
    out, _ = sparse_attention(q, kv, torch.tensor([[3, 99]]), torch.tensor([1]), None, 1.0)
    torch.testing.assert_close(out[0], kv[3].expand(2, 8))  # one key: softmax weight 1


# --- dense reference ----------------------------------------------------------------------
# The dense float64 reference agrees with THE reference (dsv4_attn.reference.sparse_attention).
#
# ``reference.sparse_attention`` treats each row as both key and value, so a dense problem maps
# onto it exactly by concatenating rows ``[k | v]`` and padding queries to ``[q | 0]``: the scores
# are ``<q, k>`` and the output's last ``Dv`` columns are ``sum_j p_j v_j``. Candidates are the
# keys each query may see, holes (-1) elsewhere.


def _via_sparse_reference(q, k, v, causal, window, sink, scale):
    """Dense attention of one sequence ``q [Sq, H, D]`` through the sparse reference."""
    sq, h, d = q.shape
    sk, hk, dv = v.shape
    group = h // hk
    mask = visible_mask(sq, sk, causal, window)
    idx = torch.where(mask, torch.arange(sk)[None, :], torch.full((sq, sk), -1))
    lens = torch.full((sq,), sk)
    out = torch.empty(sq, h, dv, dtype=torch.float64)
    lse = torch.empty(sq, h, dtype=torch.float64)
    for j in range(hk):
        heads = list(range(j * group, (j + 1) * group))
        rows = torch.cat([k[:, j], v[:, j]], dim=-1)
        qq = torch.cat([q[:, heads], torch.zeros(sq, group, dv, dtype=q.dtype)], dim=-1)
        s = None if sink is None else sink[heads]
        o, l = reference.sparse_attention(qq, rows, idx, lens, s, scale)
        out[:, heads] = o[..., d:]
        lse[:, heads] = l
    return out, lse


def _assert_same(a_out, a_lse, b_out, b_lse):
    assert torch.allclose(a_out, b_out, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isneginf(a_lse), torch.isneginf(b_lse))
    finite = torch.isfinite(b_lse)
    assert torch.allclose(a_lse[finite], b_lse[finite], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "sq, sk, h, hk, causal, window",
    [
        (5, 9, 4, 2, False, None),
        (5, 9, 4, 2, True, None),
        (9, 5, 4, 4, True, None),  # Sq > Sk: the first rows see nothing
        (7, 7, 6, 1, True, 3),  # MQA with a window
        (1, 11, 2, 1, True, 4),  # a single query (decode-like)
    ],
)
@pytest.mark.parametrize("with_sink", [False, True])
def test_matches_sparse_reference(sq, sk, h, hk, causal, window, with_sink):
    g = torch.Generator().manual_seed(sq * 100 + sk * 10 + h)
    d, dv = 12, 8
    q = torch.randn(2, sq, h, d, generator=g)
    k = torch.randn(2, sk, hk, d, generator=g)
    v = torch.randn(2, sk, hk, dv, generator=g)
    sink = torch.randn(h, generator=g) if with_sink else None
    out, lse = dense_attention(q, k, v, causal, window, sink, 0.37)
    assert out.dtype == torch.float64 and out.shape == (2, sq, h, dv)
    assert lse.shape == (2, sq, h)
    for b in range(2):
        ref_out, ref_lse = _via_sparse_reference(q[b], k[b], v[b], causal, window, sink, 0.37)
        _assert_same(out[b], lse[b], ref_out, ref_lse)


def test_packed_layout_matches_per_sequence_calls():
    g = torch.Generator().manual_seed(3)
    lq, lk = [3, 0, 6, 1], [4, 2, 6, 0]
    h, hk, d = 4, 2, 8
    q = torch.randn(sum(lq), h, d, generator=g)
    k = torch.randn(sum(lk), hk, d, generator=g)
    v = torch.randn(sum(lk), hk, d, generator=g)
    sink = torch.randn(h, generator=g)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = dense_attention(q, k, v, True, 3, sink, None, cu_q, cu_k)
    for b in range(len(lq)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = dense_attention(q[None, qs], k[None, ks], v[None, ks], True, 3, sink, d**-0.5)
        _assert_same(out[qs], lse[qs], o[0], l[0])
    # Sequence 3 has queries but no keys: out 0, lse -inf.
    assert torch.all(out[cu_q[3] :] == 0) and torch.all(torch.isneginf(lse[cu_q[3] :]))


def test_visible_mask_matches_its_definition():
    for sq, sk, causal, window in [(4, 6, True, None), (6, 4, True, 2), (3, 3, False, None)]:
        mask = visible_mask(sq, sk, causal, window)
        for i in range(sq):
            for j in range(sk):
                want = True
                if causal:
                    want &= j <= i + sk - sq
                if window is not None:
                    want &= j > i + sk - sq - window
                assert bool(mask[i, j]) == want


def test_infinite_sinks():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(3))
    sink = torch.tensor([math.inf, -math.inf])
    out, lse = dense_attention(q, k, v, sink=sink)
    plain, plain_lse = dense_attention(q, k, v)
    assert torch.all(out[..., 0, :] == 0)  # +inf sink takes all the mass
    assert torch.allclose(out[..., 1, :], plain[..., 1, :])  # -inf sink is no sink
    assert torch.allclose(lse, plain_lse)  # the LSE never includes the sink


# ----------------------------------------------------------------------------------------------
# compressed_entries: DeepSeek-V4's compressor, derived one entry, column and position at a time
# ----------------------------------------------------------------------------------------------


def brute_entries(
    kv: torch.Tensor,
    score: torch.Tensor,
    ratio: int,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    rope_dim: int,
) -> list[list[float]]:
    """The compressed entries ``[L // ratio][D]`` as Python floats (float64), from the design:

    entry ``e`` is complete at position ``p = (e + 1) * ratio - 1``; with the overlapping
    compressor (ratio 4, two halves of ``D`` columns per position) it pools positions
    ``p - 7 .. p`` that exist: those of block ``e - 1`` with their first half, those of block
    ``e`` with their second; otherwise (one half) the ``ratio`` positions of block ``e``. Per
    column a softmax over those positions' scores weights their kv values; then RMSNorm with
    weight; then GPT-J RoPE of the last ``rope_dim`` values at position ``e * ratio`` (pairs
    ``(2k, 2k + 1)`` rotated by ``cos_sin[e * ratio, k]``, ``cos_sin[e * ratio, rope_dim/2 + k]``).
    """
    kv_rows, score_rows, cs = kv.tolist(), score.tolist(), cos_sin.tolist()
    w = norm_weight.tolist()
    L, width = kv.shape
    halves = 2 if ratio == 4 else 1
    D = width // halves
    out = []
    for e in range(L // ratio):
        last = (e + 1) * ratio - 1
        positions = [p for p in range(last - halves * ratio + 1, last + 1) if p >= 0]
        x = []
        for j in range(D):
            # Own block: the last half's column j; the block before: the first half's.
            cols = [(halves - 1) * D + j if p >= e * ratio else j for p in positions]
            scores = [score_rows[p][c] for p, c in zip(positions, cols, strict=True)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            pooled = sum(
                wt * kv_rows[p][c] for wt, p, c in zip(weights, positions, cols, strict=True)
            )
            x.append(pooled / sum(weights))
        rms = math.sqrt(sum(v * v for v in x) / D + eps)
        y = [x[j] / rms * w[j] for j in range(D)]
        row = cs[e * ratio]
        for k in range(rope_dim // 2):
            a, b = y[D - rope_dim + 2 * k], y[D - rope_dim + 2 * k + 1]
            cos, sin = row[k], row[rope_dim // 2 + k]
            y[D - rope_dim + 2 * k] = a * cos - b * sin
            y[D - rope_dim + 2 * k + 1] = a * sin + b * cos
        out.append(y)
    return out


def compressor_inputs(name: str, L: int, ratio: int, D: int, rope_dim: int = 64):
    """Random fp32 kv and scores ``[L, C * D]`` (scores spread enough that the softmax is far
    from a mean), a random fp32 norm weight ``[D]``, and ``cos | sin`` of random angles per
    position ``[L + 3, rope_dim]`` (so a wrong position reads different values)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    width = (2 if ratio == 4 else 1) * D
    kv = torch.randn(L, width, generator=gen)
    score = torch.randn(L, width, generator=gen) * 3
    norm_weight = torch.rand(D, generator=gen) + 0.5
    angles = torch.rand(L + 3, rope_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    return kv, score, norm_weight, cos_sin


@pytest.mark.parametrize(
    ("ratio", "D", "L"),
    [
        (4, 512, 4 * 5 + 3),  # CSA: overlap; entry 0 without a block before; 3 trailing dropped
        (4, 96, 4),  # one entry: entry 0 alone
        (8, 96, 8 * 3 + 7),  # a non-overlapping ratio, 7 trailing positions dropped
        (128, 64, 2 * 128 + 37),  # HCA: all 64 values rotated; 37 trailing dropped
        (2, 512, 2 * 6 + 1),  # V4.1's pairs, a softmax gate per channel; 1 trailing dropped
        (1, 512, 5),  # V4.1's ratio 1: each position its own entry (a softmax of one)
    ],
)
def test_compressed_entries_match_a_loop_by_loop_derivation(ratio, D, L):
    kv, score, weight, cos_sin = compressor_inputs(f"entries-{ratio}-{D}-{L}", L, ratio, D)
    eps = 1e-6
    got = reference.compressed_entries(kv, score, ratio, weight, eps, cos_sin)
    assert got.dtype == torch.float64 and got.shape == (L // ratio, D)
    want = torch.tensor(
        brute_entries(kv, score, ratio, weight, eps, cos_sin, 64), dtype=torch.float64
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_compressed_entries_of_a_sequence_shorter_than_the_ratio():
    kv, score, weight, cos_sin = compressor_inputs("short", 3, 4, 64)
    got = reference.compressed_entries(kv, score, 4, weight, 1e-6, cos_sin)
    assert got.shape == (0, 64) and got.dtype == torch.float64


def test_compressed_entries_by_hand():
    """Ratio 4 (overlap), D = 4 with the last 2 values rotated, equal scores (a plain mean),
    norm weight ones, eps = 3, L = 9 (position 8 completes nothing):

    - entry 0 pools positions 0..3, second half only (no block before it): the mean of
      ``4 e_0 .. 4 e_3`` is ``(1, 1, 1, 1)``; RMSNorm divides by ``sqrt(1 + 3) = 2``; RoPE at
      position 0 (cos 1, sin 0) is the identity: ``(0.5, 0.5, 0.5, 0.5)``.
    - entry 1 pools positions 0..3 (first half) and 4..7 (second half), all ``(2, 2, 4, 0)``:
      mean ``(2, 2, 4, 0)``, divided by ``sqrt((4 + 4 + 16) / 4 + 3) = 3``; RoPE at position 4
      (cos 0, sin 1) turns the pair ``(4/3, 0)`` into ``(0, 4/3)``.

    Every value the entries must not read is 100 (the first half of positions 4..8, the second
    half of position 8), and cos | sin rows other than 0 and 4 are 7.
    """
    L, D, rope_dim = 9, 4, 2
    kv = torch.full((L, 2 * D), 100.0)
    kv[0:4, D:] = 4 * torch.eye(4)
    kv[0:4, :D] = torch.tensor([2.0, 2.0, 4.0, 0.0])
    kv[4:8, D:] = torch.tensor([2.0, 2.0, 4.0, 0.0])
    score = torch.full((L, 2 * D), 0.7)
    cos_sin = torch.full((L, rope_dim), 7.0)
    cos_sin[0] = torch.tensor([1.0, 0.0])
    cos_sin[4] = torch.tensor([0.0, 1.0])
    got = reference.compressed_entries(kv, score, 4, torch.ones(D), 3.0, cos_sin, rope_dim)
    want = torch.tensor([[0.5, 0.5, 0.5, 0.5], [2 / 3, 2 / 3, 0.0, 4 / 3]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize(
    ("shapes", "ratio", "message"),
    [
        (((8, 7), (8, 7), (3,)), 4, r"\[L, 2 \* D\] .* got \(8, 7\), \(8, 7\), \(3,\)"),
        (((8, 8), (8, 6), (4,)), 4, r"got \(8, 8\), \(8, 6\), \(4,\)"),
        (((8, 8), (8, 8), (8,)), 4, r"norm_weight \[D\], got \(8, 8\), \(8, 8\), \(8,\)"),
        (((8, 8), (8, 8), (4,)), 8, r"\[L, 1 \* D\] .* got \(8, 8\), \(8, 8\), \(4,\)"),
    ],
)
def test_compressed_entries_refuse_mismatched_shapes(shapes, ratio, message):
    """kv and score must share ``[L, C * D]`` (``C`` = 2 for ratio 4, else 1) and the norm
    weight be ``[D]``; the error names the shapes."""
    kv_shape, score_shape, weight_shape = shapes
    with pytest.raises(ValueError, match=message):
        reference.compressed_entries(
            torch.zeros(kv_shape),
            torch.zeros(score_shape),
            ratio,
            torch.ones(weight_shape),
            1e-6,
            torch.zeros(8, 64),
        )
