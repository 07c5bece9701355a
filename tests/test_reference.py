"""The exact reference against a brute-force dense softmax with an explicit mask."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn.reference import sparse_attention

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
