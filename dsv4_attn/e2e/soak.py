"""A soak of a running ``vllm serve``: random traffic for a fixed time, then the tally.

    python -m dsv4_attn.e2e.soak --port P --model CKPT --max-model-len 4096 --seconds 600 \
        --gpu 0 --out soak.json

``--concurrency`` clients send requests back to back until the time is up, each drawn at random
(fixed seed) from:

* prompt and output lengths up to the model length (prompt + output ``<= --max-model-len``):
  mostly short, some medium, some up to the limit;
* prompts that start with one of a few shared prefixes (prefix-cache hits);
* streamed requests whose client disconnects after a few chunks (vLLM must abort them and go on);
* plain and streamed requests read to the end, which must return exactly ``max_tokens`` tokens
  (``ignore_eos``: a shorter answer is counted as an error).

With the server started on a small KV budget (``--num-gpu-blocks-override``) the long requests
outgrow it and vLLM preempts. The report: requests by kind, errors (with the first messages),
vLLM's preemption and prefix-cache counters over the run, tokens generated, and the used memory
of the server's GPU (``nvidia-smi``; give the server a GPU of its own for a figure that is its
alone) at the start, every ``--sample-seconds`` and at the end; the server must still answer
``/health`` afterwards. The tally so far is written to ``--out`` at every sample, in case the run
is cut short; a server that stops answering ``/health`` ends the run (``server_died_at_s``).

With ``--probe SNAPSHOT`` (the server started with :class:`~dsv4_attn.e2e.memory_probe.MemoryProbe`
as its worker extension) each sample also holds every worker's torch allocator figures, and the
report ends with the memory the allocator mapped during the run, by the code that asked for it.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from dsv4_attn.e2e.serve_check import VOCAB, Server

__all__ = ["SoakRequest", "draw_request", "gpu_memory_mib", "main", "soak"]

SHARED_PREFIXES = 4
PREFIX_TOKENS = 1024
MAX_OUTPUT = 2048


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # "complete", "stream", "disconnect"
    prompt: list[int]
    max_tokens: int
    disconnect_after: int = 0  # chunks read before a "disconnect" client closes the connection
    shared_prefix: bool = False  # the prompt starts with one of the shared prefixes


def draw_request(rng: random.Random, max_model_len: int, prefixes: list[list[int]]) -> SoakRequest:
    """One random request whose prompt and output fit ``max_model_len`` tokens."""
    roll = rng.random()
    if roll < 0.5:
        total = rng.randint(2, min(512, max_model_len))
    elif roll < 0.85:
        total = rng.randint(2, min(2048, max_model_len))
    else:
        total = rng.randint(max_model_len // 2, max_model_len)
    max_tokens = rng.randint(1, max(1, min(MAX_OUTPUT, total - 1)))
    prompt_len = max(1, total - max_tokens)
    shared = prompt_len > PREFIX_TOKENS and rng.random() < 0.3
    prompt = list(rng.choice(prefixes)) if shared else []
    prompt += [rng.randrange(1, VOCAB) for _ in range(prompt_len - len(prompt))]
    roll = rng.random()
    if roll < 0.15:
        return SoakRequest("disconnect", prompt, max_tokens, rng.randint(1, 8), shared)
    return SoakRequest(
        "stream" if roll < 0.4 else "complete", prompt, max_tokens, shared_prefix=shared
    )


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    new_tokens: int = 0
    prefixed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: SoakRequest, tokens: int, error: str | None) -> None:
        with self.lock:
            self.requests[request.kind] = self.requests.get(request.kind, 0) + 1
            self.new_tokens += tokens
            self.prefixed += request.shared_prefix
            if error is not None:
                self.error_count += 1
                if len(self.errors) < 20:
                    self.errors.append(
                        f"{request.kind} ({len(request.prompt)} + "
                        f"{request.max_tokens} tokens): {error}"
                    )


def _send(server: Server, request: SoakRequest) -> tuple[int, str | None]:
    """Send one request; returns (tokens received, error or None)."""
    body = {
        "model": server.model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": request.kind != "complete",
    }
    http = urllib.request.Request(
        server.base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(http, timeout=900) as response:
            if request.kind == "complete":
                tokens = len(json.loads(response.read())["choices"][0]["token_ids"])
            else:
                tokens, chunks = 0, 0
                for line in response:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    tokens += len(choices[0].get("token_ids") or [])
                    chunks += 1
                    if request.kind == "disconnect" and chunks >= request.disconnect_after:
                        return tokens, None  # leaving the with-block closes the connection
    except urllib.error.HTTPError as exc:
        return 0, f"HTTP {exc.code}: {exc.read()[:200]!r}"
    except Exception as exc:
        return 0, repr(exc)[:200]
    if request.kind != "disconnect" and tokens != request.max_tokens:
        return tokens, f"{tokens} tokens returned, {request.max_tokens} asked"
    return tokens, None


def _query(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=True).stdout


def gpu_memory_mib(gpu: int | None) -> float | None:
    """Used memory in MiB (``nvidia-smi``) of GPU ``gpu`` (nvidia-smi's index), or of all GPUs
    with None; None where nvidia-smi cannot say. (Per-process figures are not used: inside a
    container nvidia-smi lists no process.)"""
    try:
        out = _query("nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
        used = {int(i): float(m) for i, m in (line.split(",") for line in out.splitlines() if line)}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if gpu is None:
        return sum(used.values())
    return used.get(gpu)


def soak(args: argparse.Namespace) -> dict:
    server = Server(args.port, args.model)
    server.wait(args.wait)
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(1, VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(SHARED_PREFIXES)
    ]
    tally = Tally()
    before = server.counters()
    probe = getattr(args, "probe", None)
    if probe:
        server.rpc("dsv4_memory_record")

    def sample(t: float) -> dict:
        entry: dict = {"t": round(t, 1), "mib": gpu_memory_mib(args.gpu)}
        if probe:
            try:
                entry["workers"] = server.rpc("dsv4_memory_stats")
                if t > 0:  # what grew the allocator so far, should the run be cut short
                    entry["growth"] = server.rpc("dsv4_memory_growth")
            except Exception as exc:
                entry["workers"] = repr(exc)[:200]
        return entry

    memory = [sample(0.0)]
    start = time.time()
    deadline = [start + args.seconds]  # moved up when the server stops answering
    died_at: list[float] = []

    def client(index: int) -> None:
        local = random.Random(args.seed * 1000 + index)
        while time.time() < deadline[0]:
            request = draw_request(local, args.max_model_len, prefixes)
            tokens, error = _send(server, request)
            tally.add(request, tokens, error)

    def report(complete: bool) -> dict:
        try:
            after = server.counters()
        except Exception:
            after = {}
        return {
            "complete": complete,
            "seconds": round(time.time() - start, 1),
            "server_died_at_s": died_at[0] if died_at else None,
            "concurrency": args.concurrency,
            "max_model_len": args.max_model_len,
            "seed": args.seed,
            "requests": dict(sorted(tally.requests.items())),
            "requests_total": sum(tally.requests.values()),
            "with_shared_prefix": tally.prefixed,
            "errors": tally.error_count,
            "first_errors": list(tally.errors),
            "new_tokens": tally.new_tokens,
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "gpu_memory_mib": list(memory),
            "healthy_after": server.healthy(),
        }

    threads = [
        threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)
    ]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        time.sleep(min(args.sample_seconds, max(1.0, deadline[0] - time.time())))
        if time.time() < deadline[0]:
            if not server.healthy():  # a dead server answers every request at once: stop counting
                died_at.append(round(time.time() - start, 1))
                deadline[0] = time.time()
                print(f"{died_at[0]:6.0f} s  the server stopped answering /health", flush=True)
                continue
            memory.append(sample(time.time() - start))
            print(
                f"{time.time() - start:6.0f} s  requests {sum(tally.requests.values())}  "
                f"errors {tally.error_count}  memory (MiB) {memory[-1]}",
                flush=True,
            )
            if getattr(args, "out", None):  # the tally so far, should the run be cut short
                with open(args.out, "w") as f:
                    json.dump(report(False), f, indent=1)
    memory.append(sample(time.time() - start))
    result = report(True)
    if probe and not died_at:
        result["memory_growth"] = server.rpc("dsv4_memory_dump", probe)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.e2e.soak")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument(
        "--gpu",
        type=int,
        help="nvidia-smi index of the server's GPU (its "
        "memory is sampled; default: all GPUs together)",
    )
    parser.add_argument("--wait", type=float, default=420.0, help="seconds to wait for /health")
    parser.add_argument("--sample-seconds", type=float, default=30.0)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--probe",
        metavar="SNAPSHOT",
        help="the server runs with dsv4_attn.e2e.memory_probe.MemoryProbe (and "
        "VLLM_SERVER_DEV_MODE=1): sample each worker's torch memory, record its allocations "
        "and dump torch's snapshot to SNAPSHOT ({rank} replaced) at the end",
    )
    args = parser.parse_args(argv)
    report = soak(args)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "gpu_memory_mib"}, indent=1))
    print("gpu memory (MiB):", report["gpu_memory_mib"][0], "->", report["gpu_memory_mib"][-1])
    raise SystemExit(0 if report["errors"] == 0 and report["healthy_after"] else 1)


if __name__ == "__main__":
    main()
