"""``vllm bench serve`` against vLLM's own backend and DSV4_NVFP4 (fp8, NVFP4) on one layout.

    python -m dsv4_attn.e2e.bench_serve --model CKPT --layout tp1 --out DIR \
        [--servers vllm,fp8,nvfp4] [--cases a,b] [--only NAMES] [--greedy]

For each server, one after the other: ``vllm serve CKPT`` with the layout's parallel flags and the
server's backend flags (defaults otherwise: CUDA graphs, chunked prefill, prefix caching), wait
until it answers, read the KV capacity it reports, run every case with ``vllm bench serve``
(random dataset, ``--ignore-eos``), read vLLM's preemption counter around each, stop it. Per
server ``DIR/<layout>_<server>.json``; ``DIR/<layout>_summary.json`` and a printed table at the
end. The cases (:func:`plan_cases`):

* ``a``: 8192 input / 1024 output tokens at concurrency 1, 16 and 64;
* ``b``: 65536 input / 1024 output at the concurrency that fills vLLM's backend's KV cache
  (the tokens it reports / 66560) and at 1.5x that, where a server with more capacity keeps
  more requests running. The reference capacity is read from ``DIR/<layout>_vllm.json``, so run
  the ``vllm`` server first (or in an earlier call). Each request needs 64 prompt tokens per
  output token, so the prefill bounds the output rate of every server alike;
* ``c``: 32768 input / 4096 output, one wave of 1.5x the requests vLLM's backend's cache holds
  (its tokens / 36864): decoding bounds the output rate, so a server that holds more of them at
  once finishes sooner.
* ``d``: long contexts (``--long-contexts``, default 128K tokens: prompt plus ``--long-output``
  tokens), ``--long-waves`` waves of 1.5x the requests vLLM's backend holds at once at that
  context, *measured*: before the case, vLLM's server is offered more requests of that length
  than it can hold (:func:`dsv4_attn.e2e.capacity_finder.find_capacity`, step
  ``capacity_<case>``), and the others read its figure from its record; or given
  (``--long-capacity``, e.g. :func:`dsv4_attn.vllm_glue.capacity.requests_at_once`'s
  prediction), which the case's own samples then check. vLLM's "KV cache size" line does not
  tell it (see :mod:`dsv4_attn.e2e.capacity_finder`).

During every case each server's ``/metrics`` is sampled (requests running and waiting, KV
usage, preemptions, tokens generated and prefilled): ``requests_at_once`` in its record, where
``held_while_waiting`` is what the server ran while others waited and ``while_waiting`` its
output and prompt tokens per second meanwhile (beyond capacity, without the ramp and the tail).

With ``--greedy`` each fresh server first answers the greedy-agreement set
(:func:`dsv4_attn.e2e.serve_check.greedy_plan`: prompts of 4K, 32K and the longest that fits,
then 16 concurrent ones, top-2 logprobs), compared token by token with the first server's at the
end (``DIR/<layout>_greedy.json``; a first difference where the reference's top-1 - top-2
margin is under ``serve_check.NEAR_TIE`` is a near-tie).

With ``--profile CASE`` the servers run vLLM's torch profiler on their workers (no stacks),
started and stopped around that case; :mod:`dsv4_attn.e2e.step_profile` then says, per kind of
step (decode only, prefill beside decodes), how its GPU time splits and how much is attention.

With ``--turns DIR`` the servers share one GPU: each process starts its server at once, then
takes its turn at each step (the greedy set, then each case) server by server, step by step
(:class:`dsv4_attn.e2e.turns.Turns`), so that no two benchmarks share the GPU.

The checkpoint needs a tokenizer (``python -m dsv4_attn.e2e.real_shapes`` writes one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from dsv4_attn.e2e.capacity_finder import MetricsSampler, find_capacity
from dsv4_attn.e2e.capacity_finder import summarize as summarize_samples
from dsv4_attn.e2e.serve_check import Server, greedy_plan, print_comparison, query
from dsv4_attn.e2e.turns import Turns

__all__ = [
    "LAYOUTS",
    "SERVERS",
    "Case",
    "bench_command",
    "case_seed",
    "checkpoint_vocab",
    "compare_greedy",
    "kv_tokens",
    "log_errors",
    "long_case_name",
    "main",
    "plan_cases",
    "plan_long_case",
    "profile_summary",
    "profiler_config",
    "summarize",
    "write_summary",
]

LAYOUTS = {
    "tp1": [],
    "tp2": ["--tensor-parallel-size", "2"],
    "tp4": ["--tensor-parallel-size", "4"],
    "tp8": ["--tensor-parallel-size", "8"],
    "dp2ep": ["--data-parallel-size", "2", "--enable-expert-parallel"],
    "dp4ep": ["--data-parallel-size", "4", "--enable-expert-parallel"],
    "dp8ep": ["--data-parallel-size", "8", "--enable-expert-parallel"],
}
SERVERS = {
    "vllm": [],
    "fp8": ["--attention-backend", "DSV4_NVFP4", "--kv-cache-dtype", "fp8"],
    "nvfp4": ["--attention-backend", "DSV4_NVFP4"],
}
LONG_INPUT, OUTPUT = 65536, 1024
DECODE_INPUT, DECODE_OUTPUT = 32768, 4096
"""Set c: long outputs on long contexts (a reasoning model's answer), where decoding, not the
prefill, bounds the output rate, so the requests a KV cache holds at once set it."""
TURN_TIMEOUT_S = 4 * 3600.0
"""The longest a server waits for its turn (the other servers' steps before it)."""


@dataclass(frozen=True)
class Case:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int


LONG_CONTEXTS = (131072,)
LONG_OUTPUT = 2048
BEYOND = 1.5
"""Beyond-capacity cases offer this many times the requests vLLM's backend holds at once."""


def long_case_name(context: int) -> str:
    """The name of set d's case at ``context`` tokens (prompt plus output), e.g. ``d_128k``."""
    return f"d_{context // 1024}k" if context % 1024 == 0 else f"d_{context}"


def plan_long_case(context: int, output: int, reference_capacity: int, waves: int = 1) -> Case:
    """Set d's case at ``context`` tokens: prompts of ``context - output`` tokens, ``output``
    tokens each, at a concurrency of :data:`BEYOND` x ``reference_capacity`` (vLLM's backend's
    measured requests at once), ``waves`` times that many prompts."""
    if not 0 < output < context:
        raise ValueError(f"the output ({output}) must be shorter than the context ({context})")
    if not isinstance(reference_capacity, int) or reference_capacity < 1:
        raise ValueError(
            f"set d needs the requests vLLM's backend holds at {context} tokens, measured "
            f"(>= 1), got {reference_capacity!r}"
        )
    if waves < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    c = math.ceil(BEYOND * reference_capacity)
    return Case(long_case_name(context), context - output, output, c, waves * c)


def plan_cases(which: str, reference_kv_tokens: int | None) -> list[Case]:
    """The cases of set ``which`` (``a``, ``b`` or ``c``); ``b`` and ``c`` need the reference
    server's KV capacity in tokens. (Set d's cases need a measured capacity:
    :func:`plan_long_case`.)"""
    if which == "a":
        return [Case(f"a_8k_c{c}", 8192, OUTPUT, c, max(4, 2 * c)) for c in (1, 16, 64)]
    if which not in ("b", "c"):
        raise ValueError(f"case set must be 'a', 'b' or 'c', got {which!r}")
    if not reference_kv_tokens or reference_kv_tokens < 1:
        raise ValueError(
            f"set {which} needs the KV capacity vLLM's backend reported: run the vllm "
            f"server first (got {reference_kv_tokens!r})"
        )
    if which == "c":  # decode-bound: one wave of 1.5x the requests the reference holds
        full = max(1, reference_kv_tokens // (DECODE_INPUT + DECODE_OUTPUT))
        c = math.ceil(1.5 * full)
        return [Case(f"c_32k_4k_c{c}", DECODE_INPUT, DECODE_OUTPUT, c, c)]
    full = max(1, reference_kv_tokens // (LONG_INPUT + OUTPUT))
    return [
        Case(f"b_64k_c{c}", LONG_INPUT, OUTPUT, c, 2 * c)
        for c in dict.fromkeys((full, math.ceil(1.5 * full)))
    ]


_KV_LINE = re.compile(r"pid=(\d+)\).*GPU KV cache size: ([\d,]+) tokens")


def kv_tokens(log_text: str) -> int | None:
    """The KV capacity a server reported, in tokens: the sum over its engines (one per
    data-parallel rank; the last report of each)."""
    per_engine = {pid: int(n.replace(",", "")) for pid, n in _KV_LINE.findall(log_text)}
    return sum(per_engine.values()) if per_engine else None


def checkpoint_vocab(model: str | Path) -> int:
    """The vocabulary size of the checkpoint at ``model`` (its ``config.json``: ``vocab_size``,
    or ``text_config.vocab_size`` for DeepSeek-V4.1's nested config): the bound of the prompts'
    token ids. ValueError names the file when neither is there."""
    path = Path(model) / "config.json"
    config = json.loads(path.read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        raise ValueError(f"{path}: no vocab_size (top level or text_config) of 2 or more")
    return vocab


def _vocab(args: argparse.Namespace) -> int:
    """The prompts' token-id bound: ``--vocab``, else the served checkpoint's."""
    return args.vocab if args.vocab is not None else checkpoint_vocab(args.model)


def case_seed(seed: int, case: Case) -> int:
    """The dataset seed of ``case``: the same on every server, another for every case. vLLM's
    random dataset draws the same first prompts from the same seed whatever their length or
    count, so cases sharing one seed would find each other's prompts in the prefix cache, more
    of them on a server with more KV capacity."""
    return (seed * 1_000_003 + zlib.crc32(case.name.encode())) % 2**31


def bench_command(port: int, model: str, case: Case, result_dir: Path, seed: int) -> list[str]:
    return [
        "vllm",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--port",
        str(port),
        "--model",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(case.input_len),
        "--random-output-len",
        str(case.output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(case.num_prompts),
        "--max-concurrency",
        str(case.concurrency),
        "--ignore-eos",
        "--seed",
        str(case_seed(seed, case)),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{case.name}.json",
    ]


def summarize(result: dict) -> dict:
    """The figures the report keeps from one ``vllm bench serve`` result file."""
    keys = (
        "completed",
        "failed",
        "duration",
        "output_throughput",
        "total_token_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "max_concurrent_requests",
    )
    return {k: result.get(k) for k in keys}


_REQUEST_ERROR = re.compile(r"^Error \d+: .*$", re.M)


def request_errors(bench_stdout: str, keep: int = 3) -> list[str]:
    """The first ``keep`` failed requests' errors that ``vllm bench serve`` printed (its result
    file keeps only the count)."""
    return [line[:500] for line in _REQUEST_ERROR.findall(bench_stdout)[:keep]]


def profiler_config(directory: Path, args: argparse.Namespace) -> dict:
    """vLLM's ``--profiler-config``: torch's profiler on the workers only, no Python stacks
    (they inflate host time), ``args.profile_iterations`` engine steps after skipping
    ``args.profile_delay`` (the case's ramp-up)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(directory),
        "torch_profiler_with_stack": False,
        "ignore_frontend": True,
        "delay_iterations": args.profile_delay,
        "max_iterations": args.profile_iterations,
    }


def profile_summary(directory: Path) -> dict:
    """:func:`dsv4_attn.e2e.step_profile.summarize` of every trace the workers wrote into
    ``directory``, by file name (those with engine steps)."""
    from dsv4_attn.e2e.step_profile import load_trace, summarize

    summaries = {}
    for path in sorted(directory.rglob("*.json*")):
        summary = summarize(load_trace(path))
        if summary["steps"]:
            summaries[path.name] = summary
    return summaries


def _preemptions(server: Server) -> float | None:
    try:
        return server.counters().get("vllm:num_preemptions_total")
    except OSError:
        return None


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` whole or not at all: servers benchmarked by separate processes read each
    other's records."""
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)


def write_summary(out: Path, layout: str) -> dict:
    """``DIR/<layout>_summary.json``: the record of every server of :data:`SERVERS` in ``out``
    for ``layout``, whichever process ran it (each process writes it as it ends; the last has
    them all)."""
    summary = {
        name: json.loads(path.read_text())
        for name in SERVERS
        if (path := out / f"{layout}_{name}.json").exists()
    }
    _write_json(out / f"{layout}_summary.json", summary)
    return summary


def _turns(args: argparse.Namespace) -> Turns | None:
    if not args.turns:
        return None
    return Turns(Path(args.turns), args.turn_order.split(","), args.start_after)


@contextmanager
def _turn(turns: Turns | None, steps: list[str], step: str, name: str) -> Iterator[None]:
    """Server ``name``'s turn at ``step`` when servers share a GPU (no-op otherwise)."""
    if turns is None:
        yield
        return
    turns.wait(steps, step, name, TURN_TIMEOUT_S)
    try:
        yield
    finally:
        turns.done(step, name)


def log_errors(log: bytes) -> list[str]:
    """The lines of a server log (raw bytes) that report an error or start a traceback."""
    return re.findall(r"^.*(?:Traceback|ERROR).*$", log.decode(errors="replace"), re.M)


def run_server(args: argparse.Namespace, name: str, out: Path) -> dict:
    port = args.port
    log = out / f"{args.layout}_{name}.log"
    command = [
        "vllm",
        "serve",
        args.model,
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--seed",
        "0",
        *LAYOUTS[args.layout],
        *SERVERS[name],
        *args.serve_args,
    ]
    profile_dir = None
    if args.profile:
        profile_dir = (out / f"profile_{args.layout}_{name}").resolve()
        command += ["--profiler-config", json.dumps(profiler_config(profile_dir, args))]
    record: dict = {"server": name, "layout": args.layout, "command": " ".join(command)}
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Server(port, args.model)
    turns = _turns(args)
    try:
        record["ready_s"] = round(server.wait(args.wait, process.pid), 1)
        record["kv_tokens"] = kv_tokens(log.read_text(errors="replace"))
        # At once: servers benchmarked side by side read vLLM's capacity from here for set b.
        _write_json(out / f"{args.layout}_{name}.json", record)
        if turns is not None:
            turns.up(name)
            record["waited_for_the_others_s"] = round(turns.wait_up(args.wait), 1)
        reference = record["kv_tokens"] if name == "vllm" else args.reference_kv
        if reference is None:
            reference_file = out / f"{args.layout}_vllm.json"
            if reference_file.exists():
                reference = json.loads(reference_file.read_text()).get("kv_tokens")
        cases = [
            case
            for which in args.cases
            if which != "d"
            for case in plan_cases(which, reference)
            if not args.only or case.name in args.only
        ]
        long_contexts = [
            context
            for context in (args.long_contexts if "d" in args.cases else ())
            if not args.only or long_case_name(context) in args.only
        ]
        steps = (["greedy"] if args.greedy else []) + [case.name for case in cases]
        for context in long_contexts:
            given = context in args.long_capacity
            probe = [] if given else [f"capacity_{long_case_name(context)}"]
            steps += [*probe, long_case_name(context)]
        if args.greedy:  # before the load: a fresh server, nothing cached
            with _turn(turns, steps, "greedy", name):
                greedy = {
                    "name": name,
                    **query(server, greedy_plan(_vocab(args), args.max_model_len)),
                }
            (out / f"{args.layout}_{name}_greedy.json").write_text(json.dumps(greedy))
            record["greedy_errors"] = len(greedy["errors"])
        record["cases"] = {}
        for item in [*cases, *long_contexts]:  # in the order of steps
            if isinstance(item, Case):
                case = item
            else:
                case = _long_case(args, name, item, out, turns, steps, record)
            before = _preemptions(server)
            result_dir = out / f"{args.layout}_{name}"
            profiling = profile_dir is not None and case.name == args.profile
            with _turn(turns, steps, case.name, name):
                if profiling:
                    server.post("/start_profile")
                sampler = MetricsSampler(server.base, 1.0).start()
                run = subprocess.run(
                    bench_command(port, args.model, case, result_dir, args.seed),
                    capture_output=True,
                    text=True,
                )
                samples = sampler.stop()
                after = _preemptions(server)
                entry = {"case": asdict(case), "exit": run.returncode}
                entry["requests_at_once"] = summarize_samples(samples)
                if profiling:
                    server.post("/stop_profile")
                    try:
                        entry["profile"] = profile_summary(profile_dir)
                    except Exception as error:  # the case's figures stand without it
                        entry["profile_error"] = f"{type(error).__name__}: {error}"
            result_file = result_dir / f"{case.name}.json"
            if result_file.exists():
                entry.update(summarize(json.loads(result_file.read_text())))
            if not result_file.exists() or entry.get("failed"):
                entry["request_errors"] = request_errors(run.stdout)
                entry["stderr"] = run.stderr[-2000:]
            if before is not None and after is not None:
                entry["preemptions"] = after - before
            record["cases"][case.name] = entry
            print(
                f"{args.layout} {name} {case.name}: {entry.get('output_throughput')} "
                f"tok/s out, TPOT p50 {entry.get('median_tpot_ms')} ms, "
                f"preemptions {entry.get('preemptions')}",
                flush=True,
            )
            _write_json(out / f"{args.layout}_{name}.json", record)
    finally:
        # Where the log stood when the server was told to stop: an engine core that exits
        # before its API server makes the latter log EngineDeadError, with no request in flight.
        stopped_at = log.stat().st_size
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        if turns is not None:
            turns.finished(name)
    text = log.read_bytes()
    record["server_log_errors"] = log_errors(text[:stopped_at])[:10]
    record["server_log_errors_after_stop"] = log_errors(text[stopped_at:])[:10]
    _write_json(out / f"{args.layout}_{name}.json", record)
    return record


def _long_case(args, name: str, context: int, out: Path, turns, steps, record) -> Case:
    """Set d's case at ``context`` for server ``name``: vLLM's backend first measures how many
    requests of that length it holds at once (its turn at ``capacity_<case>``; the figure goes
    into its record, ``capacity``); every server plans the case from that figure. A figure given
    in ``--long-capacity`` replaces the probe."""
    case_name = long_case_name(context)
    given = args.long_capacity.get(context)
    if given is not None:
        # Known beforehand (the planner's prediction): no probe; the case's own gauges show what
        # each server held (requests_at_once).
        return plan_long_case(context, args.long_output, given, args.long_waves)
    measured = None
    with _turn(turns, steps, f"capacity_{case_name}", name):
        if name == "vllm":
            # The token line understates requests at once ~3x at 36K, ~13x at 128K: offer 16x.
            offered = args.probe_requests or max(8, math.ceil(16 * record["kv_tokens"] / context))
            measured = find_capacity(
                args.port,
                args.model,
                context - args.long_output,
                args.long_output,
                offered,
                vocab=_vocab(args),
                seed=args.seed + 7,
            )
            record.setdefault("capacity", {})[case_name] = measured
            _write_json(out / f"{args.layout}_{name}.json", record)
    if measured is None:
        reference = json.loads((out / f"{args.layout}_vllm.json").read_text())
        measured = reference.get("capacity", {}).get(case_name)
        if measured is None:
            raise RuntimeError(f"vLLM's backend has no measured capacity for {case_name}")
    print(
        f"{args.layout} {name} {case_name}: vLLM's backend holds {measured['capacity']} "
        f"requests at once ({measured['bound']}, {measured['seconds']} s)",
        flush=True,
    )
    return plan_long_case(context, args.long_output, measured["capacity"], args.long_waves)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.e2e.bench_serve")
    parser.add_argument("--model", required=True)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp1")
    parser.add_argument("--servers", default="vllm,fp8,nvfp4")
    parser.add_argument("--cases", default="a,b")
    parser.add_argument(
        "--only",
        default="",
        help="run only these cases of the sets, by name (e.g. a_8k_c1,a_8k_c16)",
    )
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--wait", type=float, default=1200.0, help="seconds to wait for a server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference-kv", type=int, help="vLLM's backend's KV tokens (set b)")
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="first send each server the greedy-agreement set (serve_check.greedy_plan: "
        "prompts of 4K, 32K and the longest that fits, 16 concurrent) and compare the servers",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        help="token ids of the prompts are below this (default: the checkpoint's vocab_size)",
    )
    parser.add_argument(
        "--profile",
        metavar="CASE",
        help="profile the workers (torch profiler) during this case, e.g. b_64k_c20, and "
        "summarize where each kind of step's time goes (dsv4_attn.e2e.step_profile)",
    )
    parser.add_argument("--profile-delay", type=int, default=200, help="steps skipped first")
    parser.add_argument("--profile-iterations", type=int, default=40, help="steps profiled")
    parser.add_argument(
        "--turns",
        metavar="DIR",
        help="servers share one GPU: each (its own process) starts at once, then takes its "
        "turns at each step through files in DIR (dsv4_attn.e2e.turns)",
    )
    parser.add_argument(
        "--turn-order", default="vllm,fp8,nvfp4", help="the servers sharing the GPU, in turn"
    )
    parser.add_argument(
        "--start-after",
        metavar="FILE",
        help="with --turns: the first step also waits until FILE exists",
    )
    parser.add_argument(
        "--long-contexts",
        default=",".join(map(str, LONG_CONTEXTS)),
        help="set d: context lengths (prompt + output tokens), comma-separated",
    )
    parser.add_argument("--long-output", type=int, default=LONG_OUTPUT, help="set d: output")
    parser.add_argument(
        "--long-waves", type=int, default=1, help="set d: prompts as waves of the concurrency"
    )
    parser.add_argument(
        "--probe-requests",
        type=int,
        default=0,
        help="set d: requests offered to measure vLLM's capacity (0: 16x its token line's)",
    )
    parser.add_argument(
        "--long-capacity",
        default="",
        help="set d: vLLM's requests at once at each long context, comma-separated in their "
        "order, when known (e.g. dsv4_attn.vllm_glue.capacity.requests_at_once): no probe; "
        "the cases' own gauges show what each server held (empty: probe)",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("serve_args", nargs="*", help="more `vllm serve` flags (after --)")
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    args.long_contexts = [int(c) for c in args.long_contexts.split(",") if c]
    capacities = [int(c) for c in args.long_capacity.split(",") if c]
    if capacities and len(capacities) != len(args.long_contexts):
        raise SystemExit(
            f"--long-capacity {capacities} needs one figure per --long-contexts "
            f"{args.long_contexts}"
        )
    # context: vLLM's requests at once (none given: every context probed)
    args.long_capacity = dict(zip(args.long_contexts, capacities, strict=False))
    too_long = [c for c in args.long_contexts if c > args.max_model_len]
    if "d" in args.cases and too_long:
        raise SystemExit(
            f"--long-contexts {too_long} exceed --max-model-len {args.max_model_len}: raise it"
        )
    args.only = {c for c in args.only.split(",") if c}
    servers = [s for s in args.servers.split(",") if s]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown servers {unknown}: choose from {sorted(SERVERS)}")
    if args.turns:
        order = args.turn_order.split(",")
        if len(set(order)) != len(order) or not set(servers) <= set(order):
            raise SystemExit(
                f"--turn-order {args.turn_order!r} must name each server once, these "
                f"({args.servers!r}) among them"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in servers:
        run_server(args, name, out)
    write_summary(out, args.layout)
    if args.greedy:
        compare_greedy(out, args.layout, servers)


def compare_greedy(out: Path, layout: str, servers: list[str]) -> dict | None:
    """Token-by-token agreement of every server's greedy answers with the first server's
    (``DIR/<layout>_<server>_greedy.json``; vLLM's backend when it ran), printed and written
    to ``DIR/<layout>_greedy.json``. None when fewer than two servers answered."""
    files = [out / f"{layout}_{name}_greedy.json" for name in servers]
    records = [json.loads(f.read_text()) for f in files if f.exists()]
    if len(records) < 2:
        return None
    report = print_comparison([r["name"] for r in records], records)
    (out / f"{layout}_greedy.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
