"""A torch emulation of the split-KV partials: how the decode kernel encodes them and what the
combine kernel (:mod:`dsv4_attn.kernels.combine`) computes from them.

Encoding (the decode kernel's epilogue for a partial, :mod:`dsv4_attn.kernels.sparse_decode_sm90`
and ``sparse_decode_config``): a normalized row ``o`` (fp32 accumulators times ``1 / l``) takes
the scale ``2^k`` that puts its largest magnitude in ``[2^14, 2^15)``, read off the fp32 exponent
bits (``k = 127 + 14 - biased exponent``, clamped to ``[-113, 120]``; a row of zeros takes 120),
and is stored as ``fp16(o * 2^k)`` (round to nearest even) beside the fp32 pair ``(lse, k)``. A
split without keys stores ``(-inf, 120)`` and leaves its partial row unwritten.

Combine, per (token, head) row over its splits ``s`` (fp32, the kernel's order of operations,
with exact ``exp2`` / ``log2`` / reciprocal where the kernel takes PTX approximations of ~2^-22
relative error, far below the bf16 output's rounding):

    m    = max_s lse_s,  top = max_s (lse_s log2e - k_s)        (0 where -inf)
    lse2 = m log2e + log2(sum_s exp2((lse_s - m) log2e))         (-inf if the sum is 0)
    w_s  = exp2(lse_s log2e - k_s - top)                         (0 for lse_s = -inf; row unread)
    f    = exp2(top - lse2) / (1 + exp2(sink log2e - lse2))      (no sink: the first factor)
    out  = bf16((sum_s w_s (2^k_s o_s)) * f)                     (0 if lse2 = -inf)
    lse  = fp32(lse2 ln2)

which is ``sum_s exp(lse_s - lse) 2^-k_s (2^k_s o_s) sigmoid(lse - sink)``, the formula of the
combine module's docstring, with ``2^-k`` folded into the weights relative to the largest split.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "PARTIAL_MAX_LOG2",
    "PARTIAL_MIN_LOG2",
    "PARTIAL_TOP_LOG2",
    "combine",
    "combine_balanced",
    "encode_partials",
]

# The decode kernel's row-scale constants (kernels/sparse_decode_config.py), restated here so a
# change there shows up as a failing comparison rather than being copied into the expectation.
PARTIAL_TOP_LOG2 = 14
PARTIAL_MIN_LOG2 = -113
PARTIAL_MAX_LOG2 = 120

_LOG2E = torch.tensor(math.log2(math.e), dtype=torch.float32)  # the kernel's fp32 constants
_LN2 = torch.tensor(math.log(2.0), dtype=torch.float32)


def encode_partials(
    o: torch.Tensor, lse: torch.Tensor, unwritten: float = float("nan")
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials as the decode kernel stores them.

    Args:
        o: ``[..., 512]`` normalized partial outputs (any float dtype; taken as fp32, the
            kernel's accumulator precision). Rows of splits without keys are ignored.
        lse: ``[...]`` natural-log softmax sums, -inf for a split without keys.
        unwritten: what a split without keys holds in its partial row (the kernel never writes
            it: whatever the workspace held).

    Returns:
        ``(o_part, lse_part)``: fp16 ``[..., 512]`` rows ``o * 2^k`` and fp32 ``[..., 2]`` pairs
        ``(lse, k)``.
    """
    o32 = o.to(torch.float32)
    absmax = o32.abs().amax(-1)
    biased = (absmax.view(torch.int32) >> 23) & 0xFF  # absmax >= 0: no sign bit
    k = (127 + PARTIAL_TOP_LOG2 - biased).clamp(PARTIAL_MIN_LOG2, PARTIAL_MAX_LOG2)
    k = k.to(torch.float32)
    scaled = (o32 * torch.exp2(k)[..., None]).to(torch.float16)  # exact product, one rounding
    has_keys = lse > float("-inf")
    o_part = torch.where(has_keys[..., None], scaled, torch.full_like(scaled, unwritten))
    lse_part = torch.stack([lse.to(torch.float32), k], dim=-1)
    return o_part, lse_part


def combine(
    o_part: torch.Tensor, lse_part: torch.Tensor, sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine kernel on split-major partials.

    Args:
        o_part: fp16 ``[S, T, H, 512]`` scaled partial rows.
        lse_part: fp32 ``[S, T, H, 2]`` pairs ``(lse_s, k_s)``.
        sink: fp32 ``[H]`` sink logits (any of them +-inf) or None.

    Returns:
        ``(out, lse)``: bf16 ``[T, H, 512]`` and fp32 ``[T, H]`` (sink excluded).
    """
    lse_s = lse_part[..., 0].to(torch.float32)  # [S, T, H]
    k_s = lse_part[..., 1].to(torch.float32)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float32)
    zero = torch.tensor(0.0, dtype=torch.float32)
    m = lse_s.amax(0)
    top = (lse_s * _LOG2E - k_s).amax(0)
    m_safe = torch.where(m == neg_inf, zero, m)
    top = torch.where(top == neg_inf, zero, top)
    total = torch.exp2((lse_s - m_safe) * _LOG2E).sum(0)
    has_keys = total > 0
    lse2 = torch.where(has_keys, m_safe * _LOG2E + torch.log2(total), neg_inf)
    f = torch.exp2(top - lse2)
    if sink is not None:
        sink32 = sink.to(torch.float32)[None, :]
        f = f * torch.reciprocal(1.0 + torch.exp2(sink32 * _LOG2E - lse2))
    factor = torch.where(has_keys, f, zero)

    # A split without keys weighs 0 and its row is never read (it may hold NaN): select, never
    # multiply, so 0 * garbage cannot reach the sum.
    written = lse_s > neg_inf
    weight = torch.where(written, torch.exp2(lse_s * _LOG2E - k_s - top), zero)
    acc = torch.zeros(o_part.shape[1:], dtype=torch.float32)
    for s in range(o_part.shape[0]):  # the kernel's order: split after split, in fp32
        rows = torch.where(written[s, ..., None], o_part[s].to(torch.float32), zero)
        acc = acc + weight[s, ..., None] * rows
    out = (acc * factor[..., None]).to(torch.bfloat16)
    return out, (lse2 * _LN2).to(torch.float32)


def combine_balanced(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    sink: torch.Tensor | None,
    token_plan: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """The combine kernel on the balanced schedule's compact slots, in place.

    Token ``t`` has ``token_plan[t, 2]`` pieces in slots ``token_plan[t, 3]`` onwards; a token of
    at most one piece was finished by the decode kernel and its rows of ``out`` / ``lse`` are
    left alone.

    Args:
        o_part: fp16 ``[slots, H, 512]``; lse_part: fp32 ``[slots, H, 2]``.
        sink: fp32 ``[H]`` or None; token_plan: int ``[T, 5]``.
        out: bf16 ``[T, H, 512]``; lse: fp32 ``[T, H]`` (written for cut tokens only).
    """
    for t in range(token_plan.shape[0]):
        pieces, first = int(token_plan[t, 2]), int(token_plan[t, 3])
        if pieces <= 1:
            continue
        rows = slice(first, first + pieces)
        o_t, lse_t = combine(o_part[rows, None], lse_part[rows, None], sink)
        out[t], lse[t] = o_t[0], lse_t[0]
