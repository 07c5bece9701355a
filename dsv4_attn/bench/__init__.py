"""Benchmarks: ``python -m dsv4_attn.bench SUBCOMMAND [options]``, one of :data:`SUBCOMMANDS`
(decode, decode-splits, prefill, prefill-layer, fallback, step, host, wgmma-rate,
compressor-state, sass-digest; and ncu-roles, which reads the ncu page
``scripts/profile_decode.sh`` writes).

One module per benchmark, each with a ``main(argv)`` that prints a table and writes JSON; the
shared timing, ceilings and report helpers are in :mod:`dsv4_attn.bench.timing`, the anchor's
import in :mod:`.anchors`, and the memory-only kernel the prefill bench times as its floor in
:mod:`.gather_copy`.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["SUBCOMMANDS", "main"]

SUBCOMMANDS = {
    "decode": "dsv4_attn.bench.decode",
    "decode-splits": "dsv4_attn.bench.decode_splits",
    "prefill": "dsv4_attn.bench.prefill",
    "prefill-layer": "dsv4_attn.bench.prefill_layer",
    "fallback": "dsv4_attn.bench.fallback",
    "step": "dsv4_attn.bench.step",
    "host": "dsv4_attn.bench.host",
    "wgmma-rate": "dsv4_attn.bench.wgmma_rate",
    "compressor-state": "dsv4_attn.bench.compressor_state",
    "sass-digest": "dsv4_attn.bench.sass_digest",
    "ncu-roles": "dsv4_attn.bench.ncu_roles",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        names = ",".join(SUBCOMMANDS)
        raise SystemExit(f"usage: python -m dsv4_attn.bench {{{names}}} [options]")
    importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
