"""Host interface of the Hopper FMHA kernel: variants, compile cache, shape checks, launch.

:class:`FmhaVariant` names every compile-time parameter of :class:`~.fmha_sm90.FmhaSm90`; one
compiled function exists per variant, kept in a :class:`~.compile_cache.CompileCache` (this
process's memory plus the on-disk kernel cache, docs/design.md §4.4). Compilation uses fake
tensors with symbolic sizes and TVM-FFI for ``--gpu-arch sm_90a``, so it needs no GPU, and the
compiled function takes ``torch.Tensor`` arguments directly on the current CUDA stream.

Entry points used by :mod:`dsv4_attn.fmha_ops`:

* :func:`dense_unsupported_reason` / :func:`run_dense` for ``fmha``;
* :func:`sparse_unsupported_reason` / :func:`run_sparse` for ``sparse_prefill``.

``*_unsupported_reason`` returns None when the kernel runs the case, else a one-line reason.
Inputs reaching ``run_*`` are already validated by the ops layer (shapes, dtypes, devices).

The row-split mainloop (head_dim <= 256) has two implementations, a compile-time parameter of
the variant: the intra-warpgroup overlap (what the ops layer runs) and the plain ping-pong one
(``run_dense(..., intra_wg_overlap=False)``; both are compiled, tested and benchmarked).
"""

from __future__ import annotations

import functools
import math
import tempfile
from dataclasses import dataclass

import torch

from dsv4_attn.kernels.compile_cache import CompileCache, compile_tvm_ffi

__all__ = [
    "FmhaVariant",
    "VariantResources",
    "compile_variant",
    "dense_unsupported_reason",
    "dense_variant",
    "resources",
    "run_dense",
    "run_sparse",
    "sparse_unsupported_reason",
    "sparse_variant",
]

HEAD_DIMS = (64, 128, 192, 256, 512)
SPARSE_HEAD_DIM = 512
# Largest dynamic shared memory a Hopper CTA may use (227 KB).
SMEM_LIMIT = 232448


@dataclass(frozen=True)
class FmhaVariant:
    """Every compile-time parameter of one kernel (the compile-cache key)."""

    head_dim: int
    gather: bool = False
    kv_shared: bool = False
    causal: bool = False
    local: bool = False
    tile_n: int | None = None
    num_stages: int = 2
    intra_wg_overlap: bool = True

    @property
    def label(self) -> str:
        """Short name, e.g. ``sparse-d512`` or ``d128-causal-ov1``."""
        if self.gather:
            return f"sparse-d{self.head_dim}"
        mask = "window" if self.local else "causal" if self.causal else "none"
        tail = f"-ov{int(self.intra_wg_overlap)}" if self.head_dim <= 256 else "-kv"
        return f"d{self.head_dim}-{mask}{tail}"

    def make_kernel(self):
        from dsv4_attn.kernels.fmha_sm90 import FmhaSm90

        return FmhaSm90(
            self.head_dim,
            gather=self.gather,
            kv_shared=self.kv_shared,
            causal=self.causal,
            local=self.local,
            tile_n=self.tile_n,
            num_stages=self.num_stages,
            intra_wg_overlap=self.intra_wg_overlap and self.head_dim <= 256,
        )


def dense_variant(
    head_dim: int,
    causal: bool,
    local: bool,
    kv_shared: bool,
    intra_wg_overlap: bool = True,
) -> FmhaVariant:
    """The variant ``fmha`` launches for a dense problem (``intra_wg_overlap``: the row-split
    mainloop's implementation, head_dim <= 256)."""
    return FmhaVariant(
        head_dim=head_dim,
        kv_shared=kv_shared and head_dim > 256,
        causal=causal,
        local=local,
        intra_wg_overlap=intra_wg_overlap and head_dim <= 256,
    )


def sparse_variant() -> FmhaVariant:
    """The variant ``sparse_prefill`` launches."""
    return FmhaVariant(
        head_dim=SPARSE_HEAD_DIM, gather=True, kv_shared=True, intra_wg_overlap=False
    )


def all_variants() -> list[FmhaVariant]:
    """Every variant the ops layer can launch, both row-split mainloops (what CI compiles)."""
    out = [sparse_variant()]
    for d in HEAD_DIMS:
        for causal, local in ((False, False), (True, False), (True, True)):
            for overlap in (True, False) if d <= 256 else (False,):
                out.append(dense_variant(d, causal, local, d > 256, intra_wg_overlap=overlap))
    return out


