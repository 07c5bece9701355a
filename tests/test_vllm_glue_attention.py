"""DSV4NVFP4Attention on CPU: real layers built by vLLM's selector, caches laid out by vLLM's
planner, metadata from the builders; forward_mqa against the float64 reference.

The caches are filled with random bytes first (NaN-prone for NVFP4/FP8 scales), so a read of any
slot the step does not own shows up in the output.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from tests import vllm_glue_testing as vt

pytest.importorskip("vllm")

from vllm.forward_context import set_forward_context

from dsv4_attn import kv_cache, ops, reference
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.testing import random_rows
from dsv4_attn.vllm_glue import kv_spec, prefill
from dsv4_attn.vllm_glue.attention import DSV4NVFP4Attention, check_supported
from dsv4_attn.vllm_glue.metadata import (
    DSV4CompressedMetadataBuilder,
    DSV4SWAMetadataBuilder,
)
from dsv4_attn.vllm_glue.writers import DSV4NVFP4Compressor, qnorm_rope

KV_DTYPES = {"auto": KVFormat.NVFP4, "fp8": KVFormat.FP8_DS_MLA}


def poison(model: vt.TinyModel, gen: torch.Generator) -> None:
    """Random bytes over the whole KV buffer (all layers' views share it)."""
    any_view = next(iter(model.kv_caches.values()))
    raw = torch.empty(0, dtype=torch.uint8, device=any_view.device)
    raw.set_(any_view.untyped_storage())
    noise = torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8)
    raw.copy_(noise.to(raw.device))


class Builders:
    """One pair of metadata builders for a layer (a model runner keeps its builders: their
    buffers are what CUDA graphs replay)."""

    def __init__(self, layer) -> None:
        config = layer_config(layer)
        spec = layer.swa_cache_layer.get_kv_cache_spec(config)
        self.swa = DSV4SWAMetadataBuilder(spec, [], config, vt.device())
        self.compressed = None
        if layer.compress_ratio > 1:
            spec = layer.get_kv_cache_spec(config)
            self.compressed = DSV4CompressedMetadataBuilder(
                spec, [layer.prefix], config, vt.device()
            )
        self.layer = layer

    def build(self, batch: vt.Batch) -> dict:
        out = {self.layer.swa_cache_layer.prefix: self.swa.build(0, batch.swa_cm)}
        if self.compressed is not None:
            out[self.layer.prefix] = self.compressed.build(0, batch.cache_cm)
        return out


def build_metadata(layer, batch: vt.Batch) -> dict:
    return Builders(layer).build(batch)


def layer_config(layer):
    for kv_dtype in KV_DTYPES:
        model = vt.tiny_model(kv_dtype)
        if any(m is layer for m in model.layers.values()):
            return model.vllm_config
    raise AssertionError("unknown layer")


