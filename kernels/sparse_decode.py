"""Interface of the Hopper sparse-decode kernel behind ``dsv4_attn.ops.sparse_attention``.

:func:`unsupported_reason` says, in one line, why the kernel cannot run a case (or None);
:func:`sparse_attention` runs it. By default it splits each token's keys by a factor picked from
the shapes alone (one CTA per token once the tokens fill the GPU). Given a *balanced* plan
(:func:`~dsv4_attn.kernels.sparse_decode_schedule.balanced_plan`, made on the device from the
key counts, once per step for every layer with the same counts, as vLLM makes FlashMLA's
tile-scheduler plan), it runs persistent CTAs, each an equal share of all tokens' key tiles:
for ragged lists (HCA at long contexts) a wave no longer lasts as long as its longest token.
Neither needs a host sync, so a call can be captured in a CUDA graph with static shapes. Each
variant is compiled once per process (compile cache keyed on every compile-time parameter); the
decode kernel runs on the current stream, followed by the combine kernel when partials were
written.

The interface: *support* (:func:`kernel_stack_error`, :func:`unsupported_reason`,
:data:`SUPPORTED_HEAD_COUNTS`), *plan* (:func:`resolve_splits` / :func:`plan_splits`, the split
workspace (:func:`workspace_shapes`, :func:`peak_workspace_numel`, :data:`WORKSPACE_DTYPES`);
the balanced plan is :mod:`~dsv4_attn.kernels.sparse_decode_schedule`'s), *run*
(:func:`sparse_attention`) and *compile ahead* (:func:`compile_variants`). The rest is private.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from dsv4_attn.index_checks import int32_lists
from dsv4_attn.kernels import sparse_decode_schedule as schedule
from dsv4_attn.kernels.sparse_decode_config import BLOCK_H, BLOCK_N, MIN_SPLIT_TILES
from dsv4_attn.kernels.sparse_decode_schedule import num_sms as _num_sms
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat, _page_layout
from dsv4_attn.scope import KVScope

__all__ = [
    "SUPPORTED_HEAD_COUNTS",
    "WORKSPACE_DTYPES",
    "compile_variants",
    "is_common_case",
    "kernel_stack_error",
    "key_capacity",
    "peak_workspace_numel",
    "plan_splits",
    "resolve_splits",
    "sparse_attention",
    "unsupported_reason",
    "workspace_shapes",
]

SUPPORTED_HEAD_COUNTS = (8, 16, 32, 64, 128)
# Split-KV limits (a sweep of forced split counts on the H100, `python -m dsv4_attn.bench
# decode-splits`): a split of 64 keys (MIN_SPLIT_TILES, which the kernel also applies) still pays
# off at T = 2, while past ~32 splits writing and combining the partials (64 KB per split and
# 64-head block as fp16 rows) costs more than the split saves.
MAX_SPLITS = 32
MAX_GRID_TOKENS = 65535  # CUDA's limit on a grid's z axis, which carries the tokens
# The combine merges a (token, head) row with 4 warps below this many rows per SM, else with 1
# (few rows are latency-bound: four warps a row keep more loads in flight; docs/design.md §4.1.5).
WIDE_COMBINE_ROWS_PER_SM = 4
_MAX_PACKED_SLOTS = 1 << 30  # the kernel packs (slot, scope) into one int32
_LOG2_E = math.log2(math.e)
_FORMATS = {KVFormat.FP8_DS_MLA: "fp8_ds_mla", KVFormat.NVFP4: "nvfp4"}
_NOT_BALANCED = (None, None, None, None)  # the balanced schedule's partials and plan
# Module constants for the flat common-case test (a module global is cheaper than torch.<name>).
_BF16, _FP32, _UINT8 = torch.bfloat16, torch.float32, torch.uint8
_INDEX_DTYPES = (torch.int32, torch.int64)
_FP8, _NVFP4 = KVFormat.FP8_DS_MLA, KVFormat.NVFP4
# Split partials (the kernel's workspace): fp16 output rows scaled by 2^k per row, and fp32
# (lse, k) pairs; see dsv4_attn.kernels.sparse_decode_sm90.
PARTIAL_DTYPE = torch.float16
PARTIAL_PAIR_DTYPE = torch.float32
WORKSPACE_DTYPES = (PARTIAL_DTYPE, PARTIAL_PAIR_DTYPE)


# ----------------------------------------------------------------------------------------------
# Support check
# ----------------------------------------------------------------------------------------------


@functools.cache
def kernel_stack_error() -> str | None:
    try:
        import cutlass
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA/DSL install
        return (
            f"nvidia-cutlass-dsl / apache-tvm-ffi cannot be imported ({type(exc).__name__}: {exc})"
        )
    return None


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once per process (torch's query costs ~10 us
    of host time, every eager call)."""
    return torch.cuda.get_device_capability(device_index)


