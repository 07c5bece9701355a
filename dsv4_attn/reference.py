"""The exact reference for DeepSeek-V4 sparse MQA attention with an attention sink.

Everything else in this package (kernels, the SDPA fallback, the vLLM glue) is checked against
:func:`sparse_attention` here, never against each other. It computes in float64 and favours
clarity over speed; it is meant for tests and for small inputs.

The math (one query token ``t``, head ``h``; docs/design.md §1):

    s_j   = scale * <q[t, h], kv_j>                      over the candidate rows j of both scopes
    lse   = log(sum_j exp(s_j))                          natural log, sink excluded
    out   = sum_j exp(s_j) kv_j / (sum_j exp(s_j) + exp(sink[h]))

K and V are the same row (MQA with one KV head). Candidates are the first ``lens[t]`` entries of
``indices[t]`` (entries equal to -1 are skipped) plus, when given, the first ``extra_lens[t]``
entries of ``extra_indices[t]`` into ``extra_kv``. Both scopes join one softmax; a row that
appears twice counts twice (DeepSeek-V4 does not de-duplicate window and compressed entries).
With no valid candidate, ``out = 0`` and ``lse = -inf``. ``sink = +inf`` gives ``out = 0``;
``sink = -inf`` or ``None`` leaves the softmax unchanged.

:func:`dense_attention` is the same math for dense prefill (MHA/GQA/MQA, separate K and V,
causal and sliding-window masks): every key a query may see is a candidate. Its mask convention
is bottom-right aligned, as in FlashAttention: with ``Sq`` queries and ``Sk`` keys in a sequence,
query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq`` (when causal) and ``j > i + Sk - Sq - window``
(when a window is given: the ``window`` most recent keys including its own position).
``tests/test_reference.py`` checks it against :func:`sparse_attention`.
"""

from __future__ import annotations

import torch

__all__ = ["compressed_entries", "dense_attention", "sparse_attention", "visible_mask"]

# Tokens per chunk; bounds the float64 gather to about chunk * K * D * 8 bytes.
_TOKENS_PER_CHUNK = 16


def _check_scope(
    name: str, kv: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor, T: int, D: int
) -> None:
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"{name}kv must be [N, {D}], got shape {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"{name}indices must be [T={T}, K], got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}indices must be int32 or int64, got {indices.dtype}")
    if lens.shape != (T,):
        raise ValueError(f"{name}lens must be [T={T}], got shape {tuple(lens.shape)}")
    K = indices.shape[1]
    if T and (int(lens.min()) < 0 or int(lens.max()) > K):
        raise ValueError(
            f"{name}lens must lie in [0, K={K}], got min {int(lens.min())} max {int(lens.max())}"
        )
    counted = torch.arange(K, device=indices.device)[None, :] < lens[:, None].to(indices.device)
    used = indices[counted]
    bad = used[(used < -1) | (used >= kv.shape[0])]
    if bad.numel():
        raise ValueError(
            f"{name}indices must lie in [-1, N={kv.shape[0]}) within lens, got {int(bad[0])}"
        )