def write_step_rows(layer, batch: vt.Batch, gen: torch.Generator, back: int = vt.WINDOW - 1):
    """Random rows at every SWA slot the step's tokens may see (from ``back`` positions before
    each request's first query token: its window; a DSpark block reaches one further) and at
    every compressed slot the requests own (checked writer)."""
    fmt = layer.kv_format
    swa = [
        vt.slot(batch.swa_block_table, r, p, vt.SWA_BLOCK)
        for r, (s, q) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True))
        for p in range(max(0, s - q - back), s)
    ]
    where = layer.swa_pages().device
    rows = random_rows(len(swa), gen, where)
    kv_cache.write(layer.swa_pages(), torch.tensor(swa, device=where), rows, fmt, 64)
    if layer.compress_ratio > 1:
        per_block = layer.compressed_rows_per_block
        entries = [
            vt.slot(batch.cache_block_table, r, i, per_block)
            for r, s in enumerate(batch.seq_lens)
            for i in range(s // layer.compress_ratio)
        ]
        if entries:
            rows = random_rows(len(entries), gen, where)
            slots = torch.tensor(entries, device=where)
            kv_cache.write(layer.compressed_pages(), slots, rows, fmt, per_block)


def expected_output(layer, batch, q, local_topk) -> torch.Tensor:
    """float64 reference on rows read back from the caches at brute-force slots."""
    fmt, T = layer.kv_format, batch.num_tokens
    where = layer.swa_pages().device
    win_slots, win_lens = vt.brute_window(batch)
    win_slots = torch.tensor(win_slots, device=where)
    swa_rows = kv_cache.read(layer.swa_pages(), win_slots.flatten(), fmt, 64)
    local = torch.arange(win_slots.numel(), device=where).view(win_slots.shape)
    extra = ()
    if layer.compress_ratio > 1:
        if layer.compress_ratio == 4:
            slots, lens = vt.brute_local(batch, local_topk.cpu())
        else:
            slots, lens = vt.brute_visible(batch, 128, max(1, max(batch.seq_lens) // 128))
        slots = torch.tensor(slots, device=where)
        rows = kv_cache.read(
            layer.compressed_pages(), slots.flatten(), fmt, layer.compressed_rows_per_block
        )
        idx = torch.arange(slots.numel(), device=where).view(slots.shape)
        extra = (rows, torch.where(slots >= 0, idx, -1), torch.tensor(lens, device=where))
    out, _ = reference.sparse_attention(
        q,
        swa_rows,
        torch.where(win_slots >= 0, local, -1),
        torch.tensor(win_lens, device=where),
        layer.attn_sink.detach(),
        layer.scale,
        *extra,
    )
    assert out.shape[0] == T
    return out


def step_inputs(model, layer, batch: vt.Batch, gen: torch.Generator):
    """A step's random inputs: rows at every slot its tokens see, random sinks, q (bf16
    ``[T, padded_heads, 512]``) and, for a CSA layer, the indexer's picks in the model's top-k
    buffer. Returns ``(q, picks or None)``."""
    write_step_rows(layer, batch, gen)
    with torch.no_grad():
        layer.attn_sink[: vt.NUM_HEADS] = torch.randn(vt.NUM_HEADS, generator=gen)
    T, H = batch.num_tokens, layer.padded_heads
    q = (torch.randn(T, H, 512, generator=gen) * 0.5).to(torch.bfloat16)
    local_topk = None
    if layer.compress_ratio == 4:
        local_topk = vt.random_local_topk(gen, batch, vt.INDEX_TOPK)
        model.topk_indices_buffer[:T] = local_topk
    return q, local_topk


BATCHES = {
    "mixed": ([5, 300, 129], [1, 3, 129]),
    "chunked_prefill_long": ([1300, 700], [1, 90]),
    "short_requests": ([1, 2, 127], [1, 2, 60]),
    # Prefills of every kind in one step: whole prompts, prefix-cache hits / later chunks (seq >
    # query), shorter than the window, longer than top-k; several per gather chunk.
    "many_prefills": ([9, 700, 40, 1029, 260, 130], [1, 700, 40, 229, 130, 2]),
}
# Gather-workspace rows per prefill chunk (None: the layer's own budget, one chunk here); 300
# splits the step into one or two requests per chunk.
CHUNK_ROWS = {"one_chunk": None, "small_chunks": 300}


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("ratio", vt.RATIOS)
@pytest.mark.parametrize(
    ("batch_name", "chunk_rows"),
    [(name, "one_chunk") for name in BATCHES] + [("many_prefills", "small_chunks")],
)
def test_forward_mqa_matches_reference(kv_dtype, ratio, batch_name, chunk_rows, monkeypatch):
    if CHUNK_ROWS[chunk_rows] is not None:
        monkeypatch.setattr(
            DSV4NVFP4Attention, "_prefill_budget", lambda self: CHUNK_ROWS[chunk_rows]
        )
    model = vt.tiny_model(kv_dtype)
    layer = model.layers[ratio]
    assert isinstance(layer, DSV4NVFP4Attention) and layer.kv_format is KV_DTYPES[kv_dtype]
    gen = torch.Generator().manual_seed(ratio * 7 + len(batch_name))
    seq_lens, query_lens = BATCHES[batch_name]
    batch = vt.make_batch(gen, seq_lens, query_lens, padding=2, num_blocks=300)
    poison(model, gen)
    q, local_topk = step_inputs(model, layer, batch, gen)
    T, H = batch.num_tokens, layer.padded_heads
    output = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)

    with set_forward_context(build_metadata(layer, batch), model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, output)

    ref = expected_output(layer, batch, q, local_topk)
    assert torch.isfinite(output.float()).all()
    real = len(batch.positions())
    assert (output[real:] == 0).all(), "padding rows have no keys: output 0"
    torch.testing.assert_close(output.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max())


def test_prefill_chunks_are_planned_once_per_step_and_ratio(monkeypatch):
    """The host chunk plan is made by the first layer of a step and reused by the next ones
    (same metadata); a new step plans again. Outputs are the same either way."""
    model = vt.tiny_model("auto")
    layer = model.layers[128]
    gen = torch.Generator().manual_seed(3)
    seq_lens, query_lens = BATCHES["many_prefills"]
    batch = vt.make_batch(gen, seq_lens, query_lens, padding=2, num_blocks=300)
    write_step_rows(layer, batch, gen)
    calls = []
    real_plan = prefill.plan_chunks

    def spy(*args):
        calls.append(args)
        return real_plan(*args)

    monkeypatch.setattr(prefill, "plan_chunks", spy)
    q = torch.randn(batch.num_tokens, layer.padded_heads, 512, generator=gen).to(torch.bfloat16)
    outputs = [torch.full_like(q, float("nan")) for _ in range(3)]
    metadata = build_metadata(layer, batch)
    with set_forward_context(metadata, model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, outputs[0])
        layer.forward_mqa(q, None, batch.swa_cm.positions, outputs[1])  # the next layer
    assert len(calls) == 1
    with set_forward_context(build_metadata(layer, batch), model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, outputs[2])  # the next step
    assert len(calls) == 2
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    assert torch.isfinite(outputs[0].float()).all()


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("batch_name", ["decode_only", "mixed"])
def test_forward_mqa_on_the_balanced_plan(kv_dtype, batch_name, monkeypatch):
    """An HCA layer whose step metadata carries a balanced plan hands it to the attention with
    the window lengths the plan counted (the torch fallback runs here and ignores the plan's
    work split: the output is the reference's either way)."""
    from dsv4_attn.vllm_glue import balanced

    monkeypatch.setenv(balanced.SCHEDULE_ENV, "balanced")
    model = vt.tiny_model(kv_dtype)
    layer = model.layers[128]
    gen = torch.Generator().manual_seed(17)
    seq_lens, query_lens = {"decode_only": ([900, 17, 300, 128, 2], [1] * 5), **BATCHES}[batch_name]
    batch = vt.make_batch(gen, seq_lens, query_lens, padding=2, num_blocks=300)
    write_step_rows(layer, batch, gen)
    builders = Builders(layer)
    planner = vt.attach_planner(builders.compressed, layer.padded_heads, num_parts=6)
    calls = []
    real_op = ops.sparse_attention

    def spy(q, window, sink, scale, extra, **kwargs):
        calls.append((window, kwargs["plan"]))
        return real_op(q, window, sink, scale, extra, **kwargs)

    monkeypatch.setattr(ops, "sparse_attention", spy)
    T, H = batch.num_tokens, layer.padded_heads
    q = (torch.randn(T, H, 512, generator=gen) * 0.5).to(torch.bfloat16)
    output = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    metadata = builders.build(batch)
    plan = metadata[layer.prefix].decode_plan
    assert plan is not None
    with set_forward_context(metadata, model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, output)
    window, got_plan = calls[0]
    assert got_plan is plan
    assert window.lens.data_ptr() == planner.window_lens.data_ptr()
    assert window.lens.shape[0] == plan.token_plan.shape[0]
    ref = expected_output(layer, batch, q, None)
    torch.testing.assert_close(output.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max())


def test_forward_mqa_calls_ops_without_value_checks(monkeypatch):
    """No host sync in the hot path: ops.sparse_attention gets check_values=False."""
    model = vt.tiny_model("auto")
    layer = model.layers[128]
    batch = vt.make_batch(torch.Generator().manual_seed(5), [300], [1], num_blocks=300)
    calls = []
    real_op = ops.sparse_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_op(*args, **kwargs)

    monkeypatch.setattr(ops, "sparse_attention", spy)
    q = torch.randn(1, layer.padded_heads, 512).to(torch.bfloat16)
    out = torch.empty_like(q)
    with set_forward_context(build_metadata(layer, batch), model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, out)
    assert len(calls) == 1 and calls[0]["check_values"] is False


def _decode_step(model, layer, gen, seq_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of ``layer`` (a token per request) over fresh rows; returns the layer's
    output and the float64 reference."""
    batch = vt.make_batch(gen, seq_lens, [1] * len(seq_lens), num_blocks=300)
    write_step_rows(layer, batch, gen)
    q = (torch.randn(batch.num_tokens, layer.padded_heads, 512, generator=gen) * 0.5).to(
        torch.bfloat16
    )
    out = torch.full_like(q, float("nan"))
    with set_forward_context(build_metadata(layer, batch), model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, out)
    return out, expected_output(layer, batch, q, None)


@pytest.mark.parametrize("first_runs_kernel", [True, False])
def test_decode_goes_straight_to_the_kernel_once_the_first_call_ran_it(
    first_runs_kernel, monkeypatch
):
    """The first decode call goes through ops.sparse_attention (validation, dispatch, a logged
    fallback). Once that ran the kernel, later calls skip ops and call the kernel's entry with
    the same arguments; after a fallback every call stays on ops. (The kernel is stood in for
    by the torch fallback writing into the given out/lse, so the output is still checked.)"""
    from dsv4_attn import fallback
    from dsv4_attn.kernels import sparse_decode

    model = vt.tiny_model("auto")
    layer = model.layers[128]
    monkeypatch.setattr(layer, "_decode_kernel", None)  # layers are shared by the test run
    if first_runs_kernel:
        monkeypatch.setattr(ops, "_cutedsl_unsupported_reason", lambda *args: None)
    kernel_calls, op_calls = [], []

    def kernel(q, window, sink, scale, extra=None, *, out, lse, workspace, plan):
        kernel_calls.append({"q": q, "window": window, "extra": extra, "out": out})
        result, result_lse = fallback.sparse_attention(q, window, sink, scale, extra)
        out.copy_(result)
        lse.copy_(result_lse)
        return out, lse

    real_op = ops.sparse_attention

    def op(*args, **kwargs):
        op_calls.append(kwargs)
        return real_op(*args, **kwargs)

    monkeypatch.setattr(sparse_decode, "sparse_attention", kernel)
    monkeypatch.setattr(ops, "sparse_attention", op)
    gen = torch.Generator().manual_seed(11)
    for step, seq_lens in enumerate(([300, 45], [900, 129, 7])):
        out, ref = _decode_step(model, layer, gen, seq_lens)
        torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max())
        assert len(op_calls) == (1 if first_runs_kernel else step + 1)
        assert len(kernel_calls) == (step + 1 if first_runs_kernel else 0)
    if first_runs_kernel:  # the direct call's inputs: this step's rows and the caches' pages
        direct = kernel_calls[1]
        assert direct["q"].shape[0] == 3 and direct["out"].shape[0] == 3
        assert direct["window"].cache is layer.swa_pages()
        assert direct["extra"].cache is layer.compressed_pages()
        assert direct["window"].fmt is direct["extra"].fmt is layer.kv_format


def spec_builders(layer, tokens_per_request: int) -> Builders:
    """The layer's builders as a server speculating ``tokens_per_request - 1`` tokens makes
    them: vLLM's split counts requests of up to that many tokens as decodes."""
    builders = Builders(layer)
    builders.swa.decode_threshold = tokens_per_request
    if builders.compressed is not None:
        builders.compressed.decode_threshold = tokens_per_request
    return builders


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("ratio", vt.RATIOS)
def test_spec_decode_steps_run_every_token_through_the_decode_path(kv_dtype, ratio, monkeypatch):
    """An MTP verification step: every request brings 1 + 2 tokens, a uniform batch vLLM
    counts as decodes. All of them go through the decode path (no prefill chunk), each token
    with its own causal window and compressed entries, and match the float64 reference."""
    model = vt.tiny_model(kv_dtype)
    layer = model.layers[ratio]
    gen = torch.Generator().manual_seed(50 + ratio + len(kv_dtype))
    poison(model, gen)
    batch = vt.make_batch(gen, [3, 130, 300, 1029], [3] * 4, padding=2, num_blocks=300)
    q, local_topk = step_inputs(model, layer, batch, gen)
    T, H = batch.num_tokens, layer.padded_heads
    metadata = spec_builders(layer, 3).build(batch)
    swa = metadata[layer.swa_cache_layer.prefix]
    assert (swa.num_decodes, swa.num_prefills, swa.num_decode_tokens) == (4, 0, T)

    def no_prefill(*args, **kwargs):
        raise AssertionError("a spec-decode step took the prefill path")

    monkeypatch.setattr(layer, "_forward_prefill", no_prefill)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    with set_forward_context(metadata, model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, out)
    ref = expected_output(layer, batch, q, local_topk)
    real = len(batch.positions())
    assert (out[real:] == 0).all()
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max())


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_a_dspark_draft_block_attends_to_the_whole_block(kv_dtype, monkeypatch):
    """A DSpark draft step (non-causal metadata) through a SWA layer: every token of a block
    sees the window before the block and all the block's tokens, later ones included; the
    output matches the float64 reference on exactly those rows. Lists wider than the window
    reach the kernel's scratch sizing too (the layer sizes it from the lists it gets)."""
    from dsv4_attn.vllm_glue import metadata as metadata_module

    width = 192  # vLLM's padded width for a 128-token window and 4 draft tokens
    monkeypatch.setattr(metadata_module, "dspark_window_width", lambda config, window: width)
    model = vt.tiny_model(kv_dtype)
    layer = model.layers[1]
    builder = Builders(layer).swa
    builder.decode_threshold = 4  # a block of 4 draft tokens is one decode
    gen = torch.Generator().manual_seed(40 + len(kv_dtype))
    poison(model, gen)
    batch = vt.make_batch(gen, [4, 131, 300, 133], [4] * 4, padding=2, num_blocks=300)
    write_step_rows(layer, batch, gen, back=vt.WINDOW)
    with torch.no_grad():
        layer.attn_sink[: vt.NUM_HEADS] = torch.randn(vt.NUM_HEADS, generator=gen)
    T, H = batch.num_tokens, layer.padded_heads
    q = (torch.randn(T, H, 512, generator=gen) * 0.5).to(torch.bfloat16)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    md = builder.build(0, dataclasses.replace(batch.swa_cm, causal=False))
    assert md.swa_indices.shape[1] == width and md.num_decode_tokens == T
    with set_forward_context({layer.swa_cache_layer.prefix: md}, model.vllm_config):
        layer.forward_mqa(q, None, batch.swa_cm.positions, out)

    spans = [range(max(0, s - 4 - vt.WINDOW), s) for s in batch.seq_lens]
    token_req = [r for r, _ in batch.positions()]
    slots = [
        vt.padded([vt.slot(batch.swa_block_table, r, p, vt.SWA_BLOCK) for p in spans[r]], width)
        for r in token_req
    ]
    slots = torch.tensor(slots)
    rows = kv_cache.read(layer.swa_pages(), slots.flatten(), layer.kv_format, vt.SWA_BLOCK)
    local = torch.arange(slots.numel()).view(slots.shape)
    ref, _ = reference.sparse_attention(
        q[: len(token_req)],
        rows,
        torch.where(slots >= 0, local, -1),
        torch.tensor([len(spans[r]) for r in token_req]),
        layer.attn_sink.detach(),
        layer.scale,
    )
    real = len(token_req)
    assert (out[real:] == 0).all()
    got = out[:real].double()
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-3 * ref.abs().max())


def test_dspark_context_rows_land_in_nvfp4(monkeypatch):
    """DSpark's context KV through vLLM's own function (hooked): the rows of an NVFP4 layer
    are RoPE'd and NVFP4-encoded at their slots, exactly as the step's own rows; slots -1
    write nothing. An fp8_ds_mla layer is left to vLLM's writer."""
    import importlib

    from dsv4_attn import plugin
    from dsv4_attn.vllm_glue.writers import qnorm_rope

    plugin.register()
    dspark = importlib.import_module("vllm.models.deepseek_v4.nvidia.dspark")
    model = vt.tiny_model("auto")
    layer = model.layers[1]
    gen = torch.Generator().manual_seed(77)
    poison(model, gen)
    kv = (torch.randn(6, 512, generator=gen) * 3).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 63, 64, 200, 7])
    slots = torch.tensor([3, 70, 130, -1, 4000, 9])
    untouched = kv_cache.read(layer.swa_pages(), slots[3:4].clamp(min=0), layer.kv_format, 64)
    dspark._insert_context_kv(layer, kv, positions, slots)
    _, roped = qnorm_rope(kv[:, None], kv, positions, layer.rotary_emb.cos_sin_cache, 1e-6, 1)
    data, scales = kv_cache.encode_rows(roped, KVFormat.NVFP4)
    want = kv_cache.decode_rows(data, scales, KVFormat.NVFP4)
    real = slots >= 0
    got = kv_cache.read(layer.swa_pages(), slots[real], layer.kv_format, 64)
    assert torch.equal(got, want[real])
    assert torch.equal(
        kv_cache.read(layer.swa_pages(), slots[3:4].clamp(min=0), layer.kv_format, 64), untouched
    )
    with pytest.raises(ValueError, match="vLLM's to write"):
        vt.tiny_model("fp8").layers[1].insert_context_rows(kv, positions, slots)


