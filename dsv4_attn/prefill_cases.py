"""Random prefill problems for :mod:`dsv4_attn.fmha_ops`, shared by the tests and the benchmark.

A :class:`DenseCase` is an argument set for :func:`~dsv4_attn.fmha_ops.fmha` (batched or packed
layout); a :class:`SparseCase` one for :func:`~dsv4_attn.fmha_ops.sparse_prefill`, either random
(holes, ragged lengths) or shaped like DeepSeek-V4 prefill (a 128-token sliding window plus
top-k compressed rows in one gathered workspace). Values are random normal, never zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DenseCase",
    "SparseCase",
    "make_dense_case",
    "make_random_sparse_case",
    "make_v4_sparse_case",
    "visible_pairs",
]


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: int | None) -> int:
    """Number of (query, key) pairs the mask keeps in one sequence (the work that counts)."""
    if seqlen_q == 0 or seqlen_k == 0:
        return 0
    i = torch.arange(seqlen_q, dtype=torch.int64)
    diag = i + (seqlen_k - seqlen_q)
    hi = torch.clamp(diag, max=seqlen_k - 1) if causal else torch.full_like(i, seqlen_k - 1)
    lo = torch.clamp(diag - window + 1, min=0) if window is not None else torch.zeros_like(i)
    return int(torch.clamp(hi - lo + 1, min=0).sum())


@dataclass
class DenseCase:
    q: torch.Tensor  # [B, Sq, H, D] or packed [total_q, H, D]
    k: torch.Tensor
    v: torch.Tensor  # may be k itself (K = V)
    causal: bool
    window: int | None
    sink: torch.Tensor | None  # float32 [H]
    scale: float
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B + 1] (packed layout)
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None

    def kwargs(self) -> dict:
        """Keyword arguments for ``fmha_ops.fmha`` (and ``reference.dense_attention``)."""
        return dict(
            causal=self.causal,
            window=self.window,
            sink=self.sink,
            scale=self.scale,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
        )

    def seqlens(self) -> list[tuple[int, int]]:
        """``(Sq, Sk)`` per sequence."""
        if self.cu_seqlens_q is None:
            return [(self.q.shape[1], self.k.shape[1])] * self.q.shape[0]
        cq, ck = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        return [(cq[b + 1] - cq[b], ck[b + 1] - ck[b]) for b in range(len(cq) - 1)]

    def flops(self) -> float:
        """FLOPs of QK^T and PV over the visible pairs only: ``2 * H * (D + Dv)`` per pair."""
        heads, d, dv = self.q.shape[-2], self.q.shape[-1], self.v.shape[-1]
        pairs = sum(visible_pairs(sq, sk, self.causal, self.window) for sq, sk in self.seqlens())
        return float(2 * heads * (d + dv) * pairs)


def make_dense_case(
    seqlens: list[tuple[int, int]],
    heads: int,
    heads_kv: int,
    head_dim: int,
    causal: bool = False,
    window: int | None = None,
    sink: str | None = None,
    packed: bool = False,
    kv_shared: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> DenseCase:
    """A dense problem. ``seqlens``: ``(Sq, Sk)`` per sequence (all equal unless ``packed``).

    ``sink``: None, ``"random"`` (normal logits) or ``"inf"`` (random with one +inf and one -inf
    head). ``kv_shared`` makes ``v`` the very tensor ``k`` (K = V, DeepSeek-V4's latent).
    """
    # Generated on the target device (fast for benchmark-sized problems); reproducible per device.
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    if packed:
        total_q = sum(sq for sq, _ in seqlens)
        total_k = sum(sk for _, sk in seqlens)
        q = rnd(total_q, heads, head_dim)
        k = rnd(total_k, heads_kv, head_dim)
        v = k if kv_shared else rnd(total_k, heads_kv, head_dim)
        cu_q = torch.tensor([0] + [sq for sq, _ in seqlens], dtype=torch.int64).cumsum(0)
        cu_k = torch.tensor([0] + [sk for _, sk in seqlens], dtype=torch.int64).cumsum(0)
        cu_q = cu_q.to(device=device, dtype=torch.int32)
        cu_k = cu_k.to(device=device, dtype=torch.int32)
        max_q = max((sq for sq, _ in seqlens), default=0)
    else:
        if len(set(seqlens)) != 1:
            raise ValueError("the batched layout needs equal lengths; use packed=True")
        sq, sk = seqlens[0]
        batch = len(seqlens)
        q = rnd(batch, sq, heads, head_dim)
        k = rnd(batch, sk, heads_kv, head_dim)
        v = k if kv_shared else rnd(batch, sk, heads_kv, head_dim)
        cu_q = cu_k = None
        max_q = None
    sink_t = None
    if sink is not None:
        sink_t = torch.randn(heads, generator=g, device=device).cpu()
        if sink == "inf":
            sink_t[0] = float("inf")
            if heads > 1:
                sink_t[-1] = float("-inf")
        sink_t = sink_t.to(device=device, dtype=torch.float32)
    return DenseCase(q, k, v, causal, window, sink_t, head_dim**-0.5, cu_q, cu_k, max_q)


@dataclass
class SparseCase:
    q: torch.Tensor  # bf16 [T, H, D]
    kv: torch.Tensor  # bf16 [N, D]
    indices: torch.Tensor  # int32 [T, K]
    lens: torch.Tensor  # int32 [T]
    sink: torch.Tensor | None  # float32 [H]
    scale: float

    def args(self) -> tuple:
        """Positional arguments for ``fmha_ops.sparse_prefill``."""
        return (self.q, self.kv, self.indices, self.lens, self.sink, self.scale)

    def num_valid(self) -> int:
        """Valid (token, entry) pairs: counted entries that are not -1."""
        width = self.indices.shape[1]
        counted = torch.arange(width, device=self.indices.device)[None, :] < self.lens[:, None]
        return int((counted & (self.indices >= 0)).sum())

    def flops(self) -> float:
        heads, dim = self.q.shape[1], self.q.shape[2]
        return float(4 * heads * dim * self.num_valid())


def _sink(heads: int, sink: str | None, g: torch.Generator, device) -> torch.Tensor | None:
    if sink is None:
        return None
    s = torch.randn(heads, generator=g, device=g.device).cpu()
    if sink == "inf":
        s[0] = float("inf")
        if heads > 1:
            s[-1] = float("-inf")
    return s.to(device=device, dtype=torch.float32)


def _case(q, kv, indices, lens, sink, device) -> SparseCase:
    """bf16 ``q``/``kv`` and int32 lists on ``device``; softmax scale 1 / sqrt(head dim)."""
    return SparseCase(
        q.to(device=device, dtype=torch.bfloat16),
        kv.to(device=device, dtype=torch.bfloat16),
        indices.to(device=device, dtype=torch.int32),
        lens.to(device=device, dtype=torch.int32),
        sink,
        q.shape[-1] ** -0.5,
    )


def make_random_sparse_case(
    tokens: int,
    heads: int,
    num_rows: int,
    width: int,
    head_dim: int = 512,
    lens: str = "random",
    hole_fraction: float = 0.1,
    sink: str | None = "random",
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> SparseCase:
    """Random rows ``[0, num_rows)`` per token, ``hole_fraction`` of them -1; ``lens`` is
    ``"full"`` (= width), ``"random"`` (uniform in [0, width], ends forced to 0 and width) or
    ``"zero"``. Entries past a token's length are random (never read)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=g)
    kv = torch.randn(num_rows, head_dim, generator=g)
    idx = torch.randint(0, num_rows, (tokens, width), generator=g)
    idx[torch.rand(tokens, width, generator=g) < hole_fraction] = -1
    if lens == "full":
        ln = torch.full((tokens,), width)
    elif lens == "zero":
        ln = torch.zeros(tokens, dtype=torch.int64)
    else:
        ln = torch.randint(0, width + 1, (tokens,), generator=g)
        if tokens >= 2:
            ln[0], ln[1] = 0, width
    return _case(q, kv, idx, ln, _sink(heads, sink, g, device), device)


def make_v4_sparse_case(
    tokens: int,
    heads: int,
    topk: int,
    window: int = 128,
    head_dim: int = 512,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> SparseCase:
    """DeepSeek-V4-style prefill: token ``t`` (0-based, one sequence) attends to the window rows
    ``max(0, t - window + 1) .. t`` (rows ``0 .. T-1`` of the workspace) and to ``topk`` distinct
    compressed rows (rows ``T ..``; ``T`` of them, so the picks spread like CSA's). Full lists are
    ``window + topk`` long; early tokens have shorter windows (holes fill the rest)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=g, device=device)
    num_compressed = max(topk, tokens)
    kv = torch.randn(tokens + num_compressed, head_dim, generator=g, device=device)
    t = torch.arange(tokens, device=device)[:, None]
    w = torch.arange(window, device=device)[None, :]
    win = t - (window - 1) + w  # ascending window positions
    win = torch.where(win >= 0, win, torch.full_like(win, -1))
    noise = torch.rand(tokens, num_compressed, generator=g, device=device)
    picks = torch.argsort(noise, dim=1)[:, :topk]
    idx = torch.cat([win, tokens + picks], dim=1)
    lens = torch.full((tokens,), window + topk, device=device)
    return _case(q, kv, idx, lens, _sink(heads, "random", g, device), device)


def make_hca_sparse_case(
    tokens: int,
    heads: int,
    context: int,
    window: int = 128,
    ratio: int = 128,
    head_dim: int = 512,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> SparseCase:
    """DeepSeek-V4 HCA prefill, as the backend lays it out: the last ``tokens`` positions of a
    ``context``-token sequence; token at position ``p`` sees every compressed entry ``e <
    (p + 1) // ratio`` (rows ``0 .. context // ratio``), then its window ``max(0, p - window + 1)
    .. p`` (rows after the entries: positions ``context - tokens - (window - 1) ..``), packed,
    -1 after."""
    g = torch.Generator(device=device).manual_seed(seed)
    entries = context // ratio
    first_window = max(0, context - tokens - (window - 1))
    q = torch.randn(tokens, heads, head_dim, generator=g, device=device)
    kv = torch.randn(entries + context - first_window, head_dim, generator=g, device=device)
    pos = torch.arange(context - tokens, context, device=device)[:, None]
    count = (pos + 1) // ratio
    start = (pos - (window - 1)).clamp(min=0)
    wlen = pos - start + 1
    col = torch.arange(entries + window, device=device)[None, :]
    from_window = col - count
    idx = torch.where(col < count, col, entries + start - first_window + from_window)
    idx = torch.where(from_window < wlen, idx, -1)
    return _case(q, kv, idx, (count + wlen)[:, 0], _sink(heads, "random", g, device), device)
