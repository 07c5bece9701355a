"""DSV4NVFP4Attention on a Hopper GPU with vLLM's own CUDA code paths (``pytest -m gpu``).

Needs vLLM 0.33 with its CUDA kernels and ``VLLM_TARGET_DEVICE=cuda`` (the serve environment of
the GPU machine: ``scripts/gpu_serve.sh`` runs these first). The layers are built in the order
vLLM's CUDA worker uses (block size 16 at build, 256 at bind; see ``vt.tiny_model``), their caches
laid out by vLLM's planner on the GPU, and vLLM's workspace manager sized by the profiling run and
locked, as in a server. Per layer kind and cache format:

* a whole step of this backend — metadata builders, the SWA insert (this package's Triton kernel
  for NVFP4, vLLM's fused CUDA op for fp8), the NVFP4 compressor store, the attention — runs
  under ``torch.cuda.set_sync_debug_mode("error")`` (any device-to-host synchronisation raises),
  and its output matches the float64 reference on the rows the caches hold;
* a decode step captured in a ``torch.cuda.CUDAGraph``, then replayed after the metadata was
  rebuilt for a different batch of the same size, equals the eager step bit for bit;
* the compressors' rows from vLLM's CuTeDSL kernel (CSA: against ours; HCA: its production
  store into the NVFP4 cache, against the float64 reference).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from dsv4_attn.layer_kind import Family, compressed_of
from dsv4_attn.testing import assert_rows_close
from tests import vllm_glue_testing as vt

pytestmark = pytest.mark.gpu

KV_DTYPES = ("auto", "fp8")
# (layer ratio, DSV4_ATTN_DECODE_SCHEDULE): every layer kind as served, and the HCA layer on
# the balanced decode schedule too (the tiny model's lists are short: "auto" keeps the split
# launch, "balanced" forces the plan).
LAYER_SCHEDULES = [(1, "auto"), (4, "auto"), (128, "split"), (128, "balanced")]


def _needs_cuda_vllm() -> None:
    """Skips without a GPU, on a GPU other than sm_90, or where vLLM's CUDA build is not
    importable; fails where there is a GPU but ``VLLM_TARGET_DEVICE`` is not ``cuda`` (vLLM then
    takes another platform, and every test here would skip on the machine it is for)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = os.environ.get("VLLM_TARGET_DEVICE")
    if target != "cuda":
        pytest.fail(
            f"CUDA is available but VLLM_TARGET_DEVICE={target!r}: these tests need vLLM's CUDA "
            "platform; run with VLLM_TARGET_DEVICE=cuda (tests/conftest.py's default on a GPU)"
        )
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    try:
        from vllm.platforms import current_platform

        is_cuda = current_platform.is_cuda()
        found = f"its platform is {type(current_platform).__name__}"
    except Exception as exc:  # ImportError, or a build without CUDA failing on import
        is_cuda, found = False, f"{type(exc).__name__}: {exc}"
    if not is_cuda:
        pytest.skip(f"vLLM's CUDA build is not importable ({found})")


@pytest.fixture(scope="module")
def workspace():
    """vLLM's workspace manager on the GPU, as the worker creates it."""
    _needs_cuda_vllm()
    from vllm.v1.worker import workspace as ws

    ws.init_workspace_manager(torch.device("cuda", torch.cuda.current_device()))
    yield ws
    ws.reset_workspace_manager()


def _profile(model) -> None:
    """Every layer's profiling forward, as vLLM's profiling run makes it: scratch reserved at
    its peak, kernels compiled."""
    from vllm.forward_context import set_forward_context

    for layer in model.layers.values():
        T = layer.max_num_batched_tokens
        out = torch.empty(T, layer.padded_heads, 512, dtype=torch.bfloat16, device="cuda")
        with set_forward_context(None, model.vllm_config):
            layer.forward_mqa(out, None, None, out)


@pytest.fixture(scope="module")
def profiled(workspace):
    """Builds a tiny model whose layers ran their profiling forward; the first models were
    profiled (as a server that may run the balanced schedule: the reservation covers its
    partial slots too) before the workspace was locked, so a later request beyond the
    reservation raises (vLLM's lock, and before it the layer's own check)."""
    from dsv4_attn.vllm_glue.balanced import SCHEDULE_ENV

    dspark_models = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SCHEDULE_ENV, "balanced")
        for kv_dtype in KV_DTYPES:
            _profile(vt.tiny_model(kv_dtype))
        _use_dspark_width(env)
        for kv_dtype in KV_DTYPES:
            dspark_models[kv_dtype] = vt.tiny_model(kv_dtype)
            _profile(dspark_models[kv_dtype])
    workspace.lock_workspace()

    def build(kv_dtype: str, dspark: bool = False):
        """A profiled model; ``dspark``: the one built and profiled as a DSpark server's, with
        window lists :data:`DSPARK_WIDTH` wide (one per cache format, shared by its tests)."""
        if dspark:
            return dspark_models[kv_dtype]
        model = vt.tiny_model(kv_dtype)
        _profile(model)
        return model

    return build


