"""Random sparse-decode problems over paged caches, shared by tests and benchmarks.

A :class:`DecodeCase` is a ready argument set for :func:`dsv4_attn.ops.sparse_attention`: a window
scope over a SWA cache and (optionally) an extra scope over a compressed cache, both filled with
random rows, random queries, and per token slot lists in the shape DeepSeek-V4 decode produces them
(a window of up to 128 slots, then compressed slots), with holes (-1) and lengths as asked.
Values are random normal, never zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dsv4_attn import kv_cache
from dsv4_attn.index_checks import sanitized_lists
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.scope import KVScope

__all__ = [
    "DecodeCase",
    "assert_rows_close",
    "make_decode_case",
    "poison_lists",
    "poisoned_scope",
    "random_cache",
    "random_rows",
]

_FILL_CHUNK = 1 << 16  # rows generated and written at a time


def assert_rows_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: float,
    *,
    floor: float = 1e-3,
    name: str = "output",
) -> None:
    """Every row (the last dimension) of ``actual`` within ``tol`` of ``expected``'s, relative:

        ||actual_r - expected_r|| <= tol * max(||expected_r||, floor * rms_r ||expected_r||)

    A whole-tensor relative error hides a wrong row (one zeroed (token, head) row of a
    ``[128, 128, 512]`` output moves it by under 1%); this bounds each row by its own norm.
    ``floor`` keeps rows whose reference is tiny against the others (a sink near +inf) from
    demanding more than the output dtype holds; a row whose reference and floor are both zero
    must match exactly. NaN anywhere fails. The message names the worst row's index, its error
    and norm, and how many rows fail.

    Args:
        actual, expected: same shape ``[..., D]``, any float dtype (compared in float64 on
            ``expected``'s device).
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} differs from the reference's "
            f"{tuple(expected.shape)}"
        )
    if expected.numel() == 0:
        return
    ref = expected.to(torch.float64)
    got = actual.to(device=ref.device, dtype=torch.float64)
    err = (got - ref).norm(dim=-1)
    ref_norm = ref.norm(dim=-1)
    rms = ref_norm.square().mean().sqrt()
    bound = tol * torch.clamp(ref_norm, min=float(floor * rms))
    bad = ~(err <= bound)  # NaN fails
    if bad.any():
        ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, torch.inf, 0.0))
        ratio = torch.where(torch.isnan(err), torch.inf, ratio)
        worst = int(ratio.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {err.numel()} rows past the relative bound {tol:g}; "
            f"worst row {index}: error {float(err.flatten()[worst]):.3g}, reference norm "
            f"{float(ref_norm.flatten()[worst]):.3g}"
        )


def random_rows(n: int, generator: torch.Generator, device: torch.device | str = "cpu"):
    """bf16 ``[n, 512]`` rows shaped like DeepSeek-V4 KV rows after RMSNorm: nope values with a
    per-channel spread of magnitudes, RoPE values of order 1."""
    on = generator.device  # drawn where the generator lives, then moved
    channel_scale = torch.exp(torch.randn(HEAD_DIM, generator=generator, device=on) * 0.5)
    rows = torch.randn(n, HEAD_DIM, generator=generator, device=on) * channel_scale
    return rows.to(device=device, dtype=torch.bfloat16)


