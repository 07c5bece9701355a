"""A real ``vllm serve`` of the tiny DeepSeek-V4, queried and compared across attention backends.

``scripts/gpu_serve.sh`` drives it on the GPU machine; the pieces are:

* ``python -m dsv4_attn.e2e.serve_check checkpoint DIR [--mtp-layers N]`` — write the tiny
  64-head checkpoint vLLM loads as it is, with N (default 1) MTP draft layers
  (:func:`dsv4_attn.e2e.tiny_model.save_vllm_checkpoint`); with ``--v41`` the tiny
  DeepSeek-V4.1 instead (no draft; served with ``--language-model-only``);
* ``python -m dsv4_attn.e2e.serve_check query --name N --port P --out FILE`` — wait for a running
  server and send the fixed request set of :func:`request_plan` (greedy, token-id prompts, top-2
  logprobs), phase by phase; save every response and the server's preemption and prefix-cache
  counters;
* ``python -m dsv4_attn.e2e.serve_check compare REF.json OTHER.json ... [--json FILE]`` — per
  request, are the token ids those of the reference server? Where they first differ, the
  reference's own top-1 minus top-2 logprob there says whether that step was a near-tie.

The request set (fixed seed): prompts shorter than the 128-token window, longer than 128 and than
512 (CSA top-k) tokens, and 1500 tokens (several HCA entries); three prompts sharing an
1100-token prefix, sent one after another (prefix-cache hits); 16 concurrent requests; three
timed throughput runs (32 concurrent, 300-token prompts, 256 new tokens; median reported); and
160 concurrent requests of 200 prompt tokens and 1800 new ones: admitted on their short prompts,
they outgrow a KV budget of ``--num-gpu-blocks-override 2400`` blocks while decoding, so vLLM
preempts and recomputes requests (the server's preemption counter says how often).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import os
import random
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NEAR_TIE",
    "SCORED",
    "Request",
    "compare",
    "compare_scored",
    "greedy_plan",
    "main",
    "print_comparison",
    "request_plan",
]

NEAR_TIE = 0.02
"""A reference margin (top-1 minus top-2 logprob) below this is a near-tie: two correct
implementations whose logits differ by up to 0.01 (bf16 attention outputs) may pick either."""

VOCAB = 1024
SCORED = 64
"""Tokens scored after the 4K-token prompt of the greedy set's scored requests."""
THROUGHPUT_REPS = 3
"""Timed runs of 32 concurrent requests (300-token prompts, 256 new tokens); the report takes
their median tokens/s (one run of under a second moved by +-5% between repeats)."""


@dataclass(frozen=True)
class Request:
    key: str
    phase: str  # single, prefix, concurrent, throughput, preemption
    prompt: list[int]
    max_tokens: int
    logprobs: bool = True
    scored: int = 0
    """The last ``scored`` prompt tokens are scored: the server returns each one's logprob
    given the tokens before it (``prompt_logprobs``), the same contexts on every server."""


