"""DSV41NVFP4Attention on the CPU: vLLM's own V4.1 layers (built from the tiny V4.1 config), their
fp8_ds_mla caches filled with random rows, this package's decode and prefill paths against the
float64 reference on the rows the caches hold.

vLLM's V4.1 index kernels are Triton, which this host cannot launch; the tests stand them in by
torch functions written from their sources (``vllm/models/deepseek_v41/common/ops/cache_utils.py``:
``compute_global_topk_indices_and_lens``, ``dequantize_and_gather_k_cache``,
``combine_topk_swa_indices``), while the expected output is derived directly from cache slots,
positions and picks, not through those stand-ins. The same tests run on a Hopper GPU
(``pytest -m gpu``, vLLM's CUDA platform) with vLLM's real kernels and this package's CuTeDSL
decode and FMHA kernels, which also checks that the stand-ins say what vLLM's kernels do.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dsv4_attn import kv_cache, reference
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.layer_kind import Compressed
from dsv4_attn.testing import random_rows
from tests import vllm_glue_testing as vt

pytest.importorskip("vllm")

from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.utils.torch_utils import set_default_torch_dtype

from dsv4_attn.vllm_glue import attention_v41, kv_spec
from dsv4_attn.vllm_glue.attention_v41 import DSV41NVFP4Attention, v41_kv_format

FP8 = KVFormat.FP8_DS_MLA
SWA_BLOCK, CACHE_BLOCK, NUM_BLOCKS = 8, 16, 200  # tokens per page; pages per cache
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def where(request) -> torch.device:
    """Where the layers run: the CPU with the Triton stand-ins, or the GPU with vLLM's kernels
    (whichever platform vLLM runs on here)."""
    if request.param != vt.device().type:
        pytest.skip(f"vLLM runs on {vt.device().type} here")
    return torch.device(request.param)


@pytest.fixture(scope="module")
def config():
    vt._distributed_ready()
    return vt.engine_args(
        model=vt.tiny_v41_checkpoint(), attention_backend="DSV4_NVFP4", kv_cache_dtype="fp8"
    ).create_engine_config()


def _build(config, layer_id: int, where: torch.device) -> DSV41NVFP4Attention:
    """Layer ``layer_id`` of the tiny V4.1 model on ``where``; on the CPU its output
    projection's GPU setup (FP8 einsum recipe, warm-up registration: not under test) stood in."""
    from vllm.models.deepseek_v41.nvidia import flashmla

    tokens = config.scheduler_config.max_num_batched_tokens
    hf_config = config.model_config.hf_config
    topk = torch.full((tokens, hf_config.index_topk), -1, dtype=torch.int32, device=where)
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_current_vllm_config(config))
        stack.enter_context(vt._cpu_events())
        stack.enter_context(set_default_torch_dtype(torch.bfloat16))
        stack.enter_context(where)
        if where.type == "cpu":
            stand_in = ((1, 1, 128), False)
            stack.enter_context(
                mock.patch.object(flashmla, "compute_fp8_einsum_recipe", lambda b: stand_in)
            )
            stack.enter_context(
                mock.patch.object(flashmla, "register_dsv41_o_proj_warmup", lambda layer: None)
            )
        return DSV41NVFP4Attention(
            config, prefix=f"model.layers.{layer_id}.attn", topk_indices_buffer=topk
        )


@pytest.fixture(scope="module")
def layers(config, where) -> dict[int, DSV41NVFP4Attention]:
    """One layer per V4.1 ratio: 0 (window only), 2 and 1."""
    ratios = list(vt.V41_RATIOS)
    return {r: _build(config, ratios.index(r), where) for r in (0, 2, 1)}


