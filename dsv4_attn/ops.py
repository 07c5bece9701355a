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

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from dsv4_attn import fallback, kv_cache, reference
from dsv4_attn.dispatch_log import log_fallback_once
from dsv4_attn.fmha_ops import check_output_tensor, fmha, sparse_prefill
from dsv4_attn.index_checks import check_index_lists, check_index_values, sanitized_lists
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.log import get_logger
from dsv4_attn.scope import KVScope

if TYPE_CHECKING:
    from dsv4_attn.kernels.sparse_decode_schedule import DecodeSchedule

__all__ = [
    "BACKENDS",
    "Dispatch",
    "KVScope",
    "fmha",
    "last_dispatch",
    "sparse_attention",
    "sparse_prefill",
]

logger = get_logger(__name__)

BACKENDS = ("auto", "cutedsl", "sdpa", "reference")
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Dispatch(NamedTuple):
    """What the latest :func:`sparse_attention` call in this process ran, and why."""

    backend: str  # "cutedsl", "sdpa" or "reference"
    fallback_reason: str | None  # why "auto" did not run the kernel; None otherwise


_last_dispatch: Dispatch | None = None
_KERNEL = Dispatch("cutedsl", None)


def last_dispatch() -> Dispatch | None:
    """The backend the latest :func:`sparse_attention` call ran (None before the first call)."""
    return _last_dispatch


def _checked_scope(
    name: str, scope: object, T: int, device: torch.device, check_values: bool
) -> KVScope:
    """``scope`` validated (ValueError naming ``name`` and the bad field), format parsed."""
    if not isinstance(scope, KVScope):
        raise ValueError(f"{name} must be a dsv4_attn.scope.KVScope, got {type(scope).__name__}")
    prefix = f"{name}."
    fmt = scope.fmt if scope.fmt.__class__ is KVFormat else KVFormat.parse(scope.fmt)
    block_size = scope.block_size
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"{prefix}block_size must be a positive int, got {block_size!r}")
    layout = kv_cache._page_layout(fmt, block_size)  # fmt and block_size are checked above
    try:
        kv_cache._check_cache(scope.cache, layout)
    except ValueError as exc:
        raise ValueError(f"{prefix}{exc}") from None
    if scope.cache.device != device:
        raise ValueError(f"{prefix}cache is on {scope.cache.device} but q is on {device}")
    check_index_lists(prefix, scope.indices, scope.lens, T, device)
    if check_values:
        _check_slot_values(name, scope)
    return scope if fmt is scope.fmt else dataclasses.replace(scope, fmt=fmt)


def _check_slot_values(name: str, scope: KVScope) -> None:
    """``scope``'s lengths in ``[0, K]`` and counted slot ids in ``[-1, num_slots)`` (a host
    sync); ValueError naming ``name`` otherwise."""
    num_slots = scope.cache.shape[0] * scope.block_size
    note = " (num_blocks * block_size)"
    check_index_values(
        f"{name}.", scope.indices, scope.lens, num_slots, "slot", str(num_slots), note
    )


