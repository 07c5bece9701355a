"""The exact reference for DeepSeek-V4 sparse MQA attention with an attention sink.

Everything else in this package (kernels, the SDPA fallback, the vLLM glue) is checked against
:func:`sparse_attention` here, never against each other. It computes in float64 and favours
clarity over speed; it is meant for tests and for small inputs.

The math (one query token ``t``, head ``h``; DESIGN.md §2):

    s_j   = scale * <q[t, h], kv_j>                      over the candidate rows j of both scopes
    lse   = log(sum_j exp(s_j))                          natural log, sink excluded
    out   = sum_j exp(s_j) kv_j / (sum_j exp(s_j) + exp(sink[h]))

K and V are the same row (MQA with one KV head). Candidates are the first ``lens[t]`` entries of
``indices[t]`` (entries equal to -1 are skipped) plus, when given, the first ``extra_lens[t]``
entries of ``extra_indices[t]`` into ``extra_kv``. Both scopes join one softmax; a row that
appears twice counts twice (DeepSeek-V4 does not de-duplicate window and compressed entries).
With no valid candidate, ``out = 0`` and ``lse = -inf``. ``sink = +inf`` gives ``out = 0``;
``sink = -inf`` or ``None`` leaves the softmax unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["sparse_attention"]

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