DSPARK_TOKENS = 4
DSPARK_WIDTH = 192  # vLLM's list width for a 128-token window and 4 draft tokens, rounded to 64


def _use_dspark_width(env) -> None:
    """Layers and builders made from here on size their window lists as a DSpark server's
    (:data:`DSPARK_WIDTH`; the tiny config has no DSpark draft model to derive it from)."""
    from dsv4_attn.vllm_glue import attention, metadata

    for module in (attention, metadata):
        env.setattr(module, "dspark_window_width", lambda config, window: DSPARK_WIDTH)


def _use_schedule(schedule: str, monkeypatch) -> None:
    """The decode schedule the next builders are made with."""
    from dsv4_attn.vllm_glue.balanced import SCHEDULE_ENV

    monkeypatch.setenv(SCHEDULE_ENV, schedule)


def _check_plan(metadata: dict, layer, schedule: str):
    """The balanced plan is there exactly when the schedule asks for it; returns it."""
    plan = getattr(metadata.get(layer.prefix), "decode_plan", None)
    assert (plan is not None) == (schedule == "balanced")
    return plan


def _inputs(layer, batch, gen):
    T = batch.num_tokens
    q = (torch.randn(T, layer.n_local_heads, 512, generator=gen) * 2).to(torch.bfloat16)
    kv = (torch.randn(T, 512, generator=gen) * 3).to(torch.bfloat16)
    return q.cuda(), kv.cuda()


