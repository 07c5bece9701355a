"""A memory-only kernel that moves the bytes a sparse prefill must move (the prefill bench's
memory floor): per (token, 64-head block) it reads Q's rows, every listed KV row and writes O.

``out[t, h] = q[t, h] + sum(kv[indices[t, e]] for e < lens[t] if indices[t, e] >= 0)`` (fp32
sum, bf16 out), so nothing it loads can be optimised away and a test can check it did the work.
Both attention kernels read the listed rows once per 64-head block (a CTA's M tile), so this
does too: its time is what the same access pattern costs the memory system without any math,
the bound a kernel that overlaps all its math with its loads would reach.

Triton is imported when the kernel is first used (it comes with torch's CUDA builds and with
vLLM; the CPU-only test environment never launches it).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["HEAD_BLOCK", "excess_over_rounding", "gather_copy", "gather_copy_reference"]

HEAD_BLOCK = 64  # heads per program: the attention kernels' M tile


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_copy_kernel(
        q_ptr,
        kv_ptr,
        idx_ptr,
        lens_ptr,
        out_ptr,
        num_heads,
        idx_stride,
        kv_stride,
        HEAD_DIM: tl.constexpr,
        HEADS_PER_PROGRAM: tl.constexpr,
        ENTRIES: tl.constexpr,
        Q_ROWS: tl.constexpr,
    ):
        token = tl.program_id(0)
        head0 = tl.program_id(1) * HEADS_PER_PROGRAM
        cols = tl.arange(0, HEAD_DIM)
        length = tl.load(lens_ptr + token)
        acc = tl.zeros((ENTRIES, HEAD_DIM), tl.float32)
        for e0 in range(0, length, ENTRIES):
            entry = e0 + tl.arange(0, ENTRIES)
            rows = tl.load(idx_ptr + token * idx_stride + entry, mask=entry < length, other=-1)
            row_ptr = kv_ptr + rows.to(tl.int64)[:, None] * kv_stride + cols[None, :]
            acc += tl.load(row_ptr, mask=(rows >= 0)[:, None], other=0.0).to(tl.float32)
        col_sum = tl.sum(acc, axis=0)
        for h0 in range(0, HEADS_PER_PROGRAM, Q_ROWS):
            head = head0 + h0 + tl.arange(0, Q_ROWS)
            present = (head < num_heads)[:, None]
            offset = (token * num_heads + head).to(tl.int64)[:, None] * HEAD_DIM + cols[None, :]
            q = tl.load(q_ptr + offset, mask=present, other=0.0).to(tl.float32)
            tl.store(out_ptr + offset, (q + col_sum[None, :]).to(tl.bfloat16), mask=present)

    return gather_copy_kernel


def gather_copy(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor | None = None,
    entries_per_load: int = 16,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Run the memory-only kernel on CUDA tensors; returns ``out`` (bf16 ``[T, H, D]``).

    q: bf16 ``[T, H, D]``; kv: bf16 ``[N, D]`` (rows contiguous); indices: int32 ``[T, K]``
    (-1 = hole); lens: int32 ``[T]`` (entries counted per token, <= K). ``entries_per_load``
    rows are loaded per iteration of a program (``num_stages`` iterations in flight).
    """
    tokens, heads, head_dim = q.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"head dim must be a power of two for the copy kernel, got {head_dim}")
    if kv.shape[-1] != head_dim or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [N, {head_dim}] with unit column stride, got {kv.shape}")
    if not (q.is_contiguous() and indices.stride(-1) == 1):
        raise ValueError("q must be contiguous and indices row-major")
    out = torch.empty_like(q) if out is None else out
    grid = (tokens, -(-heads // HEAD_BLOCK))
    _kernel()[grid](
        q,
        kv,
        indices,
        lens,
        out,
        heads,
        indices.stride(0),
        kv.stride(0),
        HEAD_DIM=head_dim,
        HEADS_PER_PROGRAM=HEAD_BLOCK,
        ENTRIES=entries_per_load,
        Q_ROWS=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def gather_copy_reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """What :func:`gather_copy` computes, in float64 on any device (for the test)."""
    counted = torch.arange(indices.shape[1], device=indices.device)[None] < lens[:, None]
    live = counted & (indices >= 0)
    rows = kv.double()[indices.clamp(min=0).long()] * live[..., None]
    return q.double() + rows.sum(dim=1)[:, None, :]


def excess_over_rounding(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|out - ref|`` beyond one bf16 ulp of ``ref`` (2^-7 relative: Triton's
    interpreter rounds toward zero, CUDA to nearest); <= 0 when ``out`` is within it, NaN when
    ``out`` holds a NaN (an element never written)."""
    return ((out.double() - ref).abs() - ref.abs() * 2.0**-7 * 1.01).max().item()
