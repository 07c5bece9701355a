"""The serving benchmark's plan: its cases, what it reads from a server log and from vLLM's
result files, and a ``vllm bench serve`` command that vLLM's own parser accepts."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import pytest

from dsv4_attn.e2e import bench_serve


def test_set_a_is_8k_in_1k_out_at_three_concurrencies():
    cases = bench_serve.plan_cases("a", None)
    assert [(c.input_len, c.output_len, c.concurrency) for c in cases] == [
        (8192, 1024, 1),
        (8192, 1024, 16),
        (8192, 1024, 64),
    ]
    assert all(c.num_prompts >= 2 * c.concurrency for c in cases)


def test_set_b_fills_the_reference_cache_and_goes_beyond():
    # 3.2M tokens of KV hold 48 requests of 65536 + 1024 tokens; 1.5x that is 72.
    cases = bench_serve.plan_cases("b", 3_200_000)
    assert [c.concurrency for c in cases] == [48, 72]
    assert all((c.input_len, c.output_len) == (65536, 1024) for c in cases)
    assert [c.concurrency for c in bench_serve.plan_cases("b", 70_000)] == [1, 2]
    with pytest.raises(ValueError, match="run the vllm server first"):
        bench_serve.plan_cases("b", None)
    with pytest.raises(ValueError, match="'a', 'b' or 'c'"):
        bench_serve.plan_cases("d", 1)


def test_set_c_is_one_decode_bound_wave_beyond_the_reference_cache():
    # 312,302 tokens hold 8 requests of 32768 + 4096 tokens; 1.5x that is 12, sent at once.
    (case,) = bench_serve.plan_cases("c", 312_302)
    assert (case.name, case.input_len, case.output_len) == ("c_32k_4k_c12", 32768, 4096)
    assert case.concurrency == case.num_prompts == 12
    assert bench_serve.plan_cases("c", 30_000)[0].concurrency == 2  # at least one more than fits
    with pytest.raises(ValueError, match="set c needs the KV capacity"):
        bench_serve.plan_cases("c", 0)


def test_kv_tokens_sums_the_engines_last_reports():
    log = "\n".join(
        [
            "(EngineCore_DP0 pid=11) INFO [kv_cache_utils.py:1147] "
            "GPU KV cache size: 1,000 tokens, x",
            "(EngineCore_DP1 pid=12) INFO [kv_cache_utils.py:1147] "
            "GPU KV cache size: 2,500 tokens, x",
            "(EngineCore_DP0 pid=11) INFO [kv_cache_utils.py:1147] "
            "GPU KV cache size: 1,200 tokens, x",
        ]
    )
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
    result = {
        "completed": 8,
        "failed": 0,
        "output_throughput": 812.5,
        "median_tpot_ms": 9.1,
        "p99_tpot_ms": 12.0,
        "median_ttft_ms": 300.0,
        "p99_ttft_ms": 900.0,
        "duration": 10.0,
        "total_token_throughput": 9000.0,
        "itls": [1, 2],
    }
    summary = bench_serve.summarize(result)
    assert summary["output_throughput"] == 812.5 and summary["p99_ttft_ms"] == 900.0
    assert "itls" not in summary and summary["max_concurrent_requests"] is None


def test_layouts_and_servers_are_vllm_flags():
    assert bench_serve.LAYOUTS["dp4ep"] == ["--data-parallel-size", "4", "--enable-expert-parallel"]
    assert bench_serve.SERVERS["vllm"] == []  # vLLM's own backend: no attention flag
    assert "DSV4_NVFP4" in bench_serve.SERVERS["nvfp4"] and "fp8" in bench_serve.SERVERS["fp8"]


class _StandIns:
    """run_server's outside world stood in for: the server process (``launched`` commands),
    ``vllm bench serve`` (``ran`` case names; a result file unless ``results`` is False), the
    server's POSTs (``posts``, with ``bench`` marking each bench run) and greedy queries
    (``sent`` plans); :meth:`bench_flag` reads a flag of every ``vllm bench serve`` run, in
    order."""

    def __init__(self, monkeypatch) -> None:
        self.launched: list[list[str]] = []
        self.benched: list[list[str]] = []
        self.ran: list[str] = []
        self.posts: list[str] = []
        self.sent: list = []
        self.results = True
        self.on_post = None

        class _Process:
            pid = 12345

            def wait(self, timeout=None):
                return 0

        self.log_lines = ""

        def popen(command, **kwargs):
            self.launched.append(command)
            kwargs["stdout"].write(self.log_lines)
            kwargs["stdout"].flush()
            return _Process()

        monkeypatch.setattr(bench_serve.subprocess, "Popen", popen)
        monkeypatch.setattr(bench_serve.subprocess, "run", self._run)
        monkeypatch.setattr(bench_serve.os, "killpg", lambda *a: None)
        monkeypatch.setattr(bench_serve.Server, "wait", lambda server, seconds, pid=None: 2.0)
        monkeypatch.setattr(bench_serve.Server, "post", lambda server, path: self._post(path))
        monkeypatch.setattr(bench_serve, "_preemptions", lambda server: 0.0)
        monkeypatch.setattr(bench_serve, "query", self._query)

    def _run(self, command, **kwargs):
        self.benched.append(command)
        name = command[command.index("--result-filename") + 1]
        self.ran.append(name.removesuffix(".json"))
        self.posts.append("bench")
        if not self.results:
            return subprocess.CompletedProcess(command, 1, "", "no result")
        result_dir = Path(command[command.index("--result-dir") + 1])
        result_dir.mkdir(parents=True, exist_ok=True)
        (result_dir / name).write_text(json.dumps({"completed": 4, "output_throughput": 99.0}))
        return subprocess.CompletedProcess(command, 0, "", "")

    def _post(self, path):
        self.posts.append(path)
        if self.on_post is not None:
            self.on_post(path)

    def _query(self, server, plan):
        self.sent.append(plan)
        return {"results": {}, "errors": {"long_4096": "HTTP 500"}, "phases": {}}

    def bench_flag(self, name: str) -> list[str]:
        """The value of a flag of each ``vllm bench serve`` run so far, in order."""
        return [command[command.index(name) + 1] for command in self.benched]

    def flag(self, name: str) -> str:
        """The value of a flag of the (first) launched server."""
        command = self.launched[0]
        return command[command.index(name) + 1]


def _args(**overrides) -> argparse.Namespace:
    fields = dict(
        model="m",
        layout="tp1",
        cases=["a"],
        only=set(),
        max_model_len=131072,
        port=1,
        wait=5,
        seed=0,
        reference_kv=None,
        serve_args=[],
        greedy=False,
        vocab=500,
        profile=None,
        profile_delay=0,
        profile_iterations=0,
        turns=None,
        turn_order="vllm,fp8,nvfp4",
        start_after=None,
        long_contexts=[131072],
        long_output=2048,
        long_waves=1,
        probe_requests=0,
        long_capacity={},
    )
    return argparse.Namespace(**{**fields, **overrides})


def test_only_runs_the_named_cases_after_the_greedy_set(tmp_path: Path, monkeypatch):
    """--only names pick cases out of the sets, each run's figures land in the record; with
    --greedy the fresh server first answers the greedy set (ids below --vocab)."""
    world = _StandIns(monkeypatch)
    args = _args(only={"a_8k_c1", "a_8k_c64"}, greedy=True)
    record = bench_serve.run_server(args, "nvfp4", tmp_path)
    assert len(world.sent) == 1 and max(t for r in world.sent[0] for t in r.prompt) < 500
    greedy = json.loads((tmp_path / "tp1_nvfp4_greedy.json").read_text())
    assert greedy["name"] == "nvfp4" and record["greedy_errors"] == 1
    assert world.ran == ["a_8k_c1", "a_8k_c64"]
    assert sorted(record["cases"]) == ["a_8k_c1", "a_8k_c64"]
    assert record["cases"]["a_8k_c1"]["output_throughput"] == 99.0
    world.ran.clear()
    bench_serve.run_server(_args(), "nvfp4", tmp_path)
    assert world.ran == ["a_8k_c1", "a_8k_c16", "a_8k_c64"] and len(world.sent) == 1
    assert "--profiler-config" not in world.launched[1] and world.posts.count("bench") == 5


def test_the_capacity_is_on_disk_before_the_first_case(tmp_path: Path, monkeypatch):
    """A server's record, with the KV capacity its log reports, is written as soon as it is
    up: servers benchmarked side by side (each its own process) read vLLM's from there for
    set b while it runs its own cases."""
    world = _StandIns(monkeypatch)
    world.log_lines = (
        "(EngineCore pid=7) INFO [kv_cache_utils.py:1147] GPU KV cache size: 2,084,562 "
        "tokens, Maximum concurrency for 131,072 tokens per request: 15.90x\n"
    )
    seen = []
    run = world._run

    def run_and_look(command, **kwargs):
        seen.append(json.loads((tmp_path / "tp1_vllm.json").read_text())["kv_tokens"])
        return run(command, **kwargs)

    monkeypatch.setattr(bench_serve.subprocess, "run", run_and_look)
    bench_serve.run_server(_args(), "vllm", tmp_path)
    assert seen == [2084562] * 3


def test_greedy_plan_covers_4k_32k_and_the_longest_prompt_that_fits():
    from dsv4_attn.e2e.serve_check import SCORED, greedy_plan

    plan = greedy_plan(vocab=129280, max_model_len=131072)
    singles = [r for r in plan if r.phase == "single"]
    assert [len(r.prompt) for r in singles] == [4096, 32768, 131072 - 64]
    assert all(len(r.prompt) + r.max_tokens <= 131072 for r in plan)
    greedy = [r for r in plan if r.phase == "concurrent" and not r.scored]
    assert len(greedy) == 16 and {len(r.prompt) for r in greedy} == {4096}
    ids = {t for r in plan for t in r.prompt}
    assert min(ids) >= 1 and max(ids) < 129280 and max(ids) > 100000
    assert all(r.logprobs for r in plan if not r.scored)
    # The scored prompt, alone and again among the concurrent requests: 4K tokens of context,
    # then SCORED tokens whose logprobs are compared; fresh tokens, no greedy prompt's prefix.
    scored = {r.key: r for r in plan if r.scored}
    alone, batched = scored["scored_4096"], scored["scored_4096_batched"]
    assert (alone.phase, batched.phase) == ("scored", "concurrent")
    assert alone.prompt == batched.prompt and len(alone.prompt) == 4096 + SCORED
    assert alone.scored == batched.scored == SCORED
    assert all(r.prompt[:64] != alone.prompt[:64] for r in plan if not r.scored)
    assert greedy_plan(1000, 8192) == greedy_plan(1000, 8192)  # fixed seed
    small = [len(r.prompt) for r in greedy_plan(1000, 8192) if r.phase == "single"]
    assert small == [4096, 8192 - 64]


def test_greedy_comparison_of_the_servers(tmp_path: Path, capsys):
    """Each server's greedy record against the first's: identical, a near-tie, a difference."""

    def record(name, tokens):
        top2 = [[-0.1, -0.105], [-0.1, -3.0]]  # step 0 is a near-tie, step 1 is not
        return {
            "name": name,
            "errors": {},
            "phases": {},
            "results": {f"long_{i}": {"token_ids": t, "top2": top2} for i, t in enumerate(tokens)},
        }

    ref = record("vllm", [[1, 2], [3, 4], [5, 6]])
    ours = record("nvfp4", [[1, 2], [9, 4], [5, 9]])
    for r in (ref, ours):
        (tmp_path / f"tp1_{r['name']}_greedy.json").write_text(json.dumps(r))
    assert bench_serve.compare_greedy(tmp_path, "tp1", ["vllm", "fp8"]) is None  # one answered
    report = bench_serve.compare_greedy(tmp_path, "tp1", ["vllm", "nvfp4"])
    row = report["servers"]["nvfp4"]["agreement"]["phases"]["long"]
    assert row == {"requests": 3, "identical": 1, "near_tie": 1, "different": 1, "missing": 0}
    assert json.loads((tmp_path / "tp1_greedy.json").read_text()) == report
    assert "reference: vllm" in capsys.readouterr().out


def test_profiled_case_is_bracketed_and_summarized(tmp_path: Path, monkeypatch):
    """--profile CASE: the server gets vLLM's torch profiler config, /start_profile and
    /stop_profile bracket that case alone, and the workers' trace is summarized by step."""
    from tests.test_step_profile import _trace

    world = _StandIns(monkeypatch)
    world.results = False

    def write_trace(path):  # the worker writes its trace when stopped
        if path == "/stop_profile":
            trace_dir = Path(json.loads(world.flag("--profiler-config"))["torch_profiler_dir"])
            trace_dir.mkdir(parents=True, exist_ok=True)
            (trace_dir / "rank0.pt.trace.json").write_text(json.dumps(_trace()))

    world.on_post = write_trace
    args = _args(profile="a_8k_c16", profile_delay=7, profile_iterations=9)
    record = bench_serve.run_server(args, "vllm", tmp_path)
    config = json.loads(world.flag("--profiler-config"))
    assert config["profiler"] == "torch" and config["torch_profiler_with_stack"] is False
    assert (config["delay_iterations"], config["max_iterations"]) == (7, 9)
    assert world.posts == ["bench", "/start_profile", "bench", "/stop_profile", "bench"]
    profile = record["cases"]["a_8k_c16"]["profile"]
    assert profile["rank0.pt.trace.json"]["kinds"]["decode"]["steps"] == 2
    assert "profile" not in record["cases"]["a_8k_c1"]