def test_profile_run_zeroes_output():
    layer = vt.tiny_model("auto").layers[4]
    out = torch.full((3, layer.padded_heads, 512), float("nan"), dtype=torch.bfloat16)
    with set_forward_context(None, vt.tiny_model("auto").vllm_config):
        layer.forward_mqa(torch.randn_like(out), None, torch.zeros(3, dtype=torch.long), out)
    assert (out == 0).all()


@pytest.mark.parametrize("ratio", vt.RATIOS)
def test_nvfp4_swa_insert_writes_kv_cache_bytes(ratio):
    """The NVFP4 replacement of vLLM's fused insert: q normed and roped, KV roped and written
    at the step's slots as kv_cache.write would, every other byte untouched."""
    model = vt.tiny_model("auto")
    layer = model.layers[ratio]
    gen = torch.Generator().manual_seed(11 + ratio)
    batch = vt.make_batch(gen, [70, 200], [3, 64], padding=1, num_blocks=300)
    poison(model, gen)
    T = batch.num_tokens
    q = torch.randn(T, vt.NUM_HEADS, 512, generator=gen).to(torch.bfloat16)
    kv = random_rows(T, gen)
    positions = batch.swa_cm.positions
    expected = layer.swa_pages().clone()
    q_ref, kv_ref = qnorm_rope(
        q, kv, positions, layer.rotary_emb.cos_sin_cache, layer.eps, layer.padded_heads
    )
    kv_cache.write(expected, batch.swa_cm.slot_mapping, kv_ref, KVFormat.NVFP4, 64)

    q_out = layer._fused_qnorm_rope_kv_insert(q, kv, positions, build_metadata(layer, batch))

    assert torch.equal(q_out, q_ref)
    assert torch.equal(layer.swa_pages(), expected)