def _validate(q, window, sink, scale, extra, out, lse, check_values):
    """The validated ``(window, extra)``; ValueError naming the first bad argument."""
    if not isinstance(q, torch.Tensor) or len(q.shape) != 3 or q.shape[2] != HEAD_DIM:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be [T, H, {HEAD_DIM}], got {got}")
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    T, H, _ = q.shape
    window = _checked_scope("window", window, T, q.device, check_values)
    if extra is not None:
        extra = _checked_scope("extra", extra, T, q.device, check_values)
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.shape != (H,):
            got = tuple(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__
            raise ValueError(f"sink must be [H={H}] or None, got {got}")
        if sink.device != q.device:
            raise ValueError(f"sink is on {sink.device} but q is on {q.device}")
    if not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    check_output_tensor("out", out, (T, H, HEAD_DIM), torch.bfloat16, q.device)
    check_output_tensor("lse", lse, (T, H), torch.float32, q.device)
    return window, extra


@functools.cache
def _sparse_decode():
    """The CuTeDSL sparse-decode interface module, or the reason it cannot be imported (asked
    once per process)."""
    try:
        from dsv4_attn.kernels import sparse_decode
    except ImportError as exc:
        return f"the CuTeDSL sparse-decode kernel is unavailable ({exc})"
    return sparse_decode


def _cutedsl_unsupported_reason(q, window, sink, extra) -> str | None:
    """Why the CuTeDSL kernel cannot run this case, or None."""
    kernel = _sparse_decode()
    if isinstance(kernel, str):
        return kernel
    return kernel.unsupported_reason(q, window, sink, extra)


def _reference_on_cache(q, window, sink, scale, extra) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the float64 reference on the dequantized rows the indices touch."""

    def rows_and_local_ids(scope: KVScope):
        num_slots = scope.cache.shape[0] * scope.block_size
        slots, lens = sanitized_lists(scope.indices, scope.lens, num_slots)
        unique, local = torch.unique(slots, return_inverse=True)
        rows = kv_cache.read_unchecked(scope.cache, unique, scope.fmt, scope.block_size)
        local = torch.where(slots >= 0, local, torch.full_like(local, -1))
        return rows, local, lens

    kv, local, lens = rows_and_local_ids(window)
    extra_args = rows_and_local_ids(extra) if extra is not None else (None, None, None)
    out, lse = reference.sparse_attention(q, kv, local, lens, sink, scale, *extra_args)
    return out.to(torch.bfloat16), lse.to(torch.float32)


def _into(out, lse, result):
    """Copy ``result`` into the caller's ``out``/``lse`` where given; return what the caller
    gets back."""
    res_out, res_lse = result
    if out is not None:
        out.copy_(res_out)
        res_out = out
    if lse is not None:
        lse.copy_(res_lse)
        res_lse = lse
    return res_out, res_lse


def sparse_attention(
    q: torch.Tensor,
    window: KVScope,
    sink: torch.Tensor | None,
    scale: float,
    extra: KVScope | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
    check_values: bool = True,
    plan: DecodeSchedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 sparse MQA with a sink, reading KV rows straight from paged caches.

    Every query token attends, in one softmax with the sink, to the rows of its window scope and
    (optionally) of its extra scope (the compressed entries).

    Args:
        q: ``[T, H, 512]`` queries (bf16; fp16/fp32 accepted). Spec-decode tokens are just rows.
        window: the first candidate list (the sliding window), a :class:`KVScope`.
        sink: ``[H]`` per-head sink logits (float32), or None.
        scale: softmax scale (``512 ** -0.5`` for DeepSeek-V4).
        extra: the optional second list (compressed entries), in its own format: DeepSeek-V4.1's
            ``nvfp4_ds_mla`` keeps the window in ``mxfp8_ds`` and the compressed entries in
            ``nvfp4_ds``. Two formats in one call run on the fallback (the kernel reads one).
        out, lse: bf16 ``[T, H, 512]`` and fp32 ``[T, H]`` tensors to write into, in place
            (the kernel writes them directly; the fallbacks copy).
        workspace: the kernel's split-KV partials, two tensors of
            :data:`dsv4_attn.kernels.sparse_decode.WORKSPACE_DTYPES` (fp16 rows, fp32 pairs)
            shaped as :func:`dsv4_attn.kernels.sparse_decode.workspace_shapes` says (allocated
            per call when omitted; ignored by the fallbacks).
        backend: ``"auto"``, ``"cutedsl"``, ``"sdpa"`` or ``"reference"``.
        check_values: also check index and length *values* (costs a device sync on CUDA).
            Shapes, dtypes and devices are always checked. Unchecked values are safe: every
            backend counts a length outside ``[0, K]`` as clamped into it and treats a slot id
            outside the cache as a hole (:func:`~dsv4_attn.index_checks.counted_entries`).
        plan: the kernel's balanced schedule for exactly these key counts
            (:func:`dsv4_attn.kernels.sparse_decode_schedule.balanced_plan`, made once per
            step); the workspace then holds its partial slots
            (:func:`~dsv4_attn.kernels.sparse_decode_schedule.balanced_workspace_shape`). The
            fallbacks ignore it (same result, other work split).

    Returns:
        ``(out, lse)``: ``out`` bf16 ``[T, H, 512]``; ``lse`` float32 ``[T, H]``, natural log over
        both scopes, excluding the sink; ``-inf`` (and ``out = 0``) where no key is valid.
    """
    global _last_dispatch
    if backend == "auto" or backend == "cutedsl":
        kernel = _sparse_decode()
        # The serving layer's case in one flat test; anything else takes the checks below.
        if kernel.__class__ is not str and kernel.is_common_case(
            q, window, sink, scale, extra, out, lse
        ):
            if check_values:
                _check_slot_values("window", window)
                if extra is not None:
                    _check_slot_values("extra", extra)
            _last_dispatch = _KERNEL
            return kernel.sparse_attention(
                q, window, sink, scale, extra, out=out, lse=lse, workspace=workspace, plan=plan
            )
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    window, extra = _validate(q, window, sink, scale, extra, out, lse, check_values)
    if backend == "reference":
        _last_dispatch = Dispatch("reference", None)
        return _into(out, lse, _reference_on_cache(q, window, sink, scale, extra))
    reason = None
    if backend in ("auto", "cutedsl"):
        reason = _cutedsl_unsupported_reason(q, window, sink, extra)
        if reason is None:
            _last_dispatch = _KERNEL
            return _sparse_decode().sparse_attention(
                q, window, sink, scale, extra, out=out, lse=lse, workspace=workspace, plan=plan
            )
        if backend == "cutedsl":
            raise ValueError(f"backend='cutedsl' cannot run this case: {reason}")
        log_fallback_once(logger, "sparse_attention", reason)
    _last_dispatch = Dispatch("sdpa", reason)
    return _into(out, lse, fallback.sparse_attention(q, window, sink, scale, extra))
