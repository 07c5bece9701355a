"""The NVFP4 writers for vLLM's DeepSeek-V4 layers write exactly kv_cache.py's bytes."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.testing import random_rows
from dsv4_attn.vllm_glue.writers import (
    CompressedRowStager,
    qnorm_rope,
)

FORMATS = list(KVFormat)


def poisoned_cache(gen: torch.Generator, num_blocks: int, block_size: int, fmt: KVFormat):
    """A cache full of random bytes, wider than a page (vLLM's rows may be padded)."""
    width = kv_cache.page_layout(fmt, block_size).page_bytes + 64
    return torch.randint(0, 256, (num_blocks, width), generator=gen, dtype=torch.uint8)


def random_slots(gen: torch.Generator, n: int, num_slots: int, holes: float) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < holes] = -1
    return slots


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """GPT-J RoPE on the last 64 values in float64: pairs (448 + 2i, 449 + 2i), angle i."""
    out = x.clone()
    cos = cos_sin[positions][:, None, :32].double()
    sin = cos_sin[positions][:, None, 32:].double()
    even, odd = x[..., 448::2], x[..., 449::2]
    out[..., 448::2] = even * cos - odd * sin
    out[..., 449::2] = even * sin + odd * cos
    return out


def test_qnorm_rope_matches_float64_reference():
    gen = torch.Generator().manual_seed(3)
    T, H, padded, eps = 37, 6, 8, 1e-6
    q = (torch.randn(T, H, 512, generator=gen) * 3).to(torch.bfloat16)
    kv = random_rows(T, gen)
    positions = torch.randint(0, 4096, (T,), generator=gen)
    angle = positions.new_tensor(range(4096))[:, None].double() * (
        10000.0 ** (-torch.arange(32).double() / 32)
    )
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=1).float()

    q_out, kv_out = qnorm_rope(q, kv, positions, cos_sin, eps, padded)

    q64 = q.double()
    q64 = q64 / torch.sqrt(q64.square().mean(-1, keepdim=True) + eps)
    q_ref = rope_reference(q64, positions, cos_sin)
    kv_ref = rope_reference(kv.double()[:, None], positions, cos_sin)[:, 0]
    assert q_out.shape == (T, padded, 512) and q_out.dtype == torch.bfloat16
    assert torch.equal(q_out[:, H:], torch.zeros_like(q_out[:, H:]))
    # float32 math, one bf16 rounding: within a bf16 ulp (2^-8 relative) of the exact values
    torch.testing.assert_close(q_out[:, :H].double(), q_ref, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(kv_out.double(), kv_ref, rtol=2**-7, atol=1e-6)
    assert torch.equal(kv_out[:, :448], kv[:, :448])  # nope values pass through untouched


@pytest.mark.parametrize("ratio", [4, 128])
def test_stager_routes_each_completed_entry_to_its_slot(ratio):
    """Tokens that complete an entry get staging rows in token order; flush writes each row to
    that token's compressed slot, in NVFP4, and touches nothing else."""
    gen = torch.Generator().manual_seed(ratio)
    max_tokens, max_requests, rows_per_block, num_blocks = 64, 5, 256 // ratio, 12
    stager = CompressedRowStager(max_tokens, max_requests, ratio, "cpu")
    for step in range(3):
        T = int(torch.randint(1, max_tokens + 1, (1,), generator=gen))
        completed = min(T, stager.capacity, int(torch.randint(0, T + 1, (1,), generator=gen)))
        write_slots = torch.full((T,), -1, dtype=torch.int64)
        tokens = torch.randperm(T, generator=gen)[:completed]
        write_slots[tokens] = torch.randperm(num_blocks * rows_per_block, generator=gen)[:completed]
        rows, row_of_token = stager.stage(write_slots)
        done = write_slots >= 0
        assert row_of_token[done].tolist() == list(range(completed))
        assert (row_of_token[~done] == -1).all()
        # what vLLM's kernel does: each completing token's row at its staging slot
        token_rows = random_rows(T, gen)
        rows[row_of_token[done], 0] = token_rows[done]
        expected = poisoned_cache(gen, num_blocks, rows_per_block, KVFormat.NVFP4)
        cache = expected.clone()
        kv_cache.write(expected, write_slots, token_rows, KVFormat.NVFP4, rows_per_block)
        stager.flush(cache, KVFormat.NVFP4, rows_per_block)
        assert torch.equal(cache, expected), f"step {step}"


def test_stager_capacity_bounds_completed_entries():
    """No step can complete more entries than max_tokens // ratio + max_requests: a request of
    q tokens completes at most ceil(q / ratio) <= q // ratio + 1."""
    for ratio in (4, 128):
        stager = CompressedRowStager(2048, 16, ratio, "cpu")
        worst = max(
            sum(math.ceil(q / ratio) for q in split)
            for split in ([2048], [128] * 16, [ratio + 1] * 16, [1] * 16)
        )
        assert stager.capacity >= worst