def test_nvfp4_hca_compressor_stores_kernel_rows_in_nvfp4(monkeypatch):
    """HCA (fp32 state): vLLM's compressor kernel (CUDA-only, replaced by a stand-in that writes
    known rows where it is told to) feeds the staging rows; the layer's compressed cache gets
    them in NVFP4 at the compressed write slots, and nothing else changes."""
    ratio = 128
    model = vt.tiny_model("auto")
    layer = model.layers[ratio]
    assert isinstance(layer.compressor, DSV4NVFP4Compressor)
    assert layer.compressor.state_cache.dtype == torch.float32
    gen = torch.Generator().manual_seed(ratio)
    batch = vt.make_batch(gen, [400, 130, 9], [260, 2, 9], padding=3, num_blocks=300)
    poison(model, gen)
    T = batch.num_tokens
    token_rows = random_rows(T, gen)
    seen = {}

    def kernel(**kwargs):
        seen.update(kwargs)
        slots = kwargs["k_cache_metadata"].slot_mapping
        done = slots >= 0
        kwargs["kv_cache"][slots[done], 0] = token_rows[done]

    monkeypatch.setattr(DSV4NVFP4Compressor, "_store_rows_kernel", staticmethod(lambda: kernel))
    metadata = build_metadata(layer, batch)
    write_slots = metadata[layer.prefix].slot_mapping
    expected = layer.compressed_pages().clone()
    per_block = layer.compressed_rows_per_block
    kv_cache.write(expected, write_slots, token_rows, KVFormat.NVFP4, per_block)
    state = SimpleNamespace(
        slot_mapping=torch.zeros(T, dtype=torch.long),
        token_to_req_indices=None,
        block_table=None,
        block_size=8,
    )
    fp32_state = torch.zeros(1, 8, 1024)
    layer.compressor._compress_norm_rope_store(
        state, fp32_state, 512, batch.cache_cm.positions, layer.rotary_emb, metadata, {}
    )
    assert seen["store_full_kv"] is True and seen["store_full_fp8"] is False
    assert seen["compress_ratio"] == ratio and seen["head_dim"] == 512
    assert torch.equal(layer.compressed_pages(), expected)
    assert int((write_slots >= 0).sum()) > 0