@pytest.fixture
def stand_ins(where, monkeypatch) -> None:
    """vLLM's V4.1 index kernels stood in on the CPU (Triton cannot launch there)."""
    if where.type == "cpu":
        monkeypatch.setattr(attention_v41, "compute_global_topk_indices_and_lens", _global_topk)
        monkeypatch.setattr(attention_v41, "dequantize_and_gather_k_cache", _gather)
        monkeypatch.setattr(attention_v41, "combine_topk_swa_indices", _combine)


def test_only_fp8_caches_are_served():
    for value in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        assert v41_kv_format(value) is FP8
    with pytest.raises(ValueError, match=r"fp8 KV caches only.*--kv-cache-dtype 'auto' \(nvfp4\)"):
        v41_kv_format("auto")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'int8'; accepted: auto"):
        v41_kv_format("int8")


def test_nvfp4_is_refused_at_model_build():
    nvfp4 = vt.engine_args(
        model=vt.tiny_v41_checkpoint(), attention_backend="DSV4_NVFP4", kv_cache_dtype="auto"
    ).create_engine_config()
    with pytest.raises(ValueError, match=r"DeepSeek-V4\.1 with fp8 KV caches only"):
        _build(nvfp4, 1, vt.device())


def test_layer_kinds(layers):
    assert layers[0].compressed_entries is None and not layers[0]._top_k
    assert layers[2].compressed_entries == Compressed(2, True)
    assert layers[1].compressed_entries == Compressed(1, True)


# --- vLLM's V4.1 index kernels, written in torch from their Triton sources ----------------------