def _gather_scope(
    kv: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[t, K, D]`` (float64, zero where invalid) and the validity mask ``[t, K]``."""
    K = indices.shape[1]
    valid = (torch.arange(K, device=indices.device)[None, :] < lens[:, None]) & (indices >= 0)
    rows = kv.to(torch.float64)[torch.where(valid, indices, 0).long()]
    return rows * valid[..., None], valid


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA over one or two scopes of KV rows, with a per-head sink, in float64.

    Args:
        q: ``[T, H, D]`` queries, any float dtype.
        kv: ``[N, D]`` rows; each row is both key and value.
        indices: ``[T, K]`` int32/int64 row ids into ``kv``; -1 marks a hole.
        lens: ``[T]`` int; only the first ``lens[t]`` entries of ``indices[t]`` count.
        sink: ``[H]`` per-head sink logits (float32 in DeepSeek-V4), or None for no sink.
        scale: softmax scale applied to ``<q, kv>`` (``D ** -0.5`` in DeepSeek-V4).
        extra_kv, extra_indices, extra_lens: an optional second scope (the compressed entries),
            same conventions, joining the same softmax. Give all three or none.

    Returns:
        ``(out, lse)``: ``out`` float64 ``[T, H, D]``; ``lse`` float64 ``[T, H]``, the natural-log
        sum of ``exp(s_j)`` over valid candidates of both scopes, excluding the sink
        (-inf when there is none).

    Raises:
        ValueError: on a shape, dtype or index that does not fit; the message names the value.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    T, H, D = q.shape
    _check_scope("", kv, indices, lens, T, D)
    given = [x is not None for x in (extra_kv, extra_indices, extra_lens)]
    if any(given) and not all(given):
        raise ValueError("extra_kv, extra_indices and extra_lens must be given together")
    has_extra = all(given)
    if has_extra:
        _check_scope("extra_", extra_kv, extra_indices, extra_lens, T, D)
    if sink is not None and sink.shape != (H,):
        raise ValueError(f"sink must be [H={H}], got shape {tuple(sink.shape)}")
    if not (isinstance(scale, (int, float)) and scale > 0 and scale < float("inf")):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")

    out = torch.zeros(T, H, D, dtype=torch.float64, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64, device=q.device)
    for t0 in range(0, T, _TOKENS_PER_CHUNK):
        sl = slice(t0, min(T, t0 + _TOKENS_PER_CHUNK))
        rows, valid = _gather_scope(kv, indices[sl], lens[sl].to(indices.device))
        if has_extra:
            extra_rows, extra_valid = _gather_scope(
                extra_kv, extra_indices[sl], extra_lens[sl].to(extra_indices.device)
            )
            rows = torch.cat([rows, extra_rows], dim=1)
            valid = torch.cat([valid, extra_valid], dim=1)
        qc = q[sl].to(torch.float64)
        scores = torch.einsum("thd,tkd->thk", qc, rows) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        chunk_lse = torch.logsumexp(scores, dim=-1)  # -inf where no valid key
        # Probabilities relative to the real keys; safe where lse = -inf (all weights are 0).
        shift = torch.where(torch.isfinite(chunk_lse), chunk_lse, torch.zeros_like(chunk_lse))
        weights = torch.exp(scores - shift[..., None])
        o_real = torch.einsum("thk,tkd->thd", weights, rows)
        if sink is not None:
            # out = o_real * e^lse / (e^lse + e^sink) = o_real * sigmoid(lse - sink)
            sink64 = sink.to(device=q.device, dtype=torch.float64)[None, :]
            factor = torch.sigmoid(chunk_lse - sink64)
            factor = torch.where(torch.isfinite(chunk_lse), factor, torch.zeros_like(factor))
            o_real = o_real * factor[..., None]
        out[sl] = o_real
        lse[sl] = chunk_lse
    return out, lse


# ---------------------------------------------------------------------------------------------
# Dense attention (prefill)
# ---------------------------------------------------------------------------------------------

# Bound on float64 score elements per chunk (64 M elements = 512 MB).
_MAX_SCORE_ELEMS = 1 << 26


def visible_mask(
    seqlen_q: int, seqlen_k: int, causal: bool, window: int | None, device=None
) -> torch.Tensor:
    """``bool [Sq, Sk]``: which key each query sees under the causal / window convention."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= diag
    if window is not None:
        mask &= j > diag - window
    return mask


def _one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: int | None,
    sink: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``q [Sq, H, D]``, ``k [Sk, Hk, D]``, ``v [Sk, Hk, Dv]``.

    Returns float64 ``out [Sq, H, Dv]`` and ``lse [Sq, H]``.
    """
    sq, h, _ = q.shape
    sk, hk, dv = v.shape
    group = h // hk
    out = torch.zeros(sq, h, dv, dtype=torch.float64, device=q.device)
    lse = torch.full((sq, h), float("-inf"), dtype=torch.float64, device=q.device)
    if sq == 0 or sk == 0:
        return out, lse
    visible = visible_mask(sq, sk, causal, window, device=q.device)
    heads_per_chunk = max(1, _MAX_SCORE_ELEMS // max(1, sq * sk))
    for h0 in range(0, h, heads_per_chunk):
        heads = torch.arange(h0, min(h, h0 + heads_per_chunk), device=q.device)
        qh = q[:, heads].to(torch.float64).transpose(0, 1)  # [h, Sq, D]
        kh = k[:, heads // group].to(torch.float64).transpose(0, 1)  # [h, Sk, D]
        vh = v[:, heads // group].to(torch.float64).transpose(0, 1)  # [h, Sk, Dv]
        scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        chunk_lse = torch.logsumexp(scores, dim=-1)  # [h, Sq]
        shift = torch.where(torch.isfinite(chunk_lse), chunk_lse, torch.zeros_like(chunk_lse))
        o = torch.matmul(torch.exp(scores - shift[..., None]), vh)  # [h, Sq, Dv]
        if sink is not None:
            s64 = sink.to(device=q.device, dtype=torch.float64)[heads][:, None]
            factor = torch.sigmoid(chunk_lse - s64)
            factor = torch.where(torch.isfinite(chunk_lse), factor, torch.zeros_like(factor))
            o = o * factor[..., None]
        out[:, heads] = o.transpose(0, 1)
        lse[:, heads] = chunk_lse.transpose(0, 1)
    return out, lse


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention in float64.

    Args:
        q: ``[B, Sq, H, D]``, or ``[total_q, H, D]`` with ``cu_seqlens_q``.
        k: ``[B, Sk, Hk, D]``, or ``[total_k, Hk, D]`` with ``cu_seqlens_k``; ``H % Hk == 0``,
            query head ``h`` uses key head ``h // (H // Hk)``.
        v: like ``k`` with last dimension ``Dv``.
        causal, window: the mask (module docstring).
        sink: ``[H]`` per-head sink logit or None.
        scale: softmax scale, default ``D ** -0.5``.
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` cumulative sequence offsets (packed layout).

    Returns:
        ``(out, lse)`` float64: ``out`` shaped like ``q`` with last dimension ``Dv``; ``lse``
        shaped like ``q`` without its last dimension (natural log, sink excluded).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if cu_seqlens_q is None:
        results = [
            _one_sequence(q[b], k[b], v[b], causal, window, sink, scale) for b in range(q.shape[0])
        ]
        if not results:
            shape = q.shape[:-1]
            return (
                torch.zeros(*shape, v.shape[-1], dtype=torch.float64, device=q.device),
                torch.full(shape, float("-inf"), dtype=torch.float64, device=q.device),
            )
        return torch.stack([o for o, _ in results]), torch.stack([s for _, s in results])
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(len(cq) - 1):
        o, s = _one_sequence(
            q[cq[b] : cq[b + 1]],
            k[ck[b] : ck[b + 1]],
            v[ck[b] : ck[b + 1]],
            causal,
            window,
            sink,
            scale,
        )
        out[cq[b] : cq[b + 1]] = o
        lse[cq[b] : cq[b + 1]] = s
    return out, lse


def compressed_entries(
    kv: torch.Tensor,
    score: torch.Tensor,
    compress_ratio: int,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    rope_dim: int = 64,
) -> torch.Tensor:
    """DeepSeek-V4's and V4.1's compressed KV entries of one sequence, in float64.

    Each position carries ``C * D`` kv values and ``C * D`` scores (the compressor's projections,
    the scores with V4's positional bias added; V4.1 has none); ``C = 2`` for the overlapping
    compressor (V4's ratio 4, CSA), 1 otherwise (V4's 128; V4.1's 2, and its 1, where an entry
    is its position's kv: the softmax of one score is 1). Entry ``e`` is complete at position
    ``p = (e + 1) * ratio - 1`` and covers the ``C * ratio`` positions ``p - C * ratio + 1 ..
    p`` that exist (``>= 0``): the positions of its own block with their last ``D`` columns,
    with ``C = 2`` those of the block before with their first ``D``. Per column ``j``:

        x_j = sum_i softmax_i(score[i, j]) kv[i, j]

    then RMSNorm (``x / sqrt(mean(x^2) + eps) * norm_weight``) and GPT-J RoPE of the last
    ``rope_dim`` values at position ``e * ratio``: pair ``(2k, 2k + 1)`` of that part is rotated
    by ``cos = cos_sin[e * ratio, k]``, ``sin = cos_sin[e * ratio, rope_dim / 2 + k]``.

    Args:
        kv, score: ``[L, C * D]`` per position of the sequence.
        compress_ratio: positions per entry.
        norm_weight: ``[D]``; cos_sin: ``[>= L, rope_dim]`` (cos | sin).

    Returns:
        ``[L // compress_ratio, D]`` float64.
    """
    L, width = kv.shape
    overlap = compress_ratio == 4
    C = 2 if overlap else 1
    D = width // C
    if score.shape != kv.shape or width != C * D or norm_weight.shape != (D,):
        raise ValueError(
            f"kv and score must be [L, {C} * D] and norm_weight [D], got {tuple(kv.shape)}, "
            f"{tuple(score.shape)}, {tuple(norm_weight.shape)}"
        )
    kv64, score64 = kv.to(torch.float64), score.to(torch.float64)
    entries = torch.empty(L // compress_ratio, D, dtype=torch.float64, device=kv.device)
    half = rope_dim // 2
    for e in range(L // compress_ratio):
        own = slice(e * compress_ratio, (e + 1) * compress_ratio)
        kv_rows, score_rows = [kv64[own, (C - 1) * D :]], [score64[own, (C - 1) * D :]]
        if overlap and e > 0:
            before = slice((e - 1) * compress_ratio, e * compress_ratio)
            kv_rows.insert(0, kv64[before, :D])
            score_rows.insert(0, score64[before, :D])
        weights = torch.softmax(torch.cat(score_rows), dim=0)
        x = (weights * torch.cat(kv_rows)).sum(dim=0)
        x = x / torch.sqrt(x.square().mean() + eps) * norm_weight.to(torch.float64)
        cs = cos_sin[e * compress_ratio].to(torch.float64)
        cos, sin = cs[:half], cs[half:rope_dim]
        even, odd = x[D - rope_dim :: 2].clone(), x[D - rope_dim + 1 :: 2].clone()
        x[D - rope_dim :: 2] = even * cos - odd * sin
        x[D - rope_dim + 1 :: 2] = even * sin + odd * cos
        entries[e] = x
    return entries
