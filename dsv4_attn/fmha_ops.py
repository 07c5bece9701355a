"""Public prefill attention: dense :func:`fmha` and gathered :func:`sparse_prefill`.

Each validates its inputs (``ValueError`` naming the bad value and the accepted range), then runs
one backend:

* ``"cutedsl"`` — the Hopper CuTeDSL kernel (:mod:`dsv4_attn.kernels.fmha`);
* ``"sdpa"`` — the torch fallback in this module (any device; chunked float32 matmuls);
* ``"reference"`` — the float64 references (slow; for tests).

``"auto"`` takes the kernel where it supports the case, else the fallback, and logs the reason
for falling back once per distinct reason.

Conventions: ``lse`` is the natural-log sum of ``exp(scale * <q, k>)`` over the visible keys,
sink excluded, ``-inf`` (with ``out = 0``) where no key is visible; a sink ``s_h`` scales the
output by ``sigmoid(lse - s_h)``. Causal masks are bottom-right aligned (query ``i`` of ``Sq``
sees key ``j`` of ``Sk`` iff ``j <= i + Sk - Sq``); ``window = w`` keeps the ``w`` most recent of
those keys (``j > i + Sk - Sq - w``) and needs ``causal=True``.
"""

from __future__ import annotations

import math

import torch

from dsv4_attn import reference
from dsv4_attn.dispatch_log import log_fallback_once
from dsv4_attn.index_checks import (
    check_index_lists,
    check_index_values,
    counted_entries,
    int32_lists,
    sanitized_lists,
)
from dsv4_attn.log import get_logger

__all__ = ["BACKENDS", "check_output_tensor", "fmha", "sparse_prefill"]

logger = get_logger(__name__)

BACKENDS = ("auto", "cutedsl", "sdpa", "reference")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Bound on float32 score elements per fallback chunk (32 M elements = 128 MB).
_CHUNK_ELEMS = 1 << 25


# ----------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------
def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def _check_sink(sink: object, heads: int, device: torch.device) -> None:
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor) or sink.shape != (heads,):
        raise ValueError(f"sink must be a [H={heads}] tensor or None, got {_shape(sink)}")
    if not sink.is_floating_point():
        raise ValueError(f"sink must be a float tensor, got {sink.dtype}")
    if sink.device != device:
        raise ValueError(f"sink is on {sink.device} but q is on {device}")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_cu_seqlens(name: str, cu: object, total: int, device: torch.device, check_values: bool):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be a 1-D [B + 1] tensor, got {_shape(cu)}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if check_values:
        first, last = int(cu[0]), int(cu[-1])
        if first != 0 or last != total:
            raise ValueError(f"{name} must run from 0 to {total}, got {first} .. {last}")
        if cu.shape[0] > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing")


