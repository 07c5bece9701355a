"""Split-KV sweep of the sparse-decode kernel (``python -m dsv4_attn.bench decode-splits``).

For each shape, token count and cache format, the kernel with every forced split count (the
``num_splits`` override of :func:`dsv4_attn.kernels.sparse_decode.sparse_attention`) next to the
planner's own choice, on the same inputs as ``bench decode``: the evidence behind
:func:`~dsv4_attn.kernels.sparse_decode.plan_splits`. Per row: µs (median, L2 flushed), the split
count the planner picks, and max |out - out at the planned count| (splitting only reorders the
softmax sums, so it stays at bf16 rounding). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse

import torch

from dsv4_attn.bench.decode import ALL_SHAPES, _RowPool, cases
from dsv4_attn.bench.timing import measure_ceilings, report, time_cuda_us

SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 32, 64)
COLUMNS = [
    ("fmt", "fmt", "s"),
    ("shape", "shape", "s"),
    ("T", "T", "d"),
    ("splits", "splits", "d"),
    ("planned", "planned", "d"),
    ("median_us", "us", ".1f"),
    ("max_abs_diff", "max|d| vs planned", ".4f"),
]


def run(shapes, tokens, formats, splits, reps: int) -> tuple[list[dict], object]:
    from dsv4_attn.kernels import sparse_decode

    device = torch.device("cuda")
    ceilings = measure_ceilings()
    rows = []
    for fmt, shape, T, case in cases(_RowPool(device), formats, shapes, tokens):
        H, window, extra = ALL_SHAPES[shape]
        args = case.args()
        planned, _ = sparse_decode.resolve_splits(T, H, window + extra, device)
        ref = sparse_decode.sparse_attention(*args)[0]
        for s in sorted({*splits, planned}):
            if s > -(-(window + extra) // sparse_decode.BLOCK_N):  # more splits than tiles
                continue
            out = sparse_decode.sparse_attention(*args, num_splits=s)[0]
            timing = time_cuda_us(
                lambda a=args, s=s: sparse_decode.sparse_attention(*a, num_splits=s), reps=reps
            )
            rows.append(
                {
                    "fmt": fmt.value,
                    "shape": shape,
                    "T": T,
                    "H": H,
                    "splits": s,
                    "planned": planned,
                    "median_us": timing["median_us"],
                    "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
                }
            )
            print(rows[-1], flush=True)
    return rows, ceilings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench decode-splits")
    parser.add_argument(
        "--shapes", nargs="+", choices=list(ALL_SHAPES), default=["v4-flash", "v4-pro", "hca-1m"]
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[2, 64])
    parser.add_argument("--formats", nargs="+", default=["fp8_ds_mla", "nvfp4"])
    parser.add_argument("--splits", type=int, nargs="+", default=list(SPLITS))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default="bench_decode_splits.json")
    args = parser.parse_args(argv)
    if min(args.splits) < 1 or min(args.tokens) < 1:
        parser.error("--splits and --tokens take positive counts")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows, ceilings = run(args.shapes, args.tokens, args.formats, args.splits, args.reps)
    report(args.json, "decode-splits", ceilings, rows, COLUMNS, "L2 flushed before each call")


if __name__ == "__main__":
    main()
