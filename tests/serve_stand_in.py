"""A stand-in ``vllm`` executable, for running the parts of ``scripts/gpu_serve.sh`` on the CPU."""

from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for `vllm serve CKPT --port P ...`: greedy "tokens" from the prompt, top-2
# logprobs, /health, and /metrics with vLLM's spec-decode counters (half the drafts accepted)
# when it speculates.
STAND_IN_VLLM = """#!/usr/bin/env python3
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
def flag(name):
    return args[args.index(name) + 1]
if args[0] == "bench":  # vllm bench serve: log the run, write a result file
    case = flag("--result-filename").removesuffix(".json")
    with open(os.environ["STAND_IN_BENCH_LOG"], "a") as log:
        log.write(f"{time.monotonic():.6f} start {port} {case}\\n")
    time.sleep(0.2)
    with open(os.environ["STAND_IN_BENCH_LOG"], "a") as log:
        log.write(f"{time.monotonic():.6f} end {port} {case}\\n")
    os.makedirs(flag("--result-dir"), exist_ok=True)
    result = {"completed": int(flag("--num-prompts")), "failed": 0, "output_throughput": port}
    with open(os.path.join(flag("--result-dir"), flag("--result-filename")), "w") as f:
        json.dump(result, f)
    sys.exit(0)
print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
if "--kv-cache-memory-bytes" in args:  # what vLLM logs: capacity of the given KV memory
    tokens = int(flag("--kv-cache-memory-bytes")) // (1000 if "DSV4_NVFP4" in args else 1400)
    print(f"(EngineCore pid={os.getpid()}) INFO [kv_cache_utils.py:1147] GPU KV cache size: "
          f"{tokens:,} tokens", flush=True)
spec = "--speculative-config" in args
drafts = [0]
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def answer(self, text):
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            return self.answer("ok")
        text = "vllm:num_preemptions_total 0.0\\n"
        if spec:
            n = drafts[0]
            for name, value in (("drafts", n), ("draft_tokens", n), ("accepted_tokens", n // 2)):
                text += f'vllm:spec_decode_num_{name}_total{{engine="0"}} {value}\\n'
        self.answer(text)
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n, prompt = request["max_tokens"], request["prompt"]
        tokens = [(prompt[-1] * 7 + i) % 1000 for i in range(n)]
        drafts[0] += 2 * n
        choice = {"token_ids": tokens}
        if request.get("prompt_logprobs") is not None:  # each prompt token's own logprob
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": -1.0 - (t % 7) / 8, "rank": 1}} for t in prompt[1:]
            ]
        if request.get("logprobs"):
            top = [{f"token_id:{t}": -0.1, "token_id:1": -0.5} for t in tokens]
            choice["logprobs"] = {"top_logprobs": top}
        self.answer(json.dumps({"choices": [choice]}))
ThreadingHTTPServer.request_queue_size = 256  # the plan's concurrent phases: no resets
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def free_port(*offsets: int) -> int:
    """A port P such that P + offset is free on 127.0.0.1 for every offset (0 when none are
    given): fixed ports collide with another run of the suite on the same machine."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        sockets = []
        try:
            for offset in offsets or (0,):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no free ports at offsets {offsets} from 200 tries")


def run_gpu_serve(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``bash scripts/gpu_serve.sh ARGS`` with :data:`STAND_IN_VLLM` as ``vllm`` on the PATH,
    ``OUT`` at ``tmp_path / "out"`` and ``env`` added to the environment. A run past its time
    fails with the tails of its logs (a server that did not come up says why there)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    vllm = bin_dir / "vllm"
    vllm.write_text(STAND_IN_VLLM)
    vllm.chmod(vllm.stat().st_mode | stat.S_IEXEC)
    env_file = tmp_path / "env.sh"
    env_file.write_text(f'export PATH="{bin_dir}:{Path(sys.executable).parent}:$PATH"\n')
    environment = {**os.environ, "DSV4_ENV_FILE": str(env_file), "PYTHONPATH": str(ROOT)}
    environment.update(OUT=str(tmp_path / "out"), **env)
    try:
        return subprocess.run(
            ["bash", "scripts/gpu_serve.sh", *args],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as timeout:
        logs = sorted((tmp_path / "out").rglob("*.log"))
        tails = "".join(f"\n--- {log}\n{log.read_text(errors='replace')[-1500:]}" for log in logs)
        raise AssertionError(f"gpu_serve.sh {' '.join(args)} ran past 300 s{tails}") from timeout
