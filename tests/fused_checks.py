"""Checks of the Triton kernels of :mod:`dsv4_attn.fused` against the torch code they replace.

Shared by two runs: ``tests/test_fused.py`` runs the ``test_*`` functions here in a child pytest
with Triton's CPU interpreter on (``TRITON_INTERPRET=1`` must be set before Triton is imported,
so it cannot be switched on inside the main test process), and calls the checks itself, compiled,
on a GPU (``pytest -m gpu``). Expected: the cache bytes bit for bit (NVFP4's exact scale rule,
RoPE rounded once per operation), the metadata lists entry for entry, q after RMSNorm within one
bf16 rounding.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.layer_kind import Compressed, Family, compressed_of
from tests import vllm_glue_testing as vt

# ----------------------------------------------------------------------------------------------
# Checks (shared by the interpreted and the compiled runs)
# ----------------------------------------------------------------------------------------------


# bf16's smallest subnormal; and 2688 * 2^-127, the largest row maximum whose NVFP4 token
# exponent ceil(log2(amax / 2688)) is -127: below it the exponent clamps to -127 (G = 2^-127).
BF16_MIN_SUBNORMAL = 2.0**-133
NVFP4_LAST_UNCLAMPED = 2688 * 2.0**-127


def _rows(gen: torch.Generator, n: int, kind: str) -> torch.Tensor:
    """bf16 ``[n, 512]`` KV rows of one kind: "normal", "mixed" (block magnitudes 1e-8 .. 1e8),
    "edges" (e2m1 midpoints, zero blocks), "zero", "tiny" (row maxima 1e-36 .. 1e-40, bf16
    subnormals: the token exponent clamps) or "near_zero" (blocks of zeros, subnormals, tiny
    and unit values mixed; every third row tiny throughout, every fourth all zeros)."""
    x = torch.randn(n, 512, generator=gen)
    if kind == "mixed":  # block magnitudes from 1e-8 to 1e8
        magnitude = torch.logspace(-8, 8, 32)[torch.randint(0, 32, (n, 32), generator=gen)]
        x = x * magnitude.repeat_interleave(16, 1)
    elif kind == "tiny":
        magnitude = torch.tensor([1e-36, 1e-37, 1e-38, 1e-39, 1e-40])[torch.arange(n) % 5]
        x = x * magnitude[:, None]
        x[:, 1], x[:, 2] = BF16_MIN_SUBNORMAL, -BF16_MIN_SUBNORMAL
        x[5::10, 0] = NVFP4_LAST_UNCLAMPED
    elif kind == "near_zero":
        levels = torch.tensor([0.0, BF16_MIN_SUBNORMAL, 1e-39, 1e-37, 1e-30, 1.0])
        pick = torch.randint(0, 6, (n, 32), generator=gen)
        pick[::3] = pick[::3].clamp(max=3)
        x = x * levels[pick].repeat_interleave(16, 1)  # zero blocks keep their signs (-0.0)
        x[3::4] = -0.0
    elif kind == "edges":  # values on e2m1 midpoints once scaled, zero blocks
        x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 64).repeat(n, 1)
        x[:, 32:64] = 0
        x = x * torch.where(torch.rand(n, 512, generator=gen) < 0.5, -1.0, 1.0)
    elif kind == "zero":
        x = torch.zeros(n, 512)
    return x.to(torch.bfloat16)


def _poisoned_cache(gen, num_blocks: int, block_size: int, device) -> torch.Tensor:
    page = kv_cache.page_layout(KVFormat.NVFP4, block_size).page_bytes + 64  # padded stride
    raw = torch.randint(0, 256, (num_blocks, page), generator=gen, dtype=torch.uint8)
    return raw.to(device)[:, : page - 64]


def _rope_table(positions: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(32, dtype=torch.float32) / 32))
    angle = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([angle.cos(), angle.sin()], dim=1)


def check_staged_rows(fused, device, kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    T, block_size, num_blocks = 9, 16, 5
    rows = _rows(gen, T, kind)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.3] = -1
    cache = _poisoned_cache(gen, num_blocks, block_size, device)
    expected = cache.cpu().clone()
    kv_cache.write(expected, slots, rows, KVFormat.NVFP4, block_size)
    fused.kv_writers.store_staged_rows(rows.to(device), slots.to(device), cache, block_size)
    assert torch.equal(cache.cpu(), expected)


def check_insert(
    fused, device, heads: int, padded_heads: int, seed: int, q_norm: bool = True
) -> None:
    """The fused SWA insert = the torch path (``q_norm``: DeepSeek-V4's per-head q norm; V4.1
    has none)."""
    from dsv4_attn.vllm_glue.writers import qnorm_rope

    gen = torch.Generator().manual_seed(seed)
    T, block_size, num_blocks = 7, 16, 4
    q = (torch.randn(T, heads, 512, generator=gen) * 3).to(torch.bfloat16)
    kv = _rows(gen, T, "normal")
    kv[2:4] = torch.cat([_rows(gen, 1, "tiny"), _rows(gen, 1, "near_zero")])  # G clamps
    positions = torch.randint(0, 4096, (T,), generator=gen)
    positions[0] = 0
    cos_sin = _rope_table(4096)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: T - 1]  # one row unslotted
    slots[1] = -1
    cache = _poisoned_cache(gen, num_blocks, block_size, device)
    expected = cache.cpu().clone()
    q_ref, kv_ref = qnorm_rope(q, kv, positions, cos_sin, 1e-6, padded_heads, q_norm)
    kv_cache.write(expected, slots, kv_ref[: T - 1], KVFormat.NVFP4, block_size)

    def dev(t):
        return t.to(device)

    q_out = fused.kv_writers.qnorm_rope_nvfp4_insert(
        dev(q),
        dev(kv),
        dev(positions),
        dev(cos_sin),
        1e-6,
        padded_heads,
        dev(slots),
        cache,
        block_size,
        q_norm,
    )
    assert torch.equal(cache.cpu(), expected), "KV bytes differ from the torch path"
    q_out = q_out.cpu()
    assert q_out.shape == (T, padded_heads, 512)
    assert (q_out[:, heads:] == 0).all()
    # Within one bf16 rounding of the torch path (the norm's sum is reduced in another order).
    torch.testing.assert_close(q_out.float(), q_ref.float(), rtol=2**-7, atol=1e-6)


def check_gather(fused, device, kind: str, seed: int) -> None:
    """NVFP4 gather-dequantize = kv_cache.read of the same slots, bit for bit; rows past each
    request's run keep their poison."""
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks, C, width = 16, 12, 3, 40
    cache = _poisoned_cache(gen, num_blocks, block_size, device)
    slots_all = torch.arange(num_blocks * block_size)
    kv_cache.write(
        cache,
        slots_all.to(device),
        _rows(gen, len(slots_all), kind).to(device),
        KVFormat.NVFP4,
        block_size,
    )
    table = torch.randperm(num_blocks, generator=gen)[: C * 4].view(C, 4).to(torch.int32)
    seq_lens = torch.tensor([37, 5, 40], dtype=torch.int32)
    gather_lens = torch.tensor([30, 5, 1], dtype=torch.int32)
    for window, ratio in ((False, 1), (False, 2), (True, 1)):
        out = torch.full((C, 2 + width, 512), float("nan"), dtype=torch.bfloat16)
        expected = out.clone()
        for c in range(C):
            seq = int(seq_lens[c])
            first, count = (
                (seq - int(gather_lens[c]), int(gather_lens[c])) if window else (0, seq // ratio)
            )
            rows = [
                int(table[c, r // block_size]) * block_size + r % block_size
                for r in range(first, first + count)
            ]
            if rows:
                expected[c, 2 : 2 + count] = kv_cache.read(
                    cache, torch.tensor(rows, device=device), KVFormat.NVFP4, block_size
                ).cpu()
        out = out.to(device)
        fused.kv_gather.gather_nvfp4_rows(
            out,
            cache,
            block_size,
            seq_lens.to(device),
            table.to(device),
            2,
            width,
            ratio=ratio,
            gather_lens=gather_lens.to(device) if window else None,
        )
        got = out.cpu()
        assert torch.equal(got.isnan(), expected.isnan()), (window, ratio)
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), (window, ratio)
    # Poisoned metadata: runs past the block table (seq 90 > 4 pages of 16), pages outside the
    # cache (-5, 999, and num_blocks: request 1's only page), a window longer than its sequence
    # (rows before position 0). Those rows come back as zeros, nothing is read for them; the
    # rest as read from the cache, the last page (num_blocks - 1, request 2's second) included.
    # The cache is the first num_blocks pages of a buffer whose next page holds real rows, so a
    # read of page num_blocks would come back as those instead of zeros.
    page_bytes = kv_cache.page_layout(KVFormat.NVFP4, block_size).page_bytes
    backing = torch.randint(
        0, 256, (num_blocks + 1, cache.stride(0)), generator=gen, dtype=torch.uint8
    ).to(device)
    backing[:num_blocks, :page_bytes] = cache
    kv_cache.write(
        backing[:, :page_bytes],
        torch.arange(num_blocks * block_size, (num_blocks + 1) * block_size, device=device),
        _rows(gen, block_size, "normal").to(device),
        KVFormat.NVFP4,
        block_size,
    )
    cache = backing[:num_blocks, :page_bytes]
    bad_table = table.clone()
    bad_table[0, 1], bad_table[2, 0] = -5, 999
    bad_table[1, 0], bad_table[2, 1] = num_blocks, num_blocks - 1
    bad_seq = torch.tensor([90, 5, 40], dtype=torch.int32)
    bad_gather = torch.tensor([30, 9, 40], dtype=torch.int32)
    for window in (False, True):
        out = torch.full((C, 2 + 64, 512), float("nan"), dtype=torch.bfloat16)
        expected = out.clone()
        for c in range(C):
            seq = int(bad_seq[c])
            first, count = (seq - int(bad_gather[c]), int(bad_gather[c])) if window else (0, seq)
            for i, r in enumerate(range(first, first + min(count, 64))):  # max_rows: 64
                block = int(bad_table[c, r // block_size]) if 0 <= r < 4 * block_size else -1
                if 0 <= block < num_blocks:
                    slot = torch.tensor([block * block_size + r % block_size], device=device)
                    expected[c, 2 + i] = kv_cache.read(
                        cache, slot, KVFormat.NVFP4, block_size
                    ).cpu()[0]
                else:
                    expected[c, 2 + i] = 0
        out = out.to(device)
        fused.kv_gather.gather_nvfp4_rows(
            out,
            cache,
            block_size,
            bad_seq.to(device),
            bad_table.to(device),
            2,
            64,
            gather_lens=bad_gather.to(device) if window else None,
        )
        got = out.cpu()
        assert torch.equal(got.isnan(), expected.isnan()), window
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), window


def check_compress_rows(fused, device, ratio: int, dtype: torch.dtype, seed: int) -> None:
    """Compressed rows from a paged state (any float dtype) = the torch construction, bit for
    bit up to float32 summation order (a bf16 ulp); tokens that complete no entry, padding
    (no state slot) and rows other tokens own keep their poison; positions past a request's
    block table count as absent."""
    from dsv4_attn.vllm_glue import compressor_state

    gen = torch.Generator().manual_seed(seed)
    C, D, bs = (2 if ratio == 4 else 1), 512, 4
    seq_lens = [int(x) for x in torch.randint(1, 90, (3,), generator=gen)] + [ratio * 5]
    # Request 0 ends on an entry one state page past its table row (the rows back to back: a
    # page read one past it would be request 1's first); the others fit their rows.
    seq_lens[0] = ratio * (max(seq_lens) // ratio + 2)
    width = -(-seq_lens[0] // bs) - 1
    pages = torch.randperm(len(seq_lens) * width + 3, generator=gen)
    table = pages[: len(seq_lens) * width].view(len(seq_lens), width).int()
    state = (torch.randn(len(pages), bs, 2 * C * D, generator=gen) * 2).to(dtype)
    tokens = [(r, p) for r, n in enumerate(seq_lens) for p in range(max(0, n - 12), n)]
    T = len(tokens) + 2  # two padding tokens
    token_req = torch.tensor([r for r, _ in tokens] + [0, 0], dtype=torch.int32)
    positions = torch.tensor([p for _, p in tokens] + [ratio - 1, 2 * ratio - 1])
    state_slots = torch.tensor([0] * len(tokens) + [-1, -1])
    out_rows = torch.where((positions + 1) % ratio == 0, torch.arange(T), -1)
    norm_weight = torch.rand(D, generator=gen) + 0.5
    cos_sin = torch.randn(max(seq_lens) + ratio, 64, generator=gen)
    args = (token_req, positions, state_slots, out_rows)
    want = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
    compressor_state.compress_rows(state, table, *args, want, ratio, norm_weight, 1e-6, cos_sin)
    got = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=device)
    fused.compressor.compress_rows(
        state.to(device),
        table.to(device),
        *(a.to(device) for a in args),
        got,
        ratio,
        norm_weight.to(device),
        1e-6,
        cos_sin.to(device),
    )
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()), (ratio, dtype)
    assert int((~want.isnan().all(dim=1)).sum()) >= 3  # rows were written
    torch.testing.assert_close(
        got.nan_to_num().float(), want.nan_to_num().float(), rtol=2**-7, atol=1e-3
    )


def check_prefill_index(fused, device, seed: int) -> None:
    """Prefill index lists = the torch construction, entry for entry, for every layer kind;
    request 0 is a whole prompt (lists from position 0), and CSA picks sit on the visibility
    bound ``(pos + 1) // 4`` and either side of it."""
    from dsv4_attn.vllm_glue import prefill

    gen = torch.Generator().manual_seed(seed)
    C = int(torch.randint(2, 4, (1,), generator=gen))
    query_lens = torch.randint(1, 150, (C,), generator=gen)
    seq_lens = (query_lens + torch.randint(0, 700, (C,), generator=gen)).int()
    seq_lens[0] = query_lens[0]  # a whole prompt: its lists start at position 0
    positions = [  # of the tokens, in order
        p
        for q, n in zip(query_lens.tolist(), seq_lens.tolist(), strict=True)
        for p in range(n - q, n)
    ]
    first_token = int(torch.randint(0, 9, (1,), generator=gen))  # decode tokens before
    query_start = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).int() + first_token
    T = int(query_lens.sum())
    # Window only; V4's CSA and HCA; V4.1's top-k of ratio 1 and 2.
    kinds = [None, Compressed(4, True), Compressed(128, False), Compressed(1, True)]
    for kind in [*kinds, Compressed(2, True)]:
        (chunk,) = prefill.plan_chunks(
            query_start.cpu() - first_token, seq_lens, 0, C, kind, vt.WINDOW, 1 << 30
        )
        chunk = prefill.PrefillChunk(0, C, first_token, first_token + T, chunk.entries, chunk.rows)
        topk = None
        if kind is not None and kind.top_k:  # picks with holes, some past the cached entries
            r = kind.ratio
            topk = torch.randint(-1, int(seq_lens.max()) // r + 3, (T, 24), generator=gen).int()
            # The last three on the visibility bound (pos + 1) // ratio: the last complete
            # entry, the first incomplete one, the next.
            bound = torch.tensor([(p + 1) // r for p in positions], dtype=torch.int32)
            topk[:, -3:] = bound[:, None] + torch.tensor([-1, 0, 1], dtype=torch.int32)
        width = prefill.index_width(kind, 24, chunk.entries, vt.WINDOW)
        want = (
            torch.full((T, width + 3), 777, dtype=torch.int32),
            torch.full((T,), 777, dtype=torch.int32),
        )
        prefill._index_lists_torch(
            chunk, query_start, seq_lens, vt.WINDOW, kind, topk, want[0][:, :width], want[1]
        )
        got = (
            torch.full((T, width + 3), 777, dtype=torch.int32, device=device),
            torch.full((T,), 777, dtype=torch.int32, device=device),
        )
        fused.prefill_index.fill_prefill_index(
            query_start.to(device),
            seq_lens.to(device),
            first_token,
            T,
            chunk.entries,
            chunk.rows,
            kind,
            vt.WINDOW,
            topk.to(device) if topk is not None else None,
            got[0][:, :width],
            got[1],
        )
        assert torch.equal(got[0].cpu(), want[0]), kind
        assert torch.equal(got[1].cpu(), want[1]), kind


def check_metadata(fused, device, seed: int) -> None:
    """The step-metadata kernels on a random batch = the torch constructions, entry for entry."""
    gen = torch.Generator().manual_seed(seed)
    batch = vt.random_batch(gen)
    hca_width = max(1, math.ceil(max(batch.seq_lens) / 128)) + 1
    _check_metadata_lists(
        fused, device, gen, batch, batch.swa_block_table, batch.cache_block_table, (hca_width,)
    )


def check_metadata_edges(fused, device) -> None:
    """The step-metadata kernels at their bounds, deterministically. Request 0 (positions 560 ..
    699) lacks the last page of both block tables: SWA positions 640 .., compressed positions
    512 .. (CSA entries 128 .., HCA entry 4); the tables' rows lie back to back, so a page read
    one past request 0's row would be request 1's first. Request 1 is a whole prompt from
    position 0. HCA lists 2 wide (request 0 sees 4 or 5 entries) and 6 wide.

    Then slot 0, a real slot (padding is -1): a small batch whose request 1 (a prompt from
    position 0) has block 0 as its first page, in the SWA group and then in the compressed
    group, so that its first token's own slot is 0 (and, compressed, its first CSA entry's)."""
    gen = torch.Generator().manual_seed(1234)
    batch = vt.make_batch(gen, [700, 130], [140, 130], padding=2)
    swa_table = batch.swa_block_table[:, :-1].contiguous()
    cache_table = batch.cache_block_table[:, :-1].contiguous()
    assert swa_table.shape == (2, 640 // vt.SWA_BLOCK)
    assert cache_table.shape == (2, 512 // vt.CACHE_BLOCK)
    _check_metadata_lists(fused, device, gen, batch, swa_table, cache_table, (2, 6))

    seq_lens, query_lens, padding = [300, 5], [2, 5], 1
    num_tokens = sum(query_lens) + padding
    for zero_in_swa in (True, False):
        # Block ids distinct across both groups (one pool), 0 in exactly one of them.
        swa_table = torch.tensor([[11, 12, 13, 14, 15], [0 if zero_in_swa else 20, 21, 22, 23, 24]])
        cache_table = torch.tensor([[31, 32], [33 if zero_in_swa else 0, 34]])
        swa_table, cache_table = swa_table.to(torch.int32), cache_table.to(torch.int32)
        batch = vt.Batch(
            seq_lens,
            query_lens,
            num_tokens,
            swa_table,
            cache_table,
            vt._common_metadata(seq_lens, query_lens, num_tokens, swa_table, vt.SWA_BLOCK),
            vt._common_metadata(seq_lens, query_lens, num_tokens, cache_table, vt.CACHE_BLOCK),
        )
        cm = batch.swa_cm if zero_in_swa else batch.cache_cm
        assert cm.slot_mapping.tolist()[query_lens[0]] == 0  # request 1's first token
        _check_metadata_lists(fused, device, gen, batch, swa_table, cache_table, (2,))


def _check_metadata_lists(
    fused,
    device,
    gen: torch.Generator,
    batch: vt.Batch,
    swa_table: torch.Tensor,
    cache_table: torch.Tensor,
    hca_widths: tuple[int, ...],
) -> None:
    """Window, compressed (CSA and HCA, one list per width of ``hca_widths``) and entry-slot
    lists of ``batch`` through the block tables ``swa_table``/``cache_table`` (int32 ``[R,
    pages]``, which may be narrower than the batch's own) = the torch constructions; buffers
    poisoned, and the columns past an HCA list's width untouched. The indexer's picks: random
    visible entries, wild ones, and in the last three columns the visibility bound
    ``(pos + 1) // 4`` minus 1, plus 0 and plus 1."""
    from dsv4_attn.vllm_glue import metadata as md

    sm = fused.step_metadata
    T = batch.num_tokens

    def on(t):
        return t.to(device)

    def out(*shape, dtype=torch.int32):
        return torch.full(shape, 12345, dtype=dtype, device=device)  # poisoned

    cm = batch.swa_cm
    tokens = md.map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
    req, valid, idx, lens = out(T), out(T, dtype=torch.bool), out(T, vt.WINDOW), out(T)
    sm.fill_window_metadata(
        on(cm.query_start_loc),
        on(cm.seq_lens),
        on(cm.slot_mapping),
        on(swa_table),
        vt.SWA_BLOCK,
        token_req=req,
        valid=valid,
        swa_indices=idx,
        swa_lens=lens,
    )
    want_idx, want_lens = md.window_slots(tokens, swa_table, vt.SWA_BLOCK, vt.WINDOW)
    assert torch.equal(idx.cpu(), want_idx) and torch.equal(lens.cpu(), want_lens)
    assert torch.equal(valid.cpu(), tokens.valid) and torch.equal(req.cpu().long(), tokens.req)

    cm = batch.cache_cm
    tokens = md.map_tokens(cm.query_start_loc, cm.seq_lens, cm.slot_mapping, T)
    for ratio, width in [(4, 0)] + [(128, w) for w in hca_widths]:
        rows_per_block = vt.CACHE_BLOCK // ratio
        write, staging = out(T, dtype=torch.int64), out(T, dtype=torch.int64)
        visible_buffer = out(T, width + 3) if ratio == 128 else None  # 3 columns past the list
        visible = visible_buffer[:, :width] if ratio == 128 else None
        visible_lens = out(T)  # HCA: with the slots; CSA: the counts alone
        window_lens = out(T) if ratio == 128 else None  # the balanced decode plan's counts
        sm.fill_compressed_metadata(
            on(cm.query_start_loc),
            on(cm.seq_lens),
            on(cm.slot_mapping),
            on(cache_table),
            rows_per_block,
            ratio,
            token_req=req,
            valid=valid,
            write_slots=write,
            staging_rows=staging,
            visible_slots=visible,
            visible_lens=visible_lens,
            window=vt.WINDOW,
            window_lens=window_lens,
        )
        want = md.compressed_write_slots(tokens, cache_table, rows_per_block, ratio)
        assert torch.equal(write.cpu(), want)
        assert torch.equal(staging.cpu(), torch.where(want >= 0, torch.arange(T), -1))
        if ratio == 128:
            want_slots, want_count = md.visible_entry_slots(
                tokens, cache_table, rows_per_block, ratio, width
            )
            assert torch.equal(visible.cpu(), want_slots), width
            assert torch.equal(visible_lens.cpu(), want_count), width
            assert bool((visible_buffer.cpu()[:, width:] == 12345).all()), width
            assert torch.equal(window_lens.cpu().long(), md.window_lengths(tokens, vt.WINDOW))
        else:
            csa_visible = visible_lens
            assert torch.equal(visible_lens.cpu().long(), md.visible_entry_counts(tokens, ratio))

    local = vt.random_local_topk(gen, batch, vt.INDEX_TOPK)
    # Poisoned picks the indexer should never make: entries the token does not see yet, and
    # far past the block table (neither may become a slot).
    poison = torch.rand(local.shape, generator=gen) < 0.1
    local = torch.where(
        poison, torch.randint(0, 1 << 20, local.shape, generator=gen, dtype=torch.int32), local
    )
    K = local.shape[1]
    real = torch.zeros(T, dtype=torch.bool)
    bound = torch.zeros(T, dtype=torch.int32)  # entries complete at the token's position
    for t, (_, pos) in enumerate(batch.positions()):
        real[t], bound[t] = True, (pos + 1) // 4
        local[t, K - 3 :] = bound[t] + torch.tensor([-1, 0, 1], dtype=torch.int32)
    slots, entry_lens = out(T, K), out(T)
    sm.fill_entry_slots(
        on(local),
        on(tokens.req.int()),
        on(tokens.valid),
        csa_visible,
        on(cache_table),
        vt.CACHE_BLOCK // 4,
        slots=slots,
        lens=entry_lens,
    )
    want_slots, want_lens = md.local_entry_slots(
        local, tokens, cache_table, vt.CACHE_BLOCK // 4, md.visible_entry_counts(tokens, 4)
    )
    assert torch.equal(slots.cpu(), want_slots) and torch.equal(entry_lens.cpu(), want_lens)
    # A pick becomes a slot when its token is real, the entry complete and its page in the table.
    kept = (local >= 0) & (local < bound[:, None]) & real[:, None]
    kept &= local // (vt.CACHE_BLOCK // 4) < cache_table.shape[1]
    assert bool((want_slots[~kept] == -1).all()) and bool((want_slots[kept] >= 0).all())


def check_decode_schedule(fused, device, seed: int) -> None:
    """The balanced decode plan in one Triton program = the torch construction, entry for
    entry: ragged and uniform counts, empty tokens, more tokens than parts and fewer, with and
    without compressed keys, int32 and int64 counts."""
    from dsv4_attn.kernels import sparse_decode_schedule as schedule

    gen = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 300, (1,), generator=gen))
    parts = int(torch.randint(1, 140, (1,), generator=gen))
    window = torch.randint(0, 129, (T,), generator=gen)
    if seed % 3 == 0:  # uniform
        extra = torch.full((T,), int(torch.randint(0, 9000, (1,), generator=gen)))
    else:
        extra = torch.randint(0, 9000, (T,), generator=gen)
    extra[torch.rand(T, generator=gen) < 0.1] = 0
    window[torch.rand(T, generator=gen) < 0.1] = 0
    dtype = torch.int64 if seed % 2 else torch.int32
    min_share = schedule.min_share_tiles(int(torch.randint(1, 300, (1,), generator=gen)))
    for with_extra in (True, False):
        counts = window + extra if with_extra else window
        want = schedule.build_schedule(counts.to(dtype), parts, min_share)
        got = fused.decode_schedule.build_schedule(
            window.to(dtype).to(device),
            extra.to(dtype).to(device) if with_extra else None,
            (128, 9000),
            parts,
            min_share,
        )
        assert torch.equal(got.part_plan.cpu(), want.part_plan), (T, parts, with_extra)
        assert torch.equal(got.token_plan.cpu(), want.token_plan), (T, parts, with_extra)
    # Into a caller's persistent buffers (poisoned first): the same plan, at their addresses.
    buffers = schedule.DecodeSchedule(
        torch.full((parts, 4), -9, dtype=torch.int32, device=device),
        torch.full((T, 5), -9, dtype=torch.int32, device=device),
    )
    got = fused.decode_schedule.build_schedule(
        window.to(device), extra.to(device), (128, 9000), parts, min_share, out=buffers
    )
    assert got.part_plan is buffers.part_plan and got.token_plan is buffers.token_plan
    want = schedule.build_schedule(window + extra, parts, min_share)
    assert torch.equal(got.part_plan.cpu(), want.part_plan)
    assert torch.equal(got.token_plan.cpu(), want.token_plan)
    with pytest.raises(ValueError, match="token_plan must be contiguous int32"):
        fused.decode_schedule.build_schedule(
            window.to(device),
            extra.to(device),
            (128, 9000),
            parts,
            min_share,
            out=schedule.DecodeSchedule(buffers.part_plan, buffers.token_plan[:, :4]),
        )
    # Lengths outside their widths (poisoned metadata) plan as the clamped lengths.
    wild_window = window.clone()
    wild_extra = extra.clone()
    wild_window[::3] = -7
    wild_window[1::3] = 1 << 30
    wild_extra[::2] = (1 << 31) - 1
    wild_extra[1::5] = -(1 << 20)
    got = fused.decode_schedule.build_schedule(
        wild_window.to(device), wild_extra.to(device), (128, 1000), parts, min_share
    )
    want = schedule.build_schedule(
        wild_window.clamp(0, 128) + wild_extra.clamp(0, 1000), parts, min_share
    )
    assert torch.equal(got.part_plan.cpu(), want.part_plan)
    assert torch.equal(got.token_plan.cpu(), want.token_plan)


# ----------------------------------------------------------------------------------------------
# Serving: one model's kernels over batches of every shape (the specialization checks)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingStep:
    """One step's batch: each request's tokens before the step and its query length (the
    decodes, query length 1, first), ``padding`` rows past the last request (as CUDA graphs pad
    a batch), and ``offset`` (requests, tokens): where the step's rows start in vLLM's
    per-request and per-token tensors, which the kernels then get as views (a micro-batch of
    vLLM's dual-batch overlap; ``(0, 0)``: from their first row). ``table_width``: block tables
    of that many pages, rows contiguous, as a caller that sizes its tables by the batch makes
    them (the step bench); 0: vLLM's, the model's full width."""

    context: tuple[int, ...]
    query_lens: tuple[int, ...]
    padding: int = 0
    offset: tuple[int, int] = (0, 0)
    table_width: int = 0


class ServingStand:
    """One model's geometry and the buffers allocated once for its life (vLLM's per-step
    tensors, the metadata builders' lists, the KV caches, the compressor's state, a workspace)
    on ``device``. :meth:`step` runs every entry point of :mod:`dsv4_attn.fused` on a batch,
    with the arguments the backend's callers build (``dsv4_attn.vllm_glue``: metadata builders,
    writers, compressor, prefill chunks); only the batch changes from one step to the next.
    The values are valid (pages inside the caches) but arbitrary: what is looked at is which
    kernel variants the launches ask for, not what they compute."""

    MAX_REQS = 80
    MAX_TOKENS = 224
    PAGES_PER_REQ = 37  # block-table width; odd, so a view from row r starts at any alignment
    NUM_PAGES = 48
    SWA_BLOCK = 64
    CACHE_BLOCK = 256  # tokens per compressed page: 64 CSA entries, 2 HCA entries
    STATE_BLOCK = 64  # positions per page of the CSA compressor's state
    MAX_LEN = PAGES_PER_REQ * SWA_BLOCK
    HEADS, PADDED_HEADS = 6, 8
    WINDOW = 128
    TOPK = 64
    HCA_ENTRIES = -(-MAX_LEN // 128)
    PARTS = 7
    D = 512

    def __init__(self, device: torch.device | str) -> None:
        from dsv4_attn.kernels.sparse_decode_config import BLOCK_N
        from dsv4_attn.kernels.sparse_decode_schedule import min_share_tiles

        d = torch.device(device)
        self.device = d
        gen = torch.Generator().manual_seed(zlib.crc32(b"serving stand"))
        R, T, i32 = self.MAX_REQS, self.MAX_TOKENS, torch.int32

        def pages(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.uint8, device=d)

        # vLLM's per-step tensors (persistent; each step writes its rows and passes views).
        self.seq_lens = torch.zeros(R, dtype=i32, device=d)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=d)
        self.positions = torch.zeros(T, dtype=torch.int64, device=d)
        self.tables_cpu = {
            group: torch.randint(0, self.NUM_PAGES, (R, self.PAGES_PER_REQ), generator=gen).int()
            for group in ("swa", "cache", "state")
        }
        self.tables = {group: t.to(d) for group, t in self.tables_cpu.items()}
        # The layer's caches and weights.
        layout = kv_cache.page_layout
        self.swa_pages = pages(self.NUM_PAGES, layout(KVFormat.NVFP4, self.SWA_BLOCK).page_bytes)
        self.compressed_pages = {
            ratio: pages(
                self.NUM_PAGES, layout(KVFormat.NVFP4, self.CACHE_BLOCK // ratio).page_bytes
            )
            for ratio in (4, 128)
        }
        self.state = torch.zeros(
            self.NUM_PAGES, self.STATE_BLOCK, 4 * self.D, dtype=torch.bfloat16, device=d
        )
        self.norm_weight = torch.ones(self.D, dtype=torch.bfloat16, device=d)
        self.cos_sin = _rope_table(self.MAX_LEN).to(d)
        self.topk = torch.randint(-1, 40, (T, self.TOPK), generator=gen, dtype=i32).to(d)
        self.staging = torch.zeros(T, 1, self.D, dtype=torch.bfloat16, device=d)
        # The metadata builders' buffers: the SWA group's, then per compressed group (CSA, HCA).
        self.window_lists = self._lists(swa_indices=(T, self.WINDOW), swa_lens=(T,))
        self.compressed_lists = {
            4: self._lists(visible_counts=(T,)),
            128: self._lists(hca_indices=(T, self.HCA_ENTRIES), hca_lens=(T,), window_lens=(T,)),
        }
        self.part_plan = torch.zeros(self.PARTS, 4, dtype=i32, device=d)
        self.token_plan = torch.zeros(T, 5, dtype=i32, device=d)
        self.min_share = min_share_tiles(-(-(self.WINDOW + self.HCA_ENTRIES) // BLOCK_N))
        self.workspace = torch.zeros(4 << 20, dtype=torch.uint8, device=d)

    def _lists(self, **shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
        T, d = self.MAX_TOKENS, self.device
        lists = {
            "token_req": torch.zeros(T, dtype=torch.int32, device=d),
            "valid": torch.zeros(T, dtype=torch.bool, device=d),
            "write_slots": torch.full((T,), -1, dtype=torch.int64, device=d),
            "staging_rows": torch.full((T,), -1, dtype=torch.int64, device=d),
        }
        for name, shape in shapes.items():
            lists[name] = torch.zeros(shape, dtype=torch.int32, device=d)
        return lists

    def _scratch(self, shapes) -> list[torch.Tensor]:
        """Workspace views as vLLM's workspace manager hands them out: one after the other,
        each at a 256-byte boundary."""
        views, at = [], 0
        for shape, dtype in shapes:
            size = math.prod(shape) * dtype.itemsize
            views.append(self.workspace[at : at + size].view(dtype).view(shape))
            at += -(-size // 256) * 256
        return views

    def step(self, fused, step: ServingStep) -> None:
        """Every entry point of ``fused`` on ``step``'s batch, as one layer of each kind (SWA,
        CSA, HCA) would run it: metadata, decode plan, CSA entry slots, KV writers, the CSA
        compressor, and for the prefills each chunk's gathers and index lists."""
        from dsv4_attn.kernels.sparse_decode_schedule import DecodeSchedule
        from dsv4_attn.vllm_glue import prefill

        d, (r0, t0) = self.device, step.offset
        R, query_lens = len(step.query_lens), list(step.query_lens)
        seq = [c + q for c, q in zip(step.context, query_lens, strict=True)]
        assert max(seq) <= self.MAX_LEN and min(query_lens) >= 1
        T = sum(query_lens) + step.padding
        assert r0 + R <= self.MAX_REQS and t0 + T <= self.MAX_TOKENS
        decodes = next((r for r, q in enumerate(query_lens) if q > 1), R)
        decode_tokens = decodes  # one token per decode
        query_start_cpu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int()
        seq_cpu = torch.tensor(seq, dtype=torch.int32)
        positions = [p for s, q in zip(seq, query_lens, strict=True) for p in range(s - q, s)]
        requests = [r for r, q in enumerate(query_lens) for _ in range(q)]
        swa_rows = self.tables_cpu["swa"][r0 : r0 + R]
        slots = [
            int(swa_rows[r, p // self.SWA_BLOCK]) * self.SWA_BLOCK + p % self.SWA_BLOCK
            for r, p in zip(requests, positions, strict=True)
        ]
        pad = [0] * step.padding
        # vLLM's tensors: this step's rows, as views from (r0, t0). A micro-batch's query starts
        # are a new tensor (vLLM subtracts its first entry).
        seq_lens = self.seq_lens[r0 : r0 + R]
        seq_lens.copy_(seq_cpu)
        slot_mapping = self.slot_mapping[t0 : t0 + T]
        slot_mapping.copy_(torch.tensor(slots + [-1] * step.padding))
        positions_d = self.positions[t0 : t0 + T]
        positions_d.copy_(torch.tensor(positions + pad))
        tables = {group: t[r0 : r0 + R] for group, t in self.tables.items()}
        if step.table_width:
            tables = {g: t[:, : step.table_width].contiguous() for g, t in tables.items()}
        query_start = query_start_cpu.to(d)

        # Metadata (dsv4_attn.vllm_glue.metadata's builders).
        sm = fused.step_metadata
        step_args = (query_start, seq_lens, slot_mapping)
        swa = {name: buffer[:T] for name, buffer in self.window_lists.items()}
        sm.fill_window_metadata(
            *step_args,
            tables["swa"],
            self.SWA_BLOCK,
            token_req=swa["token_req"],
            valid=swa["valid"],
            swa_indices=swa["swa_indices"],
            swa_lens=swa["swa_lens"],
        )
        csa = {name: buffer[:T] for name, buffer in self.compressed_lists[4].items()}
        sm.fill_compressed_metadata(
            *step_args,
            tables["cache"],
            self.CACHE_BLOCK // 4,
            4,
            token_req=csa["token_req"],
            valid=csa["valid"],
            write_slots=csa["write_slots"],
            staging_rows=csa["staging_rows"],
            visible_lens=csa["visible_counts"],
        )
        hca = {name: buffer[:T] for name, buffer in self.compressed_lists[128].items()}
        # Decode-only steps list every entry; others as far as their longest sequence needs.
        prefills = decodes < R
        width = self.HCA_ENTRIES
        if prefills:
            width = min(width, max(1, -(-max(seq) // 128)))
        # The balanced decode plan, for the decode tokens (all rows of a decode-only step), is
        # the planner's choice per step (by token count; here from 3 tokens on).
        plan_tokens = decode_tokens if prefills else T
        planned = plan_tokens >= 3
        sm.fill_compressed_metadata(
            *step_args,
            tables["cache"],
            self.CACHE_BLOCK // 128,
            128,
            token_req=hca["token_req"],
            valid=hca["valid"],
            write_slots=hca["write_slots"],
            staging_rows=hca["staging_rows"],
            visible_slots=hca["hca_indices"][:, :width],
            visible_lens=hca["hca_lens"],
            window=self.WINDOW,
            window_lens=hca["window_lens"] if planned else None,
        )
        if planned:
            fused.decode_schedule.build_schedule(
                hca["window_lens"][:plan_tokens],
                hca["hca_lens"][:plan_tokens],
                (self.WINDOW, self.HCA_ENTRIES),
                self.PARTS,
                self.min_share,
                out=DecodeSchedule(self.part_plan, self.token_plan[:plan_tokens]),
            )
        # The CSA layer's decode tokens: the indexer's picks as slots (metadata.layer_scopes).
        n = decode_tokens if prefills else T
        if n:
            entry_slots, entry_lens = self._scratch(
                [((n, self.TOPK), torch.int32), ((n,), torch.int32)]
            )
            sm.fill_entry_slots(
                self.topk[:n],
                csa["token_req"][:n],
                csa["valid"][:n],
                csa["visible_counts"][:n],
                tables["cache"],
                self.CACHE_BLOCK // 4,
                slots=entry_slots,
                lens=entry_lens,
            )

        # KV writers and the CSA compressor (dsv4_attn.vllm_glue.writers, compressor_state).
        q = torch.zeros(T, self.HEADS, self.D, dtype=torch.bfloat16, device=d)
        kv = torch.zeros(T, self.D, dtype=torch.bfloat16, device=d)
        fused.kv_writers.qnorm_rope_nvfp4_insert(
            q,
            kv,
            positions_d,
            self.cos_sin,
            1e-6,
            self.PADDED_HEADS,
            slot_mapping,
            self.swa_pages,
            self.SWA_BLOCK,
        )
        rows = self.staging.view(-1, self.D)
        fused.compressor.compress_rows(
            self.state,
            tables["state"],
            csa["token_req"],
            positions_d,
            slot_mapping,
            csa["staging_rows"],
            rows,
            4,
            self.norm_weight,
            1e-6,
            self.cos_sin,
        )
        for ratio, lists in ((4, csa), (128, hca)):
            fused.kv_writers.store_staged_rows(
                rows, lists["write_slots"], self.compressed_pages[ratio], self.CACHE_BLOCK // ratio
            )

        # Prefill chunks of each layer kind (dsv4_attn.vllm_glue.attention._forward_prefill).
        if not prefills:
            return
        for ratio in (1, 4, 128):
            kind = compressed_of(Family.V4, ratio)
            budget = prefill.rows_budget(self.MAX_LEN, kind, self.WINDOW, self.MAX_TOKENS)
            chunks = prefill.plan_chunks(
                query_start_cpu, seq_cpu, decodes, R - decodes, kind, self.WINDOW, budget
            )
            for chunk in chunks:
                reqs = slice(chunk.first_req, chunk.end_req)
                C, N, M = chunk.end_req - chunk.first_req, chunk.entries, chunk.rows
                chunk_tokens = chunk.end_token - chunk.first_token
                topk = self.TOPK if ratio == 4 else 0
                columns = prefill.index_width(kind, topk, N, self.WINDOW)
                rows_ws, indices_ws, lens_ws, _ = self._scratch(
                    prefill.chunk_workspace_shapes(C * M, chunk_tokens, columns, self.HEADS)
                )
                chunk_starts = query_start[chunk.first_req : chunk.end_req + 1]
                chunk_seq = seq_lens[reqs]
                workspace_rows = rows_ws[: C * M].view(C, M, self.D)
                if ratio > 1 and N:
                    fused.kv_gather.gather_nvfp4_rows(
                        workspace_rows,
                        self.compressed_pages[ratio],
                        self.CACHE_BLOCK // ratio,
                        chunk_seq,
                        tables["cache"][reqs],
                        0,
                        N,
                        ratio=ratio,
                    )
                glens = prefill.gather_lens(
                    chunk_starts[1:] - chunk_starts[:-1], chunk_seq, self.WINDOW
                )
                fused.kv_gather.gather_nvfp4_rows(
                    workspace_rows,
                    self.swa_pages,
                    self.SWA_BLOCK,
                    chunk_seq,
                    tables["swa"][reqs],
                    N,
                    M - N,
                    gather_lens=glens,
                )
                tokens = slice(chunk.first_token, chunk.end_token)
                fused.prefill_index.fill_prefill_index(
                    chunk_starts,
                    chunk_seq,
                    chunk.first_token,
                    chunk_tokens,
                    N,
                    M,
                    kind,
                    self.WINDOW,
                    self.topk[tokens] if ratio == 4 else None,
                    indices_ws[:chunk_tokens, :columns],
                    lens_ws[:chunk_tokens],
                )


# What a warm-up runs: decodes (enough for the balanced plan) and a prefill long enough for HCA
# entries, so every kernel variant below is compiled once.
WARM_STEP = ServingStep(context=(300, 41, 700, 300), query_lens=(1, 1, 1, 40), padding=1)

# The variants a model legitimately compiles, each a fixed choice per layer kind or call site
# (constexprs, or a value fixed for the model's life): the index lists per layer kind (MODE:
# SWA, CSA, HCA), the gathers of window rows (WINDOW) and of CSA and HCA entries (their pages of
# 64 and 2 entries), the compressed metadata of CSA (counts) and of HCA (lists), and the staged
# rows' store into CSA and HCA pages.
KERNEL_VARIANTS = {
    "_qnorm_rope_nvfp4_insert_kernel": 1,
    "_store_staged_rows_kernel": 2,
    "_window_kernel": 1,
    "_compressed_kernel": 2,
    "_entry_slots_kernel": 1,
    "_prefill_index_kernel": 3,
    "_gather_nvfp4_kernel": 3,
    "_compress_rows_kernel": 1,
    "_decode_schedule_kernel": 1,
}


def serving_steps() -> list[ServingStep]:
    """Batches of other shapes than :data:`WARM_STEP`'s on the same model: 1, 2, 3, 17 and 64
    decoding requests; 0, 1, 5, 16 and 33 decodes before 1 to 3 prefills (the prefills' first
    token; HCA list and prefill index widths following their lengths; a whole prompt among
    them); padding rows; the same batches as micro-batches, views from request and token
    offsets 1 to 17; and block tables 16, 33 and 1 pages wide."""
    gen = torch.Generator().manual_seed(zlib.crc32(b"serving steps"))
    top = ServingStand.MAX_LEN

    def contexts(count: int, room: int) -> tuple[int, ...]:
        return tuple(int(c) for c in torch.randint(0, top - room, (count,), generator=gen))

    steps = []
    for reqs, padding in ((1, 0), (2, 3), (3, 1), (17, 0), (64, 5)):
        steps.append(ServingStep(contexts(reqs, 1), (1,) * reqs, padding))
    for decodes, query_lens in (
        (0, (37,)),
        (1, (5, 60)),
        (5, (2, 17, 4)),
        (16, (100,)),
        (33, (9, 48)),
    ):
        context = contexts(decodes + len(query_lens), 100)
        context = (*context[:decodes], 0, *context[decodes + 1 :])  # a whole prompt
        steps.append(ServingStep(context, (1,) * decodes + query_lens, decodes % 3))
    offsets = ((1, 1), (3, 5), (5, 17), (2, 2), (17, 3))
    for step, offset in zip(steps[1::2], offsets, strict=True):
        steps.append(ServingStep(step.context, step.query_lens, step.padding, offset))
    for step, width in zip(steps[4:7], (16, 33, 1), strict=True):
        steps.append(ServingStep(step.context, step.query_lens, step.padding, table_width=width))
    return steps


def fused_kernels(fused) -> dict[str, object]:
    """The kernels (``*_kernel`` JIT functions) of the modules in ``fused``, by name."""
    kernels = {}
    for module in vars(fused).values():
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "fn"):
                kernels[name] = value
    return kernels


def fused_modules():
    """The modules of :mod:`dsv4_attn.fused`, imported when first asked for (Triton reads
    ``TRITON_INTERPRET`` at import)."""
    from types import SimpleNamespace

    from dsv4_attn.fused import (
        compressor,
        decode_schedule,
        kv_gather,
        kv_writers,
        prefill_index,
        step_metadata,
    )

    return SimpleNamespace(
        kv_writers=kv_writers,
        step_metadata=step_metadata,
        kv_gather=kv_gather,
        prefill_index=prefill_index,
        compressor=compressor,
        decode_schedule=decode_schedule,
    )


# ----------------------------------------------------------------------------------------------
# CPU: Triton's interpreter
# ----------------------------------------------------------------------------------------------

KINDS = ["normal", "mixed", "edges", "zero", "tiny", "near_zero"]


def _exact_bf16_widening(convert):
    """Triton's interpreter emulates float casts bit by bit, and widens bf16 subnormals wrongly
    (2^-133 to 0, 1.01e-39 to 4.41e-39); a GPU widens bf16 to fp32 exactly, by appending 16
    zero bits. ``convert`` (the interpreter's ``_convert_float``) with that one case done so."""
    import numpy as np
    import triton.language as tl

    def widen_exactly(data, src_type, dst_type, rounding_mode):
        if src_type == tl.bfloat16 and dst_type == tl.float32:
            return np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return convert(data, src_type, dst_type, rounding_mode)

    return widen_exactly


@pytest.fixture(autouse=True)
def _interpreter_on(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run through tests/test_fused.py (needs TRITON_INTERPRET=1 from the start)")
    from triton.runtime import interpreter

    monkeypatch.setattr(
        interpreter, "_convert_float", _exact_bf16_widening(interpreter._convert_float)
    )


def test_interpreter_widens_bf16_exactly():
    """The NVFP4 writers' rows of tiny values (bf16 subnormals) reach the kernels' fp32 math
    unchanged in the interpreter, as on a GPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def widen(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, tl.load(src + i).to(tl.float32))

    values = [2.0**-133, -(2.0**-133), 1.0101904577379033e-39, 3e-39, 1e-37, 1.0, -0.0, 0.0]
    x = torch.tensor(values, dtype=torch.bfloat16)
    got = torch.zeros(8)
    widen[(1,)](x, got, N=8)
    assert torch.equal(got.view(torch.int32), x.float().view(torch.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_staged_rows_interpreted(kind):
    check_staged_rows(fused_modules(), "cpu", kind, seed=KINDS.index(kind))


@pytest.mark.parametrize("q_norm", [True, False], ids=["v4", "v41"])
@pytest.mark.parametrize(("heads", "padded"), [(6, 8), (8, 8)])
def test_insert_interpreted(heads, padded, q_norm):
    check_insert(fused_modules(), "cpu", heads, padded, seed=heads, q_norm=q_norm)


@pytest.mark.parametrize("kind", KINDS)
def test_gather_interpreted(kind):
    check_gather(fused_modules(), "cpu", kind, seed=KINDS.index(kind))


@pytest.mark.parametrize(
    ("ratio", "dtype"), [(4, torch.bfloat16), (4, torch.float32), (16, torch.bfloat16)]
)
def test_compress_rows_interpreted(ratio, dtype):
    check_compress_rows(fused_modules(), "cpu", ratio, dtype, seed=ratio)


@pytest.mark.parametrize("seed", range(3))
def test_prefill_index_interpreted(seed):
    check_prefill_index(fused_modules(), "cpu", seed)


@pytest.mark.parametrize("seed", range(4))
def test_metadata_interpreted(seed):
    check_metadata(fused_modules(), "cpu", seed)


def test_metadata_edges_interpreted():
    check_metadata_edges(fused_modules(), "cpu")


@pytest.mark.parametrize("seed", range(8))
def test_decode_schedule_interpreted(seed):
    check_decode_schedule(fused_modules(), "cpu", seed)