def test_a_trace_that_cannot_be_read_leaves_the_cases_figures(tmp_path: Path, monkeypatch):
    """A profile the summary cannot read (a trace cut short) is noted in its case; the case's
    figures and the cases after it still land in the record."""
    _StandIns(monkeypatch)

    def unreadable(directory):
        raise json.JSONDecodeError("Unterminated string", "{", 1)

    monkeypatch.setattr(bench_serve, "profile_summary", unreadable)
    record = bench_serve.run_server(_args(profile="a_8k_c16"), "vllm", tmp_path)
    entry = record["cases"]["a_8k_c16"]
    assert entry["profile_error"].startswith("JSONDecodeError: Unterminated string")
    assert entry["output_throughput"] == 99.0 and "a_8k_c64" in record["cases"]


def _serve_in_threads(tmp_path: Path, ports: dict[str, int], **overrides) -> list[Exception]:
    """``run_server`` for each server (name: port) sharing one GPU through turn files under
    ``tmp_path``, each in its own thread (its own process in use), started in the dict's order;
    the errors they raised."""
    import threading

    errors = []

    def serve(name: str, port: int) -> None:
        args = _args(port=port, turns=str(tmp_path / "turns"), **overrides)
        try:
            bench_serve.run_server(args, name, tmp_path)
        except Exception as error:  # returned to the test
            errors.append(error)

    threads = [threading.Thread(target=serve, args=item) for item in ports.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def test_servers_sharing_a_gpu_take_each_case_in_turn(tmp_path: Path, monkeypatch):
    """With --turns, three servers (each its own thread here, its own process in use) run
    the greedy set and then each case server by server in turn order, case after case."""

    world = _StandIns(monkeypatch)
    queried = []
    monkeypatch.setattr(
        bench_serve, "query", lambda server, plan: queried.append(server.base) or {"errors": {}}
    )
    errors = _serve_in_threads(tmp_path, {"nvfp4": 3, "fp8": 2, "vllm": 1}, greedy=True)
    assert not errors
    assert [base.rsplit(":", 1)[1] for base in queried] == ["1", "2", "3"]
    assert world.bench_flag("--port") == ["1", "2", "3"] * 3
    assert world.ran == [c for c in ("a_8k_c1", "a_8k_c16", "a_8k_c64") for _ in range(3)]
    summary = bench_serve.write_summary(tmp_path, "tp1")  # as the last process to end does
    assert sorted(summary) == ["fp8", "nvfp4", "vllm"]
    assert all(len(record["cases"]) == 3 for record in summary.values())
    assert json.loads((tmp_path / "tp1_summary.json").read_text()) == summary
    assert not list(tmp_path.glob("*.part"))
    assert sorted(p.name for p in (tmp_path / "turns").glob("*.finished")) == [
        "fp8.finished",
        "nvfp4.finished",
        "vllm.finished",
    ]


def test_set_d_is_one_and_a_half_times_the_measured_capacity():
    case = bench_serve.plan_long_case(131072, 2048, 5)
    assert case == bench_serve.Case("d_128k", 129024, 2048, 8, 8)
    assert bench_serve.plan_long_case(262144, 4096, 4, waves=3).num_prompts == 18
    assert bench_serve.long_case_name(1048576) == "d_1024k"
    assert bench_serve.long_case_name(100000) == "d_100000"
    with pytest.raises(ValueError, match="measured \\(>= 1\\), got None"):
        bench_serve.plan_long_case(131072, 2048, None)
    with pytest.raises(ValueError, match="output \\(131072\\) must be shorter"):
        bench_serve.plan_long_case(131072, 131072, 3)


def test_set_d_measures_vllms_capacity_first_and_every_server_plans_from_it(
    tmp_path: Path, monkeypatch
):
    """With --turns and set d, vLLM's server alone is probed (at the case's prompt length,
    before any server runs the case); its figure lands in its record, and each server then runs
    the case at 1.5x that figure, in turn order. Each case's /metrics samples are summarized."""

    world = _StandIns(monkeypatch)
    world.log_lines = "(EngineCore pid=7) INFO GPU KV cache size: 300,000 tokens\n"
    events = []
    run = world._run

    def run_in_turn(command, **kwargs):
        concurrency = command[command.index("--max-concurrency") + 1]
        events.append(("case", command[command.index("--port") + 1], concurrency))
        return run(command, **kwargs)

    def probe(port, model, input_len, output_len, offered, **kwargs):
        events.append(("probe", str(port), input_len, output_len, offered))
        return {"capacity": 5, "bound": "cache", "seconds": 3.0}

    monkeypatch.setattr(bench_serve.subprocess, "run", run_in_turn)
    monkeypatch.setattr(bench_serve, "find_capacity", probe)
    ports = {"fp8": 3, "nvfp4": 2, "vllm": 1}
    errors = _serve_in_threads(tmp_path, ports, cases=["d"], turn_order="vllm,nvfp4,fp8")
    assert not errors
    # 16 x the token line's 300,000 / 131,072 = 36.6: 37 offered
    assert events == [
        ("probe", "1", 129024, 2048, 37),
        ("case", "1", "8"),
        ("case", "2", "8"),
        ("case", "3", "8"),
    ]
    vllm = json.loads((tmp_path / "tp1_vllm.json").read_text())
    assert vllm["capacity"]["d_128k"]["capacity"] == 5
    for name in ports:
        entry = json.loads((tmp_path / f"tp1_{name}.json").read_text())["cases"]["d_128k"]
        assert entry["case"]["concurrency"] == 8 and entry["case"]["input_len"] == 129024
        assert entry["requests_at_once"]["samples"] == 0  # the stand-in has no /metrics


def test_set_d_with_a_given_capacity_probes_nothing(tmp_path: Path, monkeypatch):
    """--long-capacity (the planner's prediction) replaces the probe: no server is probed, no
    capacity step is taken, and every server runs the case at 1.5x the given figure."""
    world = _StandIns(monkeypatch)

    def probe(*args, **kwargs):
        raise AssertionError("probed although the capacity was given")

    monkeypatch.setattr(bench_serve, "find_capacity", probe)
    ports = {"vllm": 1, "nvfp4": 2}
    errors = _serve_in_threads(
        tmp_path, ports, cases=["d"], turn_order="vllm,nvfp4", long_capacity={131072: 13}
    )
    assert not errors and world.bench_flag("--max-concurrency") == ["20", "20"]
    assert "capacity" not in json.loads((tmp_path / "tp1_vllm.json").read_text())
    taken = sorted(p.name for p in (tmp_path / "turns").glob("d_*"))
    assert taken == ["d_128k.nvfp4", "d_128k.vllm"]
    assert not list((tmp_path / "turns").glob("capacity_*"))


def test_a_case_with_failed_requests_keeps_their_errors(tmp_path: Path, monkeypatch):
    """vllm bench serve's result file counts failed requests only; the errors it printed are
    kept in the case's entry (a 128K case once failed in 0.01 s with no trace of why)."""
    world = _StandIns(monkeypatch)
    printed = "".join(
        f"Error {i}: This model's maximum context length is 131072 tokens ({i})\n" for i in range(5)
    )

    def failing(command, **kwargs):
        result_dir = Path(command[command.index("--result-dir") + 1])
        result_dir.mkdir(parents=True, exist_ok=True)
        name = command[command.index("--result-filename") + 1]
        (result_dir / name).write_text(json.dumps({"completed": 0, "failed": 5}))
        return subprocess.CompletedProcess(command, 0, "ok\n" + printed, "warned")

    monkeypatch.setattr(bench_serve.subprocess, "run", failing)
    record = bench_serve.run_server(_args(only={"a_8k_c1"}), "vllm", tmp_path)
    entry = record["cases"]["a_8k_c1"]
    assert entry["failed"] == 5 and entry["stderr"] == "warned"
    assert entry["request_errors"] == [
        f"Error {i}: This model's maximum context length is 131072 tokens ({i})" for i in range(3)
    ]
    world.results = True
    monkeypatch.setattr(bench_serve.subprocess, "run", world._run)
    clean = bench_serve.run_server(_args(only={"a_8k_c1"}), "vllm", tmp_path)
    assert "request_errors" not in clean["cases"]["a_8k_c1"]


def test_errors_logged_after_the_stop_signal_are_kept_apart(tmp_path: Path, monkeypatch):
    stand_ins = _StandIns(monkeypatch)
    stand_ins.log_lines = "INFO up\n(EngineCore) ERROR during a case\n"
    log = tmp_path / "tp1_nvfp4.log"

    def killpg(pid, sig):  # the engine core dies first: its API server logs it
        with open(log, "a") as handle:
            handle.write("(APIServer) ERROR AsyncLLM output_handler failed.\nTraceback (most\n")

    monkeypatch.setattr(bench_serve.os, "killpg", killpg)
    record = bench_serve.run_server(_args(only={"a_8k_c1"}), "nvfp4", tmp_path)
    assert record["server_log_errors"] == ["(EngineCore) ERROR during a case"]
    assert record["server_log_errors_after_stop"] == [
        "(APIServer) ERROR AsyncLLM output_handler failed.",
        "Traceback (most",
    ]


def test_each_case_draws_prompts_no_other_case_shares(tmp_path: Path):
    """vLLM's random dataset, seeded as bench_command seeds it: one seed for every case would
    give b_64k_c6 the prompts of b_64k_c4 (found in the prefix cache); each case's own seed
    draws prompts that share no 64-token prefix with another case's, and the same prompts on
    every server."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    from dsv4_attn.e2e.real_shapes import write_word_tokenizer

    write_word_tokenizer(tmp_path, 129280)
    tokenizer = get_tokenizer(str(tmp_path), tokenizer_mode="deepseek_v4")

    def prefixes(seed: int, count: int) -> list[str]:
        requests = RandomDataset(random_seed=seed).sample(
            tokenizer, count, range_ratio=0.0, input_len=256, output_len=8
        )
        return [" ".join(r.prompt.split()[:64]) for r in requests]

    assert prefixes(0, 8) == prefixes(0, 12)[:8]  # the confound: one seed, shared prompts
    cases = bench_serve.plan_cases("a", None) + bench_serve.plan_cases("b", 312_302)
    drawn = {c.name: prefixes(bench_serve.case_seed(0, c), 4) for c in cases}
    every = [p for name in drawn for p in drawn[name]]
    assert len(set(every)) == len(every)
    assert drawn["b_64k_c4"] == prefixes(bench_serve.case_seed(0, cases[3]), 4)


def _run_shared_real(tmp_path: Path, layout: str, **env: str):
    """`BENCH_SHARED=1 scripts/gpu_serve.sh real LAYOUT` with the stand-in `vllm` (1 GiB of KV
    each, runs of `vllm bench serve` logged to tmp_path / "bench_runs.log") on a checkpoint
    folder that has its tokenizer already (so none is written) and V4-Flash's vocabulary."""
    from tests.serve_stand_in import run_gpu_serve

    checkpoint = tmp_path / "flash"
    checkpoint.mkdir()
    (checkpoint / "tokenizer.json").write_text("{}")
    (checkpoint / "config.json").write_text(json.dumps({"vocab_size": 129280}))
    env = {"BENCH_KV_GIB": "1", **env}
    return run_gpu_serve(
        ["real", layout],
        tmp_path,
        FLASH_CKPT=str(checkpoint),
        BENCH_SHARED="1",
        STAND_IN_BENCH_LOG=str(tmp_path / "bench_runs.log"),
        **env,
    )


def test_the_shared_real_part_with_no_cases_runs_the_greedy_set_in_turns(tmp_path: Path):
    """BENCH_CASES empty with BENCH_GREEDY=1 (a shallow control): each server answers the
    greedy set, scored requests included, one server at a time; the comparison reports each
    server's scored logprobs against the reference's and its own batch noise."""
    from tests.serve_stand_in import free_port

    port = str(free_port(0, 20, 40))
    run = _run_shared_real(tmp_path, "tp1", BENCH_CASES="", BENCH_GREEDY="1", BENCH_PORT=port)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = tmp_path / "out" / "bench_serve"
    assert not (tmp_path / "bench_runs.log").exists()  # no vllm bench serve run
    turns = sorted(p.name for p in (tmp_path / "out" / "turns").iterdir())
    assert [t for t in turns if t.startswith("greedy.")] == [
        "greedy.fp8",
        "greedy.nvfp4",
        "greedy.vllm",
    ]
    report = json.loads((results / "tp1_greedy.json").read_text())
    for name in ("fp8", "nvfp4"):
        entry = report["servers"][name]
        assert entry["errors"] == 0
        assert entry["scored"]["against_reference"] == {"mean": 0.0, "max": 0.0}
        assert entry["scored"]["self"] == {"mean": 0.0, "max": 0.0}
    assert "scored tokens" in run.stdout


@pytest.mark.parametrize(
    ("layout", "gpus", "flags"),
    [
        ("tp1", {}, ""),
        ("dp2ep", {"BENCH_GPUS": "0,1"}, "--data-parallel-size 2 --enable-expert-parallel"),
    ],
)
def test_the_shared_real_part_runs_every_server_on_the_same_gpus_in_turns(
    tmp_path: Path, layout, gpus, flags
):
    """`BENCH_SHARED=1 scripts/gpu_serve.sh real LAYOUT` on the CPU with a stand-in `vllm`:
    three server processes on the same GPUs (GPU 0 for tp1, BENCH_GPUS otherwise), each with
    the layout's flags and BENCH_KV_GIB of KV memory, no memory profiling; set b planned from
    vLLM's reported capacity; every case run by one server at a time, server by server, case by
    case; one summary of all three at the end."""
    from tests.serve_stand_in import free_port

    log = tmp_path / "bench_runs.log"
    port = free_port(0, 20, 40)  # BENCH_PORT, +20 each
    run = _run_shared_real(
        tmp_path,
        layout,
        BENCH_CASES="b,a",
        BENCH_ONLY="b_64k_c11,b_64k_c17,a_8k_c1",
        BENCH_PORT=str(port),
        **gpus,
    )
    out = tmp_path / "out"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = out / "bench_serve"
    summary = json.loads((results / f"{layout}_summary.json").read_text())
    assert sorted(summary) == ["fp8", "nvfp4", "vllm"]
    # 1 GiB / 1400 B per token (vLLM's stand-in): 766,958 tokens, 11 requests of 66,560 fill it
    assert summary["vllm"]["kv_tokens"] == 2**30 // 1400
    kv_flags = "--kv-cache-memory-bytes 1073741824 --gpu-memory-utilization 0.2"
    visible = f"CUDA_VISIBLE_DEVICES={gpus.get('BENCH_GPUS', '0')}\n"
    for name, record in summary.items():
        assert sorted(record["cases"]) == ["a_8k_c1", "b_64k_c11", "b_64k_c17"]
        assert kv_flags in record["command"] and flags in record["command"]
        assert visible in (results / f"{layout}_{name}.log").read_text()
    ports = {str(port): "vllm", str(port + 20): "fp8", str(port + 40): "nvfp4"}
    starts = [line.split() for line in log.read_text().splitlines()]
    runs = [(case, ports[port]) for _, kind, port, case in starts if kind == "start"]
    cases = ["b_64k_c11", "b_64k_c17", "a_8k_c1"]
    assert runs == [(case, name) for case in cases for name in ("vllm", "fp8", "nvfp4")]
    assert [kind for _, kind, _, _ in starts] == ["start", "end"] * len(runs)  # never two at once


def test_the_shared_real_part_plans_set_d_from_the_planners_capacity(tmp_path: Path):
    """BENCH_LONG_CAPACITY=planned: set d's concurrency is 1.5x the 128K requests (2048 tokens
    generated) the planner says vLLM's backend runs at once in BENCH_KV_GIB, with no probe."""
    pytest.importorskip("vllm")
    from dsv4_attn.vllm_glue.capacity import SCHEDULES, requests_at_once
    from tests.serve_stand_in import free_port

    planned = requests_at_once(SCHEDULES["V4-Flash"], "vllm", 8 * 2**30, 131072, 2048)
    run = _run_shared_real(
        tmp_path,
        "tp1",
        BENCH_CASES="d",
        BENCH_KV_GIB="8",
        BENCH_LONG_CAPACITY="planned",
        BENCH_SERVERS="vllm,nvfp4",
        BENCH_PORT=str(free_port(0, 20)),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "long_capacity.txt").read_text().split()[-1] == str(planned)
    for name in ("vllm", "nvfp4"):
        record = json.loads((out / "bench_serve" / f"tp1_{name}.json").read_text())
        case = record["cases"]["d_128k"]["case"]
        assert case["concurrency"] == math.ceil(1.5 * planned) and case["input_len"] == 129024
        assert "capacity" not in record


def test_a_turn_order_without_the_server_is_refused_before_any_server_starts(tmp_path: Path):
    common = ["--model", "m", "--out", str(tmp_path), "--servers", "nvfp4"]
    for order in ("vllm,fp8", "vllm,vllm,nvfp4"):
        with pytest.raises(SystemExit, match=r"--turn-order .* must name each server once"):
            bench_serve.main([*common, "--turns", str(tmp_path / "t"), "--turn-order", order])
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_prompt_token_ids_stay_below_the_checkpoints_vocabulary(tmp_path):
    """The prompts' token-id bound is read from the served checkpoint: V4-Flash's top-level
    vocab_size, V4.1-Flash's nested text_config one (4224 tokens: ids of V4's 129280 would be
    refused by that server); a config without one is an error naming the file."""
    from dsv4_attn.e2e.real_shapes import V41_OVERRIDES, flash_config, write_v41_flash_config

    v41 = tmp_path / "v41"
    write_v41_flash_config(v41, experts=4)
    assert bench_serve.checkpoint_vocab(v41) == V41_OVERRIDES["vocab_size"] == 4224
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(flash_config(experts=4).to_json_string())
    assert bench_serve.checkpoint_vocab(v4) == 129280
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"text_config": {}}))
    with pytest.raises(ValueError, match=r"bare/config\.json"):
        bench_serve.checkpoint_vocab(bare)