# ----------------------------------------------------------------------------------------------
# Compilation
# ----------------------------------------------------------------------------------------------
_compiled = CompileCache("fmha")  # FmhaVariant -> TVM-FFI function (plus the optional disk cache)


def _fake_args(variant: FmhaVariant) -> tuple:
    """Fake tensors with symbolic sizes matching what the run_* functions pass."""
    import cutlass
    import cutlass.cute as cute

    def fake(dtype, shape, divisibility):
        # Last mode contiguous; other strides symbolic (any row pitch with 16 B alignment).
        stride = tuple(
            cute.sym_int64(divisibility=divisibility) if i < len(shape) - 1 else 1
            for i in range(len(shape))
        )
        align = max(1, divisibility * dtype.width // 8)
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    d = variant.head_dim
    heads = cute.sym_int()
    sink = fake(f32, (heads,), 1)
    if variant.gather:
        tokens, rows, width = cute.sym_int(), cute.sym_int(), cute.sym_int()
        q = fake(bf16, (tokens, heads, d), 8)
        kv = fake(bf16, (rows, d), 8)
        o = fake(bf16, (tokens, heads, d), 8)
        lse = fake(f32, (tokens, heads), 1)
        indices = fake(i32, (tokens, width), 1)
        lens = fake(i32, (tokens,), 1)
        return (q, kv, None, o, lse, sink, None, None, indices, lens)
    total_q, total_k, heads_kv, batch1 = (cute.sym_int() for _ in range(4))
    q = fake(bf16, (total_q, heads, d), 8)
    k = fake(bf16, (total_k, heads_kv, d), 8)
    v = None if variant.kv_shared else fake(bf16, (total_k, heads_kv, d), 8)
    o = fake(bf16, (total_q, heads, d), 8)
    lse = fake(f32, (total_q, heads), 1)
    cu_q = fake(i32, (batch1,), 1)
    cu_k = fake(i32, (batch1,), 1)
    return (q, k, v, o, lse, sink, cu_q, cu_k, None, None)


def _compile(variant: FmhaVariant, extra_options: str = ""):
    """``(TVM-FFI function, traced kernel object)`` for ``variant``."""
    import cutlass

    kernel = variant.make_kernel()
    fn = compile_tvm_ffi(
        kernel,
        *_fake_args(variant),
        cutlass.Float32(1.0),  # softmax scale
        cutlass.Int32(0),  # window
        cutlass.Int32(1),  # max_seqlen_q
        cutlass.Int32(1),  # max_ctas
        options=extra_options,
    )
    return fn, kernel


def compile_variant(variant: FmhaVariant):
    """The TVM-FFI function of ``variant`` for sm_90a, compiled once per process (no GPU needed)."""
    return _compiled.get(variant, lambda: _compile(variant)[0])


@dataclass(frozen=True)
class VariantResources:
    """What one compiled variant uses per CTA: registers (launch count; the compute warpgroups
    raise theirs with setmaxnreg), local memory (spills) and dynamic shared memory."""

    kernels: tuple  # KernelResources per kernel in the cubin
    smem_bytes: int

    @property
    def spills(self) -> bool:
        return any(k.spills for k in self.kernels)


def resources(variant: FmhaVariant) -> VariantResources:
    """Compile ``variant`` afresh with its cubin kept and read its resource usage."""
    from dsv4_attn.kernels.resource_usage import read_resources

    with tempfile.TemporaryDirectory(prefix="fmha_cubin_") as tmp:
        fn, kernel = _compile(variant, f"--keep-cubin --dump-dir {tmp}")
        cubin = fn.artifacts.CUBIN
    if not isinstance(cubin, bytes):
        raise RuntimeError("CuTeDSL did not return the cubin bytes")
    return VariantResources(tuple(read_resources(cubin)), int(kernel.smem_bytes))


# ----------------------------------------------------------------------------------------------
# Support checks
# ----------------------------------------------------------------------------------------------
def _device_reason(t: torch.Tensor) -> str | None:
    if t.device.type != "cuda":
        return f"tensors are on {t.device.type}, the kernel needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(t.device)
    if (major, minor) != (9, 0):
        return f"the kernel targets sm_90a (Hopper), this GPU is sm_{major}{minor}"
    return None


def _layout_reason(name: str, t: torch.Tensor) -> str | None:
    if t.stride(-1) != 1:
        return f"{name} is not contiguous in its last dimension"
    if any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        return f"{name} strides/base are not 16-byte aligned"
    return None


def _dsl_reason() -> str | None:
    try:
        import cutlass  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"nvidia-cutlass-dsl is not importable ({exc})"
    return None


def dense_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None
) -> str | None:
    """Why the kernel cannot run this (already validated) dense case, or None."""
    if q.dtype != torch.bfloat16:
        return f"the kernel takes bfloat16, got {q.dtype}"
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        return f"head_dim {d} is not one of {HEAD_DIMS}"
    if v.shape[-1] != d:
        return f"head_dim_v {v.shape[-1]} differs from head_dim {d}"
    if d > 256 and not _same_tensor(k, v):
        return "head_dim 512 needs k and v to be the same tensor (K = V, MQA latent)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = _layout_reason(name, t)
        if reason:
            return reason
    return _device_reason(q) or _dsl_reason()