def _cache_reason(name: str, cache: torch.Tensor, block_size: int) -> str | None:
    pages = cache.shape[0]  # a validated uint8 [num_blocks, page_bytes] cache
    if pages == 0:
        # The kernel reads slot 0 in place of a key without a slot (and discards it).
        return f"{name}.cache has no pages"
    page_stride, byte_stride = cache.stride()  # one call: ~half the cost of two stride(i)
    if byte_stride != 1 or page_stride % 16 or cache.data_ptr() % 16:
        return f"{name}.cache pages must be 16-byte aligned with contiguous bytes"
    if pages * block_size >= _MAX_PACKED_SLOTS:
        return f"{name}.cache holds {pages * block_size} slots; the kernel handles < 2^30"
    return None


def unsupported_reason(q, window, sink, extra) -> str | None:
    """None if the kernel runs this (already validated) case, else a one-line reason.

    ``window`` and ``extra`` are :class:`dsv4_attn.scope.KVScope` (``extra`` may be None).
    Every eager call asks this, so the checks are flat (a few us of host time).
    """
    if not q.is_cuda:
        return "q is not on a CUDA device"
    major, minor = _capability(q.get_device())  # a CUDA tensor's device always has an index
    if major != 9 or minor != 0:
        return f"the kernel targets sm_90a (H100/H200); this GPU is sm_{major}{minor}"
    return _layout_reason(q, window, sink, extra) or kernel_stack_error()


def _layout_reason(q, window, sink, extra) -> str | None:
    """:func:`unsupported_reason` of the arguments alone (dtypes, shapes, strides, alignment)."""
    if window.fmt not in _FORMATS:
        fmt = KVFormat(window.fmt).value
        return f"KV-cache format {fmt} has no kernel (fp8_ds_mla and nvfp4 do)"
    if q.dtype is not torch.bfloat16:
        return f"q must be bfloat16 for the kernel, got {q.dtype}"
    if not q.is_contiguous() or q.data_ptr() % 16:
        return "q must be contiguous and 16-byte aligned for the kernel"
    if q.shape[1] not in SUPPORTED_HEAD_COUNTS:
        return f"{q.shape[1]} query heads; the kernel supports {SUPPORTED_HEAD_COUNTS}"
    reason = _scope_reason("window", window)
    if reason is None and extra is not None:
        if extra.fmt is not window.fmt:
            return (
                f"window ({KVFormat(window.fmt).value}) and extra ({KVFormat(extra.fmt).value}) "
                "are in two KV formats; the kernel reads one format a call"
            )
        if extra.indices.dtype != window.indices.dtype or extra.lens.dtype != window.lens.dtype:
            return "window and extra indices (and lens) must share one dtype"
        reason = _scope_reason("extra", extra)
    if reason is not None:
        return reason
    if sink is not None and (sink.dtype is not torch.float32 or not sink.is_contiguous()):
        return f"sink must be a contiguous float32 tensor for the kernel, got {sink.dtype}"
    return None


@functools.cache
def _runs_on(device_index: int) -> bool:
    """Whether the kernel runs on this CUDA device: an sm_90 GPU and an importable DSL stack
    (asked once per device and process)."""
    return _capability(device_index) == (9, 0) and kernel_stack_error() is None


