"""Benchmarks: ``python -m dsv4_attn.bench {decode,prefill,prefill-layer,fallback,step} [options]``.

Each subcommand lives in its own module with a ``main(argv)`` that prints a table and writes JSON.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "decode": "dsv4_attn.bench_decode",
    "prefill": "dsv4_attn.bench_prefill",
    "fallback": "dsv4_attn.bench_fallback",
    "step": "dsv4_attn.bench_step",
    "prefill-layer": "dsv4_attn.bench_prefill_layer",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        names = ", ".join(SUBCOMMANDS)
        raise SystemExit(f"usage: python -m dsv4_attn.bench {{{names}}} [options]")
    importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
