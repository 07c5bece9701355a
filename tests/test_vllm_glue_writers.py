"""The NVFP4 writers for vLLM's DeepSeek-V4 layers write exactly kv_cache.py's bytes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.testing import random_rows
from dsv4_attn.vllm_glue.writers import (
    insert_swa_rows,
    qnorm_rope,
    staging_rows,
    store_staged_rows,
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


def test_qnorm_rope_without_the_q_norm_is_rope_alone():
    """DeepSeek-V4.1's insert (``q_norm=False``): q is only roped (and head-padded), the KV row
    as with the norm."""
    gen = torch.Generator().manual_seed(41)
    T, H, padded = 11, 3, 8
    q = (torch.randn(T, H, 512, generator=gen) * 3).to(torch.bfloat16)
    kv = random_rows(T, gen)
    positions = torch.randint(0, 100, (T,), generator=gen)
    cos_sin = torch.randn(100, 64, generator=gen)
    q_out, kv_out = qnorm_rope(q, kv, positions, cos_sin, 1e-6, padded, q_norm=False)
    q_ref = rope_reference(q.double(), positions, cos_sin)
    torch.testing.assert_close(q_out[:, :H].double(), q_ref, rtol=2**-7, atol=1e-6)
    assert torch.equal(q_out[:, :H, :448], q[..., :448])  # no norm: nope values untouched
    assert torch.equal(q_out[:, H:], torch.zeros_like(q_out[:, H:]))
    assert torch.equal(kv_out, qnorm_rope(q, kv, positions, cos_sin, 1e-6, padded)[1])


def test_insert_writes_roped_rows_at_their_slots_only():
    """The CPU path of the NVFP4 SWA insert: q as qnorm_rope returns it, each token's roped row
    encoded at its slot, every other byte (and rows past the slots: padding) untouched."""
    gen = torch.Generator().manual_seed(5)
    T, H, padded, block_size, num_blocks = 9, 4, 8, 16, 6
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16)
    kv = random_rows(T, gen)
    positions = torch.randint(0, 100, (T,), generator=gen)
    cos_sin = torch.randn(100, 64, generator=gen)
    slots = random_slots(gen, T - 2, num_blocks * block_size, holes=0.3)  # 2 padding rows
    cache = poisoned_cache(gen, num_blocks, block_size, KVFormat.NVFP4)
    expected = cache.clone()
    q_ref, kv_ref = qnorm_rope(q, kv, positions, cos_sin, 1e-6, padded)
    kv_cache.write(expected, slots, kv_ref[: T - 2], KVFormat.NVFP4, block_size)
    q_out = insert_swa_rows(q, kv, positions, cos_sin, 1e-6, padded, slots, cache, block_size)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(cache, expected)


def test_staged_rows_go_to_their_slots_in_nvfp4():
    """Token t's staged row goes to write_slots[t] (where there is one), in NVFP4; nothing else
    changes. The staging buffer is one per device and size, shared."""
    gen = torch.Generator().manual_seed(4)
    rows_per_block, num_blocks, T = 64, 5, 40
    rows = staging_rows(64, "cpu")
    assert rows is staging_rows(64, "cpu") and rows.shape == (64, 1, 512)
    rows[:T, 0] = random_rows(T, gen)
    write_slots = random_slots(gen, T, num_blocks * rows_per_block, holes=0.7)
    cache = poisoned_cache(gen, num_blocks, rows_per_block, KVFormat.NVFP4)
    expected = cache.clone()
    kv_cache.write(expected, write_slots, rows[:T, 0], KVFormat.NVFP4, rows_per_block)
    store_staged_rows(rows, write_slots, cache, rows_per_block)
    assert torch.equal(cache, expected)
