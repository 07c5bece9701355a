"""``python -m dsv4_attn.bench decode --against flashmla`` (dsv4_attn/bench/decode.py) and the
FlashMLA mapping it uses (dsv4_attn/bench/anchors.py): options, q/sink padding, the view of our
fp8_ds_mla caches FlashMLA reads, the arguments it is called with (a stand-in module records
them), targets, and the report without flash_mla. CPU only, except the last test (``-m gpu``)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from dsv4_attn import fallback, kv_cache
from dsv4_attn.bench import anchors, decode, prefill
from dsv4_attn.bench.timing import Ceilings
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.testing import make_decode_case, random_rows

FP8 = KVFormat.FP8_DS_MLA


# --- options ---------------------------------------------------------------------------------


def test_plain_defaults_are_unchanged():
    args = decode.parse_args([])
    assert args.against is None and args.batches is None
    assert args.shapes == ["v4-flash", "v4-pro", "hca-1m", "window-only"]
    assert args.tokens == [1, 8, 64, 128, 256]
    assert args.formats == ["fp8_ds_mla", "nvfp4"] and args.json == "bench_decode.json"
    args = decode.parse_args(["--tokens", "4", "16", "--shapes", "v4-pro", "--formats", "NVFP4"])
    assert (args.tokens, args.shapes, args.formats) == ([4, 16], ["v4-pro"], ["nvfp4"])


def test_against_defaults_cover_the_issue_shapes_and_batches():
    args = decode.parse_args(["--against", "flashmla"])
    assert args.against == "flashmla" and args.s_q == 2
    assert args.batches == [1, 32, 64, 128, 256]
    assert args.shapes == [
        "v4-flash",
        "v4-pro",
        "hca-1m",
        "window-only",
        "v4-flash-tp2",
        "v4-flash-tp4",
        "v4-flash-tp8",
        "hca-1m-ragged",
        "hca-512k-ragged",
        "hca-256k-ragged",
        "hca-128k-ragged",
    ]
    heads = {s: decode.ALL_SHAPES[s][0] for s in args.shapes}
    assert heads == {
        "v4-flash": 64,
        "v4-pro": 128,
        "hca-1m": 64,
        "window-only": 64,
        "v4-flash-tp2": 32,
        "v4-flash-tp4": 16,
        "v4-flash-tp8": 8,
        "hca-1m-ragged": 64,
        "hca-512k-ragged": 64,
        "hca-256k-ragged": 64,
        "hca-128k-ragged": 64,
    }
    assert decode.ALL_SHAPES["v4-pro"][1:] == (128, 1024)
    assert decode.ALL_SHAPES["window-only"][1:] == (128, 0)
    assert decode.ALL_SHAPES["hca-1m"][1:] == (128, 8192)
    assert decode.ALL_SHAPES["hca-1m-ragged"][1:] == (128, 8192)
    assert [decode.ALL_SHAPES[f"hca-{c}-ragged"][1:] for c in ("512k", "256k", "128k")] == [
        (128, 4096),
        (128, 2048),
        (128, 1024),
    ]
    assert all(decode.ALL_SHAPES[s][1:] == (128, 512) for s in decode.TP_SHAPES)
    assert args.formats == ["fp8_ds_mla", "nvfp4"]
    assert args.json == "bench_decode_vs_flashmla.json"
    args = decode.parse_args(
        ["--against", "flashmla", "--batches", "64", "--shapes", "v4-flash-tp8", "--json", "x"]
    )
    assert (args.batches, args.shapes, args.json) == ([64], ["v4-flash-tp8"], "x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--against", "flashmla", "--tokens", "8"], "--batches, not --tokens"),
        (["--batches", "8"], "go with --against"),
        (["--cuda-graphs"], "go with --against"),
        (["--s-q", "1"], "go with --against"),
        (["--against", "flashmla", "--formats", "bf16"], "fp8_ds_mla and nvfp4 only"),
        (["--against", "flashmla", "--batches", "0"], "must be positive"),
        (["--formats", "int4"], "unknown KV-cache format"),
        (["--against", "sdpa"], "invalid choice"),
    ],
)
def test_conflicting_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(argv)
    assert message in capsys.readouterr().err


# --- q / sink padding ------------------------------------------------------------------------


@pytest.mark.parametrize("H, padded", [(8, 64), (16, 64), (32, 64), (64, 64), (100, 128)])
def test_heads_pad_to_what_flashmla_runs_and_slice_back(H, padded):
    assert anchors.flashmla_heads(H) == padded
    q = torch.randn(3, 2, H, 512).to(torch.bfloat16)
    q_pad = anchors.pad_heads(q, padded)
    assert q_pad.shape == (3, 2, padded, 512) and q_pad.is_contiguous()
    assert torch.equal(q_pad[:, :, :H], q)
    assert not q_pad[:, :, H:].any()
    back = anchors.unpad_heads(q_pad, H)
    assert back.shape == q.shape and torch.equal(back, q)
    sink = torch.randn(H)
    sink_pad = anchors.pad_sink(sink, padded)
    assert sink_pad.shape == (padded,) and sink_pad.dtype == torch.float32
    assert torch.equal(sink_pad[:H], sink) and bool((sink_pad[H:] == float("-inf")).all())


def test_head_counts_flashmla_cannot_run():
    with pytest.raises(ValueError, match="1 to 128"):
        anchors.flashmla_heads(129)
    with pytest.raises(ValueError, match="cannot pad"):
        anchors.pad_heads(torch.zeros(1, 65, 512), 64)
    assert anchors.pad_sink(None, 64) is None
    assert anchors.flashmla_refusal(64, [128, 512]) is None
    assert anchors.flashmla_refusal(8, [128, 8192]) is None
    assert "h_q" in anchors.flashmla_refusal(256, [128])
    assert "multiple of 64" in anchors.flashmla_refusal(64, [128, 100])
    assert "multiple of 64" in anchors.flashmla_refusal(64, [0])


# --- the cache view FlashMLA reads -----------------------------------------------------------


def _bytes_flashmla_reads(view: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The data bytes (uint8 ``[..., 576]``) and scale bytes (``[..., 8]``) FlashMLA's sm90
    MODEL1 kernel loads for ``slots`` (csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh): block =
    slot / page_block_size, row = slot % page_block_size; data at k_ptr + block * stride(0) +
    row * 576, scales at k_ptr + block * stride(0) + page_block_size * 576 + row * 8, with k_ptr,
    stride(0) and page_block_size = shape[1] taken from the view (nothing else of it is used).
    Slot -1 reads slot 0 (the kernel then zeroes the row)."""
    page_block_size = view.shape[1]
    storage = view.view(torch.uint8).as_strided((view.untyped_storage().nbytes(),), (1,), 0)
    slots = slots.long().clamp(min=0)
    page = view.storage_offset() + (slots // page_block_size) * view.stride(0)
    row = slots % page_block_size
    data = storage[(page + row * 576)[..., None] + torch.arange(576)]
    scales = storage[(page + page_block_size * 576 + row * 8)[..., None] + torch.arange(8)]
    return data, scales


def _flashmla_dequant(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FlashMLA's MODEL1 rows, bf16 ``[..., 512]``: 448 e4m3 values times 2^(scale byte - 127)
    per 64 of them, then 64 bf16 RoPE values."""
    lead = data.shape[:-1]
    nope = data[..., :448].contiguous().view(torch.float8_e4m3fn).float().view(*lead, 7, 64)
    nope = nope * torch.exp2(scales[..., :7].float() - 127)[..., None]
    rope = data[..., 448:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.view(*lead, 448).to(torch.bfloat16), rope], dim=-1)


@pytest.mark.parametrize("block_size", [64, 16])
@pytest.mark.parametrize("layout", ["allocated", "wider rows", "block slice"])
def test_flashmla_view_reads_each_slots_own_bytes(block_size, layout):
    num_blocks = 5
    page = kv_cache.page_layout(FP8, block_size).page_bytes
    if layout == "allocated":
        cache = kv_cache.allocate(num_blocks, block_size, FP8)
    elif layout == "wider rows":  # vLLM's packed pages: the row stride exceeds the page
        cache = torch.zeros(num_blocks, page + 1152, dtype=torch.uint8)
    else:  # a cache that starts inside a larger tensor (storage offset)
        cache = kv_cache.allocate(num_blocks + 2, block_size, FP8)[2:]
    cache.fill_(0xA5)  # poison: page padding and bytes past the page never look like a row
    num_slots = num_blocks * block_size
    gen = torch.Generator().manual_seed(block_size)
    rows = random_rows(num_slots, gen)
    slots = torch.randperm(num_slots, generator=gen)
    kv_cache.write(cache, slots, rows, FP8, block_size)
    data, scales = kv_cache.encode_rows(rows, FP8)

    view = anchors.flashmla_kv_view(cache, block_size)
    # what FlashMLA checks of it (api/sparse_decode.h): dtype, shape, stride(1), last dim
    assert view.dtype == torch.float8_e4m3fn
    assert view.shape == (num_blocks, block_size, 1, 584)
    assert view.stride(1) == 584 and view.stride(-1) == 1
    assert view.stride(0) == cache.stride(0)  # one page per block, no copy
    assert view.data_ptr() == cache.data_ptr()
    got_data, got_scales = _bytes_flashmla_reads(view, slots)
    assert torch.equal(got_data, data) and torch.equal(got_scales, scales)
    expected = kv_cache.read(cache, slots, FP8, block_size)
    assert torch.equal(_flashmla_dequant(got_data, got_scales), expected)


def test_flashmla_view_refuses_caches_it_cannot_map():
    with pytest.raises(ValueError, match="shorter than an fp8_ds_mla page"):
        anchors.flashmla_kv_view(kv_cache.allocate(2, 16, KVFormat.NVFP4), 16)
    with pytest.raises(ValueError, match="uint8"):
        anchors.flashmla_kv_view(torch.zeros(2, 9792, dtype=torch.int32), 16)


def test_slot_lists_and_lengths_as_flashmla_takes_them():
    indices = torch.arange(24, dtype=torch.int64).view(6, 4)
    mapped = anchors.flashmla_indices(indices, 3, 2)
    assert mapped.dtype == torch.int32 and mapped.shape == (3, 2, 4)
    assert torch.equal(mapped.view(6, 4).long(), indices)
    with pytest.raises(ValueError, match="not 2 requests"):
        anchors.flashmla_indices(indices, 2, 2)
    assert anchors.flashmla_lengths(torch.full((6,), 4, dtype=torch.int32), 4, 3, 2) is None
    lengths = anchors.flashmla_lengths(torch.tensor([4, 4, 1, 1, 0, 0]), 4, 3, 2)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [4, 1, 0]
    with pytest.raises(ValueError, match="one list length per request"):
        anchors.flashmla_lengths(torch.tensor([4, 3, 4, 4, 4, 4]), 4, 3, 2)


# --- the FlashMLA call, with a stand-in module -----------------------------------------------


class _FakeFlashMLA(types.SimpleNamespace):
    """Records the arguments of ``flash_mla_with_kvcache``; returns q as the output (so the
    sliced result must be our q) and a zero lse."""

    def __init__(self):
        super().__init__(calls=[], metas=[])

    def get_mla_metadata(self, *args, **kwargs):
        meta = object()
        self.metas.append(meta)
        return meta, None

    def flash_mla_with_kvcache(self, *args):
        self.calls.append(args)
        q = args[0]
        return q.clone(), torch.zeros(q.shape[0], q.shape[2], q.shape[1])


@pytest.mark.parametrize("H", [8, 64, 128])
def test_flashmla_call_gets_the_same_bytes_ids_q_sink_and_scale(H):
    b, s_q, window, extra = 3, 2, 64, 128
    case = make_decode_case(
        b * s_q, H, FP8, window, extra, seed=H, block_size=64, extra_block_size=16
    )
    fake = _FakeFlashMLA()
    call = anchors.flashmla_sparse_decode(fake, case, s_q)
    assert fake.calls == [] and len(fake.metas) == 1  # nothing runs until called
    out = call()
    call()
    assert len(fake.calls) == 2 and len(fake.metas) == 1  # one plan, reused
    (
        q,
        kv,
        block_table,
        seqlens,
        d_v,
        meta,
        num_splits,
        scale,
        causal,
        is_fp8,
        indices,
        sink,
        extra_kv,
        extra_indices,
        topk_length,
        extra_topk_length,
    ) = fake.calls[0]
    heads = 64 if H <= 64 else 128
    assert q.shape == (b, s_q, heads, 512) and q.dtype == torch.bfloat16
    assert torch.equal(q[:, :, :H].reshape(b * s_q, H, 512), case.q)
    assert not q[:, :, H:].any()
    assert out.shape == (b * s_q, H, 512) and torch.equal(out, case.q)  # sliced back
    assert (block_table, seqlens, num_splits, causal, is_fp8) == (None, None, None, False, True)
    assert d_v == 512 and meta is fake.metas[0] and scale == case.scale
    assert torch.equal(sink[:H], case.sink) and bool((sink[H:] == float("-inf")).all())
    for scope, view, ids in ((case.window, kv, indices), (case.extra, extra_kv, extra_indices)):
        assert view.data_ptr() == scope.cache.data_ptr()
        assert view.shape == (scope.cache.shape[0], scope.block_size, 1, 584)
        assert ids.dtype == torch.int32 and ids.shape == (b, s_q, scope.capacity)
        assert torch.equal(ids.view(b * s_q, -1), scope.indices.to(torch.int32))
    assert topk_length is None and extra_topk_length is None  # every entry counts


def test_flashmla_call_refuses_other_formats_and_partial_requests():
    case = make_decode_case(4, 8, "nvfp4", 64, 64, extra_block_size=16)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        anchors.flashmla_sparse_decode(_FakeFlashMLA(), case, 2)
    case = make_decode_case(3, 8, FP8, 64, 64, extra_block_size=16)
    with pytest.raises(ValueError, match="whole requests"):
        anchors.flashmla_sparse_decode(_FakeFlashMLA(), case, 2)


class _EmulatedFlashMLA(_FakeFlashMLA):
    """FlashMLA's sparse decode on the CPU in float64, reading the caches only as its kernel
    does through the views it is given (:func:`_bytes_flashmla_reads`); ``fail`` makes it refuse
    like a TORCH_CHECK."""

    def __init__(self, fail: str | None = None):
        super().__init__()
        self.fail = fail

    def flash_mla_with_kvcache(self, *args):
        self.calls.append(args)
        if self.fail:
            raise RuntimeError(self.fail)
        q, kv, *_, scale, _causal, _fp8, indices, sink, extra_kv, extra_indices, lens, elens = args
        keys = torch.cat(
            [
                _flashmla_dequant(*_bytes_flashmla_reads(v, i))
                for v, i in ((kv, indices), (extra_kv, extra_indices))
            ],
            dim=2,
        ).double()

        def counted(ids, lengths):  # topk_length: entries past a request's length do not count
            if lengths is None:
                return ids >= 0
            entry = torch.arange(ids.shape[-1])
            return (ids >= 0) & (entry < lengths.long()[:, None, None])

        valid = torch.cat([counted(indices, lens), counted(extra_indices, elens)], dim=-1)
        logits = torch.einsum("bshd,bskd->bshk", q.double(), keys) * scale
        logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        out = torch.einsum("bshk,bskd->bshd", torch.softmax(logits, dim=-1), keys)
        out = out * torch.sigmoid(lse - sink.double())[..., None]  # e^lse / (e^lse + e^sink)
        return out.to(torch.bfloat16), lse.float()


def _cpu_stand_ins(monkeypatch) -> list[float]:
    """Run the --against loop on the CPU: the SDPA fallback stands in for our kernel (a balanced
    plan, made on the CPU for 8 parts, changes nothing in its math), each "timing" calls once
    and returns 10, 20, 30, ... µs in call order."""
    from dsv4_attn.kernels import sparse_decode, sparse_decode_schedule

    def stand_in(*args, plan=None, **kwargs):
        return fallback.sparse_attention(*args, **kwargs)

    monkeypatch.setattr(sparse_decode, "unsupported_reason", lambda *args: None)
    monkeypatch.setattr(sparse_decode, "sparse_attention", stand_in)
    monkeypatch.setattr(sparse_decode_schedule, "balanced_parts", lambda num_heads, device: 8)
    monkeypatch.setattr(decode, "measure_ceilings", lambda: Ceilings(1000.0, 1e9, "cpu"))
    times: list[float] = []

    def fake_time(fn, reps=50, warmup=5):
        fn()
        times.append(10.0 * (len(times) + 1))
        return {"median_us": times[-1], "min_us": times[-1], "max_us": times[-1]}

    monkeypatch.setattr(decode, "time_cuda_us", fake_time)
    return times


def test_ragged_shape_gives_each_request_its_own_count_of_compressed_rows():
    """hca-1m-ragged (the balanced schedule's case): the tokens of a request share one count of
    compressed rows, counts differ between requests and stay in [0, capacity]; the window is
    full; the floor counts only the rows that count."""
    pool = decode._RowPool(torch.device("cpu"), seed=1)
    case = decode.make_case(pool, FP8, 64, 8, 16, 64, ragged_group=2)
    counts = case.extra.lens.view(32, 2)
    assert (counts[:, 0] == counts[:, 1]).all()
    assert counts.min() >= 0 and counts.max() <= 64 and len(set(counts[:, 0].tolist())) > 8
    assert (case.window.lens == 16).all()
    assert case.num_keys == int(case.window.lens.sum() + case.extra.lens.sum())
    with pytest.raises(ValueError, match="not whole requests"):
        decode.make_case(pool, FP8, 5, 8, 16, 64, ragged_group=2)


def test_window_only_shape_has_no_second_list():
    """window-only (V4.1's ratio-0 layers): each token's own full window, no compressed list."""
    pool = decode._RowPool(torch.device("cpu"), seed=2)
    H, window, extra = decode.ALL_SHAPES["window-only"]
    case = decode.make_case(pool, FP8, 4, H, window, extra)
    assert case.extra is None and case.q.shape == (4, 64, 512)
    assert (case.window.lens == 128).all() and case.num_keys == 4 * 128
    assert len(set(case.window.indices.flatten().tolist())) == 4 * 128  # no row shared


def test_against_loop_runs_the_ragged_shape_with_per_request_lengths(monkeypatch):
    _cpu_stand_ins(monkeypatch)
    fm = _EmulatedFlashMLA()
    rows, _ = decode.run_against(fm, ["hca-1m-ragged"], [2], list(decode.OURS), 2, 3, device="cpu")
    (row,) = rows
    assert "flashmla_error" not in row and row["max_abs_diff_vs_flashmla"] < 0.1
    # 8192 compressed entries: also timed on the balanced schedule, and its plan alone.
    assert row["fp8_balanced_us"] is not None and row["plan_us"] is not None
    assert row["vs_flashmla_balanced"] == row["flashmla_us"] / row["fp8_balanced_us"]
    for call in fm.calls:  # the checked call and the timed one
        window_lengths, extra_lengths = call[-2:]
        assert window_lengths is None and extra_lengths.shape == (2,)


def test_against_loop_compares_ours_with_flashmla_on_the_same_bytes(monkeypatch):
    times = _cpu_stand_ins(monkeypatch)
    fm = _EmulatedFlashMLA()
    rows, _ = decode.run_against(
        fm, ["v4-flash-tp8"], [1, 2], list(decode.OURS), 2, 3, device="cpu"
    )
    assert times == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]  # per row: fp8, nvfp4, FlashMLA
    shapes = [(r["b"], r["T"], r["H"], r["flashmla_heads"]) for r in rows]
    assert shapes == [(1, 2, 8, 64), (2, 4, 8, 64)]
    assert [(r["fp8_us"], r["nvfp4_us"], r["flashmla_us"]) for r in rows] == [
        (10.0, 20.0, 30.0),
        (40.0, 50.0, 60.0),
    ]
    assert (rows[0]["vs_flashmla_fp8"], rows[0]["vs_flashmla_nvfp4"]) == (3.0, 1.5)
    assert fm.calls[0][0].shape == (1, 2, 64, 512)  # q padded to 64 heads
    for row in rows:
        # 640 keys per token in its format, q and out: bytes at 1000 GB/s (FLOPs free here)
        q_out = 2 * row["T"] * 8 * 512 * 2
        assert row["floor_us"] == pytest.approx((row["T"] * 640 * 584 + q_out) / 1e6)
        assert row["nvfp4_floor_us"] == pytest.approx((row["T"] * 640 * 384 + q_out) / 1e6)
        # the emulated FlashMLA read the same rows as ours: bf16 rounding apart, same output
        assert row["fp8_max_abs_out"] > 0.05
        assert row["max_abs_diff_vs_flashmla"] <= 0.01 * row["fp8_max_abs_out"], row
        assert ("flashmla_error" not in row and row["target"] == "<=10us") or row["b"] == 2


def test_against_loop_times_graph_replays_of_both_with_cuda_graphs(monkeypatch):
    times = _cpu_stand_ins(monkeypatch)
    captured = []

    def fake_graph(fn):  # stands in for a capture: remembers what was captured
        captured.append(fn)
        return fn

    monkeypatch.setattr(decode, "cuda_graph_replay", fake_graph)
    fm = _EmulatedFlashMLA()
    args = decode.parse_args(["--against", "flashmla", "--cuda-graphs"])
    assert args.cuda_graphs
    rows, _ = decode.run_against(
        fm, ["v4-flash-tp8"], [1], list(decode.OURS), 2, 3, device="cpu", graphs=True
    )
    assert len(captured) == 3 and len(times) == 3  # ours fp8, ours nvfp4, FlashMLA
    assert rows[0]["flashmla_us"] == 30.0
    captured.clear()
    decode.run_against(fm, ["v4-flash-tp8"], [1], [FP8], 2, 3, device="cpu")
    assert captured == []  # eager calls unless asked


def test_against_loop_records_a_flashmla_refusal_and_goes_on(monkeypatch):
    _cpu_stand_ins(monkeypatch)
    fm = _EmulatedFlashMLA(fail="Unsupported h_q: 8\nmore lines")
    rows, _ = decode.run_against(fm, ["v4-flash-tp8"], [1, 2], [FP8], 2, 3, device="cpu")
    assert len(rows) == 2 and len(fm.calls) == 2
    for row in rows:
        assert row["flashmla_error"] == "Unsupported h_q: 8"
        assert row["flashmla_us"] is None and row["fp8_us"] > 0 and row["nvfp4_us"] is None


def test_against_loop_without_flash_mla_times_ours(monkeypatch):
    times = _cpu_stand_ins(monkeypatch)
    rows, _ = decode.run_against(None, ["v4-flash-tp8"], [1], list(decode.OURS), 2, 3, device="cpu")
    assert times == [10.0, 20.0] and rows[0]["flashmla_us"] is None
    assert rows[0]["meets_target"] is False  # b = 1: ours must take <= 10 us in both formats


# --- rows and targets ------------------------------------------------------------------------


def _row(shape, b, fp8=None, nvfp4=None, fm=None, **fm_fields):
    ours = {k: v for k, v in (("fp8_ds_mla", fp8), ("nvfp4", nvfp4)) if v is not None}
    fields = {"flashmla_us": fm, **fm_fields} if fm is not None else fm_fields
    return decode.against_row(shape, b, 2, ours, {"fp8_ds_mla": 5.0, "nvfp4": 4.0}, fields)


def test_row_ratios_are_flashmla_over_ours():
    row = _row("v4-flash-tp8", 64, fp8=20.0, nvfp4=10.0, fm=50.0, max_abs_diff_vs_flashmla=0.003)
    assert (row["H"], row["flashmla_heads"], row["T"]) == (8, 64, 128)
    assert row["vs_flashmla_fp8"] == 2.5 and row["vs_flashmla_nvfp4"] == 5.0
    assert (row["floor_us"], row["nvfp4_floor_us"]) == (5.0, 4.0)
    assert row["max_abs_diff_vs_flashmla"] == 0.003
    assert row["target"] == "fp8>=2.0x" and row["meets_target"] is True
    assert _row("v4-flash-tp8", 64, fp8=26.0, nvfp4=10.0, fm=50.0)["meets_target"] is False


@pytest.mark.parametrize(
    "shape, b, fp8, nvfp4, fm, target, met",
    [
        ("v4-flash", 64, 30.0, 25.0, 60.0, "fp8>=1.5x nvfp4>=2.0x", True),
        ("v4-flash", 256, 30.0, 35.0, 60.0, "fp8>=1.5x nvfp4>=2.0x", False),  # nvfp4 1.71x
        ("v4-flash", 64, 30.0, 25.0, None, "fp8>=1.5x nvfp4>=2.0x", None),  # no FlashMLA
        ("v4-flash", 32, 30.0, 25.0, 60.0, None, None),  # no target at b = 32
        ("v4-pro", 128, 80.0, 70.0, 100.0, "fp8>=1.25x", True),
        ("v4-pro", 128, 81.0, 70.0, 100.0, "fp8>=1.25x", False),
        ("hca-1m", 64, 30.0, 25.0, 20.0, None, None),
        ("window-only", 64, 10.0, 9.0, 13.0, "fp8>=1.3x", True),
        ("window-only", 128, 10.0, 9.0, 12.9, "fp8>=1.3x", False),
        ("v4-flash", 1, 9.0, 8.0, None, "<=10us", True),  # judged on ours alone
        ("v4-pro", 1, 9.0, 10.5, 20.0, "<=10us", False),
        ("v4-flash-tp2", 1, 9.0, None, 20.0, "<=10us", None),  # nvfp4 not timed
    ],
)
def test_targets_from_the_issue(shape, b, fp8, nvfp4, fm, target, met):
    row = _row(shape, b, fp8=fp8, nvfp4=nvfp4, fm=fm)
    assert row["target"] == target and row["meets_target"] is met


def test_flashmla_refusal_is_recorded_in_the_row():
    row = _row("v4-flash", 64, fp8=30.0, nvfp4=25.0, flashmla_error="index width 100: ...")
    assert row["flashmla_error"] == "index width 100: ..."
    assert row["flashmla_us"] is None and row["vs_flashmla_fp8"] is None
    assert row["meets_target"] is None
    assert "flashmla_error" not in _row("v4-flash", 64, fp8=30.0, fm=40.0)


# --- flash_mla absent ------------------------------------------------------------------------


def test_import_flash_mla_says_once_when_absent(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import raises ImportError
    assert anchors.import_flash_mla() is None
    assert capsys.readouterr().out.count("flash_mla is not importable") == 1
    module = types.ModuleType("flash_mla")
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    assert anchors.import_flash_mla() is module
    assert capsys.readouterr().out == ""


def test_prefill_and_decode_share_the_import_helper():
    assert prefill.import_flash_mla is anchors.import_flash_mla
    assert not hasattr(prefill, "_flash_mla")


def test_against_without_flash_mla_reports_it_then_needs_cuda(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        decode.main(["--against", "flashmla", "--batches", "1"])
    assert capsys.readouterr().out.count("flash_mla is not importable") == 1
    with pytest.raises(SystemExit, match="no CUDA device"):
        decode.main(["--tokens", "1"])  # the plain run never looks for flash_mla
    assert "flash_mla" not in capsys.readouterr().out


# --- on the GPU machine ----------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_against_flashmla_writes_rows(tmp_path):
    path = tmp_path / "vs.json"
    decode.main(
        [
            "--against",
            "flashmla",
            "--shapes",
            "v4-flash",
            "v4-flash-tp8",
            "--batches",
            "1",
            "64",
            "--reps",
            "3",
            "--json",
            str(path),
        ]
    )
    record = json.loads(path.read_text())
    assert record["benchmark"] == "decode-vs-flashmla"
    rows = record["rows"]
    assert [(r["shape"], r["b"], r["T"]) for r in rows] == [
        ("v4-flash", 1, 2),
        ("v4-flash", 64, 128),
        ("v4-flash-tp8", 1, 2),
        ("v4-flash-tp8", 64, 128),
    ]
    for row in rows:
        assert row["fp8_us"] > 0 and row["nvfp4_us"] > 0 and row["floor_us"] > 0
        assert row["nvfp4_floor_us"] < row["floor_us"]  # fewer bytes per row
    try:
        import flash_mla  # noqa: F401
    except ImportError as exc:
        assert all(r["flashmla_us"] is None for r in rows)
        pytest.skip(
            f"flash_mla is not importable ({exc}): our rows checked, no FlashMLA to compare"
        )
    for row in rows:
        assert "flashmla_error" not in row, row
        assert row["flashmla_us"] > 0
        assert row["vs_flashmla_fp8"] == pytest.approx(row["flashmla_us"] / row["fp8_us"])
        # same bytes: the outputs agree to a few bf16 roundings of the largest output value
        assert row["max_abs_diff_vs_flashmla"] <= 0.01 * row["fp8_max_abs_out"] + 1e-3, row