def _step(layer, model, metadata, q, kv, positions, out) -> torch.Tensor:
    """This backend's part of one layer step: SWA insert, then attention into ``out``."""
    from vllm.forward_context import set_forward_context

    with set_forward_context(metadata, model.vllm_config):
        q_padded = layer._fused_qnorm_rope_kv_insert(q, kv, positions, metadata)
        layer.forward_mqa(q_padded, kv, positions, out)
    return q_padded


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("ratio", "schedule"), LAYER_SCHEDULES)
def test_whole_step_has_no_host_sync_and_matches_reference(
    profiled, kv_dtype, ratio, schedule, monkeypatch
):
    from tests.test_vllm_glue_attention import Builders, expected_output, poison, write_step_rows

    _use_schedule(schedule, monkeypatch)
    model = profiled(kv_dtype)
    layer = model.layers[ratio]
    builders = Builders(layer)
    gen = torch.Generator().manual_seed(ratio + len(kv_dtype))
    poison(model, gen)
    warm = vt.make_batch(gen, [300, 45], [1, 40], padding=1, num_blocks=300, on="cuda")
    batch = vt.make_batch(
        gen, [700, 129, 64, 3], [1, 2, 64, 3], padding=2, num_blocks=300, on="cuda"
    )
    for step, b in enumerate((warm, batch)):  # the first step compiles outside the check
        write_step_rows(layer, b, gen)
        local_topk = None
        if ratio == 4:
            local_topk = vt.random_local_topk(gen, b, vt.INDEX_TOPK).cuda()
            model.topk_indices_buffer[: b.num_tokens] = local_topk
        q, kv = _inputs(layer, b, gen)
        positions = b.swa_cm.positions
        out = torch.full(
            (b.num_tokens, layer.padded_heads, 512),
            float("nan"),
            dtype=torch.bfloat16,
            device="cuda",
        )
        staged = (torch.randn(b.num_tokens, 512, generator=gen) * 2).to(torch.bfloat16).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            metadata = builders.build(b)
            _check_plan(metadata, layer, schedule)
            if ratio > 1 and kv_dtype == "auto":  # the compressor stores before the attention
                _store_staged(layer, metadata[layer.prefix], staged, check=step == 1)
                torch.cuda.set_sync_debug_mode("error" if step else "default")
            q_padded = _step(layer, model, metadata, q, kv, positions, out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    ref = expected_output(layer, batch, q_padded, local_topk)
    assert torch.isfinite(out.float()).all()
    real = len(batch.positions())
    assert (out[real:] == 0).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {float(err):.3g}"
    assert_rows_close(out, ref, 2e-2)  # every (token, head) row, not only the whole
    _check_inserted_rows(layer, batch, kv, positions)


def _store_staged(layer, metadata, rows, check: bool) -> None:
    """The NVFP4 compressor's store: rows staged where the metadata says, encoded at the write
    slots (what runs after vLLM's compressor kernel filled the staging rows)."""
    from dsv4_attn import kv_cache
    from dsv4_attn.kv_cache import KVFormat
    from dsv4_attn.vllm_glue.writers import store_staged_rows

    T = metadata.slot_mapping.shape[0]
    layer.staging_rows[:T, 0] = rows
    pages = layer.compressed_pages()
    expected = pages.clone() if check else None
    store_staged_rows(
        layer.staging_rows, metadata.slot_mapping, pages, layer.compressed_rows_per_block
    )
    if check:
        torch.cuda.set_sync_debug_mode("default")
        kv_cache.write(
            expected, metadata.slot_mapping, rows, KVFormat.NVFP4, layer.compressed_rows_per_block
        )
        assert torch.equal(pages, expected)


def _check_inserted_rows(layer, batch, kv, positions) -> None:
    """The step's own KV rows: RoPE'd and encoded at their SWA slots. NVFP4: exactly the torch
    path's bytes. fp8: vLLM's writer, byte for byte ``kv_cache``'s fp8_ds_mla encoding of the
    same rows (:func:`_check_fp8_ds_mla_bytes`)."""
    from dsv4_attn import kv_cache
    from dsv4_attn.kv_cache import KVFormat
    from dsv4_attn.vllm_glue.writers import qnorm_rope

    slots = batch.swa_cm.slot_mapping
    real = slots >= 0
    _, roped = qnorm_rope(kv[:, None], kv, positions, layer.rotary_emb.cos_sin_cache, 1e-6, 1)
    want = roped[real]
    if layer.kv_format is KVFormat.NVFP4:
        got = kv_cache.read(layer.swa_pages(), slots[real], layer.kv_format, 64)
        data, scales = kv_cache.encode_rows(want, KVFormat.NVFP4)
        assert torch.equal(got, kv_cache.decode_rows(data, scales, KVFormat.NVFP4))
    else:
        _check_fp8_ds_mla_bytes(layer.swa_pages(), slots[real], want, 64)


def _check_fp8_ds_mla_bytes(pages, slots, rows, block_size: int) -> None:
    """The bytes vLLM's fused fp8 insert wrote at ``slots`` (int ``[N]``) of ``pages`` (uint8
    ``[num_blocks, >= page_bytes]``) against ``kv_cache.encode_rows(rows)`` (``rows``: bf16
    ``[N, 512]``, this package's RoPE of the step's rows), located by the layout's byte offsets
    (slot ``b * block_size + i``: data row at ``i * 576``, scale row at ``block_size * 576 + 8 i``
    of page ``b``).

    Equal byte for byte: the 448 fp8 nope values (the same bf16 inputs: RoPE leaves them alone)
    and the 7 UE8M0 block exponents. The RoPE part's 64 bf16 values are compared as values,
    within one bf16 rounding of ours: they come out of each side's own float32 RoPE, whose
    products vLLM's compiler may fuse (one rounding fewer). The scale row's byte 7 (padding,
    read by no kernel) and the page's tail past the scale rows are not compared."""
    from dsv4_attn import kv_cache
    from dsv4_attn.kv_cache import KVFormat

    layout = kv_cache.page_layout(KVFormat.FP8_DS_MLA, block_size)
    data_bytes, scale_bytes = layout.data_row_bytes, layout.scale_row_bytes
    assert (data_bytes, scale_bytes) == (576, 8)
    block, pos = (slots // block_size).long(), (slots % block_size).long()
    data_at = pos[:, None] * data_bytes + torch.arange(data_bytes, device=pages.device)
    scale_at = (
        block_size * data_bytes
        + pos[:, None] * scale_bytes
        + torch.arange(scale_bytes, device=pages.device)
    )
    got_data = pages[block[:, None], data_at]
    got_scales = pages[block[:, None], scale_at]
    data, scales = kv_cache.encode_rows(rows, KVFormat.FP8_DS_MLA)
    assert torch.equal(got_data[:, :448], data[:, :448]), "fp8 nope bytes differ"
    assert torch.equal(got_scales[:, :7], scales[:, :7]), "UE8M0 exponent bytes differ"
    got_rope = got_data[:, 448:].contiguous().view(torch.bfloat16).float()
    want_rope = rows[:, 448:].float()
    assert ((got_rope - want_rope).abs() <= want_rope.abs() * 2.0**-7 + 1e-30).all()


def _capture(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``step`` once eagerly (the warm-up vLLM makes), then captured in a CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph


def _replay_then_eager(graph, step: Callable[[], torch.Tensor], out: torch.Tensor):
    """Replays ``graph`` and runs ``step`` eagerly on the same inputs, each into a poisoned
    ``out``; asserts the replay is finite and equal to the eager step. Returns the replayed
    output and what ``step`` returned."""
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    out.fill_(float("nan"))
    result = step()
    torch.cuda.synchronize()
    assert torch.isfinite(replayed.float()).all()
    assert torch.equal(replayed, out), "the replay differs from the eager step"
    return replayed, result


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("ratio", "schedule"), LAYER_SCHEDULES)
@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "mtp2"])
def test_decode_step_replays_in_a_cuda_graph(
    profiled, kv_dtype, ratio, schedule, tokens, monkeypatch
):
    """As vLLM's FULL decode graphs: the step is captured once; later steps rebuild the metadata
    (the balanced plan included) into the builders' buffers (and the runner's input buffers),
    then replay. ``mtp2``: MTP verification steps, 1 + 2 tokens per request (a uniform batch
    the builders count as decodes, as with --speculative-config num_speculative_tokens 2)."""
    from tests.test_vllm_glue_attention import (
        expected_output,
        poison,
        spec_builders,
        write_step_rows,
    )

    _use_schedule(schedule, monkeypatch)
    model = profiled(kv_dtype)
    layer = model.layers[ratio]
    builders = spec_builders(layer, tokens)
    gen = torch.Generator().manual_seed(100 + ratio)
    poison(model, gen)
    T = 5 * tokens + 2  # two padding rows
    runner = _RunnerBuffers(num_reqs=5, num_tokens=T)
    first = vt.make_batch(gen, [900, 17, 300, 128, 3], [tokens] * 5, padding=2, num_blocks=300)
    second = vt.make_batch(gen, [40, 1200, 3, 513, 260], [tokens] * 5, padding=2, num_blocks=300)
    q_in = torch.zeros(T, layer.n_local_heads, 512, dtype=torch.bfloat16, device="cuda")
    kv_in = torch.zeros(T, 512, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(T, layer.padded_heads, 512, dtype=torch.bfloat16, device="cuda")

    picks = {}  # a CSA step's indexer picks, for the reference

    def prepare(batch):
        runner.load(batch)
        write_step_rows(layer, batch, gen)
        if ratio == 4:
            picks[id(batch)] = topk = vt.random_local_topk(gen, batch, vt.INDEX_TOPK)
            model.topk_indices_buffer[: batch.num_tokens] = topk.cuda()
        q, kv = _inputs(layer, batch, gen)
        q_in.copy_(q)
        kv_in.copy_(kv)
        return builders.build(runner.batch(batch))

    metadata = prepare(first)
    graph = _capture(lambda: _step(layer, model, metadata, q_in, kv_in, runner.positions, out))

    metadata_again = prepare(second)
    for key, md in metadata_again.items():  # same buffers as the captured step
        for name in (
            "swa_indices",
            "swa_lens",
            "hca_indices",
            "hca_lens",
            "slot_mapping",
            "window_lens",
        ):
            if getattr(md, name, None) is not None:
                assert getattr(md, name).data_ptr() == getattr(metadata[key], name).data_ptr()
    plan, plan_again = (_check_plan(m, layer, schedule) for m in (metadata, metadata_again))
    if plan is not None:  # a new plan (other counts) where the graph reads it
        for name in ("part_plan", "token_plan"):
            assert getattr(plan, name).data_ptr() == getattr(plan_again, name).data_ptr()
    replayed, q_padded = _replay_then_eager(
        graph, lambda: _step(layer, model, metadata_again, q_in, kv_in, runner.positions, out), out
    )
    ref = expected_output(layer, second, q_padded, picks.get(id(second)))
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {float(err):.3g} against the float64 reference"
    assert_rows_close(out, ref, 2e-2)
    assert (replayed[5 * tokens :] == 0).all()  # padding rows
    swa = metadata_again[layer.swa_cache_layer.prefix]
    assert (swa.num_decode_tokens, swa.num_prefills) == (T, 0)  # all through the decode path


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("in_graph", [False, True], ids=["rebuilt", "updated_in_graph"])
def test_dspark_draft_step_replays_in_a_cuda_graph(profiled, kv_dtype, in_graph, monkeypatch):
    """A DSpark draft step (non-causal metadata: every token of a block sees the window before
    the block and the whole block) through a sliding-window layer, as FULL graphs run it:
    captured once, then for another batch either rebuilt into the builder's buffers or
    (``updated_in_graph``, as vLLM's speculators record it) recomputed by
    ``update_draft_decode_metadata`` inside the captured graph; the replay equals the eager
    step and the float64 reference on exactly the block's rows."""
    import dataclasses

    from dsv4_attn import kv_cache, reference
    from tests.test_vllm_glue_attention import poison, spec_builders, write_step_rows

    model = profiled(kv_dtype, dspark=True)
    _use_dspark_width(monkeypatch)
    layer = model.layers[1]
    builder = spec_builders(layer, DSPARK_TOKENS).swa
    gen = torch.Generator().manual_seed(300 + len(kv_dtype))
    poison(model, gen)
    with torch.no_grad():
        layer.attn_sink[: vt.NUM_HEADS] = torch.randn(vt.NUM_HEADS, generator=gen).cuda()
    R = 4
    T = R * DSPARK_TOKENS + 2  # two padding rows
    runner = _RunnerBuffers(num_reqs=R, num_tokens=T)
    first = vt.make_batch(gen, [4, 131, 300, 133], [DSPARK_TOKENS] * R, padding=2, num_blocks=300)
    second = vt.make_batch(gen, [700, 9, 128, 260], [DSPARK_TOKENS] * R, padding=2, num_blocks=300)
    q_in = torch.zeros(T, layer.n_local_heads, 512, dtype=torch.bfloat16, device="cuda")
    kv_in = torch.zeros(T, 512, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(T, layer.padded_heads, 512, dtype=torch.bfloat16, device="cuda")
    prefix = layer.swa_cache_layer.prefix

    def prepare(batch, build: bool = True):
        runner.load(batch)
        write_step_rows(layer, batch, gen, back=vt.WINDOW)
        q, kv = _inputs(layer, batch, gen)
        q_in.copy_(q)
        kv_in.copy_(kv)
        cm = dataclasses.replace(runner.batch(batch).swa_cm, causal=False)
        return {prefix: builder.build(0, cm)} if build else None

    def draft_step():
        if in_graph:
            builder.update_draft_decode_metadata(metadata[prefix])
        return _step(layer, model, metadata, q_in, kv_in, runner.positions, out)

    metadata = prepare(first)
    assert metadata[prefix].swa_indices.shape[1] == DSPARK_WIDTH
    graph = _capture(draft_step)

    if in_graph:
        # The runner's buffers now hold the next step, and only the replay computes its lists;
        # then a fresh build (what the eager step reads) must give the same ones.
        prepare(second, build=False)
        graph.replay()
        torch.cuda.synchronize()
        updated = (metadata[prefix].swa_indices.clone(), metadata[prefix].swa_lens.clone())
        cm = dataclasses.replace(runner.batch(second).swa_cm, causal=False)
        metadata_again = {prefix: builder.build(0, cm)}
        assert torch.equal(metadata_again[prefix].swa_indices, updated[0])
        assert torch.equal(metadata_again[prefix].swa_lens, updated[1])
    else:
        metadata_again = prepare(second)
    for name in ("swa_indices", "swa_lens", "slot_mapping"):
        again, captured = getattr(metadata_again[prefix], name), getattr(metadata[prefix], name)
        assert again.data_ptr() == captured.data_ptr(), name
    replayed, q_padded = _replay_then_eager(
        graph, lambda: _step(layer, model, metadata_again, q_in, kv_in, runner.positions, out), out
    )

    spans = [range(max(0, s - DSPARK_TOKENS - vt.WINDOW), s) for s in second.seq_lens]
    token_req = [r for r, _ in second.positions()]
    slots = torch.tensor(
        [
            vt.padded(
                [vt.slot(second.swa_block_table, r, p, vt.SWA_BLOCK) for p in spans[r]],
                DSPARK_WIDTH,
            )
            for r in token_req
        ]
    )
    rows = kv_cache.read(layer.swa_pages(), slots.flatten().cuda(), layer.kv_format, vt.SWA_BLOCK)
    local = torch.arange(slots.numel()).view(slots.shape)
    real = len(token_req)
    ref, _ = reference.sparse_attention(
        q_padded[:real].cpu(),
        rows.cpu(),
        torch.where(slots >= 0, local, -1),
        torch.tensor([len(spans[r]) for r in token_req]),
        layer.attn_sink.detach().cpu(),
        layer.scale,
    )
    err = (out[:real].double().cpu() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {float(err):.3g} against the float64 reference"
    assert_rows_close(out[:real].cpu(), ref, 2e-2)
    assert (replayed[real:] == 0).all()  # padding rows


class _RunnerBuffers:
    """Persistent step inputs, as vLLM's model runner keeps them: every batch of a captured size
    is copied into the same tensors, so the captured graph reads the new values."""

    def __init__(self, num_reqs: int, num_tokens: int) -> None:
        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device="cuda")

        self.query_start_loc = zeros(num_reqs + 1)
        self.seq_lens = zeros(num_reqs)
        self.positions = zeros(num_tokens, dtype=torch.int64)
        self.swa_slots = zeros(num_tokens, dtype=torch.int64)
        self.cache_slots = zeros(num_tokens, dtype=torch.int64)
        self.swa_table = zeros(num_reqs, vt.MAX_MODEL_LEN // vt.SWA_BLOCK)
        self.cache_table = zeros(num_reqs, vt.MAX_MODEL_LEN // vt.CACHE_BLOCK)

    def load(self, batch: vt.Batch) -> None:
        cm, ccm = batch.swa_cm, batch.cache_cm
        self.query_start_loc.copy_(cm.query_start_loc)
        self.seq_lens.copy_(cm.seq_lens)
        self.positions.copy_(cm.positions)
        self.swa_slots.copy_(cm.slot_mapping)
        self.cache_slots.copy_(ccm.slot_mapping)
        for table, bt in (
            (self.swa_table, batch.swa_block_table),
            (self.cache_table, batch.cache_block_table),
        ):
            table.zero_()
            table[:, : bt.shape[1]] = bt.cuda()

    def batch(self, batch: vt.Batch) -> vt.Batch:
        """``batch`` with its metadata pointing at these buffers."""
        import dataclasses

        def over(cm, slots, table):
            return dataclasses.replace(
                cm,
                query_start_loc=self.query_start_loc,
                seq_lens=self.seq_lens,
                positions=self.positions,
                slot_mapping=slots,
                block_table_tensor=table,
            )

        return dataclasses.replace(
            batch,
            swa_cm=over(batch.swa_cm, self.swa_slots, self.swa_table),
            cache_cm=over(batch.cache_cm, self.cache_slots, self.cache_table),
        )


def _random_state(gen, requests, C, D, bs, dtype):
    """A paged compressor state (kv then scores per position) for ``requests`` sequence lengths,
    pages shuffled; returns (state, block table, [(request, position)])."""
    width = -(-max(requests) // bs)
    pages = torch.randperm(len(requests) * width + 3, generator=gen)
    table = pages[: len(requests) * width].view(len(requests), width).int()
    state = torch.randn(len(pages), bs, 2 * C * D, generator=gen) * 2
    state[..., : C * D] *= torch.exp(torch.randn(C * D, generator=gen))
    return state.to(dtype), table


def test_csa_rows_match_vllms_compressor_kernel(profiled):
    """Our compressed rows against vLLM's CuTeDSL compressor kernel (store_full_kv, bf16 rows)
    on the same fp32 state: within a bf16 rounding; and vLLM's own save kernel writes a bf16
    state as the rounded fp32 values, so the served path (vLLM's save into bf16, our rows) is
    the fp32 path up to the state's rounding."""
    from vllm.models.deepseek_v4.common.ops.save_partial_states import (
        _SAVE_PARTIAL_STATES_KERNEL,
    )

    from dsv4_attn.vllm_glue.compressor_state import compress_rows
    from dsv4_attn.vllm_glue.writers import DSV4NVFP4Compressor, _StagingSlots

    _needs_cuda_vllm()
    model = profiled("auto")
    compressor = model.layers[4].compressor
    assert isinstance(compressor, DSV4NVFP4Compressor)
    assert compressor.state_cache.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    C, D, bs, ratio = 2, 512, 4, 4
    requests = [333, 41, 7]
    state, table = _random_state(gen, requests, C, D, bs, torch.float32)
    tokens = [(r, p) for r, n in enumerate(requests) for p in range(n)]
    T = len(tokens)
    token_req = torch.tensor([r for r, _ in tokens], dtype=torch.int32, device="cuda")
    positions = torch.tensor([p for _, p in tokens], device="cuda")
    state_slots = torch.tensor(
        [int(table[r, p // bs]) * bs + p % bs for r, p in tokens], device="cuda"
    )
    out_rows = torch.where((positions + 1) % ratio == 0, torch.arange(T, device="cuda"), -1)
    state, table = state.cuda(), table.cuda()
    cos_sin = model.layers[4].rotary_emb.cos_sin_cache
    vllm_rows = torch.full((T, 1, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    DSV4NVFP4Compressor._store_rows_kernel()(
        state_cache=state,
        num_actual=T,
        token_to_req_indices=token_req,
        positions=positions,
        slot_mapping=state_slots,
        block_table=table,
        block_size=bs,
        state_width=C * D,
        cos_sin_cache=cos_sin,
        kv_cache=vllm_rows,
        k_cache_metadata=_StagingSlots(out_rows),
        pdl_kwargs={"launch_pdl": False},
        head_dim=D,
        rope_head_dim=64,
        compress_ratio=ratio,
        overlap=True,
        use_fp4_cache=False,
        rms_norm_weight=compressor.norm.weight,
        rms_norm_eps=compressor.rms_norm_eps,
        quant_block=compressor._quant_block,
        token_stride=compressor._token_stride,
        scale_dim=compressor._scale_dim,
        store_full_kv=True,
        store_full_fp8=False,
        fp8_scale=None,
    )
    ours = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    compress_rows(
        state,
        table,
        token_req,
        positions,
        state_slots,
        out_rows,
        ours,
        ratio,
        compressor.norm.weight,
        compressor.rms_norm_eps,
        cos_sin,
    )
    done = out_rows >= 0
    assert torch.equal(ours.isnan().any(-1), ~done)
    torch.testing.assert_close(
        ours[done].float(), vllm_rows[done, 0].float(), rtol=2**-7, atol=1e-3
    )
    # vLLM's save kernel into a bf16 state: the fp32 values, rounded once.
    kv = torch.randn(T, C * D, generator=gen).cuda()
    score = torch.randn(T, C * D, generator=gen).cuda()
    ape = torch.randn(ratio, C * D, generator=gen).cuda()
    bf16_state = torch.full_like(state, float("nan"), dtype=torch.bfloat16)
    _SAVE_PARTIAL_STATES_KERNEL(
        kv=kv,
        score=score,
        ape=ape,
        positions=positions,
        state_cache=bf16_state,
        slot_mapping=state_slots,
        block_size=bs,
        state_width=C * D,
        compress_ratio=ratio,
        pdl_kwargs={"launch_pdl": False},
    )
    saved = bf16_state.view(-1, 2 * C * D)[state_slots]
    assert torch.equal(saved[:, : C * D], kv.bfloat16())
    want = (score + ape[positions % ratio]).bfloat16()
    assert torch.equal(saved[:, C * D :], want)


def _nvfp4_error_bound(want: torch.Tensor) -> torch.Tensor:
    """Per value, how far an NVFP4 row decoded from a bf16 rounding of ``want`` (float64
    ``[N, 512]``) may lie from it: on the 448 nope values a quarter of the value or of its
    16-value block's e2m1 step (scale rule in ``dsv4_attn.kv_cache``: s_b G >= amax_b / 6, at
    most 1.125x that from the e4m3 rounding up, with room for the bf16 rounding before the
    encode; G the token's power-of-two scale), on the 64 RoPE values (stored as bf16) one bf16
    rounding."""
    nope = want[:, :448].abs().view(-1, 28, 16)
    amax_t = nope.amax(dim=(1, 2), keepdim=True)
    token_scale = torch.where(amax_t > 0, torch.exp2(torch.ceil(torch.log2(amax_t / 2688))), 1.0)
    # The e4m3 block scale is at least 2^-9 G (its smallest subnormal).
    step = 1.125 * (1 + 2.0**-7) * nope.amax(-1, keepdim=True) / 6 + 2.0**-9 * token_scale
    nope_bound = torch.maximum(nope / 4, step / 4) + nope * 2.0**-8
    rope_bound = want[:, 448:].abs() * 2.0**-8
    # float32 arithmetic before the rounding: a little of the row's largest value
    slack = want.abs().amax(-1, keepdim=True) * 2.0**-20
    return torch.cat([nope_bound.view(-1, 448), rope_bound], dim=1) + slack


def test_hca_compressor_store_through_vllms_kernel_matches_reference(profiled):
    """The HCA (ratio 128, fp32 state) NVFP4 compressor's production store on CUDA: vLLM's
    CuTeDSL compressor kernel writes each completed entry's bf16 row into the staging buffer,
    ``store_staged_rows`` encodes it into the compressed cache. Each staged row is the float64
    reference (``reference.compressed_entries`` of the same state) within a bf16 rounding, each
    written cache row decodes within NVFP4's quantisation bound of it, the pages hold exactly
    ``kv_cache.write``'s bytes of the staged rows, and nothing else in them changes."""
    from types import SimpleNamespace

    from dsv4_attn import kv_cache, reference
    from dsv4_attn.kv_cache import KVFormat
    from dsv4_attn.vllm_glue.writers import DSV4NVFP4Compressor
    from tests.test_vllm_glue_attention import Builders, poison

    _needs_cuda_vllm()
    model = profiled("auto")
    layer = model.layers[128]
    compressor = layer.compressor
    assert isinstance(compressor, DSV4NVFP4Compressor)
    assert compressor.state_cache.dtype == torch.float32
    gen = torch.Generator().manual_seed(128)
    poison(model, gen)
    C, D, bs, ratio = 1, 512, 8, 128  # no overlap; vLLM's C128 state pages hold 8 positions
    seq_lens, query_lens = [700, 256, 9], [600, 1, 9]
    batch = vt.make_batch(gen, seq_lens, query_lens, padding=2, num_blocks=300, on="cuda")
    state, table = _random_state(gen, seq_lens, C, D, bs, torch.float32)
    tokens = batch.positions()
    T, real = batch.num_tokens, len(tokens)
    token_req = torch.tensor([r for r, _ in tokens] + [0] * (T - real), dtype=torch.int32)
    state_slots = [int(table[r, p // bs]) * bs + p % bs for r, p in tokens] + [-1] * (T - real)
    metadata = Builders(layer).build(batch)
    write_slots = metadata[layer.prefix].slot_mapping
    before = layer.compressed_pages().clone()
    layer.staging_rows.fill_(float("nan"))
    state_metadata = SimpleNamespace(
        slot_mapping=torch.tensor(state_slots, device="cuda"),
        token_to_req_indices=token_req.cuda(),
        block_table=table.cuda(),
        block_size=bs,
    )
    compressor._compress_norm_rope_store(
        state_metadata,
        state.cuda(),
        C * D,
        batch.cache_cm.positions,
        layer.rotary_emb,
        metadata,
        {"launch_pdl": False},
    )
    torch.cuda.synchronize()

    done = [t for t, (_, p) in enumerate(tokens) if (p + 1) % ratio == 0]
    assert len(done) == 6  # request 0: 5 entries, request 1: 1, request 2: none
    assert torch.equal((write_slots >= 0).nonzero().flatten().cpu(), torch.tensor(done))
    cos_sin = layer.rotary_emb.cos_sin_cache.cpu()
    want = []
    for t in done:
        r, p = tokens[t]
        rows = state[table[r].long()].view(-1, 2 * C * D)[: p + 1]
        entries = reference.compressed_entries(
            rows[:, : C * D],
            rows[:, C * D :],
            ratio,
            compressor.norm.weight.detach().cpu(),
            compressor.rms_norm_eps,
            cos_sin,
        )
        want.append(entries[p // ratio])
    want = torch.stack(want)
    staged = layer.staging_rows[done, 0]
    assert_rows_close(staged.cpu(), want, 2.0**-7, floor=0.0, name="staged rows")
    written = kv_cache.read(
        layer.compressed_pages(), write_slots[done], KVFormat.NVFP4, layer.compressed_rows_per_block
    )
    err = (written.cpu().double() - want).abs()
    assert (err <= _nvfp4_error_bound(want)).all(), f"largest error {float(err.max()):.3g}"
    expected = before.clone()
    kv_cache.write(
        expected, write_slots[done], staged, KVFormat.NVFP4, layer.compressed_rows_per_block
    )
    assert torch.equal(layer.compressed_pages(), expected)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_warm_gather_leaves_no_gather_to_compile_in_serving(kv_dtype):
    """After ``prefill.warm_gather`` (run by each layer kind in the profiling run, on caches of
    its own), prefill chunks with earlier context on caches of another size, requests and
    lengths compile no gather kernel: neither vLLM's CuTeDSL fp8 gather (its compile cache
    does not grow) nor the NVFP4 Triton gather (Triton's post-compile hook, which vLLM's JIT
    monitor also uses, is not called)."""
    _needs_cuda_vllm()
    from triton import knobs
    from vllm.models.deepseek_v4.nvidia.ops.dequant_gather_k_cutedsl import (
        _DEQUANT_GATHER_K_CACHE_CUTEDSL_KERNEL as fp8_gather,
    )

    from dsv4_attn.fused import kv_gather
    from dsv4_attn.kv_cache import KVFormat
    from dsv4_attn.vllm_glue import kv_spec, prefill

    fmt = kv_spec.resolve_kv_format(kv_dtype)
    window, swa_block, cache_block, device = 128, 64, 256, torch.device("cuda")
    fp8_gather._compiled_cache.clear()
    kv_gather._gather_nvfp4_kernel.device_caches.clear()
    for ratio in (1, 4, 128):
        kind = compressed_of(Family.V4, ratio)
        prefill.warm_gather(fmt, kind, window, swa_block, cache_block, device)
    torch.cuda.synchronize()
    warm_fp8 = set(fp8_gather._compiled_cache)
    assert bool(warm_fp8) == (fmt is KVFormat.FP8_DS_MLA)
    compiled: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def count(**kwargs):
        compiled.append(kwargs["compile"]["key"] if "key" in kwargs["compile"] else str(kwargs))
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = count
    try:
        gen = torch.Generator().manual_seed(7)
        for ratio in (1, 4, 128):
            for _ in range(3):
                _gather_with_context(fmt, ratio, window, swa_block, cache_block, gen)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert compiled == []
    assert set(fp8_gather._compiled_cache) == warm_fp8


def _gather_with_context(fmt, ratio, window, swa_block, cache_block, gen) -> None:
    """One chunk of 1-4 prefill requests with earlier context (prompts of 300-3000 tokens,
    8-200 of them new) through ``prefill.gather_rows`` on CUDA, from caches of 50-90 pages
    (fp8: vLLM's ``[pages, block, 584]`` views, as a server's layer passes its own caches)."""
    from dsv4_attn import kv_cache
    from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
    from dsv4_attn.vllm_glue import prefill

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    C = draw(1, 4)
    seq = [draw(300, 3000) for _ in range(C)]
    new = [min(s, draw(8, 200)) for s in seq]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    device = torch.device("cuda")
    seq_cpu = torch.tensor(seq, dtype=torch.int32)
    query_start_cpu = torch.tensor(starts, dtype=torch.int32)
    kind = compressed_of(Family.V4, ratio)
    budget = prefill.rows_budget(max(seq), kind, window, starts[-1])
    (chunk,) = prefill.plan_chunks(query_start_cpu, seq_cpu, 0, C, kind, window, budget * C)

    def caches(block: int):
        count = draw(50, 90)
        pages = kv_cache.allocate(count, block, fmt, device)
        width = -(-max(seq) // block)
        table = torch.randint(0, count, (C, width), generator=gen, dtype=torch.int32).to(device)
        return pages, table, prefill.token_rows_view(pages, fmt, block)

    swa_pages, swa_table, swa_view = caches(swa_block)
    extra, extra_view = None, None
    if ratio > 1:
        per_page = cache_block // ratio
        pages, table, extra_view = caches(per_page)
        extra = (pages, table, per_page, ratio)
    vllm_caches = (swa_view, extra_view) if fmt is KVFormat.FP8_DS_MLA else None
    workspace = torch.empty(C * chunk.rows, HEAD_DIM, dtype=torch.bfloat16, device=device)
    seq_lens = seq_cpu.to(device)
    query_lens = torch.tensor(new, dtype=torch.int32, device=device)
    prefill.gather_rows(
        workspace,
        chunk,
        fmt,
        seq_lens,
        query_lens,
        window,
        (swa_pages, swa_table, swa_block),
        extra,
        vllm_caches,
    )
