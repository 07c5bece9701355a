"""ops.sparse_attention: validation, backend choice and logging, agreement with the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_attn import dispatch_log, ops
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.testing import make_decode_case
from tests.test_fallback import assert_matches_reference, naive_on_cache, reference_on_rows


def small_case(**kwargs):
    kwargs.setdefault("extra", 8)
    return make_decode_case(3, 8, kwargs.pop("fmt", "nvfp4"), 16, seed=1, distinct=False, **kwargs)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_backends_agree_with_reference(backend):
    """On the CPU both run the torch fallback ("auto" with its reason), checked against the
    float64 reference."""
    case = small_case(lens="random", hole_rate=0.2, sink="mixed")
    out, lse = ops.sparse_attention(*case.args(), backend=backend)
    ran, reason = ops.last_dispatch()
    assert ran == "sdpa"
    assert (reason is None) == (backend == "sdpa")
    assert_matches_reference(out, lse, *reference_on_rows(case))


@pytest.mark.parametrize("fmt", ["mxfp8_ds", "nvfp4_ds"])
def test_v41_records_are_read_by_the_fallback(fmt):
    """Caches of DeepSeek-V4.1's records (no kernel reads them yet): the fallback reads their
    rows as the codec decodes them, against the float64 reference; ``auto`` says why."""
    case = small_case(fmt=fmt, lens="random", hole_rate=0.2)
    out, lse = ops.sparse_attention(*case.args())
    ran, reason = ops.last_dispatch()
    assert ran == "sdpa" and reason is not None
    assert_matches_reference(out, lse, *reference_on_rows(case))


def test_reference_backend_runs_the_reference_on_the_cache():
    """``backend="reference"`` runs the float64 reference on the rows the lists touch (no
    fallback reason), and its bf16 output is the attention of those rows: checked against
    :func:`~tests.test_fallback.naive_attention`, a token-by-token loop of its own."""
    case = small_case(lens="random", hole_rate=0.2, sink="mixed")
    out, lse = ops.sparse_attention(*case.args(), backend="reference")
    assert ops.last_dispatch() == ops.Dispatch("reference", None)
    assert_matches_reference(out, lse, *naive_on_cache(case))


def test_cutedsl_backend_refuses_cpu_with_reason():
    case = small_case()
    with pytest.raises(ValueError, match="backend='cutedsl' cannot run this case"):
        ops.sparse_attention(*case.args(), backend="cutedsl")


def test_auto_logs_each_fallback_reason_once(dsv4_logs, monkeypatch):
    monkeypatch.setattr(dispatch_log, "logged_reasons", set())
    case = small_case()
    for _ in range(3):
        ops.sparse_attention(*case.args())
    records = [r for r in dsv4_logs.records if "SDPA fallback" in r.getMessage()]
    assert len(records) == 1, records
    assert records[0].levelname == "WARNING" and records[0].name.startswith("vllm.dsv4_attn")


def _call_with(case, **fields):
    """Call ops.sparse_attention on ``case`` with fields replaced: top-level arguments by name,
    scope fields as ``window_<field>`` / ``extra_<field>``."""
    args = {"q": case.q, "sink": case.sink, "scale": case.scale}
    scopes = {"window": case.window, "extra": case.extra}
    for key, value in fields.items():
        name, _, field = key.partition("_")
        if name in scopes and field:
            scopes[name] = dataclasses.replace(scopes[name], **{field: value})
        else:
            args[key] = value
    args.update({k: v for k, v in scopes.items() if k not in fields})
    return ops.sparse_attention(**args)


BAD = [
    ({"q": torch.zeros(3, 8, 256, dtype=torch.bfloat16)}, "q must be \\[T, H, 512\\]"),
    ({"q": torch.zeros(3, 8, 512, dtype=torch.int32)}, "q must be bfloat16"),
    ({"window_block_size": 0}, "window.block_size must be a positive int, got 0"),
    ({"window_block_size": 128}, "window.cache rows must hold a page of"),  # 64-token pages
    (
        {"window_indices": torch.zeros(3, 16)},
        "window.indices must be an int32/int64 tensor, got torch.float32",
    ),
    (
        {"window_indices": torch.zeros(2, 16, dtype=torch.int32)},
        "window.indices must be \\[T=3, K\\]",
    ),
    (
        {"window_lens": torch.full((3,), 17, dtype=torch.int32)},
        "window.lens must lie in \\[0, K=16\\]",
    ),
    ({"window_indices": torch.full((3, 16), 10**6, dtype=torch.int32)}, "hold slot 1000000"),
    ({"extra_indices": torch.full((3, 8), -5, dtype=torch.int32)}, "extra.indices hold slot -5"),
    ({"extra_fmt": KVFormat.FP8_DS_MLA}, "extra.cache rows must hold a page"),
    ({"window": (1, 2)}, "window must be a dsv4_attn.scope.KVScope, got tuple"),
    ({"sink": torch.zeros(7)}, "sink must be \\[H=8\\]"),
    ({"scale": -1.0}, "scale must be a positive finite float, got -1.0"),
    ({"scale": 0.0}, "scale must be a positive finite float, got 0.0"),
    ({"scale": 0}, "scale must be a positive finite float, got 0$"),
    ({"scale": float("inf")}, "scale must be a positive finite float, got inf"),
    ({"scale": float("nan")}, "scale must be a positive finite float, got nan"),
    ({"window_fmt": "int4"}, "unknown KV-cache format 'int4'"),
    ({"out": torch.zeros(3, 8, 512)}, r"out must be a contiguous \(3, 8, 512\) torch.bfloat16"),
    ({"lse": torch.zeros(3, 7)}, r"lse must be a contiguous \(3, 8\) torch.float32 .* \(3, 7\)"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_input_raises_value_error(fields, message):
    with pytest.raises(ValueError, match=message):
        _call_with(small_case(), **fields)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_scopes_in_two_formats_are_served(backend):
    """An MXFP8_DS window beside NVFP4_DS compressed entries (DeepSeek-V4.1's nvfp4_ds_mla):
    valid; on the CPU "auto" runs the fallback, and both backends match the float64 reference
    on each scope's own rows."""
    case = small_case(fmt="mxfp8_ds", extra_fmt="nvfp4_ds", lens="random", hole_rate=0.2)
    out, lse = ops.sparse_attention(*case.args(), backend=backend)
    assert ops.last_dispatch().backend == ("sdpa" if backend == "auto" else "reference")
    assert_matches_reference(out, lse, *reference_on_rows(case))


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_out_and_lse_are_written_in_place(backend):
    case = small_case(lens="random", hole_rate=0.2)
    T, H = case.q.shape[:2]
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((T, H), float("nan"))
    got_out, got_lse = ops.sparse_attention(*case.args(), out=out, lse=lse, backend=backend)
    assert got_out is out and got_lse is lse
    assert ops.last_dispatch().backend == ("reference" if backend == "reference" else "sdpa")
    # The reference backend against a computation of its own, not against itself.
    expected = naive_on_cache if backend == "reference" else reference_on_rows
    assert_matches_reference(out, lse, *expected(case))


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.sparse_attention(*small_case().args(), backend="flash")


def test_check_values_false_skips_value_checks_only():
    case = small_case()
    with pytest.raises(ValueError, match="indices must be \\[T=3, K\\]"):
        _call_with(case, window_indices=case.window.indices[:2], check_values=False)
    out, _ = ops.sparse_attention(*case.args(), check_values=False)
    assert out.shape == (3, 8, 512)


def test_last_dispatch_reports_what_ran():
    case = small_case()
    ops.sparse_attention(*case.args(), backend="reference")
    assert ops.last_dispatch() == ops.Dispatch("reference", None)
    ops.sparse_attention(*case.args(), backend="sdpa")
    assert ops.last_dispatch() == ops.Dispatch("sdpa", None)
    ops.sparse_attention(*case.args())  # auto on CPU: the fallback, with its reason
    backend, reason = ops.last_dispatch()
    assert backend == "sdpa" and "cuda" in reason.lower()


def _kernel_on_cpu(monkeypatch) -> list:
    """The kernel made reachable on CPU: its flat test and support check without their device
    tests, the kernel stood in for by the torch fallback writing into the given outputs. Returns the
    list of calls the stand-in received."""
    from dsv4_attn import fallback
    from dsv4_attn.kernels import sparse_decode

    calls = []

    def kernel(q, window, sink, scale, extra=None, *, out=None, lse=None, workspace, plan):
        calls.append(window)
        result = fallback.sparse_attention(q, window, sink, scale, extra)
        return ops._into(out, lse, result)

    monkeypatch.setattr(sparse_decode, "is_common_case", sparse_decode._common_layout)
    monkeypatch.setattr(ops, "_cutedsl_unsupported_reason", sparse_decode._layout_reason)
    monkeypatch.setattr(sparse_decode, "sparse_attention", kernel)
    return calls


def test_the_kernels_common_case_skips_only_the_shape_checks(monkeypatch):
    """A call of the serving layer's kind goes straight to the kernel (ops' flat test), its
    result that of the float64 reference; slot values are still checked when asked."""
    calls = _kernel_on_cpu(monkeypatch)
    case = make_decode_case(3, 64, KVFormat.NVFP4, 128, 512, lens="random", hole_rate=0.2)
    out, lse = ops.sparse_attention(*case.args())
    assert ops.last_dispatch() == ops.Dispatch("cutedsl", None) and len(calls) == 1
    assert_matches_reference(out, lse, *reference_on_rows(case))

    num_slots = case.window.cache.shape[0] * case.window.block_size
    indices = case.window.indices.clone()
    indices[1, 0] = num_slots
    bad = dataclasses.replace(case.window, indices=indices)
    args = (case.q, bad, case.sink, case.scale, case.extra)
    with pytest.raises(ValueError, match=f"window.indices hold slot {num_slots}: slots must lie"):
        ops.sparse_attention(*args)
    lens = case.extra.lens.clone()
    lens[0] = case.extra.capacity + 1
    bad = dataclasses.replace(case.extra, lens=lens)
    with pytest.raises(ValueError, match=r"extra.lens must lie in \[0, K=512\]"):
        ops.sparse_attention(case.q, case.window, case.sink, case.scale, bad)
    assert len(calls) == 1
    ops.sparse_attention(*args, check_values=False)  # unchecked values are the kernel's rule
    assert len(calls) == 2


def test_a_call_outside_the_common_case_takes_the_full_checks(monkeypatch):
    """What the flat test refuses still gets the message that names the bad value, or runs
    where it can (a format given by name)."""
    calls = _kernel_on_cpu(monkeypatch)
    case = make_decode_case(3, 64, KVFormat.FP8_DS_MLA, 128, 512)
    q, window, sink, scale, extra = case.args()
    with pytest.raises(ValueError, match=r"sink must be \[H=64\] or None, got \(63,\)"):
        ops.sparse_attention(q, window, sink[:63], scale, extra)
    named = dataclasses.replace(window, fmt="fp8_ds_mla")
    out, lse = ops.sparse_attention(q, named, sink, scale, extra)
    assert ops.last_dispatch() == ops.Dispatch("cutedsl", None) and len(calls) == 1
    assert calls[0].fmt is KVFormat.FP8_DS_MLA  # parsed by the full checks
    assert_matches_reference(out, lse, *reference_on_rows(case))


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs a Hopper (sm_90) GPU",
)
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_auto_runs_the_kernel_on_the_serving_layers_calls(fmt, T):
    """On an sm_90 GPU the serving layer's call takes the flat test straight to the kernel
    (poisoned outputs written in place), matching the float64 reference; a bad slot is still
    named when values are checked."""
    from dsv4_attn.kernels import sparse_decode

    case = make_decode_case(T, 64, fmt, 128, 512, device="cuda", seed=T, lens="random")
    assert sparse_decode.is_common_case(*case.args(), None, None)
    out = torch.full((T, 64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((T, 64), float("nan"), device="cuda")
    ops.sparse_attention(*case.args(), out=out, lse=lse)
    assert ops.last_dispatch() == ops.Dispatch("cutedsl", None)
    assert_matches_reference(out, lse, *reference_on_rows(case))
    indices = case.window.indices.clone()
    indices[-1, 0] = -2
    bad = dataclasses.replace(case.window, indices=indices)
    with pytest.raises(ValueError, match=r"window\.indices hold slot -2"):
        ops.sparse_attention(case.q, bad, case.sink, case.scale, case.extra)