def request_plan(seed: int = 2026) -> list[Request]:
    """The fixed request set, in the order and grouping it is sent."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    plan = [Request(f"single_{n}", "single", ids(n), 32) for n in (8, 100, 200, 600, 1500)]
    prefix = ids(1100)
    plan += [Request(f"prefix_{i}", "prefix", prefix + ids(60), 32) for i in range(3)]
    plan += [Request(f"concurrent_{i}", "concurrent", ids(300), 48) for i in range(16)]
    for rep in range(THROUGHPUT_REPS):  # fresh prompts each time: no prefix-cache hits
        plan += [
            Request(f"throughput{rep}_{i}", f"throughput{rep}", ids(300), 256, False)
            for i in range(32)
        ]
    plan += [Request(f"preempt_{i}", "preemption", ids(200), 1800) for i in range(160)]
    return plan


def greedy_plan(vocab: int, max_model_len: int, seed: int = 2026) -> list[Request]:
    """The greedy-agreement set for a model at real shapes: one prompt each of 4K, 32K tokens
    and the longest that leaves room for the answer in ``max_model_len`` (sent one after
    another), then 16 concurrent 4K-token prompts; 32 greedy tokens each with top-2 logprobs.
    Token ids are drawn from ``1 .. vocab - 1``.

    Greedy tokens part at the first step where two servers' logits cross, which a deep model
    with random weights reaches from rounding alone. So the set also scores fixed tokens on
    fixed contexts: a 4K-token prompt followed by :data:`SCORED` more tokens, whose logprobs
    each server returns (``scored_4096``, sent alone), and the same request again among the
    concurrent ones (``scored_4096_batched``), whose difference from the first is the server's
    own noise from batch composition (:func:`compare_scored`)."""
    rng = random.Random(seed)
    new_tokens = 32

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    longest = max_model_len - 2 * new_tokens
    lengths = sorted({n for n in (4096, 32768, longest) if n <= longest})
    plan = [Request(f"long_{n}", "single", ids(n), new_tokens) for n in lengths]
    scored = ids(4096 + SCORED)
    plan.append(Request("scored_4096", "scored", scored, 1, logprobs=False, scored=SCORED))
    plan += [Request(f"concurrent_{i}", "concurrent", ids(4096), new_tokens) for i in range(16)]
    plan.append(
        Request("scored_4096_batched", "concurrent", scored, 1, logprobs=False, scored=SCORED)
    )
    return plan


# ----------------------------------------------------------------------------------------------
# Talking to the server
# ----------------------------------------------------------------------------------------------


class Server:
    def __init__(self, port: int, model: str) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.model = model

    def wait(self, seconds: float, pid: int | Path | None = None) -> float:
        """Seconds until /health answers; raises if it does not within ``seconds`` or the server
        process exits first. ``pid`` is the server's process id, or the file its launcher writes
        the id to (read at every poll: it may not be written yet, and a relaunch rewrites it)."""
        start = time.time()
        while time.time() - start < seconds:
            if self.healthy(timeout=2):
                return time.time() - start
            server_pid = _read_pid(pid) if isinstance(pid, Path) else pid
            if server_pid is not None and not _alive(server_pid):
                raise RuntimeError(f"the server (pid {server_pid}) exited before it came up")
            time.sleep(2)
        raise TimeoutError(f"server at {self.base} not up after {seconds:.0f} s")

    def healthy(self, timeout: float = 10) -> bool:
        """Whether the server answers ``/health`` within ``timeout`` seconds."""
        try:
            urllib.request.urlopen(self.base + "/health", timeout=timeout).read()
            return True
        except Exception:
            return False

    def complete(self, request: Request) -> dict:
        body = {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if request.logprobs:
            body.update({"logprobs": 2, "return_tokens_as_token_ids": True})
        if request.scored:
            body["prompt_logprobs"] = 1
        http = urllib.request.Request(
            self.base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.time()
        with urllib.request.urlopen(http, timeout=600) as response:
            reply = json.loads(response.read())
        choice = reply["choices"][0]
        result = {"token_ids": choice.get("token_ids"), "s": round(time.time() - start, 3)}
        logprobs = choice.get("logprobs") or {}
        if logprobs.get("top_logprobs"):
            result["top2"] = [
                sorted(d.values(), reverse=True)[:2] for d in logprobs["top_logprobs"]
            ]
        if request.scored:
            positions = choice["prompt_logprobs"][-request.scored :]
            tokens = request.prompt[-request.scored :]
            result["scored"] = [
                position[str(token)]["logprob"]
                for position, token in zip(positions, tokens, strict=True)
            ]
        return result

    def post(self, path: str, timeout: float = 300) -> None:
        """An empty POST (``/start_profile``, ``/stop_profile``)."""
        http = urllib.request.Request(self.base + path, data=b"", method="POST")
        urllib.request.urlopen(http, timeout=timeout).read()

    def rpc(self, method: str, *args: str) -> list:
        """Every worker's result of ``method(*args)`` through vLLM's development endpoint
        ``POST /collective_rpc`` (the server runs with ``VLLM_SERVER_DEV_MODE=1``)."""
        http = urllib.request.Request(
            self.base + "/collective_rpc",
            data=json.dumps({"method": method, "args": list(args)}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(http, timeout=120) as response:
            body = response.read()
        return json.loads(body)["results"] if body else []

    def counters(self) -> dict[str, float]:
        """:func:`parse_counters` of the server's /metrics."""
        return parse_counters(
            urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()
        )


