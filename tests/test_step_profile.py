"""The step profile: kernels charged to the engine step that launched them, per kind of step
(hand-made traces in the torch profiler's Chrome format)."""

from __future__ import annotations

import gzip
import json

import pytest

from dsv4_attn.e2e import step_profile


def _step(name: str, ts: float, dur: float, pid: int = 7) -> dict:
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": name,
        "pid": pid,
        "tid": 1,
        "ts": ts,
        "dur": dur,
    }


def _launch(correlation: int, ts: float, pid: int = 7, cat: str = "cuda_runtime") -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": "cudaLaunchKernel",
        "pid": pid,
        "tid": 1,
        "ts": ts,
        "dur": 3,
        "args": {"correlation": correlation},
    }


def _kernel(name: str, correlation: int, dur: float, cat: str = "kernel") -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": 10_000.0,
        "dur": dur,
        "args": {"correlation": correlation},
    }


def _trace() -> dict:
    events = [
        # two decode steps (graph launches), one mixed step, one prefill step
        _step("execute_context_0(0)_generation_64(64)", 0, 100),
        _step("execute_context_0(0)_generation_64(64)", 200, 120),
        _step("execute_context_1(2048)_generation_63(63)", 400, 900),
        _step("execute_context_2(8192)_generation_0(0)", 1400, 500),
        _launch(1, 10, cat="cuda_driver"),
        _launch(2, 210),
        _launch(3, 420),
        _launch(4, 430),
        _launch(5, 1410),
        _launch(6, 5000),  # 6: outside every step
        _launch(7, 50, pid=99),  # another process: not a step of pid 7
        _kernel("kernel_SparseDecodeSm90_sm90a", 1, 30),
        _kernel("fused_moe_kernel", 1, 70),
        _kernel("kernel_SparseDecodeSm90_sm90a", 2, 50),
        _kernel("fused_moe_kernel", 2, 50),
        _kernel("fmha_gather_kernel", 3, 400),
        _kernel("Memcpy HtoD (Pinned -> Device)", 4, 100, cat="gpu_memcpy"),
        _kernel("nvjet_gemm", 5, 1000),
        _kernel("kernel_SparseDecodeSm90_sm90a", 6, 999),
        _kernel("kernel_SparseDecodeSm90_sm90a", 7, 999),
    ]
    return {"traceEvents": events}


def test_kernels_are_charged_to_the_step_that_launched_them():
    summary = step_profile.summarize(_trace())
    assert summary["steps"] == 4
    decode, mixed, prefill = (summary["kinds"][k] for k in ("decode", "mixed", "prefill"))
    assert decode["steps"] == 2
    assert decode["median_gpu_us"] == 100  # 30 + 70 and 50 + 50
    assert decode["median_attention_us"] == 40  # 30 and 50
    assert decode["attention_share"] == pytest.approx(80 / 200)
    assert decode["median_cpu_us"] == 110
    assert mixed == {
        **mixed,
        "steps": 1,
        "median_gpu_us": 500,
        "median_attention_us": 400,
        "median_decode_requests": 63,
        "median_prefill_tokens": 2048,
    }
    assert prefill["median_gpu_us"] == 1000 and prefill["attention_share"] == 0
    top = decode["top_kernels"]
    assert [k["name"] for k in top] == ["fused_moe_kernel", "kernel_SparseDecodeSm90_sm90a"]
    assert [k["attention"] for k in top] == [False, True]


@pytest.mark.parametrize(
    ("name", "attention"),
    [
        ("kernel_cutlass_SparseDecodeSm90_object_at", True),
        ("flash_fwd_splitkv_mla_fp8_sparse_kernel", True),
        ("fp8_mqa_logits_kernel", True),
        ("_insert_swa_rows_kernel", True),
        ("fused_moe_kernel", False),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", False),
        ("triton_red_fused_rms_norm", False),
    ],
)
def test_attention_kernels_by_name(name, attention):
    assert step_profile.attention_kernel(name) is attention


def test_cli_reads_a_gzipped_trace(tmp_path, capsys):
    path = tmp_path / "worker.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    out = tmp_path / "summary.json"
    step_profile.main([str(path), "--json", str(out), "--top", "1"])
    printed = capsys.readouterr().out
    assert "4 steps in the trace" in printed and "decode: 2 steps" in printed
    assert len(json.loads(out.read_text())["kinds"]["decode"]["top_kernels"]) == 1
