"""The serving benchmark's plan: its cases, what it reads from a server log and from vLLM's
result files, and a ``vllm bench serve`` command that vLLM's own parser accepts."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from dsv4_attn.e2e import bench_serve


def test_set_a_is_8k_in_1k_out_at_three_concurrencies():
    cases = bench_serve.plan_cases("a", None)
    assert [(c.input_len, c.output_len, c.concurrency) for c in cases] == [
        (8192, 1024, 1), (8192, 1024, 16), (8192, 1024, 64)
    ]  # fmt: skip
    assert all(c.num_prompts >= 2 * c.concurrency for c in cases)


def test_set_b_fills_the_reference_cache_and_goes_beyond():
    # 3.2M tokens of KV hold 48 requests of 65536 + 1024 tokens; 1.5x that is 72.
    cases = bench_serve.plan_cases("b", 3_200_000)
    assert [c.concurrency for c in cases] == [48, 72]
    assert all((c.input_len, c.output_len) == (65536, 1024) for c in cases)
    assert [c.concurrency for c in bench_serve.plan_cases("b", 70_000)] == [1, 2]
    with pytest.raises(ValueError, match="run the vllm server first"):
        bench_serve.plan_cases("b", None)
    with pytest.raises(ValueError, match="'a' or 'b'"):
        bench_serve.plan_cases("c", 1)


def test_kv_tokens_sums_the_engines_last_reports():
    log = "\n".join([
        "(EngineCore_DP0 pid=11) INFO [kv_cache_utils.py:1147] GPU KV cache size: 1,000 tokens, x",
        "(EngineCore_DP1 pid=12) INFO [kv_cache_utils.py:1147] GPU KV cache size: 2,500 tokens, x",
        "(EngineCore_DP0 pid=11) INFO [kv_cache_utils.py:1147] GPU KV cache size: 1,200 tokens, x",
    ])  # fmt: skip
    assert bench_serve.kv_tokens(log) == 3700
    assert bench_serve.kv_tokens("no report") is None


def test_bench_command_parses_with_vllms_own_cli(tmp_path: Path):
    pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    case = bench_serve.plan_cases("b", 3_200_000)[0]
    command = bench_serve.bench_command(8200, "/ckpt", case, tmp_path, seed=3)
    assert command[:3] == ["vllm", "bench", "serve"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(command[3:])
    assert (args.random_input_len, args.random_output_len) == (65536, 1024)
    assert (args.max_concurrency, args.num_prompts, args.ignore_eos) == (48, 96, True)
    assert args.result_dir == str(tmp_path) and args.result_filename == f"{case.name}.json"


def test_summary_keeps_the_reported_figures():
    result = {"completed": 8, "failed": 0, "output_throughput": 812.5, "median_tpot_ms": 9.1,
              "p99_tpot_ms": 12.0, "median_ttft_ms": 300.0, "p99_ttft_ms": 900.0,
              "duration": 10.0, "total_token_throughput": 9000.0, "itls": [1, 2]}  # fmt: skip
    summary = bench_serve.summarize(result)
    assert summary["output_throughput"] == 812.5 and summary["p99_ttft_ms"] == 900.0
    assert "itls" not in summary and summary["max_concurrent_requests"] is None


def test_layouts_and_servers_are_vllm_flags():
    assert bench_serve.LAYOUTS["dp4ep"] == ["--data-parallel-size", "4", "--enable-expert-parallel"]
    assert bench_serve.SERVERS["vllm"] == []  # vLLM's own backend: no attention flag
    assert "DSV4_NVFP4" in bench_serve.SERVERS["nvfp4"] and "fp8" in bench_serve.SERVERS["fp8"]


def test_only_runs_the_named_cases(tmp_path: Path, monkeypatch):
    """run_server with the server, vllm bench serve and the process group stood in for: the
    --only names pick cases out of the sets, and each run's figures land in the record."""
    ran: list[str] = []

    class _Process:
        pid = 12345

        def wait(self, timeout=None):
            return 0

    def fake_run(command, **kwargs):
        name = command[command.index("--result-filename") + 1]
        ran.append(name.removesuffix(".json"))
        result_dir = Path(command[command.index("--result-dir") + 1])
        result_dir.mkdir(parents=True, exist_ok=True)
        (result_dir / name).write_text(json.dumps({"completed": 4, "output_throughput": 99.0}))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench_serve.subprocess, "Popen", lambda *a, **k: _Process())
    monkeypatch.setattr(bench_serve.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_serve.os, "killpg", lambda *a: None)
    monkeypatch.setattr(bench_serve.Server, "wait", lambda self, seconds, pid=None: 2.0)
    monkeypatch.setattr(bench_serve, "_preemptions", lambda server: 0.0)
    args = argparse.Namespace(model="m", layout="tp1", cases=["a"], only={"a_8k_c1", "a_8k_c64"},
                              max_model_len=131072, port=1, wait=5, seed=0, reference_kv=None,
                              serve_args=[])  # fmt: skip
    record = bench_serve.run_server(args, "nvfp4", tmp_path)
    assert ran == ["a_8k_c1", "a_8k_c64"]
    assert sorted(record["cases"]) == ["a_8k_c1", "a_8k_c64"]
    assert record["cases"]["a_8k_c1"]["output_throughput"] == 99.0
    args.only = set()
    ran.clear()
    bench_serve.run_server(args, "nvfp4", tmp_path)
    assert ran == ["a_8k_c1", "a_8k_c16", "a_8k_c64"]
