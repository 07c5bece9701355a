"""The capacity finder against a stand-in server whose KV cache holds a known number of requests."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsv4_attn.e2e import capacity_finder as cf

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.9
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
vllm:num_requests_running_histogram_bucket{le="1"} 99.0
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:generation_tokens_total{engine="1",model_name="m"} 20.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 4096.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
"""


def test_gauges_are_summed_over_engines_and_usage_averaged():
    assert cf.parse_gauges(METRICS) == {
        "running": 5.0,
        "waiting": 4.0,
        "kv_usage": pytest.approx(0.7),
        "preemptions": 8.0,
        "generated": 120.0,
        "prompted": 4096.0,
        "finished": 4.0,
    }


def test_summary_of_samples():
    samples = [  # t, running, waiting, usage, preemptions, generated, prompted, finished
        cf.Sample(0.0, 1, 5, 0.2, 3.0, 0, 8192, 0),
        cf.Sample(0.5, 4, 2, 0.95, 3.0, 50, 16384, 0),
        cf.Sample(1.0, 5, 1, 1.0, 4.0, 110, 16384, 1),
        cf.Sample(1.5, 4, 2, 0.91, 5.0, 200, 20480, 2),
        cf.Sample(2.0, 4, 0, 0.9, 5.0, 320, 20480, 3),
        cf.Sample(2.5, 6, 0, 0.9, 5.0, 500, 20480, 4),
    ]
    summary = cf.summarize(samples)
    # while waiting: samples 0 to 3, 1.5 s: 200 tokens out, 12288 prompt tokens, 2 finished
    assert summary["while_waiting"] == {
        "seconds": 1.5,
        "output_tok_s": 133.3,
        "prompt_tok_s": 8192.0,
        "finished": 2,
    }
    assert summary["max_running"] == 6 and summary["max_waiting"] == 5
    assert summary["held_while_waiting"] == 4  # 4 twice while some waited; 1 and 5 once
    assert summary["running_while_waiting_min_max"] == [1, 5]
    assert summary["peak_kv_usage"] == 1.0 and summary["preemptions"] == 2.0
    assert cf.summarize([]) == {"samples": 0}
    assert cf.summarize(samples[-2:])["held_while_waiting"] is None


class _Cache:
    """A stand-in vLLM: ``slots`` requests fit; a new request prefills for ``prefill_s`` (one
    at a time) then streams a token every 20 ms while it holds a slot; one more request than
    fits is admitted, prefills, then is preempted and re-admitted over and over (counted as
    running, never streaming), as vLLM does with a request admitted into the last free blocks.
    A client that disconnects frees its request."""

    def __init__(self, slots: int, prefill_s: float = 0.05) -> None:
        self.slots, self.prefill_s = slots, prefill_s
        self.lock = threading.Lock()
        self.prefill = threading.Lock()
        self.decoding = 0
        self.waiting = 0
        self.partial = 0
        self.preemptions = 0
        self.prompts: list[int] = []

    def metrics(self) -> str:
        with self.lock:
            used = 0.95 if self.partial else self.decoding / self.slots
            return (
                f'vllm:num_requests_running{{engine="0"}} {self.decoding + self.partial}\n'
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
                f'vllm:kv_cache_usage_perc{{engine="0"}} {min(1.0, used)}\n'
                f'vllm:num_preemptions_total{{engine="0"}} {self.preemptions}\n'
            )

    def serve(self, handler: BaseHTTPRequestHandler, body: dict) -> None:
        self.prompts.append(len(body["prompt"]))
        with self.lock:
            self.waiting += 1
        holding = False
        try:
            while True:
                with self.prefill:
                    with self.lock:
                        self.waiting -= 1
                        self.partial = 1  # running while it prefills, its chunks' blocks held
                    if _gone(handler):
                        return
                    time.sleep(self.prefill_s)
                    with self.lock:
                        if self.decoding < self.slots:
                            self.decoding += 1
                            self.partial = 0
                            holding = True
                        else:
                            self.partial = 1
                            self.preemptions += 1
                            self.waiting += 1
                if holding:
                    break
                time.sleep(self.prefill_s)
                with self.lock:
                    self.partial = 0
                if _gone(handler):
                    with self.lock:
                        self.waiting -= 1
                    return
            handler.send_response(200)
            handler.end_headers()
            for i in range(body["max_tokens"]):
                handler.wfile.write(b'data: {"choices": [{"text": "t%d"}]}\n\n' % i)
                handler.wfile.flush()
                time.sleep(0.02)
        except OSError:
            pass
        finally:
            with self.lock:
                if holding:
                    self.decoding -= 1


def _gone(handler: BaseHTTPRequestHandler) -> bool:
    """Whether the client closed its connection (readable, and nothing left to read)."""
    readable, _, _ = select.select([handler.connection], [], [], 0)
    return bool(readable) and handler.connection.recv(1, socket.MSG_PEEK) == b""


@pytest.fixture
def stand_in():
    servers = []

    def start(slots: int) -> tuple[int, _Cache]:
        cache = _Cache(slots)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                text = cache.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def do_POST(self):
                length = int(self.headers["Content-Length"])
                cache.serve(self, json.loads(self.rfile.read(length)))

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1], cache

    yield start
    for server in servers:
        server.shutdown()


@pytest.mark.parametrize("slots", [1, 3, 5])
def test_finds_how_many_requests_the_cache_holds(stand_in, slots):
    port, cache = stand_in(slots)
    found = cf.find_capacity(
        port, "m", 40, 10_000, slots + 3, vocab=50, settle_s=0.6, interval_s=0.05, timeout_s=30
    )
    assert found["bound"] == "cache", found
    assert found["capacity"] == slots
    assert found["server"]["max_running"] == slots + 1  # vLLM's count holds the partial one
    assert found["server"]["preemptions"] > 0
    assert found["request_errors"] == []
    assert cache.prompts == [40] * (slots + 3)
    deadline = time.monotonic() + 10  # every request was aborted
    while cache.decoding and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.decoding == 0


def test_a_prefill_longer_than_the_settling_time_is_not_the_bound(stand_in):
    """A long prompt's prefill keeps vLLM's cache 95% used and the rest waiting for longer
    than ``settle_s`` (vLLM at 128K tokens): the finder waits for the requests that fit."""
    port, cache = stand_in(3)
    cache.prefill_s = 0.8
    found = cf.find_capacity(
        port, "m", 40, 10_000, 5, vocab=50, settle_s=0.5, interval_s=0.05, timeout_s=60
    )
    assert found["bound"] == "cache" and found["capacity"] == 3, found


def test_all_offered_fit(stand_in):
    port, _ = stand_in(8)
    found = cf.find_capacity(
        port, "m", 16, 10_000, 4, vocab=50, settle_s=0.4, interval_s=0.05, timeout_s=30
    )
    assert found["bound"] == "offered" and found["capacity"] == 4


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_requests must be >= 1, got 16, 8, 0"):
        cf.find_capacity(1, "m", 16, 8, 0)