def _global_topk(local, token_req, block_table, per_block, valid):
    """``compute_global_topk_indices_and_lens``: local entry j of a token's request -> slot
    ``block_table[req, j // per_block] * per_block + j % per_block``; length = valid picks,
    0 for padding tokens."""
    rows = block_table[token_req.long()]
    safe = local.clamp(min=0).long()
    slots = rows.gather(1, safe // per_block) * per_block + safe % per_block
    slots = torch.where(local >= 0, slots, -1).to(local.dtype)
    lens = torch.where(valid, (local >= 0).sum(1), 0).to(torch.int32)
    return slots, lens


def _gather(out, cache, seq_lens, gather_lens, block_table, block_size, offset):
    """``dequantize_and_gather_k_cache``: request i's last ``gather_lens[i]`` (all, if None) of
    its ``seq_lens[i]`` rows, dequantized, into ``out[i, offset:]``."""
    pages = kv_spec.paged_view(cache, FP8, block_size)
    for i in range(seq_lens.shape[0]):
        seq = int(seq_lens[i])
        n = seq if gather_lens is None else int(gather_lens[i])
        pos = torch.arange(seq - n, seq)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        out[i, offset : offset + n] = kv_cache.read(pages, slots, FP8, block_size)


def _combine(topk, query_start, seq_lens, gather_lens, window, ratio, top_k, M, N, out):
    """``combine_topk_swa_indices``: per token, its first ``min((pos+1)//ratio, top_k)`` picks
    (those in ``[0, N)``, else -1) at ``M * b + j``, then its window's rows at ``M * b + N +
    (p - gather_start)``."""
    indices, lens = out
    indices.fill_(-1)
    base = int(query_start[0])
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(query_start[b]) - base, int(query_start[b + 1]) - base
        seq, gather = int(seq_lens[b]), int(gather_lens[b])
        for t in range(q0, q1):
            pos = seq - (q1 - q0) + (t - q0)
            k = max(min((pos + 1) // ratio, top_k), 0) if ratio > 0 else 0
            picks = topk[t, :k]
            indices[t, :k] = torch.where((picks >= 0) & (picks < N), picks + M * b, -1)
            start = max(pos - window + 1, 0, seq - gather)
            rows = torch.arange(start, pos + 1)
            indices[t, k : k + rows.numel()] = M * b + N + rows - (seq - gather)
            lens[t] = k + rows.numel()
    return indices, lens


# --- caches and expected outputs --------------------------------------------------------------


def _vllm_cache(rows_per_block: int, gen, where) -> torch.Tensor:
    """An fp8_ds_mla cache as vLLM binds it, ``uint8 [NUM_BLOCKS, rows_per_block, 584]`` over
    padded pages, every row random."""
    page = kv_cache.page_layout(FP8, rows_per_block).page_bytes
    row = kv_cache.bytes_per_token(FP8)
    storage = torch.zeros(NUM_BLOCKS * page, dtype=torch.uint8, device=where)
    cache = storage.as_strided((NUM_BLOCKS, rows_per_block, row), (page, row, 1))
    n = NUM_BLOCKS * rows_per_block
    pages = kv_spec.paged_view(cache, FP8, rows_per_block)
    kv_cache.write(
        pages, torch.arange(n, device=where), random_rows(n, gen, where), FP8, rows_per_block
    )
    return cache


def _caches(layer, gen, where):
    """Fresh caches of random rows for the layer's window and (ratio > 0) compressed entries,
    the window's bound where the layer reads it; random sinks. Returns ``(window pages,
    compressed pages or None, entries per compressed page, compressed cache or None)``."""
    per_block = CACHE_BLOCK // layer.compress_ratio if layer.compress_ratio else 0
    layer.swa_cache_layer.kv_cache = _vllm_cache(SWA_BLOCK, gen, where)
    swa = kv_spec.paged_view(layer.swa_cache_layer.kv_cache, FP8, SWA_BLOCK)
    cache = _vllm_cache(per_block, gen, where) if per_block else None
    compressed = kv_spec.paged_view(cache, FP8, per_block) if per_block else None
    with torch.no_grad():
        layer.attn_sink.copy_(torch.randn(layer.attn_sink.shape, generator=gen))
    return swa, compressed, per_block, cache


def _tables(gen, reqs: int, pages: int) -> torch.Tensor:
    """Block tables of distinct shuffled pages, ``int32 [reqs, pages]``."""
    return torch.randperm(NUM_BLOCKS, generator=gen)[: reqs * pages].view(reqs, pages).int()


def _expected(layer, q, swa, compressed, per_block, keys):
    """float64 reference: ``keys[t] = (window slots, compressed slots)`` of token t, read back
    from the caches."""
    T = q.shape[0]
    width = max([len(w) for w, _ in keys] + [1])
    extra_width = max([len(c) for _, c in keys] + [1])
    win = torch.full((T, width), -1, dtype=torch.long)
    ext = torch.full((T, extra_width), -1, dtype=torch.long)
    for t, (w, c) in enumerate(keys):
        win[t, : len(w)] = torch.tensor(w, dtype=torch.long)
        ext[t, : len(c)] = torch.tensor(c, dtype=torch.long)
    win_rows = kv_cache.read(swa, win.clamp(min=0).flatten().to(swa.device), FP8, SWA_BLOCK)
    local = torch.arange(win.numel()).view(win.shape)
    extra = ()
    if compressed is not None:
        rows = kv_cache.read(compressed, ext.clamp(min=0).flatten().to(swa.device), FP8, per_block)
        rows = rows.cpu()
        idx = torch.arange(ext.numel()).view(ext.shape)
        extra = (rows, torch.where(ext >= 0, idx, -1), torch.tensor([len(c) for _, c in keys]))
    out, _ = reference.sparse_attention(
        q.cpu(),
        win_rows.cpu(),
        torch.where(win >= 0, local, -1),
        torch.tensor([len(w) for w, _ in keys]),
        layer.attn_sink.detach().cpu(),
        layer.scale,
        *extra,
    )
    return out


def _picks(gen, visible: int, top_k: int) -> list[int]:
    """The indexer's picks for a token seeing ``visible`` entries: distinct, valid first."""
    n = min(visible, top_k)
    return torch.randperm(visible, generator=gen)[:n].tolist() if n else []


def _close(output, ref):
    assert torch.isfinite(output.float()).all()
    output = output.double().cpu()
    torch.testing.assert_close(output, ref, rtol=2**-7, atol=1e-3 * ref.abs().max())


@pytest.mark.parametrize("ratio", [0, 2, 1])
def test_decode_matches_reference(layers, where, stand_ins, ratio):
    """Three decode requests and a padding row through ``_forward_decode``: each token's window
    (vLLM's ``decode_swa_indices``) and its picks' compressed entries, one softmax with the
    sink; the padding row sees nothing (output 0)."""
    layer = layers[ratio]
    gen = torch.Generator().manual_seed(41 + ratio)
    swa, compressed, per_block, cache = _caches(layer, gen, where)
    seq_lens = [300, 9, 140]
    pages = 40
    swa_table, table = _tables(gen, 3, pages), _tables(gen, 3, pages)
    T, H, W = 4, layer.padded_heads, layer.window_size
    top_k = layer.topk_indices_buffer.shape[1]
    swa_idx = torch.full((T, 1, W), -1, dtype=torch.int32)
    swa_lens = torch.zeros(T, dtype=torch.int32)
    picks_buffer = torch.full((T, top_k), -1, dtype=torch.int32)
    keys = []
    for t, seq in enumerate(seq_lens):
        pos = torch.arange(max(seq - W, 0), seq)
        slots = (swa_table[t, pos // SWA_BLOCK] * SWA_BLOCK + pos % SWA_BLOCK).tolist()
        swa_idx[t, 0, : len(slots)] = torch.tensor(slots)
        swa_lens[t] = len(slots)
        entries = []
        if ratio:
            picks = _picks(gen, seq // ratio, top_k)
            picks_buffer[t, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
            entries = [int(table[t, j // per_block]) * per_block + j % per_block for j in picks]
        keys.append((slots, entries))
    keys.append(([], []))
    layer.topk_indices_buffer[:T] = picks_buffer.to(where)
    swa_md = SimpleNamespace(
        num_decode_tokens=T,
        num_decodes=3,
        decode_swa_indices=swa_idx.to(where),
        decode_swa_lens=swa_lens.to(where),
        token_to_req_indices=torch.tensor([0, 1, 2, 0], dtype=torch.int32, device=where),
        is_valid_token=torch.tensor([True, True, True, False], device=where),
        block_size=SWA_BLOCK,
    )
    attn_md = SimpleNamespace(block_size=CACHE_BLOCK, block_table=table.to(where))
    q = (torch.randn(T, H, 512, generator=gen) * 0.5).to(torch.bfloat16)
    output = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=where)
    layer._forward_decode(
        q.to(where), cache, swa_md, attn_md if ratio else None, ratio == 0, output
    )
    _close(output, _expected(layer, q, swa, compressed, per_block, keys))
    assert (output[3] == 0).all()


@pytest.mark.parametrize("ratio", [0, 2, 1])
def test_prefill_matches_reference(layers, where, stand_ins, ratio, monkeypatch):
    """Three prefill requests after a decode token, in two chunks: a whole prompt, a later chunk
    of a long one (prefix 200) and one whose window starts at a replay boundary (vLLM's gather
    length cut to the query + 5 rows): each token's picks and window, as gathered."""
    layer = layers[ratio]
    monkeypatch.setattr(layer, "PREFILL_CHUNK_SIZE", 2)
    gen = torch.Generator().manual_seed(410 + ratio)
    swa, compressed, per_block, cache = _caches(layer, gen, where)
    W, H = layer.window_size, layer.padded_heads
    top_k = layer.topk_indices_buffer.shape[1]
    seq_lens, query_lens = [70, 260, 90], [70, 60, 30]
    gather_lens = [70, 60 + W - 1, 30 + 5]  # no prefix; prefix 200 (a full window); replay
    pages = 40
    swa_table, table = _tables(gen, 4, pages), _tables(gen, 4, pages)
    T = 1 + sum(query_lens)  # token 0: a decode, not prefilled here
    picks_buffer = torch.full((T, top_k), -1, dtype=torch.int32)
    keys, t = [([], [])], 1
    for b, (seq, qlen, gather) in enumerate(zip(seq_lens, query_lens, gather_lens, strict=True)):
        for pos in range(seq - qlen, seq):
            entries = []
            if ratio:
                picks = _picks(gen, (pos + 1) // ratio, top_k)
                picks_buffer[t, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
                r = b + 1
                entries = [int(table[r, j // per_block]) * per_block + j % per_block for j in picks]
            window = range(max(pos - W + 1, 0, seq - gather), pos + 1)
            r = b + 1
            slots = [int(swa_table[r, p // SWA_BLOCK]) * SWA_BLOCK + p % SWA_BLOCK for p in window]
            keys.append((slots, entries))
            t += 1
    layer.topk_indices_buffer[:T] = picks_buffer.to(where)
    seqs = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, 1, 71, 131, 161], dtype=torch.int32)

    def plan(compress_ratio, prefill_chunk_size, has_compressed):
        assert (compress_ratio, prefill_chunk_size, has_compressed) == (ratio, 2, ratio > 0)
        n = [s // ratio if ratio else 0 for s in seq_lens]
        return [(0, 2, max(n[:2]), max(n[:2]) + max(gather_lens[:2])), (2, 3, n[2], n[2] + 35)]

    swa_md = SimpleNamespace(
        num_decodes=1,
        num_decode_tokens=1,
        num_prefill_tokens=T - 1,
        prefill_seq_lens=seqs.to(where),
        prefill_gather_lens=torch.tensor(gather_lens, dtype=torch.int32, device=where),
        query_start_loc_cpu=starts,
        query_start_loc=starts.to(where),
        block_table=swa_table.to(where),
        block_size=SWA_BLOCK,
        get_prefill_chunk_plan=plan,
    )
    attn_md = SimpleNamespace(block_size=CACHE_BLOCK, block_table=table.to(where))
    q = (torch.randn(T, H, 512, generator=gen) * 0.5).to(torch.bfloat16)
    output = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=where)
    swa_cache = layer.swa_cache_layer.kv_cache
    layer._forward_prefill(
        q[1:].to(where), None, cache, swa_cache, output[1:], attn_md if ratio else None, swa_md
    )
    ref = _expected(layer, q, swa, compressed, per_block, keys)
    _close(output[1:], ref[1:])
    assert torch.isnan(output[0].float()).all(), "the decode token's row is not the prefill's"


def test_profiling_run_reserves_what_both_paths_ask(config, layers, where, monkeypatch):
    """The profiling forward zeroes the output and reserves the peak decode and prefill scratch
    in vLLM's workspace; a real step's requests stay within it."""
    asked = []
    manager = SimpleNamespace(get_simultaneous=lambda *shapes: asked.append(shapes))
    monkeypatch.setattr(attention_v41, "_workspace_manager", lambda: manager)
    layer = layers[2]
    q = torch.randn(4, layer.padded_heads, 512, device=where).to(torch.bfloat16)
    output = torch.full_like(q, float("nan"))
    with set_forward_context(None, config):
        layer.forward_mqa(q, None, torch.arange(4), output)
    assert (output == 0).all()
    assert len(asked) == 2
    decode, chunk = asked
    # vLLM's three prefill views at their peak (as its FlashMLA layer reserves), then the lse.
    entries = -(-layer.max_model_len // 2)
    assert chunk[0] == (
        (layer.PREFILL_CHUNK_SIZE, entries + layer.window_size + layer.max_num_batched_tokens, 512),
        torch.bfloat16,
    )
    assert chunk[3] == ((layer.max_num_batched_tokens, layer.padded_heads), torch.float32)
    assert decode[0] == ((layer.max_num_batched_tokens, layer.padded_heads), torch.float32)