COUNTER = re.compile(
    r"^(vllm:[a-z_]*(?:preempt|prefix_cache|spec_decode)[a-z_]*)(?:\{.*\})? (\S+)$"
)


def parse_counters(text: str) -> dict[str, float]:
    """vLLM's preemption, prefix-cache and speculative-decoding counters of a /metrics page
    (Prometheus text), each summed over its labels (engines, draft positions)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = COUNTER.match(line)
        if match:
            totals[match[1]] = totals.get(match[1], 0.0) + float(match[2])
    return totals


def acceptance(record: dict) -> dict | None:
    """Speculative decoding over every phase of ``record``: drafts, draft tokens, accepted
    tokens, the acceptance rate (accepted / draft tokens) and the mean acceptance length
    (1 + accepted / drafts, vLLM's figure); None for a server without speculation."""
    totals = dict.fromkeys(("drafts", "draft_tokens", "accepted_tokens"), 0.0)
    for phase in record["phases"].values():
        counters = phase.get("counters", {})
        for key in totals:
            totals[key] += counters.get(f"vllm:spec_decode_num_{key}_total", 0.0)
    if not totals["drafts"]:
        return None
    return {
        **{key: int(value) for key, value in totals.items()},
        "rate": round(totals["accepted_tokens"] / totals["draft_tokens"], 4),
        "mean_length": round(1 + totals["accepted_tokens"] / totals["drafts"], 4),
    }


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs; an exited one that nobody reaped yet (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # the state is the field after the parenthesised command name
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: os.kill's answer stands
    return state not in ("Z", "X")


def _read_pid(pid_file: Path) -> int | None:
    """The process id in ``pid_file``; None while it is missing or not written yet."""
    try:
        return int(pid_file.read_text())
    except (OSError, ValueError):
        return None


def query(server: Server, plan: list[Request]) -> dict:
    """Send the plan phase by phase; concurrent phases all at once."""
    record: dict = {"results": {}, "errors": {}, "phases": {}}
    phases: dict[str, list[Request]] = {}
    for request in plan:
        phases.setdefault(request.phase, []).append(request)
    for phase, requests in phases.items():
        before = server.counters()
        start = time.time()
        if phase in ("single", "prefix"):
            outcomes = [_attempt(server, r) for r in requests]
        else:
            with futures.ThreadPoolExecutor(len(requests)) as pool:
                outcomes = list(pool.map(lambda r: _attempt(server, r), requests))
        seconds = time.time() - start
        after = server.counters()
        new_tokens = 0
        for request, (result, error) in zip(requests, outcomes, strict=True):
            if error is not None:
                record["errors"][request.key] = error
            else:
                record["results"][request.key] = result
                new_tokens += len(result["token_ids"] or [])
        record["phases"][phase] = {
            "requests": len(requests),
            "seconds": round(seconds, 3),
            "new_tokens": new_tokens,
            "tok_per_s": round(new_tokens / seconds, 1),
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
        }
        print(
            f"{phase}: {len(requests)} requests, {seconds:.1f} s, "
            f"{new_tokens / seconds:.0f} new tok/s, errors {len(record['errors'])}, "
            f"counters {record['phases'][phase]['counters']}",
            flush=True,
        )
    return record


def _attempt(server: Server, request: Request) -> tuple[dict | None, str | None]:
    try:
        return server.complete(request), None
    except urllib.error.HTTPError as exc:
        return None, f"HTTP {exc.code}: {exc.read()[:300]!r}"
    except Exception as exc:
        return None, repr(exc)[:300]


# ----------------------------------------------------------------------------------------------
# Comparing servers
# ----------------------------------------------------------------------------------------------


def compare_one(ref: dict, other: dict) -> dict:
    """Token identity of one request against the reference, and the margins where it differs."""
    a, b = ref["token_ids"], other["token_ids"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) == len(b):
        return {"identical": True, "steps": len(a)}
    out: dict = {"identical": False, "steps": len(a), "first_difference": first}
    if first is not None and "top2" in ref and first < len(ref["top2"]):
        top = ref["top2"][first]
        out["ref_margin"] = top[0] - top[1] if len(top) == 2 else None
        out["near_tie"] = out["ref_margin"] is not None and out["ref_margin"] < NEAR_TIE
    return out


def compare(ref_record: dict, other_record: dict) -> dict:
    """Per phase (the timing run aside): requests identical, differing first at a near-tie of
    the reference, differing otherwise, missing from ``other_record``."""
    summary: dict = {}
    per_request = {}
    for key, ref in ref_record["results"].items():
        phase = key.rsplit("_", 1)[0]
        if phase.startswith("throughput") or key.startswith("scored"):
            continue  # a timing run, without logprobs, or scored tokens (compare_scored)
        phase = "preemption" if phase == "preempt" else phase
        row = summary.setdefault(
            phase, {"requests": 0, "identical": 0, "near_tie": 0, "different": 0, "missing": 0}
        )
        row["requests"] += 1
        other = other_record["results"].get(key)
        if other is None:
            row["missing"] += 1
            continue
        result = compare_one(ref, other)
        per_request[key] = result
        if result["identical"]:
            row["identical"] += 1
        elif result.get("near_tie"):
            row["near_tie"] += 1
        else:
            row["different"] += 1
    return {"phases": summary, "requests": per_request}


def _logprob_gap(a: list[float], b: list[float]) -> dict:
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"mean": round(statistics.fmean(gaps), 5), "max": round(max(gaps), 5)}


def compare_scored(record: dict, reference: dict | None = None) -> dict | None:
    """The logprobs of ``record``'s scored tokens: sent alone against sent among the concurrent
    requests (``self``, the server's own batch noise), and against ``reference``'s on the same
    contexts, each sent alone (``against_reference``); mean and max absolute difference (nats).
    None where ``record`` lacks them."""
    results = record["results"]
    alone = results.get("scored_4096", {}).get("scored")
    if alone is None:
        return None
    report: dict = {}
    batched = results.get("scored_4096_batched", {}).get("scored")
    if batched is not None:
        report["self"] = _logprob_gap(alone, batched)
    if reference is not None:
        other = reference["results"].get("scored_4096", {}).get("scored")
        if other is not None:
            report["against_reference"] = _logprob_gap(alone, other)
    return report


def print_comparison(names: list[str], records: list[dict]) -> dict:
    """Print the agreement of every record with the first (per phase) and each server's figures;
    returns the report."""
    report = {"reference": names[0], "servers": {}}
    ref = records[0]
    for name, record in zip(names, records, strict=True):
        entry = {
            "throughput_tok_per_s": throughput(record),
            "errors": len(record["errors"]),
            "preemptions": _counter(record, "preemption", "vllm:num_preemptions_total"),
            "prefix_cache_hits": _counter(record, "prefix", "vllm:prefix_cache_hits_total"),
            "speculation": acceptance(record),
        }
        if record is not ref:
            entry["agreement"] = compare(ref, record)
        scored = compare_scored(record, None if record is ref else ref)
        if scored is not None:
            entry["scored"] = scored
        report["servers"][name] = entry
    print(f"reference: {names[0]}; near-tie: reference top-1 - top-2 logprob < {NEAR_TIE}")
    print(
        f"{'server':>10} {'phase':>11} {'requests':>8} {'identical':>9} {'near-tie':>8} "
        f"{'different':>9} {'missing':>7}"
    )
    for name, entry in report["servers"].items():
        for phase, row in entry.get("agreement", {}).get("phases", {}).items():
            print(
                f"{name:>10} {phase:>11} {row['requests']:>8} {row['identical']:>9} "
                f"{row['near_tie']:>8} {row['different']:>9} {row['missing']:>7}"
            )
    for name, entry in report["servers"].items():
        if "scored" in entry:
            rows = ", ".join(
                f"{what} mean {gap['mean']:.4f} max {gap['max']:.4f}"
                for what, gap in entry["scored"].items()
            )
            print(f"{name:>10}: |logprob difference| of the {SCORED} scored tokens: {rows}")
    for name, entry in report["servers"].items():
        print(
            f"{name:>10}: throughput {entry['throughput_tok_per_s']} tok/s, errors "
            f"{entry['errors']}, preemptions {entry['preemptions']}, prefix-cache hits "
            f"{entry['prefix_cache_hits']}"
        )
        if entry["speculation"]:
            spec = entry["speculation"]
            print(
                f"{name:>10}: {spec['drafts']} drafts, {spec['accepted_tokens']} of "
                f"{spec['draft_tokens']} draft tokens accepted ({spec['rate']:.1%}), mean "
                f"acceptance length {spec['mean_length']}"
            )
    return report


def throughput(record: dict) -> float | None:
    """Median new tokens/s over the timed throughput runs of ``record`` (None without any)."""
    rates = [v["tok_per_s"] for k, v in record["phases"].items() if k.startswith("throughput")]
    return statistics.median(rates) if rates else None


def _counter(record: dict, phase: str, name: str) -> float | None:
    """How much the server's counter ``name`` grew during ``phase`` (None if not reported)."""
    return record["phases"].get(phase, {}).get("counters", {}).get(name)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.e2e.serve_check")
    sub = parser.add_subparsers(dest="command", required=True)
    ckpt = sub.add_parser("checkpoint", help="write the tiny checkpoint vLLM serves")
    ckpt.add_argument("directory")
    ckpt.add_argument(
        "--mtp-layers",
        type=int,
        default=None,
        help="MTP draft layers in the checkpoint (default 1; 0: none)",
    )
    ckpt.add_argument(
        "--draftable",
        action="store_true",
        help="layers scaled down and a draft that predicts the embedding's next token "
        "(tiny_model.DRAFTABLE_SPEC): for measuring speculation",
    )
    ckpt.add_argument(
        "--dspark",
        action="store_true",
        help="the DSpark draft instead of MTP layers (one checkpoint holds one of them)",
    )
    ckpt.add_argument(
        "--v41",
        action="store_true",
        help="the tiny DeepSeek-V4.1 (Engram, tokenizer) instead of DeepSeek-V4; its only draft "
        "is DSpark (--dspark, with --draftable one that drafts the bigram)",
    )
    q = sub.add_parser("query", help="send the request set to a running server")
    q.add_argument("--name", required=True)
    q.add_argument("--port", type=int, required=True)
    q.add_argument("--model", required=True, help="the served model path (request 'model')")
    q.add_argument("--wait", type=float, default=420)
    q.add_argument("--pid", type=int, help="the server's pid: stop waiting if it exits")
    q.add_argument("--out", required=True)
    q.add_argument("--skip", default="", help="phases not to send, comma-separated")
    q.add_argument("--seed", type=int, default=2026, help="prompt seed (another: no cache hits)")
    c = sub.add_parser("compare", help="compare servers' records with the first one")
    c.add_argument("records", nargs="+")
    c.add_argument("--json")
    args = parser.parse_args(argv)
    if args.command == "checkpoint":
        from dsv4_attn.e2e.tiny_model import DRAFTABLE_SPEC, VLLM_SPEC, save_vllm_checkpoint

        if args.mtp_layers is not None and args.mtp_layers < 0:
            raise SystemExit(f"--mtp-layers must be >= 0, got {args.mtp_layers}")
        if args.v41 and (args.mtp_layers or (args.draftable and not args.dspark)):
            # V4.1 has no MTP (vLLM refuses method "mtp" on it): its draftable variant is for
            # the DSpark draft
            raise SystemExit(
                "--v41 writes no draft but DSpark: no --mtp-layers with --v41, and --draftable "
                "only with --dspark"
            )
        spec = DRAFTABLE_SPEC if args.draftable else VLLM_SPEC
        if args.v41 or args.dspark:
            mtp_layers = 0
        else:
            mtp_layers = 1 if args.mtp_layers is None else args.mtp_layers
        family = "v41" if args.v41 else "v4"
        path = save_vllm_checkpoint(
            args.directory, spec, mtp_layers, dspark=args.dspark, family=family
        )
        print(f"checkpoint: {path}")
    elif args.command == "query":
        server = Server(args.port, args.model)
        waited = server.wait(args.wait, args.pid)
        print(f"{args.name}: up after {waited:.0f} s", flush=True)
        skip = {phase for phase in args.skip.split(",") if phase}
        plan = [r for r in request_plan(args.seed) if r.phase not in skip]
        record = {"name": args.name, "skipped": sorted(skip), **query(server, plan)}
        Path(args.out).write_text(json.dumps(record))
        if record["errors"]:
            print(f"{args.name}: {len(record['errors'])} requests failed", file=sys.stderr)
    else:
        records = [json.loads(Path(p).read_text()) for p in args.records]
        names = [r["name"] for r in records]
        report = print_comparison(names, records)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
