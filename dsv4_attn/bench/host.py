"""Host time of one eager sparse-decode call: what each attention layer costs the CPU in a step
that runs outside CUDA graphs (every mixed prefill + decode step, layer by layer).

``python -m dsv4_attn.bench host [--batches 1 64] [--formats fp8_ds_mla nvfp4] [--reps 2000]
[--json PATH]``

V4-Flash's decode shape (64 heads, a 128-slot window + 512 compressed entries, one token per
request), the split-KV partials in a caller's workspace as the serving layer passes them. Per
row, the CPU time from a call's start to its return (the GPU idle before each call, so no launch
waits on a full queue), median of ``--reps`` calls, the columns timed in turns (one call of
each per round), for:

* ``ops_us`` — :func:`dsv4_attn.ops.sparse_attention` (``check_values=False``): the public entry,
  which validates every argument and picks the kernel; a serving layer's first decode call;
* ``direct_us`` — :func:`dsv4_attn.kernels.sparse_decode.sparse_attention`: the serving layer's
  later calls, once its first ran the kernel;
* ``launch_us`` — the compiled kernels' own calls alone (the decode kernel, and the combine
  where the keys are split), their arguments prepared beforehand: what no Python around them
  can save;
* ``flashmla_us`` — FlashMLA's ``flash_mla_with_kvcache`` on the same fp8 bytes, its plan made
  once (as vLLM makes it per step): the anchor, in the same process (fp8 rows only).

``--profile DIR`` also writes, per row, the functions that take each call's host time (cProfile
of ``--reps`` calls, sorted by own time) to ``DIR/host_<fmt>_b<batch>_{direct,ops}.txt``.

Device time is not measured here (``bench decode`` does that).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsv4_attn import ops
from dsv4_attn.bench import anchors
from dsv4_attn.bench.timing import format_table, write_json
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.testing import make_decode_case

__all__ = ["COLUMNS", "host_us", "host_us_interleaved", "main"]

HEADS, WINDOW, EXTRA = 64, 128, 512  # V4-Flash
COLUMNS = [
    ("fmt", "format", "s"),
    ("batch", "b", "d"),
    ("ops_us", "ops (us)", ".1f"),
    ("direct_us", "direct (us)", ".1f"),
    ("launch_us", "launch (us)", ".1f"),
    ("flashmla_us", "FlashMLA (us)", ".1f"),
    ("direct_vs_flashmla", "FlashMLA/direct", ".2f"),
    ("ops_vs_flashmla", "FlashMLA/ops", ".2f"),
]

# The clock host_us reads (seconds); a module global so tests can substitute a fake one.
_clock: Callable[[], float] = time.perf_counter


def host_us(call: Callable[[], object], reps: int, warmup: int = 50) -> float:
    """Median CPU time of ``call`` in microseconds, the device synchronized before each call
    (an empty queue: the time is the host's own work and its launches, not a wait)."""
    return host_us_interleaved({"call": call}, reps, warmup)["call"]


def host_us_interleaved(
    calls: dict[str, Callable[[], object]], reps: int, warmup: int = 50
) -> dict[str, float]:
    """:func:`host_us` of each of ``calls``, timed in turns (one call of each per round, in
    order): a drift of the host's speed over the run (its clock, its neighbours) falls on every
    column alike instead of on whichever ran last."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            torch.cuda.synchronize()
            start = _clock()
            call()
            times[name].append(_clock() - start)
    torch.cuda.synchronize()
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def _launch_only(case, out, lse, workspace):
    """The direct call's kernel launches alone, every argument prepared once here."""
    from dsv4_attn.kernels import sparse_decode as sd

    q, window, sink, scale, extra = case.args()
    window, extra = sd._int32_scope(window), sd._int32_scope(extra)
    T, H, _ = q.shape
    splits, tiles = sd.resolve_splits(T, H, sd.key_capacity(window, extra), q.device)
    config = sd.decode_config(window, sink, extra, splits > 1)
    decode = sd._caches()[0].get(config, lambda: sd.build_decode_kernel(config))
    o_dest, lse_dest = out, lse
    combine = None
    if splits > 1:
        o_dest, lse_dest = sd._partials(workspace, *sd.workspace_shape(splits, T, H), q.device)
        combine_config = sd.combine_config_for(
            T * H, sink is not None, False, sd._num_sms(q.device.index or 0)
        )
        combine = sd._caches()[1].get(
            combine_config, lambda: sd.build_combine_kernel(combine_config)
        )
    args = (*sd._input_args(q, window, extra, sink), o_dest, lse_dest, *sd._NOT_BALANCED)
    scale_log2 = float(scale) * math.log2(math.e)

    def launch() -> None:
        decode(*args, scale_log2, splits, tiles)
        if combine is not None:
            combine(o_dest, lse_dest, sink, out, lse, None)

    return launch


def _profile(call: Callable[[], object], reps: int, path: Path) -> None:
    """cProfile of ``reps`` calls of ``call``, the top 30 functions by own time, into ``path``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


def _row(fmt: KVFormat, batch: int, reps: int, flash_mla, profile: Path | None = None) -> dict:
    from dsv4_attn.kernels import sparse_decode

    case = make_decode_case(batch, HEADS, fmt, WINDOW, EXTRA, device="cuda", seed=batch)
    out = torch.empty_like(case.q)
    lse = torch.empty(batch, HEADS, dtype=torch.float32, device="cuda")
    shapes = sparse_decode.workspace_shapes(batch, HEADS, WINDOW + EXTRA, case.q.device)
    workspace = None
    if shapes is not None:  # exact shapes, as the serving layer's scratch
        workspace = tuple(
            torch.empty(shape, dtype=dtype, device="cuda")
            for shape, dtype in zip(shapes, sparse_decode.WORKSPACE_DTYPES, strict=True)
        )
    args = case.args()

    def public() -> None:
        ops.sparse_attention(*args, out=out, lse=lse, workspace=workspace, check_values=False)

    def direct() -> None:
        sparse_decode.sparse_attention(*args, out=out, lse=lse, workspace=workspace)

    public()
    if ops.last_dispatch() != ops.Dispatch("cutedsl", None):
        raise SystemExit(f"the kernel does not run this case: {ops.last_dispatch()}")
    calls = {
        "ops_us": public,
        "direct_us": direct,
        "launch_us": _launch_only(case, out, lse, workspace),
    }
    if flash_mla is not None and fmt is KVFormat.FP8_DS_MLA:
        calls["flashmla_us"] = anchors.flashmla_sparse_decode(flash_mla, case, 1)
    row = {
        "fmt": fmt.value,
        "batch": batch,
        "heads": HEADS,
        "window": WINDOW,
        "extra": EXTRA,
        **host_us_interleaved(calls, reps),
    }
    if profile is not None:
        _profile(direct, reps, profile / f"host_{fmt.value}_b{batch}_direct.txt")
        _profile(public, reps, profile / f"host_{fmt.value}_b{batch}_ops.txt")
    if "flashmla_us" in row:
        row["direct_vs_flashmla"] = row["flashmla_us"] / row["direct_us"]
        row["ops_vs_flashmla"] = row["flashmla_us"] / row["ops_us"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench host")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--formats", nargs="+", default=["fp8_ds_mla", "nvfp4"])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--json", default="bench_host.json")
    parser.add_argument("--profile", type=Path, help="write cProfile tables of both calls here")
    args = parser.parse_args(argv)
    formats = [KVFormat.parse(f) for f in args.formats]
    if not torch.cuda.is_available():
        raise SystemExit("the host benchmark launches the CUDA kernels: no CUDA device found")
    flash_mla = anchors.import_flash_mla()
    rows = [
        _row(fmt, b, args.reps, flash_mla, args.profile) for fmt in formats for b in args.batches
    ]
    write_json(args.json, "host", None, rows)
    print(
        f"device: {torch.cuda.get_device_name()}; host time per eager call, median of "
        f"{args.reps}; V4-Flash {HEADS} heads, window {WINDOW} + {EXTRA} entries"
    )
    print(format_table(rows, COLUMNS))
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
