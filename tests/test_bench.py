"""The benchmark package's command line (dsv4_attn/bench/__init__.py); the timing helpers are in
tests/test_bench_timing.py. The benchmarks themselves time CUDA kernels (GPU machine)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from dsv4_attn import bench


def test_every_subcommand_is_a_module_with_main():
    assert set(bench.SUBCOMMANDS) == {
        "decode",
        "decode-splits",
        "prefill",
        "prefill-layer",
        "fallback",
        "step",
        "wgmma-rate",
    }
    for name, module in bench.SUBCOMMANDS.items():
        assert callable(importlib.import_module(module).main), name


def test_unknown_subcommand_names_the_accepted_ones():
    names = r"\{decode,decode-splits,prefill,prefill-layer,fallback,step,wgmma-rate\}"
    with pytest.raises(SystemExit, match=names):
        bench.main(["nope"])
    result = subprocess.run([sys.executable, "-m", "dsv4_attn.bench"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode != 0 and "usage: python -m dsv4_attn.bench" in result.stderr


def test_decode_splits_options():
    from dsv4_attn.bench import decode_splits

    args = decode_splits.parse_args(["--shapes", "v4-pro", "--tokens", "2", "--splits", "1", "9"])
    assert (args.shapes, args.tokens, args.splits) == (["v4-pro"], [2], [1, 9])
    assert decode_splits.parse_args([]).splits == list(decode_splits.SPLITS)
    with pytest.raises(SystemExit):
        decode_splits.parse_args(["--splits", "0"])


def test_prefill_sweep_fit_recovers_fixed_and_step_costs():
    """The sweep's fit splits a CTA's time into a fixed part and a part per 128-key step."""
    from dsv4_attn.bench.prefill import fit_cta_costs

    tokens, sms, fixed, step = 4096, 132, 6.5, 2.75
    widths = [128, 256, 512, 1024, 2048]
    times = [tokens / sms * (fixed + step * w / 128) for w in widths]
    fit = fit_cta_costs(widths, times, tokens, sms)
    assert abs(fit["fixed_us"] - fixed) < 1e-9 and abs(fit["step_us"] - step) < 1e-9
    with pytest.raises(ValueError, match="at least two widths"):
        fit_cta_costs([512], times[:1], tokens, sms)
