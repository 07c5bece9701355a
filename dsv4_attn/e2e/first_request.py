"""The first request a fresh server answers, against the ones after it.

    python -m dsv4_attn.e2e.first_request --port P --model CKPT --log SERVER_LOG --out FILE

Against a server that has just come up (``scripts/gpu_serve.sh first`` starts it with
``--jit-monitor-verbose``): one prompt of :data:`LENGTH` tokens, then a second fresh prompt of the
same length (no prefix-cache hit), each for one new token, so each request's time is its
time to first token; then prompts of other lengths, alone and four at once, that take the
prefill path through other batch shapes. Then the server log: vLLM's JIT monitor, active once
vLLM's warmup is done, logs a line for every kernel compiled while serving
("Triton kernel JIT compilation during inference: NAME ..."), the latency spike a user's
request pays. The record (JSON) holds both times, their ratio and the compiles by kernel name.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

from dsv4_attn.e2e.serve_check import VOCAB, Request, Server

__all__ = ["LENGTH", "SPREAD", "first_requests", "jit_compiles", "main"]

LENGTH = 1500
"""Prompt tokens of the first two requests: several HCA entries and CSA top-k picks."""

SPREAD = (7, 64, 129, 333, 700, 1000, 2500)
"""Prompt lengths sent after them, alone: below and past the 128-token window, a 512-entry
top-k, several pages; then four at once of lengths in between (a mixed prefill batch)."""

# vLLM's line: "<runtime> <event> during inference: <name>[ (<details>)]. This causes ..."
_JIT_LINE = re.compile(r"during inference: (.+?)(?: \(|\. This causes|$)", re.M)


def jit_compiles(log_text: str) -> Counter[str]:
    """Kernel compiles vLLM's JIT monitor logged in a server log, counted by kernel name."""
    return Counter(match.group(1) for match in _JIT_LINE.finditer(log_text))


def first_requests(server: Server, seed: int = 2026) -> dict:
    """Times (s) of a fresh server's first request and of a second of equal length, and of the
    requests of :data:`SPREAD` (see the module docstring)."""
    rng = random.Random(seed)

    def request(key: str, n: int) -> Request:
        return Request(key, "first", [rng.randrange(1, VOCAB) for _ in range(n)], 1, False)

    first = server.complete(request("first", LENGTH))["s"]
    second = server.complete(request("second", LENGTH))["s"]
    spread = {n: server.complete(request(f"spread_{n}", n))["s"] for n in SPREAD}
    batch = [request(f"batch_{i}", 400 + 150 * i) for i in range(4)]
    with futures.ThreadPoolExecutor(len(batch)) as pool:
        at_once = [r["s"] for r in pool.map(server.complete, batch)]
    return {
        "length": LENGTH,
        "first_s": first,
        "second_s": second,
        "first_over_second": round(first / second, 3) if second > 0 else None,
        "spread_s": spread,
        "at_once_s": at_once,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.e2e.first_request")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the served model path (request 'model')")
    parser.add_argument("--log", required=True, help="the server's log (vLLM's JIT monitor)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for /health")
    parser.add_argument("--pid", type=Path, help="the server's pid file: stop if it exits")
    args = parser.parse_args(argv)
    server = Server(args.port, args.model)
    up = server.wait(args.wait, args.pid)
    record = {"up_s": round(up, 1), **first_requests(server)}
    text = Path(args.log).read_text(errors="replace")
    record["monitor_active"] = "Kernel JIT monitor activated" in text
    record["jit_compiles"] = dict(jit_compiles(text))
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    if not record["monitor_active"]:
        print("vLLM's JIT monitor did not report itself active in the log", file=sys.stderr)


if __name__ == "__main__":
    main()
