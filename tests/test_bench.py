"""The benchmark package's command line (dsv4_attn/bench/__init__.py); the timing helpers are in
tests/test_bench_timing.py. The benchmarks themselves time CUDA kernels (GPU machine)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_attn import bench

ROOT = Path(__file__).resolve().parents[1]


def test_every_subcommand_is_a_module_with_main():
    assert set(bench.SUBCOMMANDS) == {
        "decode",
        "decode-splits",
        "prefill",
        "prefill-layer",
        "fallback",
        "step",
        "host",
        "wgmma-rate",
        "compressor-state",
        "sass-digest",
        "ncu-roles",
    }
    for name, module in bench.SUBCOMMANDS.items():
        assert callable(importlib.import_module(module).main), name


def test_unknown_subcommand_names_the_accepted_ones():
    names = (
        r"\{decode,decode-splits,prefill,prefill-layer,fallback,step,host,wgmma-rate,"
        r"compressor-state,sass-digest,ncu-roles\}"
    )
    with pytest.raises(SystemExit, match=names):
        bench.main(["nope"])
    result = subprocess.run(
        [sys.executable, "-m", "dsv4_attn.bench"], capture_output=True, text=True, timeout=120
    )
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


def test_flashmla_comparison_reports_a_refused_shape(monkeypatch):
    """The comparison with FlashMLA (both the case table and the sweep use it) times FlashMLA
    and reports the ratio and max |diff|; a shape FlashMLA refuses becomes an error entry, not
    a crash (stand-ins for both kernels: this checks the bookkeeping only)."""
    from types import SimpleNamespace

    from dsv4_attn.bench import prefill
    from dsv4_attn.prefill_cases import make_random_sparse_case

    case = make_random_sparse_case(4, 8, 50, 16, head_dim=64, lens="full", hole_fraction=0.0)
    ours = torch.ones_like(case.q)
    monkeypatch.setattr(prefill.fmha_ops, "sparse_prefill", lambda *a, **k: (ours, None))
    monkeypatch.setattr(prefill, "time_cuda_us", lambda fn, reps: (fn(), {"median_us": 30.0})[1])
    agrees = SimpleNamespace(flash_mla_sparse_fwd=lambda *a: (ours + 0.25, None))
    row = prefill._against_flashmla(agrees, case, 20.0, 3, "sparse-test")
    assert row["flashmla_us"] == 30.0 and row["vs_flashmla"] == 1.5 and row["meets_target"]
    assert row["max_abs_diff_vs_flashmla"] == 0.25

    def refuse(*args):
        raise RuntimeError("unsupported topk\nmore")

    row = prefill._against_flashmla(
        SimpleNamespace(flash_mla_sparse_fwd=refuse), case, 20.0, 3, "sparse-test"
    )
    assert row == {"flashmla_error": "unsupported topk"}


def check_gather_copy(device: str, heads: int) -> None:
    """The prefill bench's memory-floor kernel reads every counted row: out = q + the rows'
    sum, to one bf16 ulp (Triton's interpreter rounds toward zero, CUDA to nearest), with holes
    and ragged lengths; and the check can fail (a result without one counted row is far off)."""
    from dsv4_attn.bench import gather_copy as gc
    from dsv4_attn.prefill_cases import make_random_sparse_case

    case = make_random_sparse_case(6, heads, 300, 40, head_dim=64, device=device, seed=heads)
    out = torch.full_like(case.q, float("nan"))
    gc.gather_copy(case.q, case.kv, case.indices, case.lens, out=out)
    ref = gc.gather_copy_reference(case.q, case.kv, case.indices, case.lens)
    assert case.lens.min() == 0 and (case.indices < 0).any()

    assert gc.excess_over_rounding(out, ref) <= 1e-3
    counted = torch.arange(case.indices.shape[1], device=device)[None] < case.lens[:, None]
    token, entry = ((case.indices >= 0) & counted).nonzero()[0].tolist()
    dropped = case.indices.clone()
    dropped[token, entry] = -1
    without_row = gc.gather_copy_reference(case.q, case.kv, dropped, case.lens)
    assert gc.excess_over_rounding(without_row, ref) > 0.1


def test_gather_copy_in_the_triton_interpreter():
    """:func:`check_gather_copy` on the CPU, in a child process started with
    ``TRITON_INTERPRET=1`` (it must be set before Triton is first imported)."""
    pytest.importorskip("triton")
    code = "from tests.test_bench import check_gather_copy as c; c('cpu', 8); c('cpu', 70)"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 70])
def test_gather_copy_cuda(heads):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_gather_copy("cuda", heads)


def test_compressor_state_bench_measures_each_state_dtype():
    """The CPU measurement behind the bf16 CSA state: per score spread, one row per state
    dtype; fp32 state rows are only the bf16 output's rounding away from the reference, the
    bf16 state adds its own, and the cache's NVFP4 encoding dwarfs both."""
    from dsv4_attn.bench import compressor_state

    rows = compressor_state.measure(length=256, sigmas=[4.0], seed=1)
    by_state = {row["state"]: row for row in rows}
    assert set(by_state) == {"fp32", "bf16", "fp16"} and by_state["fp32"]["entries"] == 64
    assert by_state["fp32"]["row_median"] < 2**-8  # one bf16 rounding of the row
    assert by_state["bf16"]["row_median"] > by_state["fp32"]["row_median"]
    assert by_state["bf16"]["nvfp4_median"] > 10 * by_state["bf16"]["row_median"]


class _FakeClock:
    """A clock (seconds) that moves only when told to: the host-time bench reads it instead of
    ``time.perf_counter``, so the test knows every duration exactly, whatever the load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize(
    "durations, median_us",
    [
        # Powers of two of a second add and scale by 1e6 exactly: the medians are exact.
        ([2**-10, 2**-8, 2**-9], 1e6 * 2**-9),  # odd count: the middle one (1953.125 us)
        ([2**-10, 2**-7, 2**-9, 2**-8], 1e6 * 3 * 2**-10),  # even: mean of the middle two
    ],
)
def test_host_time_is_the_median_of_calls_on_an_idle_device(monkeypatch, durations, median_us):
    """host_us synchronizes before every timed call (none of the time is a wait for the GPU:
    a synchronize here takes a whole second of the fake clock), leaves the warm-up calls (a
    second each) out, and reports the median CPU time of the timed calls in microseconds."""
    from dsv4_attn.bench import host

    clock = _FakeClock()
    monkeypatch.setattr(host, "_clock", clock)
    events = []

    def synchronize() -> None:
        events.append("sync")
        clock.advance(1.0)  # a wait for the device: must fall outside every timed interval

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    warmup = 3
    call_durations = iter([1.0] * warmup + durations)

    def call() -> None:
        events.append("call")
        clock.advance(next(call_durations))

    assert host.host_us(call, reps=len(durations), warmup=warmup) == median_us
    assert events[:warmup] == ["call"] * warmup
    assert events[warmup:] == ["sync", "call"] * len(durations) + ["sync"]


def test_host_times_in_turns_charge_a_drift_to_every_column(monkeypatch):
    """host_us_interleaved times one call of each column per round, in order, each after a
    synchronize: when the host slows down halfway through the run (every call 4x longer once
    the clock passes 6 ms), both columns' medians move alike and their ratio stays the calls'
    own 2x (timed one column after the other, a would be all fast and b all slow: 8x)."""
    from dsv4_attn.bench import host

    clock = _FakeClock()
    monkeypatch.setattr(host, "_clock", clock)
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))

    def timed(name: str, seconds: float):
        def call() -> None:
            events.append(name)
            clock.advance(seconds * (4.0 if clock.now >= 6 * 2**-10 else 1.0))

        return call

    calls = {"a": timed("a", 2**-10), "b": timed("b", 2**-9)}
    times = host.host_us_interleaved(calls, reps=4, warmup=0)
    # rounds take 3, 3, 12, 12 ms (2**-10 s units): a is 1, 1, 4, 4 and b 2, 2, 8, 8 units
    assert times == {"a": 1e6 * 2.5 * 2**-10, "b": 1e6 * 5 * 2**-10}
    assert events == ["sync", "a", "sync", "b"] * 4 + ["sync"]


def test_host_bench_needs_cuda(monkeypatch):
    from dsv4_attn.bench import host

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        host.main(["--reps", "1"])
