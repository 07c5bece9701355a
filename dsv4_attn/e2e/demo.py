"""``python -m dsv4_attn demo``: greedy decoding of a tiny DeepSeek-V4 through this package.

Builds (or loads) the tiny random-weight model, runs HF's eager attention as the oracle, then
each requested KV-cache format through :func:`dsv4_attn.ops.sparse_attention`, and prints the
agreement, which attention backend ran (or why it fell back) and tokens/s. Runs on CPU or GPU
with no download.

``--shape flash [--layers N]`` runs V4-Flash's attention at its real shapes instead
(:mod:`dsv4_attn.e2e.real_shapes`, the first N of its 43 layers, fp32 weights drawn in memory):
how far our path is from HF's attention on the very rows the cache stores, and how far cache
rounding alone moves the logits of a model of that size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path

import torch

from dsv4_attn.e2e import harness
from dsv4_attn.e2e.tiny_model import LAYER_TYPES, TinySpec, build_model, load_or_build
from dsv4_attn.kv_cache import KVFormat

__all__ = ["add_arguments", "default_model_dir", "main", "run"]

_SHORT = {
    "sliding_attention": "SWA",
    "compressed_sparse_attention": "CSA",
    "heavily_compressed_attention": "HCA",
}


def default_model_dir(spec: TinySpec) -> Path:
    """Where the demo keeps its checkpoint: ``$XDG_CACHE_HOME/dsv4_attn/...`` (or ~/.cache)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dsv4_attn" / f"tiny-deepseek-v4-h{spec.num_heads}-seed{spec.seed}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument(
        "--shape",
        default="tiny",
        choices=["tiny", "flash"],
        help="tiny: the demo's 4-layer model; flash: V4-Flash's attention at its real shapes "
        "(dsv4_attn.e2e.real_shapes: hidden 4096, 64 heads, CSA top-512, built in memory on "
        "--device in fp32; 34 GB at 43 layers: a GPU)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="with --shape flash: the first N layers of V4-Flash's schedule (default all 43)",
    )
    parser.add_argument(
        "--kv-format",
        default="all",
        choices=["all"] + [f.value for f in _FORMAT_ORDER],
        help="KV-cache format(s) to run through the backend (default: all three)",
    )
    parser.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)"
    )
    parser.add_argument(
        "--heads", type=int, default=None, help="query heads (default: 64 on cuda, 8 on cpu)"
    )
    parser.add_argument(
        "--seeds",
        default=str(harness.CASE_SEED),
        help=f"comma-separated model/prompt seeds, e.g. 0,1,2 (default {harness.CASE_SEED}, "
        "the tests' case)",
    )
    parser.add_argument("--prompt-len", type=int, default=harness.PROMPT_LEN)
    parser.add_argument("--new-tokens", type=int, default=harness.NEW_TOKENS)
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "cutedsl", "sdpa", "reference"],
        help="dsv4_attn.ops backend (auto: the kernel where it supports the case)",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="checkpoint folder to load or create (default: under ~/.cache/dsv4_attn)",
    )
    parser.add_argument(
        "--no-save", action="store_true", help="build the model in memory, write nothing"
    )
    parser.add_argument(
        "--no-sim", action="store_true", help="skip the storage-matched oracle runs (faster)"
    )
    parser.add_argument(
        "--rounding-control",
        action="store_true",
        help="also run the storage-matched oracle with q and output in fp32: how far a "
        "rounding-level change moves a correct run's logits (the yardstick for our path's)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: this model is too small to gain from more, and "
        "spinning OpenMP threads slow it down badly on a busy machine)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds):
        raise SystemExit(f"--seeds must list non-negative integers, got {text!r}")
    return seeds


def _describe_layers(layer_types: list[str]) -> str:
    """``SWA | CSA | HCA | HCA`` for a few layers, counts per kind for many."""
    short = [_SHORT[t] for t in layer_types]
    if len(short) <= 8:
        return " | ".join(short)
    counts = Counter(short)
    return f"{len(short)} (" + ", ".join(f"{counts[k]} {k}" for k in dict.fromkeys(short)) + ")"


def _rounding_spread(model, oracle: harness.OracleRun, fmt: KVFormat) -> dict:
    """How far a rounding-level change moves a correct run's logits: the storage-matched
    oracle teacher-forced over the oracle's tokens with q and output in bf16 (as our path has
    them) against the same with both in fp32. Our path's distance from the storage-matched
    oracle is judged against it."""
    from dsv4_attn.e2e.attention_route import simulate_kv_format

    prompt_len = oracle.prompt.shape[1]
    with simulate_kv_format(model, fmt):
        bf16_ops = harness.teacher_forced(model, oracle.sequence, prompt_len)
    with simulate_kv_format(model, fmt, q_dtype=None, round_output=False):
        fp32_ops = harness.teacher_forced(model, oracle.sequence, prompt_len)
    difference = (bf16_ops.float() - fp32_ops.float()).abs()
    return {
        "max": round(difference.max().item(), 4),
        "median": round(difference.median().item(), 5),
    }


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was requested but torch sees no CUDA device")
    return device


def _backend_summary(stats) -> list[str]:
    """One line per backend with its calls, then the distinct fallback reasons."""
    by_backend: Counter = Counter()
    phases: dict[str, Counter] = {}
    for (phase, backend), n in stats.calls.items():
        by_backend[backend] += n
        phases.setdefault(backend, Counter())[phase] += n
    lines = []
    for backend, n in sorted(by_backend.items()):
        parts = ", ".join(f"{k} {v}" for k, v in sorted(phases[backend].items()))
        name = {"cutedsl": "CuTeDSL kernel", "sdpa": "SDPA fallback"}.get(backend, backend)
        lines.append(f"{name}: {n} calls ({parts})")
    for reason in stats.fallback_reasons:
        lines.append(f"fallback reason: {reason}")
    return lines


def _report_json(report: harness.FormatReport) -> dict:
    def agreement(a):
        return None if a is None else a.__dict__

    return {
        "format": report.fmt.value,
        "tokens": report.ours.tokens.tolist(),
        "tokens_per_s": report.ours.tokens_per_s,
        "greedy_vs_oracle": agreement(report.vs_oracle),
        "greedy_vs_storage_matched_oracle": agreement(report.vs_sim),
        "teacher_forced_vs_oracle": agreement(report.tf_vs_oracle),
        "teacher_forced_vs_storage_matched_oracle": agreement(report.tf_vs_sim),
        "storage_matched_oracle_vs_oracle": agreement(report.tf_sim_vs_oracle),
        "storage_matched_teacher_forcing_reproduces_greedy": (
            report.sim_teacher_forcing_reproduces_greedy
        ),
        "backend_calls": {f"{p}/{b}": n for (p, b), n in report.stats.calls.items()},
        "fallback_reasons": dict(report.stats.fallback_reasons),
        "released_window_pages": report.stats.released_pages,
        "max_compressed_rows": dict(report.stats.max_extra_rows),
    }


_FORMAT_ORDER = (KVFormat.BF16, KVFormat.FP8_DS_MLA, KVFormat.NVFP4)
_ROW = "  {:<11} {:<32} {:<25} {:<42} {:>6}"


def _seed_header(out) -> None:
    out(
        _ROW.format(
            "run",
            "greedy tokens vs oracle",
            "teacher-forced vs oracle",
            "vs storage-matched oracle: greedy; steps",
            "tok/s",
        )
    )


def _format_row(report: harness.FormatReport) -> str:
    matched = "-"
    if report.vs_sim is not None and report.tf_vs_sim is not None:
        greedy = report.vs_sim.describe().split(" (")[0]
        tf = report.tf_vs_sim
        matched = f"{greedy}; {tf.matching_steps}/{tf.positions}, max {tf.max_error:.4f}"
    return _ROW.format(
        report.fmt.value,
        report.vs_oracle.describe(),
        report.tf_vs_oracle.describe(),
        matched,
        f"{report.ours.tokens_per_s:.1f}",
    )


def _summary(reports_by_seed: dict[int, list[harness.FormatReport]], out) -> None:
    """Across seeds, per format: how often the greedy runs are identical to the storage-matched
    oracle, how many teacher-forced steps pick its token, and the worst errors."""
    out(f"\nsummary over seeds {', '.join(str(s) for s in reports_by_seed)}:")
    by_format: dict[KVFormat, list[harness.FormatReport]] = {}
    for reports in reports_by_seed.values():
        for report in reports:
            by_format.setdefault(report.fmt, []).append(report)
    for fmt, reports in by_format.items():
        line = f"  {fmt.value:<11} teacher-forced vs oracle: worst top-1 " + (
            f"{100 * min(r.tf_vs_oracle.top1 for r in reports):.1f}%, worst max "
            f"{max(r.tf_vs_oracle.max_error for r in reports):.4f}"
        )
        matched = [r for r in reports if r.vs_sim is not None and r.tf_vs_sim is not None]
        if matched:
            identical = sum(r.vs_sim.identical for r in matched)
            steps = sum(r.tf_vs_sim.matching_steps for r in matched)
            total = sum(r.tf_vs_sim.positions for r in matched)
            worst = max(r.tf_vs_sim.max_error for r in matched)
            line += (
                f"; vs storage-matched: greedy identical {identical}/{len(matched)} runs, "
                f"steps {steps}/{total}, worst max {worst:.4f}"
            )
        out(line)


def run(args: argparse.Namespace, out=print) -> dict:
    """Run the demo for ``args`` (see :func:`add_arguments`); returns the results as a dict."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # keep the summary compact
    device = _resolve_device(args.device)
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    threads = args.threads
    torch.set_num_threads(threads)
    flash = args.shape == "flash"
    if args.layers is not None and not flash:
        raise SystemExit("--layers applies to --shape flash only")
    if flash and args.heads is not None:
        raise SystemExit("--heads applies to --shape tiny only (V4-Flash has 64 heads)")
    heads = 64 if flash else args.heads or (64 if device.type == "cuda" else 8)
    formats = list(_FORMAT_ORDER) if args.kv_format == "all" else [KVFormat(args.kv_format)]
    seeds = _parse_seeds(args.seeds)
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    )
    if flash:
        from dsv4_attn.e2e.real_shapes import FLASH_LAYER_TYPES, flash_config

        layers = len(FLASH_LAYER_TYPES) if args.layers is None else args.layers
        try:
            config = flash_config(layers=layers)
        except ValueError as error:
            raise SystemExit(f"--{error}") from None
        layer_types, topk, name = config.layer_types, config.index_topk, "V4-Flash-shaped"
    else:
        layer_types, topk, name = list(LAYER_TYPES), TinySpec().index_topk, "tiny"
    out(
        f"dsv4-attn demo: {name} random-weight DeepSeek-V4 "
        f"(transformers {transformers.__version__} DeepseekV4ForCausalLM)"
    )
    out(
        f"  layers {_describe_layers(layer_types)}; {heads} heads x 512, window 128, "
        f"CSA top-{topk}, HCA ratio 128"
    )
    out(
        f"  {device} ({device_name or 'cpu'}), torch {torch.__version__}, {threads} CPU threads; "
        f"prompt {args.prompt_len} tokens -> {args.new_tokens} generated, greedy"
    )
    out("  oracle: HF eager attention, fp32. storage-matched oracle: HF eager attention on the")
    out("    rows the cache stores (FP8/NVFP4 round trip), q and output in bf16 like our path.")
    out("  split@N (margin m): first differing greedy step; m = the reference's top-1 minus top-2")
    out("    logit there. teacher-forced: our path fed the oracle's tokens; top-1 agreement and")
    std = "logit std ~1.3" if flash else "logit std ~0.3"
    out(f"    max |logit difference| ({std}); an error <= max can flip a step only if")
    out("    m < 2 x max, so near-ties (tiny m) split correct runs of a random-weight model.")
    out("  steps: our path fed the storage-matched oracle's own greedy tokens; the steps at which")
    out("    it picks that oracle's token (a near-tie costs one step, not the rest of the run).")
    results: dict = {
        "device": str(device),
        "device_name": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "heads": heads,
        "shape": args.shape,
        "layers": len(layer_types),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "backend": args.backend,
        "seeds": {},
    }
    reports_by_seed: dict[int, list[harness.FormatReport]] = {}
    for seed in seeds:
        start = time.perf_counter()
        if flash:
            # fp32 like the tiny model: the oracle's precision
            model = build_model(config, seed, device, dtype=torch.float32)
            path, how, vocab_size = None, "built in memory on " + str(device), config.vocab_size
        else:
            spec = TinySpec(seed=seed, num_heads=heads)
            path = None
            if not args.no_save:
                path = default_model_dir(spec)
                if args.model_dir:
                    path = Path(args.model_dir)
                    path = path / f"h{heads}-seed{seed}" if len(seeds) > 1 else path
            model, loaded = load_or_build(path, spec)
            model = model.to(device)
            how = "in memory" if path is None else ("loaded from" if loaded else "built, saved to")
            vocab_size = spec.vocab_size
        out(f"\nseed {seed}: model {how} {path or ''} ({time.perf_counter() - start:.1f} s)")
        prompt = harness.make_prompt(vocab_size, args.prompt_len, seed=seed)
        oracle = harness.run_oracle(model, prompt, args.new_tokens)
        _seed_header(out)
        out(_ROW.format("HF eager", "(the oracle)", "", "", f"{oracle.greedy.tokens_per_s:.1f}"))
        seed_results: dict = {
            "oracle_tokens": oracle.greedy.tokens.tolist(),
            "oracle_tokens_per_s": oracle.greedy.tokens_per_s,
            "formats": {},
        }
        reports = []
        for fmt in formats:
            report = harness.run_format(
                model,
                oracle,
                fmt,
                backend=args.backend,
                sim_greedy=not args.no_sim,
                sim_teacher_forced=not args.no_sim,
                seed=seed,
            )
            reports.append(report)
            seed_results["formats"][fmt.value] = _report_json(report)
            out(_format_row(report))
            if args.rounding_control:
                spread = _rounding_spread(model, oracle, fmt)
                seed_results["formats"][fmt.value]["rounding_control"] = spread
                out(
                    f"  {'':<11} rounding control: the storage-matched oracle with q and output "
                    f"in fp32 instead of bf16 moves its logits by up to {spread['max']:.4f} "
                    f"(median {spread['median']:.5f})"
                )
        # One block per distinct backend summary (usually all formats share one).
        summaries: dict[tuple[str, ...], list[str]] = {}
        for report in reports:
            summaries.setdefault(tuple(_backend_summary(report.stats)), []).append(report.fmt.value)
        for lines, names in summaries.items():
            out(f"  attention in the greedy run ({', '.join(names)}):")
            for line in lines:
                out(f"    {line}")
        tokens = " ".join(str(t) for t in reports[0].ours.tokens.tolist())
        out(f"  tokens ({reports[0].fmt.value} path): {tokens}")
        results["seeds"][str(seed)] = seed_results
        reports_by_seed[seed] = reports
        if args.json:  # after every seed, so an interrupted run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if len(seeds) > 1:
        _summary(reports_by_seed, out)
    if args.json:
        out(f"\nresults written to {args.json}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv4-attn demo", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0