def sparse_unsupported_reason(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor
) -> str | None:
    """Why the kernel cannot run this (already validated) sparse-prefill case, or None."""
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"the kernel takes bfloat16 q and kv, got {q.dtype} and {kv.dtype}"
    if q.shape[-1] != SPARSE_HEAD_DIM:
        return f"sparse prefill needs head_dim {SPARSE_HEAD_DIM}, got {q.shape[-1]}"
    for name, t in (("q", q), ("kv", kv)):
        reason = _layout_reason(name, t)
        if reason:
            return reason
    if indices.stride(-1) != 1:
        return "indices is not contiguous in its last dimension"
    return _device_reason(q) or _dsl_reason()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------
_NO_SINK: dict[tuple[torch.device, int], torch.Tensor] = {}


def _sink_or_neg_inf(sink: torch.Tensor | None, heads: int, device: torch.device) -> torch.Tensor:
    """The kernel always reads a sink; -inf adds exp(-inf) = 0 to the denominator."""
    if sink is not None:
        return sink.to(dtype=torch.float32).contiguous()
    key = (device, heads)
    if key not in _NO_SINK:
        _NO_SINK[key] = torch.full((heads,), -math.inf, dtype=torch.float32, device=device)
    return _NO_SINK[key]


def run_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    causal: bool,
    window: int | None,
    sink: torch.Tensor | None,
    scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    intra_wg_overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on packed ``q [total_q, H, D]``, ``k``/``v`` ``[total_k, Hk, D]``.

    ``cu_seqlens_*`` int32 ``[B + 1]`` on the device. Returns ``out`` bf16 ``[total_q, H, D]``
    and ``lse`` fp32 ``[total_q, H]`` (written into ``out``/``lse`` when given: contiguous,
    right shape; tests pass poisoned buffers).
    """
    total_q, heads, d = q.shape
    kv_shared = d > 256
    variant = dense_variant(d, causal, window is not None, kv_shared, intra_wg_overlap)
    fn = compile_variant(variant)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(total_q, heads, dtype=torch.float32, device=q.device) if lse is None else lse
    fn(
        q,
        k,
        None if kv_shared else v,
        out,
        lse,
        _sink_or_neg_inf(sink, heads, q.device),
        cu_seqlens_q,
        cu_seqlens_k,
        None,
        None,
        float(scale),
        int(window) if window is not None else 0,
        int(max_seqlen_q),
        1,  # max_ctas: gathered only
    )
    return out, lse


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the persistent gathered kernel's grid)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def run_sparse(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on ``q [T, H, 512]``, ``kv [N, 512]``, ``indices [T, K]`` and ``lens [T]`` (int32).

    Returns ``out`` bf16 ``[T, H, 512]`` and ``lse`` fp32 ``[T, H]`` (into ``out``/``lse`` when
    given).
    """
    tokens, heads, _ = q.shape
    fn = compile_variant(sparse_variant())
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device) if lse is None else lse
    fn(
        q,
        kv,
        None,
        out,
        lse,
        _sink_or_neg_inf(sink, heads, q.device),
        None,
        None,
        indices,
        lens,
        float(scale),
        0,
        1,
        _sm_count(q.device),  # persistent: one CTA per SM at most
    )
    return out, lse