def random_cache(
    num_rows: int,
    block_size: int,
    fmt: KVFormat,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A paged cache (``uint8 [num_blocks, page_bytes]``) of at least ``num_rows`` rows of
    ``block_size`` per page, every slot holding one of :func:`random_rows`."""
    num_blocks = max(1, -(-num_rows // block_size))
    cache = kv_cache.allocate(num_blocks, block_size, fmt, device=device)
    total = num_blocks * block_size
    for start in range(0, total, _FILL_CHUNK):
        slots = torch.arange(start, min(total, start + _FILL_CHUNK))
        kv_cache.write(
            cache, slots.to(device), random_rows(len(slots), generator, device), fmt, block_size
        )
    return cache


@dataclass
class DecodeCase:
    q: torch.Tensor  # bf16 [T, H, 512]
    window: KVScope  # int32 indices [T, window]
    sink: torch.Tensor | None  # float32 [H]
    scale: float
    extra: KVScope | None = None  # int32 indices [T, K_extra]

    def args(self) -> tuple:
        """Positional arguments for ``ops.sparse_attention``."""
        return (self.q, self.window, self.sink, self.scale, self.extra)

    @property
    def fmt(self) -> KVFormat:
        return self.window.fmt

    @property
    def num_keys(self) -> int:
        """Valid (non-hole, within-length) keys over all tokens and both scopes."""

        def count(scope: KVScope | None) -> int:
            if scope is None:
                return 0
            k = torch.arange(scope.capacity, device=scope.indices.device)
            return int(((k[None, :] < scope.lens[:, None]) & (scope.indices >= 0)).sum())

        return count(self.window) + count(self.extra)


def _slot_lists(
    T: int,
    width: int,
    rows_per_token: int,
    num_slots: int,
    hole_rate: float,
    gen: torch.Generator,
    distinct: bool,
) -> torch.Tensor:
    """Slot ids ``[T, width]``: token t's rows in its own range when ``distinct`` (like separate
    requests, so every key is a separate read), else drawn from the whole cache."""
    if distinct:
        base = (torch.arange(T) * rows_per_token)[:, None]
        offsets = torch.stack(
            [torch.randperm(rows_per_token, generator=gen)[:width] for _ in range(T)]
        )
        slots = base + offsets
    else:
        slots = torch.randint(0, num_slots, (T, width), generator=gen)
    if hole_rate > 0:
        slots[torch.rand(T, width, generator=gen) < hole_rate] = -1
    return slots.to(torch.int32)


def make_decode_case(
    T: int,
    H: int,
    fmt: KVFormat | str,
    window: int = 128,
    extra: int | None = None,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    block_size: int = 64,
    extra_block_size: int = 64,
    hole_rate: float = 0.0,
    lens: str = "full",
    sink: str | None = "finite",
    distinct: bool = True,
    extra_fmt: KVFormat | str | None = None,
) -> DecodeCase:
    """A random decode problem.

    Args:
        T, H: query tokens and heads.
        window: slots per token in the SWA scope (indices width); ``extra``: width of the
            compressed scope (None for no extra scope; 0 for an empty one).
        lens: ``"full"`` (every slot counts) or ``"random"`` (uniform in [0, width], with the
            first token at 0 and the last at full width).
        sink: None, ``"finite"``, ``"inf"`` (+inf), ``"-inf"`` or ``"mixed"`` (all of those).
        distinct: give each token its own rows (realistic traffic for benchmarks).
        extra_fmt: the compressed scope's format (None: ``fmt``), e.g. ``nvfp4_ds`` beside an
            ``mxfp8_ds`` window (DeepSeek-V4.1's ``nvfp4_ds_mla``).
    """
    fmt = KVFormat.parse(fmt)
    extra_fmt = fmt if extra_fmt is None else KVFormat.parse(extra_fmt)
    gen = torch.Generator().manual_seed(seed)

    def scope(width: int, bs: int, fmt: KVFormat = fmt):
        rows_per_token = max(width, 1)
        num_slots = T * rows_per_token if distinct else max(4 * width, bs)
        cache = random_cache(num_slots, bs, fmt, gen, device)
        num_blocks = cache.shape[0]
        indices = _slot_lists(T, width, rows_per_token, num_blocks * bs, hole_rate, gen, distinct)
        if lens == "full":
            scope_lens = torch.full((T,), width, dtype=torch.int32)
        elif lens == "random":
            scope_lens = torch.randint(0, width + 1, (T,), generator=gen, dtype=torch.int32)
            scope_lens[0], scope_lens[-1] = 0, width
        else:
            raise ValueError(f"lens must be 'full' or 'random', got {lens!r}")
        return KVScope(cache, fmt, bs, indices.to(device), scope_lens.to(device))

    window_scope = scope(window, block_size)
    q = (torch.randn(T, H, HEAD_DIM, generator=gen) * 0.5).to(device=device, dtype=torch.bfloat16)
    sinks = {
        None: None,
        "finite": torch.randn(H, generator=gen) * 2,
        "inf": torch.full((H,), float("inf")),
        "-inf": torch.full((H,), float("-inf")),
        "mixed": torch.tensor([float("inf"), float("-inf"), 0.0, 3.0] * H)[:H],
    }
    if sink not in sinks:
        raise ValueError(f"sink must be one of {list(sinks)}, got {sink!r}")
    sink_t = sinks[sink].to(device) if sinks[sink] is not None else None
    extra_scope = scope(extra, extra_block_size, extra_fmt) if extra is not None else None
    return DecodeCase(q, window_scope, sink_t, HEAD_DIM**-0.5, extra_scope)


def poison_lists(
    indices: torch.Tensor, lens: torch.Tensor, limit: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``indices [T, K]`` and ``lens [T]`` with values no builder should produce: about
    a quarter of the lengths outside ``[0, K]`` (negative, past K, the dtype's extremes) and an
    eighth of the ids outside ``[-1, limit)`` (below -1, at and past ``limit``, the extremes;
    for int64 also values whose low 32 bits are in range).
    ``gen`` is a CPU generator; the copies keep the inputs' dtype and device."""
    T, K = indices.shape
    info, lens_info = torch.iinfo(indices.dtype), torch.iinfo(lens.dtype)
    bad_ids = [-2, -1000, info.min, limit, limit + 5, info.max]
    if info.bits > 32:  # low words in range: a reader of 32-bit words would see slots 1 and 2
        bad_ids += [2**32 + 1, -(2**32) + 2]
    bad_lens = [-7, -1, K + 1, K + 37, lens_info.min, lens_info.max]
    if lens_info.bits > 32:
        bad_lens += [2**32 + 1]
    bad_ids = torch.tensor(bad_ids, dtype=torch.int64)
    bad_lens = torch.tensor(bad_lens, dtype=torch.int64)
    pick_id = bad_ids[torch.randint(0, len(bad_ids), (T, K), generator=gen)]
    pick_len = bad_lens[torch.randint(0, len(bad_lens), (T,), generator=gen)]
    id_mask = torch.rand(T, K, generator=gen) < 0.125
    len_mask = torch.rand(T, generator=gen) < 0.25
    poisoned_ids = torch.where(id_mask, pick_id, indices.cpu().long())
    poisoned_lens = torch.where(len_mask, pick_len, lens.cpu().long())
    return (
        poisoned_ids.to(indices.dtype).to(indices.device),
        poisoned_lens.to(lens.dtype).to(lens.device),
    )


def poisoned_scope(scope: KVScope, gen: torch.Generator) -> tuple[KVScope, KVScope]:
    """``scope`` with poisoned lists (:func:`poison_lists`), and the same scope with those lists
    sanitized (:func:`~dsv4_attn.index_checks.sanitized_lists`): what a backend must compute
    from the first."""
    limit = scope.cache.shape[0] * scope.block_size
    indices, lens = poison_lists(scope.indices, scope.lens, limit, gen)
    clean = sanitized_lists(indices, lens, limit)
    return replace(scope, indices=indices, lens=lens), replace(
        scope, indices=clean[0], lens=clean[1]
    )
