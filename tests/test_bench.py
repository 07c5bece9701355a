"""The benchmark package's command line (dsv4_attn/bench/__init__.py); the timing helpers are in
tests/test_bench_timing.py. The benchmarks themselves time CUDA kernels (GPU machine)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from dsv4_attn import bench


def test_every_subcommand_is_a_module_with_main():
    assert set(bench.SUBCOMMANDS) == {"decode", "prefill", "prefill-layer", "fallback", "step"}
    for name, module in bench.SUBCOMMANDS.items():
        assert callable(importlib.import_module(module).main), name


def test_unknown_subcommand_names_the_accepted_ones():
    with pytest.raises(SystemExit, match=r"\{decode,prefill,prefill-layer,fallback,step\}"):
        bench.main(["nope"])
    result = subprocess.run([sys.executable, "-m", "dsv4_attn.bench"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode != 0 and "usage: python -m dsv4_attn.bench" in result.stderr
