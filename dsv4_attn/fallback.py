"""Batched torch fallback for sparse MQA over a paged KV cache (any device, any head count).

It gathers and dequantizes the candidate rows of a chunk of query tokens (never the whole cache),
computes the scores with one batched matmul, adds the sink as an extra logit column of the softmax
and reduces with a second batched matmul. It never builds a ``[T, H, N_total]`` mask: memory is
bounded by the chunk, ``tokens_per_chunk * K_total * 512`` float32 values.

Numerics: scores and the softmax in float32; rows are bf16-exact, so the products are exact and
only the float32 accumulation rounds. Output bf16, lse float32 (natural log, sink excluded).
"""

from __future__ import annotations

import torch

from dsv4_attn import kv_cache
from dsv4_attn.index_checks import counted_entries
from dsv4_attn.scope import KVScope

__all__ = ["sparse_attention"]

# Target bytes of float32 gathered rows per chunk (the largest temporary).
_CHUNK_BYTES = 256 * 1024 * 1024


def _gather(scope: KVScope) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized rows ``[t, K, 512]`` float32 (zeros at holes) and the valid mask ``[t, K]``
    (:func:`~dsv4_attn.index_checks.counted_entries`: slots outside the cache are holes)."""
    indices = scope.indices
    t, K = indices.shape
    valid = counted_entries(indices, scope.lens, scope.cache.shape[0] * scope.block_size)
    slots = torch.where(valid, indices, torch.full_like(indices, -1)).reshape(-1)
    rows = kv_cache.read_unchecked(scope.cache, slots, scope.fmt, scope.block_size)
    return rows.view(t, K, kv_cache.HEAD_DIM).float(), valid


def sparse_attention(
    q: torch.Tensor,
    window: KVScope,
    sink: torch.Tensor | None,
    scale: float,
    extra: KVScope | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`dsv4_attn.ops.sparse_attention` (inputs already validated there).

    Returns ``(out bf16 [T, H, 512], lse float32 [T, H])``.
    """
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    k_total = window.capacity + (extra.capacity if extra is not None else 0)
    tokens_per_chunk = max(1, _CHUNK_BYTES // max(1, k_total * D * 4))
    # The sink column: +inf is clamped to the float32 maximum so that it dominates every real
    # logit without producing inf - inf; -inf contributes exp(-inf) = 0 as it should.
    if sink is not None:
        sink_logit = sink.to(device=q.device, dtype=torch.float32).clamp(
            max=torch.finfo(torch.float32).max
        )
    for t0 in range(0, T, tokens_per_chunk):
        sl = slice(t0, min(T, t0 + tokens_per_chunk))
        rows, valid = _gather(window.tokens(sl.start, sl.stop))
        if extra is not None:
            extra_rows, extra_valid = _gather(extra.tokens(sl.start, sl.stop))
            rows = torch.cat([rows, extra_rows], dim=1)
            valid = torch.cat([valid, extra_valid], dim=1)
        scores = torch.bmm(q[sl].float(), rows.transpose(1, 2)) * scale  # [t, H, K]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        if sink is not None:
            sink_col = sink_logit[None, :, None].expand(scores.shape[0], H, 1)
            logits = torch.cat([scores, sink_col], dim=-1)
        else:
            logits = scores
        row_max = logits.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(logits - row_max)
        denom = weights.sum(dim=-1, keepdim=True)
        # A NaN sink keeps its NaN (as the reference's), only an empty row's zero is guarded.
        probs = weights[..., : scores.shape[-1]] / torch.where(denom == 0, 1.0, denom)
        chunk_out = torch.bmm(probs, rows).masked_fill(~valid.any(dim=-1)[:, None, None], 0.0)
        out[sl] = chunk_out.to(torch.bfloat16)
        lse[sl] = torch.logsumexp(scores, dim=-1)
    return out, lse
