"""Per-token index lists (``indices [T, K]`` with ``lens [T]``), shared by the sparse-attention
entry points: their validation (every failure a ValueError naming the value and the range), and
the rule every backend applies to values it was not asked to check (:func:`counted_entries`)."""

from __future__ import annotations

import torch

__all__ = [
    "check_index_lists",
    "check_index_values",
    "counted_entries",
    "int32_lists",
    "sanitized_lists",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_name(t: object) -> str:
    return str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__


def check_index_lists(
    prefix: str, indices: object, lens: object, tokens: int, device: torch.device
) -> None:
    """Dtypes, shapes and device of ``indices [T, K]`` and ``lens [T]`` (no host sync).

    Every eager attention call runs this per scope, so the common case is one flat test
    (~1 us of host time); only a failing call walks the checks that name the bad value.
    """
    if (
        isinstance(indices, torch.Tensor)
        and isinstance(lens, torch.Tensor)
        and indices.dtype in _INDEX_DTYPES
        and lens.dtype in _INDEX_DTYPES
        and indices.dim() == 2
        and indices.shape[0] == tokens
        and lens.dim() == 1
        and lens.shape[0] == tokens
        and indices.device == device
        and lens.device == device
    ):
        return
    for name, t in (("indices", indices), ("lens", lens)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{prefix}{name} must be an int32/int64 tensor, got {_dtype_name(t)}")
    if indices.dim() != 2 or indices.shape[0] != tokens:
        raise ValueError(
            f"{prefix}indices must be [T={tokens}, K], got shape {tuple(indices.shape)}"
        )
    if lens.shape != (tokens,):
        raise ValueError(f"{prefix}lens must be [T={tokens}], got shape {tuple(lens.shape)}")
    for name, t in (("indices", indices), ("lens", lens)):
        if t.device != device:
            raise ValueError(f"{prefix}{name} is on {t.device} but q is on {device}")


def check_index_values(
    prefix: str,
    indices: torch.Tensor,
    lens: torch.Tensor,
    limit: int,
    what: str,
    shown_limit: str,
    note: str = "",
) -> None:
    """``lens`` in ``[0, K]`` and, within them, ``indices`` in ``[-1, limit)`` (a host sync).

    ``what`` names an id ("slot", "row"); the message spells the range ``[-1, shown_limit)``
    followed by ``note``.
    """
    if indices.shape[0] == 0:
        return
    width = indices.shape[1]
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0 or hi > width:
        raise ValueError(f"{prefix}lens must lie in [0, K={width}], got values from {lo} to {hi}")
    counted = torch.arange(width, device=indices.device)[None, :] < lens[:, None]
    bad = indices[counted & ((indices < -1) | (indices >= limit))]
    if bad.numel():
        raise ValueError(
            f"{prefix}indices hold {what} {int(bad[0])}: {what}s must lie in "
            f"[-1, {shown_limit}){note}, -1 meaning skip"
        )


def counted_entries(indices: torch.Tensor, lens: torch.Tensor, limit: int) -> torch.Tensor:
    """bool ``[T, K]``: the entries that count, whatever the values hold.

    The rule of ``check_values=False`` in every backend (kernels and fallbacks alike): a length
    outside ``[0, K]`` counts as clamped into it, and an id outside ``[0, limit)`` (-1, or any
    other) is a hole. Nothing is read for a hole, so no value makes a backend read outside its
    cache or rows; values that pass :func:`check_index_values` are unaffected.
    """
    width = indices.shape[1]
    within = torch.arange(width, device=indices.device)[None, :] < lens[:, None]
    return within & (indices >= 0) & (indices < limit)


def sanitized_lists(
    indices: torch.Tensor, lens: torch.Tensor, limit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`counted_entries` as lists that pass :func:`check_index_values` (what the float64
    reference takes): ids that do not count become -1, lengths are clamped into ``[0, K]``."""
    counted = counted_entries(indices, lens, limit)
    return torch.where(counted, indices, -1), lens.clamp(0, indices.shape[1])


def int32_lists(indices: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``indices [T, K]`` and ``lens [T]`` as int32, under the rule of :func:`counted_entries`
    (for kernels that read 32-bit words: an int64 id whose low word is a slot must not become
    that slot). An id outside int32's range becomes -1 (a hole: every cache has fewer than
    2^31 slots), a length outside ``[0, K]`` is clamped into it; int32 inputs come back as
    they are (no copy)."""
    if indices.dtype != torch.int32:
        info = torch.iinfo(torch.int32)
        inside = (indices >= info.min) & (indices <= info.max)
        indices = torch.where(inside, indices, -1).to(torch.int32)
    if lens.dtype != torch.int32:
        lens = lens.clamp(0, indices.shape[1]).to(torch.int32)
    return indices, lens
