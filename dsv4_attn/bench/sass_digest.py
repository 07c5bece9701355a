"""Digests of the serving kernels' machine code: ``python -m dsv4_attn.bench sass-digest``.

A refactor of kernel source that should not change behaviour can be checked without a GPU: the
SASS ptxas emits for sm_90a is compared between two trees. This compiles, in memory (no disk
cache), every kernel a server launches (what
:func:`dsv4_attn.kernels.precompile.compile_serving_layer` compiles for both cache formats and
the three layer kinds: decode, its split and balanced variants, combine, the gathered prefill
FMHA) plus the dense FMHA variants of
``--fmha-head-dims`` (causal, both row-split mainloops where there are two), disassembles each
cubin with ``nvdisasm`` and records, per kernel in compile order, its cache name, compile key,
the SHA-256 of its SASS text and of its cubin, and the SASS line count. Needs no GPU
(``CUTE_DSL_ARCH=sm_90a``); about a minute on two cores.

Run it in each tree (``PYTHONPATH=TREE``), then ``--against`` the other run's JSON: the table
says, kernel by kernel, whether the SASS is the same; the exit status is 1 where any differs.

Prints a table, writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from pathlib import Path

from dsv4_attn.bench.timing import format_table, write_json

__all__ = ["compare", "main", "measure"]

DEFAULT_FMHA_HEAD_DIMS = (128, 512)
COLUMNS = [
    ("name", "kernel", "s"),
    ("lines", "SASS lines", "d"),
    ("sass", "SASS sha256", "s"),
    ("cubin", "cubin sha256", "s"),
    ("verdict", "against", "s"),
    ("key", "compile key", "s"),
]


def measure(fmha_head_dims: tuple[int, ...] = DEFAULT_FMHA_HEAD_DIMS) -> list[dict]:
    """Compile the serving kernel set and the dense FMHA variants of ``fmha_head_dims`` in this
    process (which must not have compiled them before: an in-memory hit is not recorded) and
    return one record per kernel, in compile order."""
    os.environ["DSV4_ATTN_KERNEL_CACHE_DIR"] = "0"  # compile every kernel, store none
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from dsv4_attn.kernels import compile_cache, fmha, sass
    from dsv4_attn.kernels.precompile import DEEPSEEK_V4_RATIOS, compile_serving_layer
    from dsv4_attn.kv_cache import KVFormat

    records: list[dict] = []
    build = compile_cache.CompileCache._build

    def digest_build(cache, key, builder, where):
        compiled = build(cache, key, builder, where)
        cubin = compile_cache.cubin_bytes(compiled)
        text = sass.disassemble(cubin)
        records.append(
            {
                "name": cache.name,
                "key": repr(key),
                "sass": hashlib.sha256(text.encode()).hexdigest(),
                "cubin": hashlib.sha256(cubin).hexdigest(),
                "lines": text.count("\n"),
            }
        )
        return compiled

    with tempfile.TemporaryDirectory() as dump_dir, compile_cache.keeping_cubins(dump_dir):
        compile_cache.CompileCache._build = digest_build
        try:
            for fmt in (KVFormat.NVFP4, KVFormat.FP8_DS_MLA):
                for ratio in DEEPSEEK_V4_RATIOS:
                    compile_serving_layer(fmt, ratio)
            for variant in fmha.all_variants():
                if variant.head_dim in fmha_head_dims and variant.causal and not variant.local:
                    fmha.compile_variant(variant)
        finally:
            compile_cache.CompileCache._build = build
    return records


def compare(records: list[dict], other: list[dict]) -> list[str]:
    """Per record, ``same`` or ``differs`` (its SASS against the record at the same position
    of ``other``, which must list the same kernels: same cache names in the same order; the
    keys may differ where a config class gained a field), or ``missing``."""
    verdicts = []
    for i, record in enumerate(records):
        if i >= len(other) or other[i]["name"] != record["name"]:
            verdicts.append("missing")
        else:
            verdicts.append("same" if other[i]["sass"] == record["sass"] else "differs")
    return verdicts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench sass-digest")
    parser.add_argument(
        "--fmha-head-dims",
        default=",".join(str(d) for d in DEFAULT_FMHA_HEAD_DIMS),
        help="dense FMHA head dims to add (comma-separated; empty: none)",
    )
    parser.add_argument("--against", help="another run's JSON: compare the SASS kernel by kernel")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    head_dims = tuple(int(d) for d in args.fmha_head_dims.split(",") if d)
    records = measure(head_dims)
    verdicts = ["-"] * len(records)
    if args.against:
        other = json.loads(Path(args.against).read_text())["rows"]
        verdicts = compare(records, other)
        if len(other) != len(records):
            print(f"{args.against} lists {len(other)} kernels, this run {len(records)}")
    for record, verdict in zip(records, verdicts, strict=True):
        record["verdict"] = verdict
    shown = [
        {**r, "sass": r["sass"][:16], "cubin": r["cubin"][:16], "key": r["key"][:80]}
        for r in records
    ]
    print(format_table(shown, COLUMNS))
    if args.json:
        write_json(args.json, "sass-digest", None, records)
    differing = sum(v != "same" for v in verdicts) if args.against else 0
    print(f"{len(records)} kernels" + (f", {differing} not the same" if args.against else ""))
    if differing:
        raise SystemExit(1)
