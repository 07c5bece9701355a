"""The request set and the comparison of scripts/gpu_serve.sh (the serving itself runs on GPU)."""

from __future__ import annotations

from types import SimpleNamespace

from dsv4_attn.e2e import serve_check
from dsv4_attn.e2e.serve_check import NEAR_TIE, compare, compare_one, request_plan


def test_plan_covers_every_case_the_serving_check_needs():
    plan = request_plan()
    assert plan == request_plan()  # fixed
    lengths = {r.key: len(r.prompt) for r in plan}
    assert lengths["single_8"] < 128 < lengths["single_200"] and lengths["single_600"] > 512
    prefix = [r.prompt for r in plan if r.phase == "prefix"]
    assert len(prefix) == 3 and all(p[:1100] == prefix[0][:1100] for p in prefix)
    assert len({tuple(p[1100:]) for p in prefix}) == 3
    assert sum(r.phase == "concurrent" for r in plan) == 16
    assert all(not r.logprobs for r in plan if r.phase.startswith("throughput"))
    preempt = [r for r in plan if r.phase == "preemption"]
    assert len(preempt) == 160 and all(len(r.prompt) + r.max_tokens < 4096 for r in preempt)
    assert all(r.max_tokens > 4 * len(r.prompt) for r in preempt)  # they grow while decoding
    assert all(0 < t < serve_check.VOCAB for r in plan for t in r.prompt)


def test_compare_classifies_by_the_reference_margin():
    ref = {
        "token_ids": [5, 6, 7, 8],
        "top2": [[-0.1, -3.0], [-0.5, -0.505], [-0.2, -2.0], [-1, -2]],
    }
    assert compare_one(ref, {"token_ids": [5, 6, 7, 8]}) == {"identical": True, "steps": 4}
    tie = compare_one(ref, {"token_ids": [5, 9, 7, 8]})
    assert tie["first_difference"] == 1 and tie["near_tie"] and tie["ref_margin"] < NEAR_TIE
    real = compare_one(ref, {"token_ids": [4, 6, 7, 8]})
    assert real["first_difference"] == 0 and not real["near_tie"]
    keys = ("single_8", "prefix_0", "preempt_3", "throughput0_1")
    records = {"results": {key: ref for key in keys}}
    other = {"results": {"single_8": {"token_ids": [5, 9, 7, 8]}, "prefix_0": ref}}
    phases = compare(records, other)["phases"]
    assert phases["single"] == {
        "requests": 1,
        "identical": 0,
        "near_tie": 1,
        "different": 0,
        "missing": 0,
    }
    assert phases["prefix"]["identical"] == 1 and phases["preemption"]["missing"] == 1
    assert not any(phase.startswith("throughput") for phase in phases)


def test_throughput_is_the_median_of_the_timed_runs():
    rates = [900.0, 1200.0, 1000.0]
    phases = {f"throughput{i}": {"tok_per_s": rate} for i, rate in enumerate(rates)}
    record = {"phases": {"single": {"tok_per_s": 5.0}, **phases}}
    assert serve_check.throughput(record) == 1000.0
    assert serve_check.throughput({"phases": {"single": {"tok_per_s": 5.0}}}) is None