def is_common_case(q, window, sink, scale, extra, out, lse) -> bool:
    """True only for a call that ``dsv4_attn.ops.sparse_attention``'s validation passes and this
    kernel runs (:func:`unsupported_reason` None): bf16 contiguous q on an sm_90 GPU, KVScopes
    of a kernel format over aligned pages, contiguous index lists, fp32 sink, exact outputs.

    What a serving layer passes every call, tested in one flat pass that reads each tensor's
    metadata once (~3 us of host time on a 2-core CPU, against ~9 us for the validation that
    names a bad value followed by :func:`unsupported_reason`). False proves nothing: the caller
    then runs those checks, which say what is wrong or why the kernel cannot run the case.
    """
    return (
        isinstance(q, torch.Tensor)
        and q.is_cuda
        and _runs_on(q.get_device())
        and _common_layout(q, window, sink, scale, extra, out, lse)
    )


def _common_layout(q, window, sink, scale, extra, out, lse) -> bool:
    """:func:`is_common_case` without its device test (so it can be checked on CPU tensors).

    Flat on purpose: each function call and each read of a tensor's metadata costs ~0.1 us of
    host time, and this runs before every eager decode call."""
    try:
        T, H, D = q.shape
    except ValueError:  # not 3 dims
        return False
    device = q.device
    if not (
        D == HEAD_DIM
        and q.dtype is _BF16
        and H in SUPPORTED_HEAD_COUNTS
        and q.is_contiguous()
        and q.data_ptr() % 16 == 0
        and scale.__class__ is float
        and 0.0 < scale < math.inf
        and _common_scope(window, T, device)
    ):
        return False
    if extra is not None and not (
        _common_scope(extra, T, device)
        and extra.fmt is window.fmt
        and extra.indices.dtype is window.indices.dtype
        and extra.lens.dtype is window.lens.dtype
    ):
        return False
    if sink is not None and not (
        isinstance(sink, torch.Tensor)
        and sink.dtype is _FP32
        and sink.shape == (H,)
        and sink.device == device
        and sink.is_contiguous()
    ):
        return False
    if out is not None and not (
        isinstance(out, torch.Tensor)
        and out.dtype is _BF16
        and out.shape == q.shape
        and out.device == device
        and out.is_contiguous()
    ):
        return False
    return lse is None or (
        isinstance(lse, torch.Tensor)
        and lse.dtype is _FP32
        and lse.shape == (T, H)
        and lse.device == device
        and lse.is_contiguous()
    )


def _common_scope(scope, tokens: int, device: torch.device) -> bool:
    """A KVScope of a kernel format over aligned pages of ``device``, contiguous lists of
    ``tokens`` rows (the conditions of ops' scope validation and of :func:`_scope_reason`)."""
    if scope.__class__ is not KVScope:
        return False
    fmt, block_size, cache = scope.fmt, scope.block_size, scope.cache
    indices, lens = scope.indices, scope.lens
    if not (
        (fmt is _FP8 or fmt is _NVFP4)
        and block_size.__class__ is int
        and block_size > 0
        and isinstance(cache, torch.Tensor)
        and isinstance(indices, torch.Tensor)
        and isinstance(lens, torch.Tensor)
        and cache.dtype is _UINT8
        and indices.dtype in _INDEX_DTYPES
        and lens.dtype in _INDEX_DTYPES
        and cache.device == device
        and indices.device == device
        and lens.device == device
    ):
        return False
    try:
        pages, page_bytes = cache.shape
        rows, width = indices.shape
        (lens_rows,) = lens.shape
    except ValueError:  # a tensor of other dims
        return False
    page_stride, byte_stride = cache.stride()
    return (
        pages > 0
        and pages * block_size < _MAX_PACKED_SLOTS
        and page_bytes >= _page_layout(fmt, block_size).page_bytes
        and byte_stride == 1
        and page_stride % 16 == 0
        and cache.data_ptr() % 16 == 0
        and rows == tokens
        and lens_rows == tokens
        and (width == 0 or indices.stride()[1] == 1)
        and (lens_rows <= 1 or lens.stride()[0] == 1)
    )


def _scope_reason(name: str, scope) -> str | None:
    """Why the kernel cannot read this scope's cache and lists, or None."""
    reason = _cache_reason(name, scope.cache, scope.block_size)
    if reason is not None:
        return reason
    indices, lens = scope.indices, scope.lens
    if indices.shape[1] > 0 and indices.stride()[1] != 1:
        return f"{name}.indices rows must be contiguous"
    if lens.shape[0] > 1 and lens.stride()[0] != 1:
        return f"{name}.lens must be contiguous"
    return None


