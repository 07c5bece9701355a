"""The compressor state of DSV4_NVFP4 layers: its dtype, and the compressed rows read from it.

vLLM's DeepSeek-V4 compressors keep, per position, ``C * D`` kv values and as many scores in a
paged fp32 "state" cache (``C = 2`` for the overlapping CSA compressor, ratio 4; 1 for HCA,
ratio 128), from which each completed entry is computed
(:func:`dsv4_attn.reference.compressed_entries`). In vLLM's KV accounting every block id costs
the bytes of the widest cache group, and with the NVFP4 cache the fp32 CSA state group (main
compressor and indexer, 860,160 B per block for V4-Flash) is the widest: it would cap NVFP4's
gain at 1.165x fp8's tokens. With the main CSA compressor's state in bf16 the widest group is a
KV group again (the compressed caches, 714,240 B) and NVFP4 holds 1.40x fp8's tokens. A
compressed entry ends in NVFP4 (a 4-bit code per value): bf16's rounding of the state (2^-9
relative) is far below that quantization's (``python -m dsv4_attn.bench compressor-state``
measures both: entries 2.8-4.8e-3 from the reference against 1.6e-3 from an fp32 state, and
8.9-9.2e-2 either way once NVFP4-encoded). bf16 rather than fp16, which rounds 8x finer: an fp16
state turns any kv value or score above 65504 into inf, bf16 keeps fp32's range, and once the
entry is NVFP4-encoded the two cannot be told apart.

:func:`state_dtype` is the rule; :func:`compress_rows` computes the rows from a state of any
float dtype (Triton on CUDA, torch elsewhere), where vLLM's kernels read fp32 only.
"""

from __future__ import annotations

import torch

from dsv4_attn.kv_cache import KVFormat

__all__ = ["CSA_STATE_DTYPE", "compress_rows", "state_dtype"]

CSA_STATE_DTYPE = torch.bfloat16
"""The main CSA compressor's state dtype with an NVFP4 cache."""


def state_dtype(fmt: KVFormat, compress_ratio: int, head_dim: int) -> torch.dtype:
    """The state dtype of a DSV4_NVFP4 layer's compressor: bf16 for the main (head_dim 512) CSA
    compressor (ratio 4) with an NVFP4 cache, whose fp32 state group would otherwise be the
    widest; fp32 otherwise (the indexer's and HCA's state groups are narrower than the NVFP4
    KV groups, and with ``--kv-cache-dtype fp8`` the KV groups are the widest anyway, so the
    fp8 path stays byte-identical with vLLM's own)."""
    if fmt is KVFormat.NVFP4 and compress_ratio == 4 and head_dim == 512:
        return CSA_STATE_DTYPE
    return torch.float32


def compress_rows(
    state: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    state_slots: torch.Tensor,
    out_rows: torch.Tensor,
    out: torch.Tensor,
    compress_ratio: int,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    rope_dim: int = 64,
) -> None:
    """``out[out_rows[t]]`` = the compressed row (bf16) of each token ``t < out_rows.shape[0]``
    that completes an entry (``out_rows[t] >= 0`` and ``state_slots[t] >= 0``), read from the
    paged ``state`` ``[blocks, state_block_size, 2 * C * D]`` of any float dtype through
    ``block_table`` (``[R, width]``) at the token's request ``token_req[t]`` and position.

    On CUDA one Triton kernel (:func:`dsv4_attn.fused.compressor.compress_rows`); elsewhere
    torch ops computing the same (float32 math, one rounding to bf16).
    """
    if state.is_cuda:
        from dsv4_attn.fused import compressor

        compressor.compress_rows(
            state,
            block_table,
            token_req,
            positions,
            state_slots,
            out_rows,
            out,
            compress_ratio,
            norm_weight,
            eps,
            cos_sin,
            rope_dim,
        )
        return
    T = out_rows.shape[0]
    C = 2 if compress_ratio == 4 else 1
    D = out.shape[-1]
    use = (out_rows[:T] >= 0) & (state_slots[:T] >= 0)
    tokens = torch.nonzero(use).flatten()
    if tokens.numel() == 0:
        return
    position = positions[tokens].long()
    req = token_req[tokens].long()
    i = torch.arange(C * compress_ratio, device=state.device)
    pos = position[:, None] - C * compress_ratio + 1 + i[None, :]
    bs, width = state.shape[1], block_table.shape[1]
    block = pos.clamp(min=0) // bs
    live = (pos >= 0) & (pos // bs < width)
    page = block_table[req[:, None], block.clamp(max=width - 1)].long()
    live &= page >= 0
    rows = state[page.clamp(min=0), pos.clamp(min=0) % bs].float()  # [n, window, 2 C D]
    column0 = torch.where(i >= (C - 1) * compress_ratio, (C - 1) * D, 0)
    cols = column0[:, None] + torch.arange(D, device=state.device)[None, :]  # [window, D]
    kv = rows.gather(2, cols[None].expand(len(tokens), -1, -1))
    score = rows.gather(2, (cols + C * D)[None].expand(len(tokens), -1, -1))
    score = score.masked_fill(~live[..., None], float("-inf"))
    kv = kv.masked_fill(~live[..., None], 0.0)
    top = score.amax(dim=1, keepdim=True)
    weights = torch.exp(score - torch.where(torch.isinf(top), 0.0, top))
    x = (weights * kv).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-30)
    x = x / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps) * norm_weight.float()
    cs = cos_sin[(position // compress_ratio) * compress_ratio].float()
    half = rope_dim // 2
    cos, sin = cs[:, :half], cs[:, half:rope_dim]
    even, odd = x[:, D - rope_dim :: 2], x[:, D - rope_dim + 1 :: 2]
    rope = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(1)
    x = torch.cat([x[:, : D - rope_dim], rope], dim=1)
    out[out_rows[tokens].long()] = x.to(out.dtype).view_as(out[out_rows[tokens].long()])