# ----------------------------------------------------------------------------------------------
# Dense attention
# ----------------------------------------------------------------------------------------------
def _validate_dense(
    q, k, v, causal, window, sink, scale, cu_seqlens_q, cu_seqlens_k, check_values
) -> tuple[bool, float]:
    """Raise ValueError on bad input; return (packed, scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                "with cu_seqlens, q/k/v must be [total, heads, dim], got "
                f"{_shape(q)}, {_shape(k)}, {_shape(v)}"
            )
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same rows, got {k.shape[0]} and {v.shape[0]}")
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, check_values)
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, check_values)
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(
                "cu_seqlens_q and cu_seqlens_k must both be [B + 1], got "
                f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
            )
    else:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                f"q/k/v must be [B, S, heads, dim], got {_shape(q)}, {_shape(k)}, {_shape(v)}"
            )
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            raise ValueError(
                f"q, k, v batch sizes differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
            )
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have the same length, got {k.shape[1]}, {v.shape[1]}")
    heads, dim = q.shape[-2], q.shape[-1]
    heads_kv = k.shape[-2]
    if k.shape[-1] != dim:
        raise ValueError(f"k head_dim must equal q's ({dim}), got {k.shape[-1]}")
    if v.shape[-2] != heads_kv:
        raise ValueError(f"v must have k's {heads_kv} heads, got {v.shape[-2]}")
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({heads_kv})")
    if dim < 1 or v.shape[-1] < 1:
        raise ValueError(f"head dims must be positive, got {dim} and {v.shape[-1]}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if not causal:
            raise ValueError("window needs causal=True (it keeps the most recent visible keys)")
    _check_sink(sink, heads, q.device)
    return packed, _check_scale(scale, dim)


def _dense_torch(q, k, v, cu_q, cu_k, causal, window, sink, scale):
    """Torch fallback on packed ``[total, heads, dim]`` tensors: float32 matmuls, chunked.

    Returns ``out`` (q's dtype) ``[total_q, H, Dv]`` and ``lse`` float32 ``[total_q, H]``.
    """
    total_q, heads, _ = q.shape
    heads_kv, dim_v = v.shape[1], v.shape[2]
    group = heads // heads_kv
    out = torch.zeros(total_q, heads, dim_v, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, heads), -math.inf, dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        sq, sk = q1 - q0, k1 - k0
        if sq == 0 or sk == 0:
            continue
        kb = k[k0:k1].float().permute(1, 2, 0)  # [Hk, D, Sk]
        vb = v[k0:k1].float().transpose(0, 1)  # [Hk, Sk, Dv]
        visible = reference.visible_mask(sq, sk, causal, window, device=q.device)
        rows = max(1, _CHUNK_ELEMS // (heads * sk))
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            n = r1 - r0
            # [Hk, group * n, D]: query heads of one KV head stacked along rows.
            qc = q[q0 + r0 : q0 + r1].float().reshape(n, heads_kv, group, -1)
            qc = qc.permute(1, 2, 0, 3).reshape(heads_kv, group * n, -1)
            scores = torch.bmm(qc, kb) * scale  # [Hk, group * n, Sk]
            scores = scores.view(heads_kv, group, n, sk).masked_fill(~visible[r0:r1], -math.inf)
            chunk_lse = torch.logsumexp(scores, dim=-1)  # [Hk, group, n]
            shift = torch.where(torch.isfinite(chunk_lse), chunk_lse, torch.zeros_like(chunk_lse))
            probs = torch.exp(scores - shift[..., None]).view(heads_kv, group * n, sk)
            o = torch.bmm(probs, vb).view(heads_kv, group, n, dim_v)
            if sink is not None:
                s = sink.float().view(heads_kv, group, 1)
                factor = torch.sigmoid(chunk_lse - s)
                factor = torch.where(torch.isfinite(chunk_lse), factor, torch.zeros_like(factor))
                o = o * factor[..., None]
            out[q0 + r0 : q0 + r1] = o.permute(2, 0, 1, 3).reshape(n, heads, dim_v).to(q.dtype)
            lse[q0 + r0 : q0 + r1] = chunk_lse.permute(2, 0, 1).reshape(n, heads)
    return out, lse


_CU_CACHE: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _uniform_cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    key = (batch, seqlen, device)
    if key not in _CU_CACHE:
        _CU_CACHE[key] = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * seqlen
    return _CU_CACHE[key]


def fmha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    backend: str = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention (MHA / GQA / MQA) with causal or sliding-window masks and a sink.

    Args:
        q: ``[B, Sq, H, D]``, or ``[total_q, H, D]`` with ``cu_seqlens_q`` (bf16 for the kernel;
            fp16/fp32 run on the fallback).
        k: ``[B, Sk, Hk, D]`` or ``[total_k, Hk, D]``; ``H`` a multiple of ``Hk``.
        v: like ``k`` with head dim ``Dv``. The kernel needs ``Dv == D`` in
            {64, 128, 192, 256, 512}; at 512 it needs ``v`` to be ``k`` (MQA latent).
        causal: bottom-right aligned causal mask.
        window: keep only the ``window`` most recent visible keys (needs ``causal``).
        sink: ``[H]`` per-head sink logits (float) or None.
        scale: softmax scale, default ``D ** -0.5``.
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32/int64 cumulative offsets (packed layout).
        max_seqlen_q: longest query sequence (packed layout), at least the true maximum;
            computed (a device sync) if None.
        backend: ``"auto"``, ``"cutedsl"``, ``"sdpa"`` (torch fallback) or ``"reference"``.
        check_values: also check ``cu_seqlens`` values (a device sync on CUDA).

    Returns:
        ``(out, lse)``: ``out`` like ``q`` with head dim ``Dv`` (q's dtype); ``lse`` float32,
        ``q``'s shape without the head dim.
    """
    _check_backend(backend)
    packed, scale = _validate_dense(
        q, k, v, causal, window, sink, scale, cu_seqlens_q, cu_seqlens_k, check_values
    )
    if backend == "reference":
        out, lse = reference.dense_attention(
            q, k, v, causal, window, sink, scale, cu_seqlens_q, cu_seqlens_k
        )
        return out.to(q.dtype), lse.to(torch.float32)

    # Work on the packed layout; remember how to restore the caller's.
    same_kv = k is v
    if packed:
        qp, kp, vp = q, k, v
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
        if max_seqlen_q is None or check_values:
            lens = cu_q[1:] - cu_q[:-1]
            longest = int(lens.max()) if lens.numel() else 0
            if max_seqlen_q is None:
                max_seqlen_q = longest
            elif max_seqlen_q < longest:
                raise ValueError(
                    f"max_seqlen_q ({max_seqlen_q}) is below the longest query sequence ({longest})"
                )
    else:
        batch, sq, heads, dim = q.shape
        sk = k.shape[1]
        qp = q.reshape(batch * sq, heads, dim)
        kp = k.reshape(batch * sk, k.shape[2], k.shape[3])
        vp = kp if same_kv else v.reshape(batch * sk, v.shape[2], v.shape[3])
        cu_q = _uniform_cu_seqlens(batch, sq, q.device)
        cu_k = _uniform_cu_seqlens(batch, sk, q.device)
        max_seqlen_q = sq

    out = lse = None
    if backend in ("auto", "cutedsl"):
        reason = _dense_kernel_reason(qp, kp, vp, cu_q, causal, window)
        if reason is None:
            from dsv4_attn.kernels import fmha as kernel

            out, lse = kernel.run_dense(
                qp,
                kp,
                vp,
                cu_q.to(torch.int32),
                cu_k.to(torch.int32),
                max_seqlen_q,
                causal,
                window,
                sink,
                scale,
            )
        elif backend == "cutedsl":
            raise ValueError(f"backend='cutedsl' cannot run this case: {reason}")
        else:
            log_fallback_once(logger, "fmha", reason)
    if out is None:
        out, lse = _dense_torch(qp, kp, vp, cu_q, cu_k, causal, window, sink, scale)
    if not packed:
        out = out.view(*q.shape[:-1], v.shape[-1])
        lse = lse.view(q.shape[:-1])
    return out, lse


def _dense_kernel_reason(q, k, v, cu_q, causal, window) -> str | None:
    if q.shape[0] == 0 or k.shape[0] == 0 or q.shape[1] == 0:
        return "empty problem (no queries, keys or heads)"
    if cu_q.shape[0] - 1 > 65535:
        return f"more than 65535 sequences ({cu_q.shape[0] - 1})"
    try:
        from dsv4_attn.kernels import fmha as kernel
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"the CuTeDSL FMHA kernel is unavailable ({exc})"
    return kernel.dense_unsupported_reason(q, k, v, causal, window)


# ----------------------------------------------------------------------------------------------
# Sparse prefill
# ----------------------------------------------------------------------------------------------
def _validate_sparse(q, kv, indices, lens, sink, scale, check_values) -> float:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {_shape(q)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    tokens, heads, dim = q.shape
    if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[1] != dim:
        raise ValueError(f"kv must be [N, D={dim}], got {_shape(kv)}")
    if kv.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"kv must be bfloat16, float16 or float32, got {kv.dtype}")
    if kv.device != q.device:
        raise ValueError(f"kv is on {kv.device} but q is on {q.device}")
    check_index_lists("", indices, lens, tokens, q.device)
    _check_sink(sink, heads, q.device)
    scale = _check_scale(scale, dim)
    if check_values:
        rows = kv.shape[0]
        check_index_values("", indices, lens, rows, "row", f"N={rows}")
    return scale


def _sparse_torch(q, kv, indices, lens, sink, scale):
    """Torch fallback: gather the rows of a chunk of tokens, float32 batched matmuls."""
    tokens, heads, dim = q.shape
    width = indices.shape[1]
    out = torch.zeros(tokens, heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float32, device=q.device)
    per_chunk = max(1, _CHUNK_ELEMS // max(1, width * max(dim, heads)))
    for t0 in range(0, tokens, per_chunk):
        t1 = min(tokens, t0 + per_chunk)
        idx = indices[t0:t1]
        valid = counted_entries(idx, lens[t0:t1], kv.shape[0])
        rows = kv[torch.where(valid, idx, torch.zeros_like(idx)).long()].float()  # [t, K, D]
        scores = torch.bmm(q[t0:t1].float(), rows.transpose(1, 2)) * scale  # [t, H, K]
        scores = scores.masked_fill(~valid[:, None, :], -math.inf)
        chunk_lse = torch.logsumexp(scores, dim=-1)
        shift = torch.where(torch.isfinite(chunk_lse), chunk_lse, torch.zeros_like(chunk_lse))
        o = torch.bmm(torch.exp(scores - shift[..., None]), rows)
        if sink is not None:
            factor = torch.sigmoid(chunk_lse - sink.float()[None, :])
            factor = torch.where(torch.isfinite(chunk_lse), factor, torch.zeros_like(factor))
            o = o * factor[..., None]
        out[t0:t1] = o.to(q.dtype)
        lse[t0:t1] = chunk_lse
    return out, lse


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    check_values: bool = True,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA prefill: each query token attends to its own list of KV rows.

    DeepSeek-V4 prefill gathers each token's window and compressed rows into a bf16 workspace
    ``kv`` and lists them in ``indices``. K and V are the same row.

    Args:
        q: ``[T, H, 512]`` queries (bf16 for the kernel).
        kv: ``[N, 512]`` rows, each both key and value.
        indices: ``[T, K]`` int32/int64 row ids into ``kv``; -1 = skip.
        lens: ``[T]`` int; only the first ``lens[t]`` entries of ``indices[t]`` count.
        sink: ``[H]`` per-head sink logits (float) or None.
        scale: softmax scale, default ``512 ** -0.5``.
        backend: ``"auto"``, ``"cutedsl"``, ``"sdpa"`` (torch fallback) or ``"reference"``.
        check_values: also check index and length values (a device sync on CUDA). Unchecked
            values are safe: a length outside ``[0, K]`` counts as clamped into it and a row id
            outside ``kv`` is a hole (:func:`~dsv4_attn.index_checks.counted_entries`).
        out: ``[T, H, 512]`` in q's dtype, contiguous: written in place and returned.
        lse: ``[T, H]`` float32, contiguous: written in place and returned (a serving layer
            passes a view of its workspace, so nothing is allocated per call).

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, 512]`` in q's dtype, ``lse`` float32 ``[T, H]``.
    """
    _check_backend(backend)
    scale = _validate_sparse(q, kv, indices, lens, sink, scale, check_values)
    check_output_tensor("out", out, tuple(q.shape), q.dtype, q.device)
    check_output_tensor("lse", lse, tuple(q.shape[:2]), torch.float32, q.device)
    if backend == "reference":
        result, result_lse = reference.sparse_attention(
            q, kv, *sanitized_lists(indices, lens, kv.shape[0]), sink, scale
        )
        return _into(out, result.to(q.dtype)), _into(lse, result_lse.to(torch.float32))
    if backend in ("auto", "cutedsl"):
        reason = _sparse_kernel_reason(q, kv, indices)
        if reason is None:
            from dsv4_attn.kernels import fmha as kernel

            idx32, lens32 = int32_lists(indices, lens)  # the kernel reads 32-bit words
            return kernel.run_sparse(
                q, kv, idx32.contiguous(), lens32.contiguous(), sink, scale, out=out, lse=lse
            )
        if backend == "cutedsl":
            raise ValueError(f"backend='cutedsl' cannot run this case: {reason}")
        log_fallback_once(logger, "sparse_prefill", reason)
    result, result_lse = _sparse_torch(q, kv, indices, lens, sink, scale)
    return _into(out, result), _into(lse, result_lse)


def check_output_tensor(
    name: str, tensor: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """A caller's output tensor (or None) must be exactly what the kernel writes: a contiguous
    ``shape`` tensor of ``dtype`` on ``device``; ValueError naming ``name`` and both otherwise.
    Shared by every entry point that writes into given tensors."""
    if tensor is not None and (
        not isinstance(tensor, torch.Tensor)
        or tensor.shape != shape
        or tensor.dtype != dtype
        or tensor.device != device
        or not tensor.is_contiguous()
    ):
        got = type(tensor).__name__
        if isinstance(tensor, torch.Tensor):
            got = f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
            got += "" if tensor.is_contiguous() else " (not contiguous)"
        raise ValueError(
            f"{name} must be a contiguous {shape} {dtype} tensor on {device}, got {got}"
        )


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def _sparse_kernel_reason(q, kv, indices) -> str | None:
    if q.shape[0] == 0 or q.shape[1] == 0:
        return "empty problem (no tokens or heads)"
    if kv.shape[0] == 0:
        return "kv has no rows"
    if kv.shape[0] >= 2**31:
        return f"kv has {kv.shape[0]} rows, more than int32 indices address"
    try:
        from dsv4_attn.kernels import fmha as kernel
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"the CuTeDSL FMHA kernel is unavailable ({exc})"
    return kernel.sparse_unsupported_reason(q, kv, indices)