def test_nvfp4_csa_compressor_rows_from_its_bf16_state():
    """CSA with an NVFP4 cache: the compressor's state is bf16 (its spec half the fp32 page),
    and each completed entry is the reference's row of that state (float64, one bf16 rounding
    apart), stored in NVFP4 at the compressed write slot; tokens that complete nothing and
    padding write nothing."""
    ratio, C, D = 4, 2, 512
    model = vt.tiny_model("auto")
    layer = model.layers[ratio]
    compressor = layer.compressor
    assert compressor.state_cache.dtype == torch.bfloat16
    spec = compressor.state_cache.get_kv_cache_spec(vt.engine_config())
    assert spec.dtype == torch.bfloat16 and spec.page_size_bytes == 4 * 2 * C * D * 2
    gen = torch.Generator().manual_seed(44)
    seq_lens, query_lens = [401, 130, 9], [261, 2, 9]
    batch = vt.make_batch(gen, seq_lens, query_lens, padding=3, num_blocks=300)
    poison(model, gen)
    T = batch.num_tokens
    # Each request's positions in a paged bf16 state of 4-position blocks (pages shuffled).
    width = -(-max(seq_lens) // 4)
    pages = torch.randperm(len(seq_lens) * width + 5, generator=gen)
    table = pages[: len(seq_lens) * width].view(len(seq_lens), width).int()
    state = torch.full((len(pages), 4, 2 * C * D), float("nan"), dtype=torch.bfloat16)
    per_request = []
    for r, n in enumerate(seq_lens):
        kv = torch.randn(n, C * D, generator=gen) * torch.exp(torch.randn(C * D, generator=gen))
        score = torch.randn(n, C * D, generator=gen) * 3
        for pos in range(n):
            state[table[r, pos // 4], pos % 4] = torch.cat([kv[pos], score[pos]]).bfloat16()
        per_request.append(state[table[r].long()].view(-1, 2 * C * D)[:n].float())
    positions = batch.cache_cm.positions
    token_req = torch.tensor([r for r, _ in batch.positions()] + [0] * 3, dtype=torch.int32)
    state_slots = torch.tensor([0] * (T - 3) + [-1] * 3)
    metadata = build_metadata(layer, batch)
    staging = metadata[layer.prefix].staging_rows
    write_slots = metadata[layer.prefix].slot_mapping
    layer.staging_rows.fill_(float("nan"))
    state_meta = SimpleNamespace(
        slot_mapping=state_slots, token_to_req_indices=token_req, block_table=table, block_size=4
    )
    compressor._compress_norm_rope_store(
        state_meta, state, C * D, positions, layer.rotary_emb, metadata, {}
    )
    cos_sin = layer.rotary_emb.cos_sin_cache
    done = 0
    expected = layer.compressed_pages().clone()
    for t, (r, pos) in enumerate(batch.positions()):
        if (pos + 1) % ratio:
            assert int(staging[t]) == -1
            continue
        rows = per_request[r]
        want = reference.compressed_entries(
            rows[: pos + 1, : C * D],
            rows[: pos + 1, C * D :],
            ratio,
            compressor.norm.weight,
            compressor.rms_norm_eps,
            cos_sin,
        )[pos // ratio]
        got = layer.staging_rows[t, 0].double()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
        kv_cache.write(
            expected,
            write_slots[t : t + 1],
            layer.staging_rows[t],
            KVFormat.NVFP4,
            layer.compressed_rows_per_block,
        )
        done += 1
    assert done > 50
    assert torch.equal(layer.compressed_pages(), expected)


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_kv_cache_specs_and_views(kv_dtype):
    """The specs vLLM's planner allocated from, and the page views the layers read through."""
    model = vt.tiny_model(kv_dtype)
    fmt = KV_DTYPES[kv_dtype]
    for ratio, layer in model.layers.items():
        swa_spec = layer.swa_cache_layer.get_kv_cache_spec(model.vllm_config)
        assert swa_spec.state_content_size_bytes == kv_cache.bytes_per_token(fmt)
        assert swa_spec.block_size == 64 and swa_spec.sliding_window == vt.WINDOW
        pages = layer.swa_pages()
        assert pages.shape[1] == kv_cache.page_layout(fmt, 64).page_bytes
        spec = layer.get_kv_cache_spec(model.vllm_config)
        if ratio == 1:
            assert spec is None
            continue
        assert spec.tokens_per_state == ratio and spec.num_states == 256 // ratio
        assert spec.state_content_size_bytes == kv_cache.bytes_per_token(fmt)
        layout = kv_cache.page_layout(fmt, 256 // ratio)
        assert layer.compressed_pages().shape[1] == layout.page_bytes
        assert spec.page_size_bytes == layout.page_bytes
    if fmt is KVFormat.NVFP4:  # 384 B per token instead of 584
        assert swa_spec.page_size_bytes == 64 * 384
    else:
        assert model.vllm_config.cache_config.cache_dtype == "fp8_ds_mla"


def test_nvfp4_fits_more_blocks_than_fp8_in_the_same_memory():
    blocks = {dt: vt.tiny_model(dt).kv_cache_config.num_blocks for dt in KV_DTYPES}
    assert blocks["auto"] > blocks["fp8"], blocks


def test_unsupported_kv_cache_dtype_fails_at_model_build():
    config = vt.engine_config("DSV4_NVFP4", "bfloat16")
    with pytest.raises(ValueError, match=r"kv-cache-dtype 'bfloat16'.*auto \(nvfp4\)"):
        DSV4NVFP4Attention(config, prefix="model.layers.0.attn")


def test_resolve_kv_format_lists_accepted_values():
    assert kv_spec.resolve_kv_format("auto") is KVFormat.NVFP4
    for name in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        assert kv_spec.resolve_kv_format(name) is KVFormat.FP8_DS_MLA
    for name in ("fp8_e5m2", "nvfp4", "nvfp4_ds_mla", "bfloat16"):
        with pytest.raises(ValueError, match="accepted: auto"):
            kv_spec.resolve_kv_format(name)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decode_context_parallel_size": 2}, "context parallelism"),
        ({"prefill_context_parallel_size": 2}, "context parallelism"),
        ({"vision_n_layers": 2}, "vision"),
        ({"heads": 256}, r"at most 128 query heads per rank .* has 256 per rank"),
        ({"use_ubatching": True, "enable_dbo": True}, r"micro-batching .* --enable-dbo is True"),
    ],
)
def test_unsupported_configurations_are_refused(change, message):
    parallel = SimpleNamespace(
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
        tensor_parallel_size=1,
        use_ubatching=False,
        enable_dbo=False,
        ubatch_size=0,
    )
    hf = SimpleNamespace(vision_n_layers=0)
    heads = 64
    for key, value in change.items():
        if key == "vision_n_layers":
            hf.vision_n_layers = value
        elif key == "heads":
            heads = value
        else:
            setattr(parallel, key, value)
    config = SimpleNamespace(
        parallel_config=parallel,
        model_config=SimpleNamespace(hf_config=hf, get_num_attention_heads=lambda _: heads),
        speculative_config=None,
    )
    with pytest.raises(ValueError, match=message):
        check_supported(config)
    check_supported(vt.engine_config())  # the tiny model itself is fine


@pytest.mark.parametrize("setting", [{"enable_dbo": True}, {"ubatch_size": 2}])
def test_micro_batching_is_refused_by_vllms_own_switch(setting):
    """Dual-batch overlap as vLLM's config reports it (``use_ubatching``; vLLM's CPU platform
    turns DBO off, so the switch is set on the built config as the CUDA platform leaves it)."""
    config = vt.engine_args(attention_backend="DSV4_NVFP4").create_engine_config()
    check_supported(config)
    for name, value in setting.items():
        setattr(config.parallel_config, name, value)
    assert config.parallel_config.use_ubatching
    with pytest.raises(ValueError, match=r"does not support micro-batching .* --ubatch-size"):
        check_supported(config)


def test_paged_view_rejects_what_it_cannot_address():
    cache = torch.zeros(4, 64, 384, dtype=torch.uint8)
    assert kv_spec.paged_view(cache, KVFormat.NVFP4, 64).shape == (4, 64 * 384)
    with pytest.raises(ValueError, match="rows of nvfp4"):
        kv_spec.paged_view(cache, KVFormat.NVFP4, 32)
    dense = torch.zeros(4, 64, 584, dtype=torch.uint8)  # no room for the 576-B page padding
    with pytest.raises(ValueError, match="less than a fp8_ds_mla page"):
        kv_spec.paged_view(dense, KVFormat.FP8_DS_MLA, 64)
    page = kv_cache.page_layout(KVFormat.FP8_DS_MLA, 64).page_bytes
    short = torch.zeros(3 * page + 64 * 584, dtype=torch.uint8)
    padded = torch.as_strided(short, (4, 64, 584), (page, 584, 1))
    with pytest.raises(ValueError, match="runs past its storage"):
        kv_spec.paged_view(padded, KVFormat.FP8_DS_MLA, 64)
    roomy = torch.zeros(4 * page, dtype=torch.uint8)
    view = kv_spec.paged_view(
        torch.as_strided(roomy, (4, 64, 584), (page, 584, 1)), KVFormat.FP8_DS_MLA, 64
    )
    assert view.shape == (4, page) and view.stride() == (page, 1)


def test_head_padding_follows_the_kernels_head_counts():
    """No padding where the kernel takes the head count; otherwise the next count it takes."""
    from dsv4_attn.kernels import sparse_decode

    counts = sorted(sparse_decode.SUPPORTED_HEAD_COUNTS)
    for n in range(1, counts[-1] + 3):
        got = DSV4NVFP4Attention.get_padded_num_q_heads(n)
        if n in counts or n > counts[-1]:
            assert got == n
        else:
            assert got == min(c for c in counts if c > n)


def test_backend_capabilities():
    from vllm.platforms.interface import DeviceCapability

    from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend, DSV4NVFP4SWABackend

    assert DSV4NVFP4Backend.get_name() == "DSV4_NVFP4"
    assert DSV4NVFP4SWABackend.get_name() == "DSV4_NVFP4_SWA"
    assert DSV4NVFP4Backend.is_mla() and DSV4NVFP4Backend.is_sparse()
    assert DSV4NVFP4Backend.supports_sink()
    assert DSV4NVFP4Backend.get_supported_head_sizes() == [512]
    for dtype in ("auto", "fp8", "fp8_ds_mla"):
        assert DSV4NVFP4Backend.supports_kv_cache_dtype(dtype)
    assert not DSV4NVFP4Backend.supports_kv_cache_dtype("bfloat16")
    for major in (8, 9, 10, 12):
        assert DSV4NVFP4Backend.supports_compute_capability(DeviceCapability(major, 0))
        assert DSV4NVFP4Backend.kernels_support(DeviceCapability(major, 0)) == (major == 9)
    assert DSV4NVFP4Backend.get_supported_kernel_block_sizes() == [256]
    with pytest.raises(NotImplementedError):
        DSV4NVFP4Backend.get_impl_cls()


def test_query_rows_past_the_metadata_attend_to_nothing():
    """q may be padded past the step's tokens (CUDA-graph sizes): those rows come out 0 and the
    others as without the padding."""
    model = vt.tiny_model("auto")
    layer = model.layers[128]
    gen = torch.Generator().manual_seed(21)
    batch = vt.make_batch(gen, [300, 40], [1, 5], num_blocks=300)
    poison(model, gen)
    write_step_rows(layer, batch, gen)
    T, H = batch.num_tokens, layer.padded_heads
    q = torch.randn(T + 3, H, 512, generator=gen).to(torch.bfloat16)
    padded_out = torch.full((T + 3, H, 512), float("nan"), dtype=torch.bfloat16)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    metadata = build_metadata(layer, batch)
    with set_forward_context(metadata, model.vllm_config):
        layer.forward_mqa(q, None, None, padded_out)
        layer.forward_mqa(q[:T], None, None, out)
    assert torch.equal(padded_out[:T], out) and (padded_out[T:] == 0).all()
    assert torch.isfinite(out.float()).all() and out.abs().amax() > 0


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_sizes_come_from_the_bound_cache_not_the_build_time_block_size(kv_dtype):
    """vLLM's CUDA worker builds the layers while cache_config.block_size is 16 and binds caches
    of 256-token blocks later; vt.tiny_model follows that order."""
    model = vt.tiny_model(kv_dtype)
    fmt = KV_DTYPES[kv_dtype]
    for ratio in (4, 128):
        layer = model.layers[ratio]
        assert layer.compressed_rows_per_block == vt.CACHE_BLOCK // ratio
        assert layer.compressed_rows_per_block != vt.BUILD_BLOCK // ratio
        page = kv_cache.page_layout(fmt, vt.CACHE_BLOCK // ratio).page_bytes
        assert layer.compressed_pages().shape[1] == page


@pytest.mark.parametrize("ratio", vt.RATIOS)
@pytest.mark.parametrize("step", ["one_prompt", "prompt_after_prefix", "decodes"])
def test_profiling_run_reserves_the_scratch_of_the_largest_step(ratio, step, monkeypatch):
    """The profiling forward asks vLLM's workspace manager for the peak scratch (decode kernel
    and prefill gather workspace); after vLLM locks it, the largest steps fit (a locked manager
    refuses to grow): a max_num_batched_tokens prompt, one as the last chunk of a max_model_len
    sequence (the most compressed rows), and a batch of decodes."""
    from vllm.v1.worker import workspace

    # The manager frees the accelerator's cache when it grows; a CPU-only torch has none.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)

    model = vt.tiny_model("auto")
    layer = model.layers[ratio]
    T = layer.max_num_batched_tokens
    max_len = layer.max_model_len
    seq_lens, query_lens = {
        "one_prompt": ([T], [T]),
        "prompt_after_prefix": ([max_len], [min(T, max_len)]),
        "decodes": ([129 + (r % 7) for r in range(128)], [1] * 128),
    }[step]
    requested: list[int] = []
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        manager = workspace.current_workspace_manager()
        real_get = manager.get_simultaneous

        def counting_get(*shapes):
            requested.append(sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes))
            return real_get(*shapes)

        monkeypatch.setattr(manager, "get_simultaneous", counting_get)
        out = torch.empty(T, layer.padded_heads, 512, dtype=torch.bfloat16)
        with set_forward_context(None, model.vllm_config):
            layer.forward_mqa(out, None, None, out)
        reserved = max(requested)
        workspace.lock_workspace()
        gen = torch.Generator().manual_seed(3)
        batch = vt.make_batch(gen, seq_lens, query_lens, num_blocks=600)
        write_step_rows(layer, batch, gen)
        if ratio == 4:
            model.topk_indices_buffer[: batch.num_tokens] = vt.random_local_topk(
                gen, batch, vt.INDEX_TOPK
            )
        n = batch.num_tokens
        q = torch.randn(n, layer.padded_heads, 512, generator=gen).to(torch.bfloat16)
        requested.clear()
        with set_forward_context(build_metadata(layer, batch), model.vllm_config):
            layer.forward_mqa(q, None, None, out[:n])  # would raise if the scratch had to grow
        assert torch.isfinite(out[:n].float()).all()
        assert requested and max(requested) <= reserved
    finally:
        workspace.reset_workspace_manager()


@pytest.fixture
def cpu_workspace(monkeypatch):
    """vLLM's workspace manager on the CPU, as the worker creates it (unlocked, as during
    CUDA-graph capture)."""
    from vllm.v1.worker import workspace

    # The manager frees the accelerator's cache when it grows; a CPU-only torch has none.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        yield workspace.current_workspace_manager()
    finally:
        workspace.reset_workspace_manager()


def _workspace_buffer(manager) -> tuple[int, int]:
    """(address, bytes) of the manager's current buffer."""
    storage = manager.get_simultaneous(((1,), torch.uint8))[0].untyped_storage()
    return storage.data_ptr(), storage.nbytes()


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_a_request_above_the_reservation_raises_and_keeps_the_workspace(
    path, cpu_workspace, monkeypatch
):
    """A layer whose peak accounting fell short (stood in by shrinking what its profiling run
    reserves): the step raises, naming both sizes, and vLLM's buffer is neither freed nor
    grown. The manager is unlocked, as during CUDA-graph capture, where growing it would free
    the buffer earlier graphs write into."""
    model = vt.tiny_model("auto")
    layer = model.layers[4]
    tiny = [((16,), torch.float32)]
    monkeypatch.setattr(layer, "_peak_scratch", tiny)
    monkeypatch.setattr(layer, "_peak_prefill_scratch", lambda: tiny)
    out = torch.empty(4, layer.padded_heads, 512, dtype=torch.bfloat16)
    with set_forward_context(None, model.vllm_config):
        layer.forward_mqa(out, None, None, out)  # the (short) profiling run
    before = _workspace_buffer(cpu_workspace)
    gen = torch.Generator().manual_seed(11)
    seq_lens, query_lens = ([200] * 4, [1] * 4) if path == "decode" else ([300], [300])
    batch = vt.make_batch(gen, seq_lens, query_lens, num_blocks=300)
    write_step_rows(layer, batch, gen)
    model.topk_indices_buffer[: batch.num_tokens] = vt.random_local_topk(gen, batch, vt.INDEX_TOPK)
    q = torch.randn(batch.num_tokens, layer.padded_heads, 512, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    with (
        set_forward_context(build_metadata(layer, batch), model.vllm_config),
        pytest.raises(RuntimeError, match=rf"a {path} step asks .* for \d+ B .* reserved 256 B"),
    ):
        layer.forward_mqa(q, None, None, out)
    assert _workspace_buffer(cpu_workspace) == before


def test_lse_of_both_paths_lives_in_the_workspace(cpu_workspace, monkeypatch):
    """The decode kernel's and the prefill FMHA's log-sum-exp are views of vLLM's workspace
    (nothing a step allocates outside what the profiling run reserved)."""
    model = vt.tiny_model("auto")
    layer = model.layers[128]
    out = torch.empty(layer.max_num_batched_tokens, layer.padded_heads, 512, dtype=torch.bfloat16)
    with set_forward_context(None, model.vllm_config):
        layer.forward_mqa(out, None, None, out)
    address, size = _workspace_buffer(cpu_workspace)
    seen: dict[str, torch.Tensor] = {}
    real_decode, real_attend = ops.sparse_attention, prefill.attend

    def decode_spy(*args, **kwargs):
        seen["decode"] = kwargs["lse"]
        return real_decode(*args, **kwargs)

    def attend_spy(*args):
        seen["prefill"] = args[-1]
        return real_attend(*args)

    monkeypatch.setattr(ops, "sparse_attention", decode_spy)
    monkeypatch.setattr(prefill, "attend", attend_spy)
    gen = torch.Generator().manual_seed(12)
    batch = vt.make_batch(gen, [200, 260, 90], [1, 1, 90], num_blocks=300)  # 2 decodes, 1 prompt
    write_step_rows(layer, batch, gen)
    q = torch.randn(batch.num_tokens, layer.padded_heads, 512, generator=gen).to(torch.bfloat16)
    with set_forward_context(build_metadata(layer, batch), model.vllm_config):
        layer.forward_mqa(q, None, None, out[: batch.num_tokens])
    for path, lse in seen.items():
        start = lse.data_ptr()
        assert address <= start and start + lse.nbytes <= address + size, path
        assert lse.shape == ((2,) if path == "decode" else (90,)) + (layer.padded_heads,)
        assert torch.isfinite(lse).all(), path  # written: every token has keys
    assert set(seen) == {"decode", "prefill"}
