"""Benchmark of the SDPA fallback on decode shapes (``python -m dsv4_attn.bench fallback``).

Shapes: B in {1, 64} decode tokens of separate requests, H in {64, 128},
a full 128-slot window plus {0, 512, 1024} compressed entries, FP8_DS_MLA and NVFP4 caches.
Prints a table and writes JSON; each row also carries the floor from ceilings measured in the
same run.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from dsv4_attn import fallback
from dsv4_attn.bench.timing import (
    decode_roofline,
    measure_ceilings,
    report,
    time_cuda_us,
)
from dsv4_attn.testing import make_decode_case

COLUMNS = [
    ("fmt", "fmt", "s"),
    ("B", "B", "d"),
    ("H", "H", "d"),
    ("extra", "extra", "d"),
    ("median_us", "us", ".1f"),
    ("gbps", "eff GB/s", ".0f"),
    ("tflops", "TFLOP/s", ".2f"),
    ("floor_us", "floor us", ".1f"),
    ("of_floor", "floor/t", ".3f"),
]


def run(batches, heads, extras, formats, reps: int) -> tuple[list[dict], object]:
    ceilings = measure_ceilings()
    rows = []
    for fmt, B, H, extra in itertools.product(formats, batches, heads, extras):
        case = make_decode_case(B, H, fmt, 128, extra, seed=B * H + extra, device="cuda")
        args = case.args()
        timing = time_cuda_us(lambda args=args: fallback.sparse_attention(*args), reps=reps)
        rows.append(
            {
                "fmt": case.fmt.value,
                "B": B,
                "H": H,
                "window": 128,
                "extra": extra,
                **timing,
                **decode_roofline(case, timing["median_us"], ceilings),
            }
        )
        del case, args
        torch.cuda.empty_cache()
    return rows, ceilings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench fallback")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--extras", type=int, nargs="+", default=[0, 512, 1024])
    parser.add_argument("--formats", nargs="+", default=["fp8_ds_mla", "nvfp4"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default="bench_fallback.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the fallback benchmark times CUDA kernels: no CUDA device found")
    rows, ceilings = run(args.batches, args.heads, args.extras, args.formats, args.reps)
    report(args.json, "fallback", ceilings, rows, COLUMNS, "window 128")
