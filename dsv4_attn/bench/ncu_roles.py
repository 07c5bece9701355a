"""Where each warp role of the sparse-decode kernel spends its time, from an ncu source page
(``python -m dsv4_attn.bench ncu-roles``).

Input: the CSV that ``scripts/profile_decode.sh`` writes (``ncu --page source --csv
--print-source sass``; plain or ``.gz``). The kernel's SASS is cut into its three roles at the
``setmaxnreg`` instructions each role starts with: the one that lowers its registers is the
producer (WG2), of the two that raise theirs the one issuing the 64 x 32 QK wgmmas is WG0 (QK,
softmax, PV of the left columns), the other WG1 (PV of the right columns). The instructions before
the first ``setmaxnreg`` (set-up, the Q copy) form a fourth part, "prologue". Every role has
four warps resident for the whole kernel, so a role's share of the warp-state samples is its
share of the warps' time, and its stall reasons say what those warps wait for.

Prints, per role: its share of the samples, its stall reasons and its most-sampled
instructions; writes the same as JSON to ``--json``. Runs anywhere (no GPU):

    python -m dsv4_attn.bench ncu-roles ncu_source.csv [--top 8] [--json roles.json]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source_page(path: Path) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of an ncu source-page CSV; the first line (the kernel's name) is skipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if SAMPLES in r)
    header = rows[header_at]
    return header, [r for r in rows[header_at + 1 :] if len(r) >= len(header)]


def split_roles(sass: list[str]) -> dict[str, tuple[int, int]]:
    """Role -> (first, end) instruction indices, cut at the ``setmaxnreg`` instructions."""
    marks = [i for i, s in enumerate(sass) if "SETMAXREG" in s]
    if len(marks) != 3:
        raise ValueError(f"expected 3 setmaxnreg instructions (one per role), found {len(marks)}")
    spans = list(zip(marks, [*marks[1:], len(sass)], strict=True))
    roles = {"prologue": (0, marks[0])}
    for first, end in spans:
        if "DEALLOC" in sass[first]:
            roles["producer"] = (first, end)
        elif any("HGMMA.64x32" in s for s in sass[first:end]):
            roles["WG0"] = (first, end)
        else:
            roles["WG1"] = (first, end)
    if set(roles) != {"prologue", "producer", "WG0", "WG1"}:
        raise ValueError(f"could not tell the roles apart: {sorted(roles)}")
    return roles


def summarize(path: Path, top: int) -> dict:
    header, rows = read_source_page(path)
    col = {h: i for i, h in enumerate(header)}
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    sass = [r[col["Source"]].strip() for r in rows]
    samples = [int(r[col[SAMPLES]] or 0) for r in rows]
    total = sum(samples)
    result = {"source": str(path), "samples": total, "roles": {}}
    for role, (first, end) in split_roles(sass).items():
        role_samples = sum(samples[first:end])
        stalls = collections.Counter()
        for r in rows[first:end]:
            for c in stall_cols:
                stalls[c.removeprefix("stall_")] += int(r[col[c]] or 0)
        hot = sorted(range(first, end), key=lambda i: -samples[i])[:top]
        result["roles"][role] = {
            "share": role_samples / total if total else 0.0,
            "stalls": {k: v / role_samples for k, v in stalls.most_common() if v}
            if role_samples
            else {},
            "hot": [
                {
                    "index": i,
                    "share_of_role": samples[i] / role_samples,
                    "reason": max(stall_cols, key=lambda c: int(rows[i][col[c]] or 0))[6:],
                    "executed": int(rows[i][col[EXECUTED]] or 0),
                    "sass": sass[i],
                }
                for i in sorted(hot)
                if samples[i]
            ],
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4_attn.bench ncu-roles", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("source_csv", type=Path)
    parser.add_argument("--top", type=int, default=8, help="hottest instructions per role")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = summarize(args.source_csv, args.top)
    print(f"{result['source']}: {result['samples']} samples")
    for role, info in result["roles"].items():
        stalls = ", ".join(f"{k} {v:.0%}" for k, v in list(info["stalls"].items())[:8])
        print(f"{role:9s} {info['share']:6.1%} of samples; {stalls}")
        for hot in info["hot"]:
            print(
                f"    {hot['index']:5d} {hot['share_of_role']:6.1%} {hot['reason']:13s} "
                f"x{hot['executed']:<7d} {hot['sass'][:72]}"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
