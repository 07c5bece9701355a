"""Public entry points: DeepSeek-V4 sparse attention over a paged KV cache.

:func:`sparse_attention` validates its inputs, then runs one of three backends:

* ``"cutedsl"`` — the Hopper (sm_90a) CuTeDSL kernel (``dsv4_attn.kernels``), where it exists and
  supports the case;
* ``"sdpa"`` — the batched torch fallback (:mod:`dsv4_attn.fallback`), any device;
* ``"reference"`` — the float64 reference (:mod:`dsv4_attn.reference`) on the dequantized rows.

``"auto"`` picks the kernel where it supports the case and otherwise the fallback, and logs the
reason for falling back once per distinct reason.

The prefill family, :func:`fmha` (dense) and :func:`sparse_prefill` (index-gathered bf16 rows),
lives in :mod:`dsv4_attn.fmha_ops` and is re-exported here.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from dsv4_attn import fallback, kv_cache, reference
from dsv4_attn.dispatch_log import log_fallback_once
from dsv4_attn.fmha_ops import fmha, sparse_prefill
from dsv4_attn.index_checks import check_index_lists, check_index_values
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat

__all__ = ["BACKENDS", "Dispatch", "fmha", "last_dispatch", "sparse_attention", "sparse_prefill"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cutedsl", "sdpa", "reference")


class Dispatch(NamedTuple):
    """What the latest :func:`sparse_attention` call in this process ran, and why."""

    backend: str  # "cutedsl", "sdpa" or "reference"
    fallback_reason: str | None  # why "auto" did not run the kernel; None otherwise


_last_dispatch: Dispatch | None = None


def last_dispatch() -> Dispatch | None:
    """The backend the latest :func:`sparse_attention` call ran (None before the first call)."""
    return _last_dispatch


def _check_block_size(name: str, block_size: object) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"{name} must be a positive int, got {block_size!r}")
    return block_size


def _check_scope(
    prefix: str,
    cache: torch.Tensor,
    fmt: KVFormat,
    block_size: int,
    indices: torch.Tensor,
    lens: torch.Tensor,
    T: int,
    device: torch.device,
    check_values: bool,
) -> None:
    layout = kv_cache.page_layout(fmt, block_size)
    kv_cache._check_cache(cache, layout)
    if cache.device != device:
        raise ValueError(f"{prefix}cache is on {cache.device} but q is on {device}")
    check_index_lists(prefix, indices, lens, T, device)
    if check_values:
        num_slots = cache.shape[0] * block_size
        note = " (num_blocks * block_size)"
        check_index_values(prefix, indices, lens, num_slots, "slot", str(num_slots), note)


def _validate(
    q,
    cache,
    fmt,
    block_size,
    indices,
    lens,
    sink,
    scale,
    extra_cache,
    extra_block_size,
    extra_indices,
    extra_lens,
    check_values,
) -> None:
    """Raise ValueError naming the first bad argument."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != HEAD_DIM:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be [T, H, {HEAD_DIM}], got {got}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    T, H, _ = q.shape
    _check_block_size("block_size", block_size)
    _check_scope("", cache, fmt, block_size, indices, lens, T, q.device, check_values)
    given = [x is not None for x in (extra_cache, extra_block_size, extra_indices, extra_lens)]
    if any(given) and not all(given):
        raise ValueError(
            "extra_cache, extra_block_size, extra_indices and extra_lens must be given together"
        )
    if all(given):
        _check_block_size("extra_block_size", extra_block_size)
        _check_scope(
            "extra_",
            extra_cache,
            fmt,
            extra_block_size,
            extra_indices,
            extra_lens,
            T,
            q.device,
            check_values,
        )
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.shape != (H,):
            got = tuple(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__
            raise ValueError(f"sink must be [H={H}] or None, got {got}")
        if sink.device != q.device:
            raise ValueError(f"sink is on {sink.device} but q is on {q.device}")
    if not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")


def _cutedsl_unsupported_reason(args: tuple) -> str | None:
    """Why the CuTeDSL kernel cannot run this case (``args`` as for the kernel), or None."""
    try:
        from dsv4_attn.kernels import sparse_decode
    except ImportError as exc:
        return f"the CuTeDSL sparse-decode kernel is unavailable ({exc})"
    return sparse_decode.unsupported_reason(*args)


def _reference_on_cache(
    q,
    cache,
    fmt,
    block_size,
    indices,
    lens,
    sink,
    scale,
    extra_cache,
    extra_block_size,
    extra_indices,
    extra_lens,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the float64 reference on the dequantized rows the indices touch."""

    def rows_and_local_ids(cache_, block_size_, indices_, lens_):
        K = indices_.shape[1]
        counted = torch.arange(K, device=indices_.device)[None, :] < lens_[:, None]
        slots = torch.where(counted, indices_, torch.full_like(indices_, -1))
        unique, local = torch.unique(slots, return_inverse=True)
        rows = kv_cache.read_unchecked(cache_, unique, fmt, block_size_)
        local = torch.where(slots >= 0, local, torch.full_like(local, -1))
        return rows, local, lens_

    kv, local, lens_ = rows_and_local_ids(cache, block_size, indices, lens)
    extra = (None, None, None)
    if extra_cache is not None:
        extra = rows_and_local_ids(extra_cache, extra_block_size, extra_indices, extra_lens)
    out, lse = reference.sparse_attention(q, kv, local, lens_, sink, scale, *extra)
    return out.to(torch.bfloat16), lse.to(torch.float32)


def sparse_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    fmt: KVFormat | str,
    block_size: int,
    indices: torch.Tensor,
    lens: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    extra_cache: torch.Tensor | None = None,
    extra_block_size: int | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    backend: str = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 sparse MQA with a sink, reading KV rows straight from a paged cache.

    Args:
        q: ``[T, H, 512]`` queries (bf16; fp16/fp32 accepted). Spec-decode tokens are just rows.
        cache: ``uint8 [num_blocks, >= page_bytes]`` paged cache in format ``fmt``
            (:mod:`dsv4_attn.kv_cache` documents the byte layout).
        fmt: :class:`~dsv4_attn.kv_cache.KVFormat` (or its name) of both caches.
        block_size: tokens per page of ``cache``.
        indices: ``int32/int64 [T, K]`` cache slot ids (``block * block_size + offset``); -1 = hole.
        lens: ``int [T]``; only the first ``lens[t]`` entries of ``indices[t]`` count.
        sink: ``[H]`` per-head sink logits (float32), or None.
        scale: softmax scale (``512 ** -0.5`` for DeepSeek-V4).
        extra_cache, extra_block_size, extra_indices, extra_lens: the optional second scope
            (compressed entries), joining the same softmax. Give all four or none.
        backend: ``"auto"``, ``"cutedsl"``, ``"sdpa"`` or ``"reference"``.
        check_values: also check index and length *values* (costs a device sync on CUDA).
            Shapes, dtypes and devices are always checked.

    Returns:
        ``(out, lse)``: ``out`` bf16 ``[T, H, 512]``; ``lse`` float32 ``[T, H]``, natural log over
        both scopes, excluding the sink; ``-inf`` (and ``out = 0``) where no key is valid.
    """
    fmt = KVFormat.parse(fmt)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    args = (
        q,
        cache,
        fmt,
        block_size,
        indices,
        lens,
        sink,
        scale,
        extra_cache,
        extra_block_size,
        extra_indices,
        extra_lens,
    )
    _validate(*args, check_values)
    global _last_dispatch
    if backend == "reference":
        _last_dispatch = Dispatch("reference", None)
        return _reference_on_cache(*args)
    reason = None
    if backend in ("auto", "cutedsl"):
        reason = _cutedsl_unsupported_reason(args)
        if reason is None:
            from dsv4_attn.kernels import sparse_decode

            _last_dispatch = Dispatch("cutedsl", None)
            return sparse_decode.sparse_attention(*args)
        if backend == "cutedsl":
            raise ValueError(f"backend='cutedsl' cannot run this case: {reason}")
        log_fallback_once(logger, "sparse_attention", reason)
    _last_dispatch = Dispatch("sdpa", reason)
    return fallback.sparse_attention(*args)
