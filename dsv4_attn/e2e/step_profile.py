"""Where a served step's time goes, from a torch-profiler trace of a ``vllm serve`` worker.

    python -m dsv4_attn.e2e.step_profile TRACE.json[.gz] [--json OUT] [--top 12]

vLLM's worker, started with ``--profiler-config '{"profiler": "torch", ...}'`` and driven with
``POST /start_profile`` / ``/stop_profile``, writes a Chrome trace in which each engine step is
a CPU range named ``execute_context_C(c)_generation_G(g)`` (C prefill requests of c tokens, G
decode requests of g tokens). Every GPU kernel carries the correlation id of the CPU launch
(a kernel launch, or the CUDA-graph launch that replays it); the launch lies inside its step's
range. So each kernel is charged to its step, and per kind of step —

* ``decode``: decode requests only (what vLLM's FULL CUDA graphs run);
* ``mixed``: a prefill chunk beside decodes (run eagerly, layer by layer);
* ``prefill``: prefill requests only —

it reports the medians of: the step's CPU time (its range), the GPU time of its kernels, and the
share of attention in it (kernels whose names match :data:`ATTENTION`: this project's decode,
combine and prefill kernels and metadata writers, FlashMLA's, vLLM's sparse-attention
indexer and compressor kernels), plus the kernels taking the most GPU time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ATTENTION", "Step", "attention_kernel", "load_trace", "summarize"]

_STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
ATTENTION = re.compile(
    r"sparse_decode|SparseDecode|split_combine|Combine|fmha|Fmha|FMHA|flash_fwd|flashmla|"
    r"flash_mla|FlashMLA|sparse_attn|mla_|_mla|indexer|Indexer|mqa_logits|compressor|"
    r"Compressor|kv_writers|insert_swa|store_staged|step_metadata|row_slots|entry_slots|"
    r"swa_indices|hca_|decode_schedule|gather_rows|index_lists",
)
"""GPU kernels counted as attention: everything the DeepSeek-V4 attention layer launches beyond
its projections (both backends' attention kernels, their cache writers and metadata, vLLM's
indexer and compressor)."""
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Step:
    """One engine step: its CPU range and what it scheduled."""

    pid: int
    start_us: float
    end_us: float
    prefill_requests: int
    prefill_tokens: int
    decode_requests: int
    decode_tokens: int
    gpu_us: float = 0.0
    attention_us: float = 0.0

    @property
    def kind(self) -> str:
        if self.prefill_requests == 0:
            return "decode"
        return "prefill" if self.decode_requests == 0 else "mixed"


def attention_kernel(name: str) -> bool:
    """Whether a GPU kernel of this name is part of attention (:data:`ATTENTION`)."""
    return ATTENTION.search(name) is not None


def load_trace(path: str | Path) -> dict:
    """A Chrome trace (``.json`` or ``.json.gz``) as a dict with ``traceEvents``."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}


def _steps(events: list[dict]) -> list[Step]:
    steps = []
    for event in events:
        match = _STEP.match(str(event.get("name", "")))
        if match and event.get("ph") == "X":
            counts = [int(g) for g in match.groups()]
            start = float(event["ts"])
            steps.append(Step(event["pid"], start, start + float(event["dur"]), *counts))
    return sorted(steps, key=lambda s: s.start_us)


def _step_of_launches(events: list[dict], steps: list[Step]) -> dict[int, Step]:
    """Correlation id -> the step whose CPU range holds the launch of that id."""
    by_pid: dict[int, list[Step]] = defaultdict(list)
    for step in steps:
        by_pid[step.pid].append(step)
    owner: dict[int, Step] = {}
    for event in events:
        if event.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        correlation = (event.get("args") or {}).get("correlation")
        if correlation is None:
            continue
        ts = float(event["ts"])
        for step in by_pid.get(event["pid"], ()):
            if step.start_us <= ts <= step.end_us:
                owner[correlation] = step
                break
    return owner


def summarize(trace: dict, top: int = 12) -> dict:
    """Per kind of step: how many, medians of CPU time, GPU time, attention's GPU time and
    share; and the kernels with the most GPU time in each kind."""
    events = trace.get("traceEvents", [])
    steps = _steps(events)
    owner = _step_of_launches(events, steps)
    per_kernel: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if event.get("cat") not in _GPU_CATEGORIES or event.get("ph") != "X":
            continue
        step = owner.get((event.get("args") or {}).get("correlation"))
        if step is None:
            continue
        dur = float(event.get("dur", 0.0))
        step.gpu_us += dur
        name = str(event.get("name", ""))
        if attention_kernel(name):
            step.attention_us += dur
        per_kernel[step.kind][name] += dur
    kinds: dict[str, dict] = {}
    for kind in ("decode", "mixed", "prefill"):
        chosen = [s for s in steps if s.kind == kind and s.gpu_us > 0]
        if not chosen:
            continue
        gpu_total = sum(s.gpu_us for s in chosen)
        kernels = sorted(per_kernel[kind].items(), key=lambda kv: -kv[1])[:top]
        kinds[kind] = {
            "steps": len(chosen),
            "median_cpu_us": statistics.median(s.end_us - s.start_us for s in chosen),
            "median_gpu_us": statistics.median(s.gpu_us for s in chosen),
            "median_attention_us": statistics.median(s.attention_us for s in chosen),
            "attention_share": sum(s.attention_us for s in chosen) / gpu_total,
            "median_decode_requests": statistics.median(s.decode_requests for s in chosen),
            "median_prefill_tokens": statistics.median(s.prefill_tokens for s in chosen),
            "top_kernels": [
                {"name": name[:120], "share": dur / gpu_total, "attention": attention_kernel(name)}
                for name, dur in kernels
            ],
        }
    return {"steps": len(steps), "kinds": kinds}


def _print(summary: dict) -> None:
    print(f"{summary['steps']} steps in the trace")
    for kind, row in summary["kinds"].items():
        print(
            f"{kind}: {row['steps']} steps; medians: CPU {row['median_cpu_us']:.0f} us, GPU "
            f"{row['median_gpu_us']:.0f} us, attention {row['median_attention_us']:.0f} us "
            f"({100 * row['attention_share']:.1f}% of GPU time); "
            f"{row['median_decode_requests']:.0f} decodes, "
            f"{row['median_prefill_tokens']:.0f} prefill tokens"
        )
        for kernel in row["top_kernels"]:
            mark = "A" if kernel["attention"] else " "
            print(f"   {mark} {100 * kernel['share']:5.1f}%  {kernel['name']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.e2e.step_profile")
    parser.add_argument("trace", help="a worker's torch-profiler trace (.json or .json.gz)")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    summary = summarize(load_trace(args.trace), args.top)
    _print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
