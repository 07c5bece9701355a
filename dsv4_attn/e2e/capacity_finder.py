"""How many requests of a given context a running ``vllm serve`` holds at once: measured.

vLLM's "GPU KV cache size" line counts each request's admission reservation at
``max_model_len`` (its window groups sized for two batches of tokens in flight). What a
DeepSeek-V4 cache runs at once is neither that nor what its requests hold while they decode: a
new request waits until the free blocks hold its own admission reservation, while those running
hold only their windows and compressed rows
(:func:`dsv4_attn.vllm_glue.capacity.requests_at_once` predicts it). Benchmarks that mean to
run "beyond capacity" therefore measure it:

* :class:`MetricsSampler` polls the server's ``/metrics`` (requests running and waiting, KV
  usage, preemptions) in a thread while a benchmark runs; :func:`summarize` says how many ran
  at once, and how many ran while others waited (the cache's bound).
* :func:`find_capacity` offers ``max_requests`` requests of ``input_len`` prompt tokens at
  once (outputs long enough that none finishes), waits until the cache is full and requests
  wait, reads the requests running over ``settle_s`` more seconds, and aborts them all (by
  closing their connections, which makes vLLM abort them).

The figure is counted by the client: requests streaming tokens at once, each with its whole
prompt in the cache. vLLM's own running count also holds a request admitted into the last free
blocks that cannot finish its prefill (preempted, re-admitted, until a slot frees).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import socket
import statistics
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass

__all__ = [
    "GAUGES",
    "MetricsSampler",
    "Sample",
    "find_capacity",
    "parse_gauges",
    "summarize",
]

GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:generation_tokens_total": "generated",
    "vllm:prompt_tokens_total": "prompted",
    "vllm:request_success_total": "finished",
}
"""The /metrics series read, by the field of :class:`Sample` each fills (summed over engines)."""

_LINE = re.compile(r"^(vllm:[a-z_]+)(?:\{.*\})? (\S+)$")


@dataclass(frozen=True)
class Sample:
    """One look at a server: seconds since sampling began, requests running and waiting, the
    KV cache's used fraction (0-1, the mean over engines), preemptions so far, and the server's
    counters so far: output tokens generated, prompt tokens computed, requests finished."""

    t: float
    running: int
    waiting: int
    kv_usage: float
    preemptions: float
    generated: float = 0.0
    prompted: float = 0.0
    finished: float = 0.0


def parse_gauges(text: str) -> dict[str, float]:
    """The :data:`GAUGES` of a /metrics page (Prometheus text), each summed over its labels
    (engines); ``kv_usage`` is averaged over them instead. Missing series are absent."""
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match and match[1] in GAUGES:
            totals.setdefault(GAUGES[match[1]], []).append(float(match[2]))
    values = {name: sum(v) for name, v in totals.items()}
    if "kv_usage" in totals:
        values["kv_usage"] = statistics.fmean(totals["kv_usage"])
    return values


def _read(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        return parse_gauges(response.read().decode())


class MetricsSampler:
    """Samples a server's gauges every ``interval_s`` seconds in a thread, from :meth:`start`
    to :meth:`stop` (which returns the samples); a failed read is skipped."""

    def __init__(self, base: str, interval_s: float = 0.5) -> None:
        self.base = base
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()  # samples' times count from here (and from start())

    def sample(self) -> Sample | None:
        """Read the gauges now, keep and return the sample (None if the read failed)."""
        try:
            values = _read(self.base)
        except (OSError, ValueError):
            return None
        sample = Sample(
            round(time.monotonic() - self.t0, 3),
            int(values.get("running", 0)),
            int(values.get("waiting", 0)),
            values.get("kv_usage", 0.0),
            values.get("preemptions", 0.0),
            values.get("generated", 0.0),
            values.get("prompted", 0.0),
            values.get("finished", 0.0),
        )
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> MetricsSampler:
        self.t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples


def summarize(samples: list[Sample]) -> dict:
    """What a run's samples say about requests at once: the most running, the most waiting,
    the running count while some waited (``held_while_waiting``: its most frequent value, the
    cache's bound; ``None`` if none ever waited), the KV usage peak, preemptions during the run
    and the number of samples; and ``while_waiting``, the server's rates from the first to the
    last sample with requests waiting (beyond capacity, the ramp and the tail left out:
    seconds, output and prompt tokens per second, requests finished)."""
    if not samples:
        return {"samples": 0}
    waiting = [s for s in samples if s.waiting > 0]
    held = None
    if waiting:
        counts = Counter(s.running for s in waiting)
        held = max(counts, key=lambda n: (counts[n], n))  # ties: the larger count
    return {
        "samples": len(samples),
        "max_running": max(s.running for s in samples),
        "max_waiting": max(s.waiting for s in samples),
        "held_while_waiting": held,
        "running_while_waiting_min_max": (
            [min(s.running for s in waiting), max(s.running for s in waiting)] if waiting else None
        ),
        "peak_kv_usage": round(max(s.kv_usage for s in samples), 4),
        "preemptions": samples[-1].preemptions - samples[0].preemptions,
        "while_waiting": _rates(waiting[0], waiting[-1]) if len(waiting) > 1 else None,
    }


def _rates(first: Sample, last: Sample) -> dict:
    """The server's rates between two samples."""
    seconds = last.t - first.t
    return {
        "seconds": round(seconds, 1),
        "output_tok_s": round((last.generated - first.generated) / seconds, 1),
        "prompt_tok_s": round((last.prompted - first.prompted) / seconds, 1),
        "finished": last.finished - first.finished,
    }


class _Request(threading.Thread):
    """One streamed completion request in its own thread: :attr:`decoding_since` is set when
    its first output token arrives (its prompt is in the cache: it holds its context's blocks);
    :meth:`abort` closes its connection (vLLM aborts a request whose client went away)."""

    def __init__(self, host: str, port: int, body: dict) -> None:
        super().__init__(daemon=True)
        self.connection = http.client.HTTPConnection(host, port, timeout=3600)
        self.body = json.dumps({**body, "stream": True}).encode()
        self.decoding_since: float | None = None
        self.error: str | None = None
        self.sock: socket.socket | None = None
        self.aborted = False

    def run(self) -> None:
        if self.aborted:
            return
        try:
            self.connection.request(
                "POST", "/v1/completions", self.body, {"Content-Type": "application/json"}
            )
            # Kept: http.client drops its own reference once a response without a length
            # (a stream) begins, while the response keeps reading from it.
            self.sock = self.connection.sock
            response = self.connection.getresponse()
            if response.status != 200:
                self.error = f"HTTP {response.status}: {response.read()[:200]!r}"
                return
            for line in response:
                if self.decoding_since is None and line.startswith(b"data: {"):
                    self.decoding_since = time.monotonic()
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as exc:
            # AttributeError: http.client reading a response whose socket abort() closed.
            if not self.aborted:
                self.error = type(exc).__name__

    def abort(self) -> None:
        self.aborted = True
        sock = self.sock or self.connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.connection.close()


def find_capacity(
    port: int,
    model: str,
    input_len: int,
    output_len: int,
    max_requests: int,
    *,
    vocab: int = 129280,
    seed: int = 0,
    settle_s: float = 10.0,
    timeout_s: float = 600.0,
    interval_s: float = 0.5,
    host: str = "127.0.0.1",
) -> dict:
    """Requests of ``input_len`` prompt tokens (random ids from ``1 .. vocab - 1``, seeded by
    ``seed``) that the server on ``port`` decodes at once: ``max_requests`` of them offered at
    once (streamed), each asking for ``output_len`` tokens (ignoring EOS; long enough that
    none finishes while this looks).

    The figure is the number of requests streaming tokens at once (prompt prefilled, context
    held) once the cache is full: requests wait while none is being prefilled (vLLM's running
    count equals the streaming one), or vLLM preempts (a request admitted into the last free
    blocks could not grow), for ``settle_s`` seconds without that number changing. (A long
    prompt's prefill holds its window groups' blocks for each chunk in flight: at 128K tokens
    and 7 GiB of V4-Flash cache one prefilling request kept vLLM's usage at 95% and the rest
    waiting, which is not the bound.) The server's own gauges are sampled
    alongside (:func:`summarize`). Then every request is aborted, and the call returns once the
    server runs none.

    Returns ``{"capacity", "bound", "input_len", "output_len", "offered", "seconds",
    "request_errors", "server": summarize(...), "timeline": [...]}``; ``bound`` is ``"cache"``,
    ``"offered"`` (all ``max_requests`` decode and none waits: the capacity is at least that) or
    ``"timeout"`` (``capacity`` is then what decoded at the end).
    """
    if input_len < 1 or output_len < 1 or max_requests < 1:
        raise ValueError(
            f"input_len, output_len and max_requests must be >= 1, got {input_len}, "
            f"{output_len}, {max_requests}"
        )
    rng = random.Random(seed)
    requests = [
        _Request(
            host,
            port,
            {
                "model": model,
                "prompt": [rng.randrange(1, vocab) for _ in range(input_len)],
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        for _ in range(max_requests)
    ]
    sampler = MetricsSampler(f"http://{host}:{port}", interval_s)
    start = sampler.t0
    first = sampler.sample()
    preempted_before = first.preemptions if first is not None else 0.0
    for request in requests:
        request.start()
    bound, decoding, stable_since, last = "timeout", 0, start, -1
    full_since: float | None = None
    try:
        while time.monotonic() - start < timeout_s:
            time.sleep(interval_s)
            sample = sampler.sample()
            now = time.monotonic()
            decoding = sum(r.decoding_since is not None for r in requests)
            if decoding != last:
                last, stable_since = decoding, now
            if decoding >= max_requests and now - stable_since >= settle_s:
                bound = "offered"
                break
            # Full: requests wait although none is being prefilled (vLLM's running count is
            # the streaming one: it would admit a waiting request at once if blocks were free),
            # or vLLM preempts (one admitted into the last blocks cannot grow). A long prompt's
            # prefill holds many blocks for a while: waiting then says nothing.
            full = (
                sample is not None
                and sample.waiting > 0
                and (sample.running == decoding or sample.preemptions > preempted_before)
            )
            if not full:
                full_since = None
            elif full_since is None:
                full_since = now
            if full_since is not None and now - max(full_since, stable_since) >= settle_s:
                bound = "cache"
                break
            if all(not r.is_alive() for r in requests):
                break  # every request ended (answered or failed) before a bound showed
    finally:
        stop_t = time.monotonic() - start
        errors = sorted({r.error for r in requests if r.error and not r.is_alive()})
        for request in requests:
            request.abort()
        drained = time.monotonic()
        while time.monotonic() - drained < 120:
            sample = sampler.sample()
            if sample is not None and sample.running == 0 and sample.waiting == 0:
                break
            time.sleep(interval_s)
    return {
        "capacity": decoding,
        "bound": bound,
        "input_len": input_len,
        "output_len": output_len,
        "offered": max_requests,
        "seconds": round(stop_t, 1),
        "request_errors": errors,
        "server": summarize([s for s in sampler.samples if s.t <= stop_t]),
        "timeline": [asdict(s) for s in sampler.samples],
    }