# ----------------------------------------------------------------------------------------------
# Launch planning
# ----------------------------------------------------------------------------------------------


def plan_splits(
    num_tokens: int, num_heads: int, key_capacity: int, num_sms: int
) -> tuple[int, int]:
    """``(num_splits, tiles_per_split)`` for the split-KV decode, from shapes only.

    ``key_capacity`` is the widest key list a token can have (``indices.shape[1]`` plus
    ``extra_indices.shape[1]``). Without splitting there is one CTA per (token, 64-head block);
    when those fill less than ~80% of the SMs, each token's key tiles are split so the grid
    fills at most one wave (a second wave of short CTAs costs more than it saves), with at most
    :data:`MAX_SPLITS` splits of at least :data:`MIN_SPLIT_TILES` tiles. The grid is sized
    by the capacity; the kernel spreads each token's own tiles over its splits (at most
    ``tiles_per_split`` each), so a token with a shorter list finishes sooner, not on fewer SMs.
    (``python -m dsv4_attn.bench decode-splits`` sweeps forced split counts: this choice is
    within 0-1.2 us of the best at T = 2-64; docs/design.md §4.1.5.)
    """
    tiles = max(1, math.ceil(key_capacity / BLOCK_N))
    ctas = num_tokens * math.ceil(num_heads / BLOCK_H)
    if ctas >= 0.8 * num_sms:
        return 1, tiles
    want = min(num_sms // ctas, tiles // MIN_SPLIT_TILES, MAX_SPLITS)
    if want <= 1:
        return 1, tiles
    tiles_per_split = math.ceil(tiles / want)
    return math.ceil(tiles / tiles_per_split), tiles_per_split


# ----------------------------------------------------------------------------------------------
# Compile cache
# ----------------------------------------------------------------------------------------------


def _fake(dtype, shape, stride, align=16):
    """A fake tensor to compile against (CuTeDSL's, no memory)."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _rows(dtype, lead: int):
    """A fake ``[*lead dims, 512]`` tensor of 512-wide rows (contiguous rows, any outer strides)."""
    import cutlass.cute as cute

    shape = (*(cute.sym_int() for _ in range(lead)), HEAD_DIM)
    strides = tuple(cute.sym_int64(divisibility=HEAD_DIM) for _ in range(lead - 1))
    return _fake(dtype, shape, (*strides, HEAD_DIM, 1))


def _lse(lead: int):
    """A fake fp32 ``[*lead dims]`` tensor, contiguous in its last dim (an lse beside rows)."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = tuple(cute.sym_int() for _ in range(lead))
    strides = tuple(cute.sym_int64() for _ in range(lead - 1))
    return _fake(Float32, shape, (*strides, 1), 4)


def _partial_pair(lead: int):
    """A fake fp32 ``[*lead dims, 2]`` tensor of (lse, k) pairs beside partial rows."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (*(cute.sym_int() for _ in range(lead)), 2)
    strides = tuple(cute.sym_int64(divisibility=2) for _ in range(lead - 1))
    return _fake(Float32, shape, (*strides, 2, 1), 8)


def _plan(columns: int):
    """A fake int32 ``[n, columns]`` plan of the balanced schedule."""
    import cutlass.cute as cute
    from cutlass import Int32

    return _fake(Int32, (cute.sym_int(), columns), (columns, 1), 4)


def build_decode_kernel(config):
    """Compile one :class:`SparseDecodeConfig` variant against fake tensors (no GPU needed)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32, Uint8

    from dsv4_attn.kernels.compile_cache import compile_tvm_ffi
    from dsv4_attn.kernels.sparse_decode_sm90 import SparseDecodeSm90

    sym, sym64 = cute.sym_int, cute.sym_int64

    def scope():  # int32 slot ids and lengths (sparse_attention narrows int64 lists)
        return (
            _fake(Uint8, (sym(), sym()), (sym64(divisibility=16), 1)),
            _fake(Int32, (sym(), sym()), (sym64(), 1), 4),
            _fake(Int32, (sym(),), (1,), 4),
        )

    q = _rows(BFloat16, 2)
    window = scope()
    extra = scope() if config.has_extra else (None, None, None)
    sink = _fake(Float32, (sym(),), (1,), 4) if config.has_sink else None
    if config.write_partial:  # split-major [S, T, H, 512] and [S, T, H, 2]
        out, lse = _rows(Float16, 3), _partial_pair(3)
    else:
        out, lse = _rows(BFloat16, 2), _lse(2)
    balanced = _NOT_BALANCED
    if config.balanced:  # slot-major partials [slots, H, 512] and [slots, H, 2], the two plans
        balanced = (_rows(Float16, 2), _partial_pair(2), _plan(4), _plan(5))
    return compile_tvm_ffi(
        SparseDecodeSm90(config),
        q,
        *window,
        *extra,
        sink,
        out,
        lse,
        *balanced,
        Float32(1.0),
        Int32(1),
        Int32(1),
    )


def build_combine_kernel(config):
    """Compile one :class:`CombineConfig` variant against fake tensors."""
    from dsv4_attn.kernels.combine import SplitCombine
    from dsv4_attn.kernels.compile_cache import compile_tvm_ffi

    return compile_tvm_ffi(
        SplitCombine(config), *_combine_fake_args(config.has_sink, config.balanced)
    )


def _combine_fake_args(has_sink: bool, balanced: bool) -> tuple:
    """The fake tensors a combine kernel compiles against (its arguments before the stream)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32

    # Partials: balanced slot-major [slots, H, ...], else split-major [S, T, H, ...].
    lead = 2 if balanced else 3
    token_plan = _plan(5) if balanced else None
    sink = _fake(Float32, (cute.sym_int(),), (1,), 4) if has_sink else None
    return (
        _rows(Float16, lead),
        _partial_pair(lead),
        sink,
        _rows(BFloat16, 2),
        _lse(2),
        token_plan,
    )


@functools.cache
def _caches():
    from dsv4_attn.kernels.compile_cache import CompileCache

    return CompileCache("sparse_decode_sm90"), CompileCache("split_combine")


def decode_config(window, sink, extra, write_partial: bool, balanced: bool = False):
    """The :class:`SparseDecodeConfig` (compile-cache key) of a call."""
    return _decode_config(
        window.fmt,
        window.block_size,
        extra.block_size if extra is not None else 0,
        sink is not None,
        write_partial,
        balanced,
    )


@functools.cache
def _decode_config(fmt, block_size, extra_block_size, has_sink, write_partial, balanced):
    # One config object per distinct call structure: an eager call then pays a dict lookup,
    # not a dataclass construction and its hash.
    from dsv4_attn.kernels.sparse_decode_config import SparseDecodeConfig

    return SparseDecodeConfig(
        _FORMATS[fmt],
        block_size,
        extra_block_size,
        has_sink,
        write_partial,
        balanced,
    )


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def compile_variants(
    fmt: KVFormat, block_size: int, extra_block_size: int, balanced: bool = False
) -> None:
    """Compile (or load from the disk cache) the variants a serving layer uses: int32 slot lists,
    a sink, final output and split partials, plus the combine kernel; with ``balanced`` also
    the balanced schedule's variant and combine. ``extra_block_size`` 0: no extra scope."""
    from dsv4_attn.kernels.combine import CombineConfig
    from dsv4_attn.kernels.sparse_decode_config import SparseDecodeConfig

    decode_cache, combine_cache = _caches()
    outputs = [(False, False), (True, False)] + ([(False, True)] if balanced else [])
    for partial, balanced_variant in outputs:  # (write_partial, balanced)
        config = SparseDecodeConfig(
            _FORMATS[fmt], block_size, extra_block_size, True, partial, balanced_variant
        )
        decode_cache.get(config, lambda c=config: build_decode_kernel(c))
    for balanced_combine in (False, True) if balanced else (False,):
        for warps_per_row in (1, 4):
            combine = CombineConfig(True, balanced_combine, warps_per_row)
            combine_cache.get(combine, lambda c=combine: build_combine_kernel(c))


def workspace_shape(num_splits: int, num_tokens: int, num_heads: int) -> tuple[tuple, tuple]:
    """Shapes of the split-KV workspace: partial outputs (:data:`PARTIAL_DTYPE`) and their
    (lse, row scale) pairs (:data:`PARTIAL_PAIR_DTYPE`)."""
    return ((num_splits, num_tokens, num_heads, HEAD_DIM), (num_splits, num_tokens, num_heads, 2))


def resolve_splits(
    num_tokens: int,
    num_heads: int,
    key_capacity: int,
    device: torch.device,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """``(num_splits, tiles_per_split)`` for a call (``num_splits`` overrides the plan)."""
    tiles = max(1, math.ceil(key_capacity / BLOCK_N))
    if num_splits is None:
        return plan_splits(num_tokens, num_heads, key_capacity, _num_sms(device.index or 0))
    num_splits = max(1, min(int(num_splits), tiles))
    tiles_per_split = math.ceil(tiles / num_splits)
    return math.ceil(tiles / tiles_per_split), tiles_per_split


def key_capacity(window, extra) -> int:
    """The widest key list a token of this call can have (both scopes)."""
    width = window.indices.shape[1]
    return width if extra is None else width + extra.indices.shape[1]


def workspace_shapes(
    num_tokens: int, num_heads: int, capacity: int, device: torch.device
) -> tuple[tuple, tuple] | None:
    """Split-KV workspace shapes a call with these sizes needs, None when it runs unsplit.

    ``capacity`` as :func:`key_capacity` counts it.
    """
    if num_tokens == 0:
        return None
    num_splits, _ = resolve_splits(num_tokens, num_heads, capacity, device)
    return workspace_shape(num_splits, num_tokens, num_heads) if num_splits > 1 else None


def peak_workspace_numel(
    max_tokens: int, num_heads: int, capacity: int, device: torch.device
) -> tuple[int, int]:
    """The most elements of partial outputs (:data:`PARTIAL_DTYPE`) and of their (lse, scale)
    pairs (:data:`PARTIAL_PAIR_DTYPE`) that any call with at most ``max_tokens`` tokens (and
    this head count and key capacity) needs.

    Splitting happens only while the unsplit grid is below about one wave, so only small token
    counts need a workspace; each of them is checked.
    """
    peak_o = peak_lse = 0
    full_wave = _num_sms(device.index or 0)
    for tokens in range(1, max_tokens + 1):
        shapes = workspace_shapes(tokens, num_heads, capacity, device)
        if shapes is not None:
            peak_o = max(peak_o, math.prod(shapes[0]))
            peak_lse = max(peak_lse, math.prod(shapes[1]))
        elif tokens * math.ceil(num_heads / BLOCK_H) >= full_wave:
            break  # past one full wave nothing splits any more
    return peak_o, peak_lse


def sparse_attention(
    q,
    window,
    sink,
    scale,
    extra=None,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    plan: schedule.DecodeSchedule | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`dsv4_attn.ops.sparse_attention` (validated, supported inputs).

    Keyword-only extras: ``num_splits`` overrides the split-KV factor (by default
    :func:`plan_splits` picks it from the shapes); ``plan`` (from ``schedule.balanced_plan`` for
    these key counts) runs the balanced schedule instead, its partials in a ``workspace`` of
    ``schedule.balanced_workspace_shape``; ``out`` (bf16 ``[T, H, 512]``) and ``lse``
    (fp32 ``[T, H]``) are written in place when given; ``workspace`` is a pair of tensors of
    :data:`WORKSPACE_DTYPES` holding at least :func:`workspace_shape` for the split-KV partials
    (their leading part is used; allocated per call when omitted). Returns ``(out, lse)``.
    """
    T, H, _ = q.shape
    window, extra = _int32_scope(window), _int32_scope(extra)
    if out is None:
        out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    if plan is not None:  # one CTA per part: no grid limit on tokens
        if num_splits is not None:
            raise ValueError("num_splits and plan exclude each other: a plan fixes the work split")
        return _balanced_attention(q, window, sink, scale, extra, plan, out, lse, workspace)
    if T > MAX_GRID_TOKENS:  # tokens are the grid's z axis: launch in slices
        for t0 in range(0, T, MAX_GRID_TOKENS):
            t1 = min(T, t0 + MAX_GRID_TOKENS)
            sparse_attention(
                q[t0:t1],
                window.tokens(t0, t1),
                sink,
                scale,
                extra.tokens(t0, t1) if extra is not None else None,
                num_splits=num_splits,
                out=out[t0:t1],
                lse=lse[t0:t1],
                workspace=workspace,
            )
        return out, lse
    capacity = key_capacity(window, extra)
    if num_splits is None:  # the plan follows from the shapes: made once per call structure
        launch = _split_launch(
            window.fmt,
            window.block_size,
            0 if extra is None else extra.block_size,
            sink is not None,
            T,
            H,
            capacity,
            q.device.index or 0,
        )
    else:
        num_splits, tiles = resolve_splits(T, H, capacity, q.device, num_splits)
        launch = _make_split_launch(
            decode_config(window, sink, extra, num_splits > 1), num_splits, tiles, T, H, q.device
        )
    decode_cache, combine_cache = _caches()
    config = launch.decode_config
    decode = decode_cache.get(config, lambda: build_decode_kernel(config))
    scale_log2 = float(scale) * _LOG2_E
    inputs = _input_args(q, window, extra, sink)
    if launch.combine_config is None:  # one split: the kernel writes the final rows
        decode(*inputs, out, lse, *_NOT_BALANCED, scale_log2, 1, launch.tiles)
        return out, lse
    # Splits write partials, which the combine kernel merges.
    o_part, lse_part = _partials(workspace, launch.o_shape, launch.lse_shape, q.device)
    decode(*inputs, o_part, lse_part, *_NOT_BALANCED, scale_log2, launch.splits, launch.tiles)
    combine_config = launch.combine_config
    combine = combine_cache.get(combine_config, lambda: build_combine_kernel(combine_config))
    combine(o_part, lse_part, sink, out, lse, None)
    return out, lse


class _SplitLaunch(NamedTuple):
    """What a split-KV launch needs beyond its tensors, fixed by the call's structure."""

    decode_config: object  # SparseDecodeConfig
    splits: int
    tiles: int  # key tiles per split
    combine_config: object | None  # CombineConfig where the keys are split, else None
    o_shape: tuple
    lse_shape: tuple


@functools.lru_cache(maxsize=4096)
def _split_launch(
    fmt: KVFormat,
    block_size: int,
    extra_block_size: int,
    has_sink: bool,
    tokens: int,
    heads: int,
    key_capacity: int,
    device_index: int,
) -> _SplitLaunch:
    """The default (shape-planned) launch of a call structure, made once: an eager call then
    pays one lookup, not the planning (a few us of host time per layer call)."""
    device = torch.device("cuda", device_index)
    splits, tiles = resolve_splits(tokens, heads, key_capacity, device)
    config = _decode_config(fmt, block_size, extra_block_size, has_sink, splits > 1, False)
    return _make_split_launch(config, splits, tiles, tokens, heads, device)


def _make_split_launch(config, splits: int, tiles: int, tokens: int, heads: int, device):
    if splits == 1:
        return _SplitLaunch(config, 1, tiles, None, (), ())
    rows = tokens * heads
    combine = combine_config_for(rows, config.has_sink, False, _num_sms(device.index or 0))
    return _SplitLaunch(config, splits, tiles, combine, *workspace_shape(splits, tokens, heads))


def combine_config_for(rows: int, has_sink: bool, balanced: bool, num_sms: int):
    """The combine variant (:class:`~dsv4_attn.kernels.combine.CombineConfig`) for ``rows``
    (token, head) rows on a GPU of ``num_sms`` SMs: four warps a row while there are fewer
    than :data:`WIDE_COMBINE_ROWS_PER_SM` rows per SM (latency-bound: more SMs and more loads
    in flight per row), else one."""
    wide = rows < WIDE_COMBINE_ROWS_PER_SM * num_sms
    return _combine_config(has_sink, balanced, 4 if wide else 1)


@functools.cache
def _combine_config(has_sink: bool, balanced: bool, warps_per_row: int):
    from dsv4_attn.kernels.combine import CombineConfig

    return CombineConfig(has_sink, balanced, warps_per_row)


def _balanced_attention(q, window, sink, scale, extra, plan, out, lse, workspace):
    """:func:`sparse_attention` on the balanced schedule ``plan``."""
    T, H, _ = q.shape
    if plan.token_plan.shape[0] != T:
        raise ValueError(f"the plan covers {plan.token_plan.shape[0]} tokens, the call has {T}")
    parts = plan.num_parts
    o_part, lse_part = _partials(workspace, *schedule.balanced_workspace_shape(parts, H), q.device)
    decode_cache = _caches()[0]
    config = decode_config(window, sink, extra, False, balanced=True)
    decode = decode_cache.get(config, lambda: build_decode_kernel(config))
    scale_log2 = float(scale) * math.log2(math.e)
    inputs = _input_args(q, window, extra, sink)
    decode(*inputs, out, lse, o_part, lse_part, plan.part_plan, plan.token_plan, scale_log2, 1, 0)
    if parts > 1:  # one part cuts no token
        _merge_partials(o_part, lse_part, sink, out, lse, plan.token_plan)
    return out, lse


def _merge_partials(o_part, lse_part, sink, out, lse, token_plan) -> None:
    """The combine kernel over a call's partials (``token_plan``: the balanced schedule's,
    None for the split launch), in the width :func:`combine_config_for` picks."""
    T, H, _ = out.shape
    num_sms = _num_sms(out.device.index or 0)
    config = combine_config_for(T * H, sink is not None, token_plan is not None, num_sms)
    combine = _caches()[1].get(config, lambda: build_combine_kernel(config))
    combine(o_part, lse_part, sink, out, lse, token_plan)


def _int32_scope(scope):
    """``scope`` with int32 lists: the kernel reads each slot id as one 32-bit word, so int64
    lists are narrowed first (``index_checks.int32_lists``: an id past int32 is a hole, not the
    slot its low word names)."""
    if scope is None or scope.indices.dtype == scope.lens.dtype == torch.int32:
        return scope
    indices, lens = int32_lists(scope.indices, scope.lens)
    return dataclasses.replace(scope, indices=indices, lens=lens)


def _input_args(q, window, extra, sink) -> tuple:
    """The decode kernel's leading arguments: q, each scope's cache, slot ids and lengths (Nones
    for a missing extra scope), the sink."""
    scopes = (window.cache, window.indices, window.lens)
    scopes += (None, None, None) if extra is None else (extra.cache, extra.indices, extra.lens)
    return q, *scopes, sink


def _partials(workspace, o_shape, lse_shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs and (lse, scale) pairs of these shapes: views of the caller's workspace,
    or new."""
    if workspace is not None:
        return _workspace_views(workspace, o_shape, lse_shape)
    shapes = (o_shape, lse_shape)
    o_part, lse_part = (
        torch.empty(shape, dtype=dtype, device=device)
        for shape, dtype in zip(shapes, WORKSPACE_DTYPES, strict=True)
    )
    return o_part, lse_part


def _workspace_views(workspace, o_shape, lse_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous views of the exact shapes at the start of the caller's workspace tensors."""
    o_ws, lse_ws = workspace
    if (  # the serving layer's scratch comes at the exact shapes
        o_ws.dtype is PARTIAL_DTYPE
        and lse_ws.dtype is PARTIAL_PAIR_DTYPE
        and o_ws.shape == o_shape
        and lse_ws.shape == lse_shape
        and o_ws.is_contiguous()
        and lse_ws.is_contiguous()
    ):
        return o_ws, lse_ws
    views = []
    for tensor, shape, dtype in zip(workspace, (o_shape, lse_shape), WORKSPACE_DTYPES, strict=True):
        if tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous():
            views.append(tensor)  # the serving layer's scratch comes at the exact shape
            continue
        need = math.prod(shape)
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.numel() < need:
            raise ValueError(
                f"workspace tensors must be contiguous {WORKSPACE_DTYPES} holding at least "
                f"{(o_shape, lse_shape)}; tensor of {shape} is {tensor.dtype} "
                f"{tuple(tensor.shape)}{'' if tensor.is_contiguous() else ' (not contiguous)'}"
            )
        views.append(tensor.view(-1)[:need].view(shape))
    return views[0], views[1]
