"""The soak driver's requests and its tally, against a local stand-in of vLLM's completions API
(the soak itself runs against a real ``vllm serve`` on the GPU machine)."""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsv4_attn.e2e import soak


def test_drawn_requests_fit_the_model_and_cover_every_kind():
    rng = random.Random(0)
    prefixes = [[7] * soak.PREFIX_TOKENS, [9] * soak.PREFIX_TOKENS]
    drawn = [soak.draw_request(rng, 4096, prefixes) for _ in range(3000)]
    assert all(len(r.prompt) + r.max_tokens <= 4096 for r in drawn)
    assert all(len(r.prompt) >= 1 and r.max_tokens >= 1 for r in drawn)
    assert {r.kind for r in drawn} == {"complete", "stream", "disconnect"}
    assert max(len(r.prompt) + r.max_tokens for r in drawn) > 4000  # up to the model length
    assert any(r.shared_prefix for r in drawn)
    assert all((r.prompt[: soak.PREFIX_TOKENS] in prefixes) == r.shared_prefix for r in drawn)
    assert all(r.disconnect_after >= 1 for r in drawn if r.kind == "disconnect")


class _Completions(BaseHTTPRequestHandler):
    """vLLM's /v1/completions as the soak uses it; ``short`` answers one token too few."""

    short = False
    disconnects = 0
    dies_after: int | None = None  # completions served before the "engine" dies
    served = 0
    rpc_calls: list | None = None  # (method, args) of every /collective_rpc

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _dead(self) -> bool:
        cls = type(self)
        return cls.dies_after is not None and cls.served >= cls.dies_after

    def do_GET(self):
        if self._dead():
            return self._answer(500, b"engine dead")
        body = b"ok" if self.path == "/health" else b"vllm:num_preemptions_total 3.0\n"
        self._answer(200, body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/collective_rpc":
            type(self).rpc_calls.append((request["method"], request.get("args", [])))
            result = {
                "dsv4_memory_record": None,
                "dsv4_memory_stats": {"rank": 0, "reserved_mib": 5.0},
                "dsv4_memory_growth": {"mapped_mib": 1.0},
                "dsv4_memory_dump": {"mapped_mib": 2.0},
            }[request["method"]]
            return self._answer(200, json.dumps({"results": [result]}).encode())
        if self._dead():
            return self._answer(500, b"engine dead")
        type(self).served += 1
        count = request["max_tokens"] - (1 if type(self).short else 0)
        ids = list(range(count))
        if not request["stream"]:
            body = json.dumps({"choices": [{"token_ids": ids}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.end_headers()
        try:
            for i in range(0, count, 2):
                chunk = {"choices": [{"token_ids": ids[i : i + 2]}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            type(self).disconnects += 1


@pytest.mark.parametrize("short", [False, True])
def test_soak_counts_requests_tokens_and_errors(short, tmp_path):
    report = _run(type("Handler", (_Completions,), {"short": short}), tmp_path)
    partial = json.loads((tmp_path / "soak.json").read_text())  # written while it ran
    assert partial["complete"] is False and report["complete"] is True
    assert 0 < partial["requests_total"] <= report["requests_total"]
    total = report["requests_total"]
    assert total > 20 and sum(report["requests"].values()) == total
    assert report["healthy_after"] and report["new_tokens"] > 0
    assert report["counters"] == {"vllm:num_preemptions_total": 0.0}
    read_to_end = total - report["requests"].get("disconnect", 0)
    if short:  # every request read to the end is one token short
        assert report["errors"] == read_to_end and "tokens returned" in report["first_errors"][0]
    else:
        assert report["errors"] == 0 and report["first_errors"] == []


def test_gpu_memory_reads_one_gpu_or_all(monkeypatch):
    monkeypatch.setattr(soak, "_query", lambda *args: "0, 1000\n1, 2500\n")
    assert soak.gpu_memory_mib(1) == 2500.0 and soak.gpu_memory_mib(None) == 3500.0
    assert soak.gpu_memory_mib(7) is None

    def no_smi(*args):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(soak, "_query", no_smi)
    assert soak.gpu_memory_mib(0) is None


def _run(handler, tmp_path, **overrides) -> dict:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        fields = dict(
            port=httpd.server_address[1],
            model="m",
            max_model_len=512,
            seconds=1.5,
            concurrency=4,
            seed=1,
            gpu=None,
            wait=10,
            sample_seconds=0.5,
            out=str(tmp_path / "soak.json"),
        )
        fields.update(overrides)
        return soak.soak(argparse.Namespace(**fields))
    finally:
        httpd.shutdown()


def test_a_dead_server_ends_the_soak_instead_of_counting_errors(tmp_path):
    handler = type("Handler", (_Completions,), {"dies_after": 30, "served": 0})
    start = time.time()
    report = _run(handler, tmp_path, seconds=30.0)
    assert time.time() - start < 10  # stopped at the first sample after the death, not at 30 s
    assert report["server_died_at_s"] is not None and report["server_died_at_s"] < 5
    assert report["healthy_after"] is False
    assert 0 < report["errors"] < 2000  # the requests in flight, not a flood


def test_probe_records_samples_each_worker_and_dumps_at_the_end(tmp_path):
    calls: list = []
    handler = type("Handler", (_Completions,), {"rpc_calls": calls})
    path = str(tmp_path / "snap_{rank}.pickle")
    report = _run(handler, tmp_path, seconds=1.6, probe=path)
    methods = [m for m, _ in calls]
    assert methods[0] == "dsv4_memory_record" and methods[-1] == "dsv4_memory_dump"
    assert calls[-1][1] == [path]
    samples = report["gpu_memory_mib"]
    assert len(samples) >= 3 and methods.count("dsv4_memory_stats") == len(samples)
    assert methods.count("dsv4_memory_growth") == len(samples) - 1
    assert all(s["workers"] == [{"rank": 0, "reserved_mib": 5.0}] for s in samples)
    assert "growth" not in samples[0]
    assert all(s["growth"] == [{"mapped_mib": 1.0}] for s in samples[1:])
    assert report["memory_growth"] == [{"mapped_mib": 2.0}]