def test_acceptance_reads_vllms_own_spec_decode_counters():
    """The counters come from vLLM's own Prometheus metrics class, rendered as /metrics
    renders them: two draft positions, two phases of a round."""
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    before = set(prometheus_client.REGISTRY._collector_to_names)
    spec = SpecDecodingProm(
        SimpleNamespace(num_speculative_tokens=2), ["model_name", "engine"], {0: ["m", "0"]}
    )
    try:
        pages = []
        for drafts, accepted_per_pos in ((10, [6, 3]), (30, [12, 5])):
            stats = SpecDecodingStats.new(2)
            stats.num_drafts, stats.num_draft_tokens = drafts, 2 * drafts
            stats.num_accepted_tokens = sum(accepted_per_pos)
            stats.num_accepted_tokens_per_pos = accepted_per_pos
            spec.observe(stats)
            pages.append(serve_check.parse_counters(prometheus_client.generate_latest().decode()))
    finally:
        for collector in set(prometheus_client.REGISTRY._collector_to_names) - before:
            prometheus_client.REGISTRY.unregister(collector)
    first, second = pages
    assert first["vllm:spec_decode_num_drafts_total"] == 10
    assert second["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 6 + 3 + 12 + 5
    record = {
        "phases": {
            "single": {"counters": first},
            "preemption": {"counters": {k: second[k] - first.get(k, 0) for k in second}},
        }
    }
    assert serve_check.acceptance(record) == {
        "drafts": 40,
        "draft_tokens": 80,
        "accepted_tokens": 26,
        "rate": round(26 / 80, 4),
        "mean_length": round(1 + 26 / 40, 4),
    }
    assert serve_check.acceptance({"phases": {"single": {"counters": {}}}}) is None


def test_the_spec_part_serves_both_rounds_and_compares_them(tmp_path):
    """`SPEC_PORT=P scripts/gpu_serve.sh spec fp8 dspark 4` on the CPU with a stand-in
    `vllm serve`: the server without and the one with speculation start side by side on the
    draftable DSpark checkpoint with this backend's flags and 3200 KV blocks, on SPEC_PORT and the
    next port; both answer the request plan, stop, and the comparison reports the agreement
    and the drafts' acceptance."""
    import json

    from tests.serve_stand_in import free_port, run_gpu_serve

    port = free_port(0, 1)
    run = run_gpu_serve(
        ["spec", "fp8", "dspark", "4"], tmp_path, SKIP_PHASES="preemption", SPEC_PORT=str(port)
    )
    out = tmp_path / "out"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    servers = json.loads((out / "spec_compare.json").read_text())["servers"]
    assert set(servers) == {"fp8_plain", "fp8_dspark4"}
    assert servers["fp8_plain"]["speculation"] is None
    spark = servers["fp8_dspark4"]
    assert spark["speculation"]["rate"] == 0.5 and spark["errors"] == 0
    assert spark["agreement"]["phases"]["concurrent"]["identical"] == 16
    command = (out / "serve_fp8_dspark4.cmd").read_text()
    assert "/tmp/dsv4_dspark_ckpt" in command and "--kv-cache-dtype fp8" in command
    assert '{"method": "dspark", "num_speculative_tokens": 4}' in command
    assert f"--port {port + 1} " in command  # SPEC_PORT and the next port: pairs side by side
    assert f"--port {port} " in (out / "serve_fp8_plain.cmd").read_text()
    assert "--num-gpu-blocks-override 3200 " in command
    assert "server fp8_dspark4 stopped" in (out / "round_spec.log").read_text()


def test_the_v41_rounds_serve_the_tiny_v41_with_its_tokenizer(tmp_path):
    """`SERVE_MODEL=v41 scripts/gpu_serve.sh vllm`, then `fp8`, then `compare`, on the CPU with
    a stand-in `vllm serve`: the tiny V4.1 checkpoint, served with its tokenizer (no
    --skip-tokenizer-init) and its text model only; vLLM's own round with fp8 caches as this
    backend's; the comparison of the two rounds that ran."""
    import json

    from tests.serve_stand_in import free_port, run_gpu_serve

    port = free_port(0, 1)
    env = dict(SERVE_MODEL="v41", SKIP_PHASES="preemption")
    for offset, part in enumerate(("vllm", "fp8")):
        run = run_gpu_serve([part], tmp_path, ROUND_PORT=str(port + offset), **env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out"
    for name, flags in (
        ("vllm", "--kv-cache-dtype fp8"),
        ("fp8", "--attention-backend DSV4_NVFP4 --kv-cache-dtype fp8"),
    ):
        command = (out / f"serve_{name}.cmd").read_text()
        assert command.startswith("vllm serve /tmp/dsv41_tiny_ckpt ") and flags in command
        assert "--language-model-only" in command and "--skip-tokenizer-init" not in command
    run = run_gpu_serve(["compare"], tmp_path, **env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert set(json.loads((out / "serve_compare.json").read_text())["servers"]) == {"vllm", "fp8"}


def test_scored_tokens_are_read_from_vllms_own_completion_response():
    """A completion with prompt logprobs as vLLM's server serializes it (its own response
    classes): the scored result holds each of the last prompt tokens' own logprob, also where
    the top-1 entry beside it is another token."""
    import json
    import random
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import pytest

    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.logprobs import Logprob

    rng = random.Random(5)
    prompt = [rng.randrange(1, 1000) for _ in range(12)]
    own = [-rng.uniform(0.5, 9.0) for _ in prompt]
    positions = [None] + [
        {token: Logprob(own[i], rank=2, decoded_token=f"w{token}"), 999: Logprob(-0.1, rank=1)}
        for i, token in enumerate(prompt[1:], start=1)
    ]
    reply = CompletionResponse(
        model="m",
        choices=[
            CompletionResponseChoice(index=0, text="", token_ids=[7], prompt_logprobs=positions)
        ],
        usage=UsageInfo(prompt_tokens=len(prompt), completion_tokens=1, total_tokens=13),
    ).model_dump_json()
    sent = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            sent.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(reply.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = serve_check.Server(server.server_address[1], "m")
        request = serve_check.Request("scored_x", "scored", prompt, 1, logprobs=False, scored=5)
        result = client.complete(request)
    finally:
        server.shutdown()
    assert sent[0]["prompt_logprobs"] == 1 and "logprobs" not in sent[0]
    assert result["scored"] == pytest.approx(own[-5:])
    assert result["token_ids"] == [7]


def test_scored_logprobs_compared_against_the_reference_and_the_servers_own_noise():
    def record(alone, batched):
        return {
            "results": {
                "scored_4096": {"scored": alone},
                "scored_4096_batched": {"scored": batched},
            }
        }

    ref = record([-1.0, -2.0, -3.0], [-1.0, -2.5, -3.0])
    other = record([-1.25, -2.0, -2.0], [-1.25, -2.0, -2.0])
    report = serve_check.compare_scored(other, ref)
    assert report["self"] == {"mean": 0.0, "max": 0.0}
    assert report["against_reference"] == {"mean": 0.41667, "max": 1.0}
    assert serve_check.compare_scored(ref)["self"] == {"mean": 0.16667, "max": 0.5}
    assert serve_check.compare_scored({"results": {}}) is None


def test_waiting_for_a_server_ends_once_its_process_has_exited(tmp_path):
    """A server process that exits before /health answers ends the wait at once, also while it
    is a zombie nobody has reaped yet, and also when its id comes from the launcher's pid file
    (missing at first, written later)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    import pytest

    from tests.serve_stand_in import free_port

    server = serve_check.Server(free_port(), "")  # nothing listens there
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 20
    while serve_check._alive(exited.pid) and time.time() < deadline:
        time.sleep(0.05)  # until it has exited; not reaped (no wait() yet), so a zombie
    assert Path(f"/proc/{exited.pid}").exists() and not serve_check._alive(exited.pid)
    start = time.time()
    with pytest.raises(RuntimeError, match=f"pid {exited.pid}"):
        server.wait(60, exited.pid)
    pid_file = tmp_path / "serve.pid"
    pid_file.write_text(f"{exited.pid}\n")
    with pytest.raises(RuntimeError, match=f"pid {exited.pid}"):
        server.wait(60, pid_file)
    assert time.time() - start < 20
    with pytest.raises(TimeoutError, match="not up after 3 s"):  # no pid file: the time limit
        server.wait(3, tmp_path / "never_written.pid")
    exited.wait()


def test_the_checkpoint_command_gives_the_v41_its_dspark_draft(tmp_path, capsys):
    """`serve_check checkpoint DIR --v41 --dspark`: the tiny V4.1 (its tokenizer and config)
    with the DSpark draft, as V4's `--dspark` without `--draftable` (seeded, a Markov head of the
    default rank rather than the bigram's); `--v41` still refuses `--mtp-layers` (V4.1 has no
    MTP) and `--draftable` without `--dspark`, before writing anything."""
    import json

    import pytest
    from safetensors import safe_open

    path = tmp_path / "ckpt"
    serve_check.main(["checkpoint", str(path), "--v41", "--dspark"])
    assert f"checkpoint: {path}" in capsys.readouterr().out
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "deepseek_v41" and (path / "tokenizer.json").exists()
    assert text["n_mtp_layers"] == 3 and text["dspark_target_layer_ids"] == [3, 4, 5]
    assert text["dspark_markov_rank"] == 64  # not the bigram head's rank (the vocabulary)
    with safe_open(str(path / "dspark.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.embed.weight"} <= names
    for flags in (["--draftable"], ["--mtp-layers=1"], ["--dspark", "--mtp-layers=1"]):
        with pytest.raises(SystemExit, match="--draftable only with --dspark"):
            serve_check.main(["checkpoint", str(tmp_path / "refused"), "--v41", *flags])
    assert not (tmp_path / "refused").exists()


def test_the_v41_spec_part_serves_its_dspark_checkpoint_and_refuses_mtp(tmp_path):
    """`SERVE_MODEL=v41 scripts/gpu_serve.sh spec fp8 dspark 4` with a stand-in `vllm serve`:
    the pair serves the tiny V4.1 with its DSpark draft (its text model, its tokenizer, 3200
    blocks); `spec fp8 mtp 1` is refused before any server starts (V4.1 has no MTP)."""
    from tests.serve_stand_in import free_port, run_gpu_serve

    port = free_port(0, 1)
    env = dict(SERVE_MODEL="v41", SKIP_PHASES="preemption", SPEC_PORT=str(port))
    run = run_gpu_serve(["spec", "fp8", "dspark", "4"], tmp_path, **env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out"
    for name in ("fp8_plain", "fp8_dspark4"):
        command = (out / f"serve_{name}.cmd").read_text()
        assert command.startswith("vllm serve /tmp/dsv41_dspark_ckpt ")
        assert "--language-model-only" in command and "--skip-tokenizer-init" not in command
        assert "--num-gpu-blocks-override 3200 " in command
    (tmp_path / "mtp").mkdir()
    refused = run_gpu_serve(["spec", "fp8", "mtp", "1"], tmp_path / "mtp", **env)
    assert refused.returncode == 2
    assert "DeepSeek-V4.1 speculates with dspark only, not mtp" in refused.stderr
    assert not list((tmp_path / "mtp").glob("**/serve_*.cmd"))
