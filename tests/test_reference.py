"""The exact reference against a brute-force dense softmax with an explicit mask."""

from __future__ import annotations

import math

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
