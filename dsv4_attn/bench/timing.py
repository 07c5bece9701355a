"""Timing and roofline helpers shared by the benchmarks (``python -m dsv4_attn.bench ...``).

Method (docs/design.md §5.5): time with CUDA events around each call, median over many calls,
after a warm-up; the L2 cache is flushed between calls (outside the timed region) so small
problems are timed from HBM, as they would run inside a model step; ceilings (copy bandwidth,
bf16 matmul rate) are measured in the same process and the floor of a problem is
``max(bytes / copy_bandwidth, flops / matmul_rate)``.
"""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import torch

from dsv4_attn import kv_cache
from dsv4_attn.testing import DecodeCase

__all__ = [
    "Ceilings",
    "cuda_graph_replay",
    "decode_roofline",
    "decode_traffic",
    "format_table",
    "measure_ceilings",
    "report",
    "time_cuda_us",
    "write_json",
]

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any Hopper L2 (50-60 MB)


def time_cuda_us(fn: Callable[[], object], reps: int = 50, warmup: int = 5) -> dict[str, float]:
    """Median / min / max microseconds of ``fn()`` on the current CUDA stream, L2 flushed first."""
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        flush.fill_(1)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [1e3 * s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}


def cuda_graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured once into a CUDA graph (after one eager call on a side stream, which also
    does any lazy set-up); returns the graph's replay. Timing the replay measures device work
    only, as vLLM runs decode steps, with no host launch overhead per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@dataclass
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    bf16_tflops: float  # 8192^3 bf16 matmul on random data
    device: str

    def floor_us(self, bytes_moved: float, flops: float) -> float:
        return max(bytes_moved / (self.copy_gbps * 1e3), flops / (self.bf16_tflops * 1e6))


def measure_ceilings() -> Ceilings:
    """Measure this GPU's copy bandwidth and bf16 matmul rate (about 2 s)."""
    n = 1 << 30  # 1 GiB copy
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = time_cuda_us(lambda: dst.copy_(src), reps=20)["median_us"]
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm = time_cuda_us(lambda: a @ b, reps=10)["median_us"]
    return Ceilings(
        copy_gbps=2 * n / (copy * 1e3),
        bf16_tflops=2 * m**3 / (mm * 1e6),
        device=torch.cuda.get_device_name(),
    )


def decode_traffic(case: DecodeCase) -> tuple[float, float]:
    """(bytes that must move, FLOPs) for one sparse-decode call.

    Bytes: every valid KV row read once in its cache format, q read, out written (bf16).
    FLOPs: QK^T and PV, ``2 * 2 * H * 512`` per (token, valid key).
    """
    T, H, D = case.q.shape
    keys = case.num_keys
    bytes_moved = keys * kv_cache.bytes_per_token(case.fmt) + 2 * (T * H * D * 2)
    return float(bytes_moved), float(4 * H * D * keys)


def decode_roofline(case: DecodeCase, median_us: float, ceilings: Ceilings) -> dict[str, float]:
    """Bytes, FLOPs, achieved GB/s and TFLOP/s, and the floor of one timed decode call."""
    bytes_moved, flops = decode_traffic(case)
    floor = ceilings.floor_us(bytes_moved, flops)
    return {
        "bytes": bytes_moved,
        "flops": flops,
        "gbps": bytes_moved / (median_us * 1e3),
        "tflops": flops / (median_us * 1e6),
        "floor_us": floor,
        "of_floor": floor / median_us,
    }


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; ``columns`` = (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([format(row[k], f) if row.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, kind: str, ceilings: Ceilings | None, rows: list[dict]) -> None:
    record = {
        "benchmark": kind,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ceilings": asdict(ceilings) if ceilings else None,
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def report(
    json_path: str,
    kind: str,
    ceilings: Ceilings,
    rows: list[dict],
    columns: list[tuple[str, str, str]],
    note: str,
) -> None:
    """Write the JSON record, then print the ceilings line and the table (last, for logs)."""
    write_json(json_path, kind, ceilings, rows)
    print(
        f"device: {ceilings.device}; ceilings: copy {ceilings.copy_gbps:.0f} GB/s, "
        f"bf16 matmul {ceilings.bf16_tflops:.0f} TFLOP/s; {note}"
    )
    print(format_table(rows, columns))
    print(f"json: {json_path}")
