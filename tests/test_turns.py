"""Turns of servers sharing one GPU, taken by separate processes as the benchmark takes them."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from dsv4_attn.e2e.turns import Turns

SERVERS = ["vllm", "fp8", "nvfp4"]
STEPS = ["greedy", "a_8k_c1", "b_64k_c4"]


def _take_turns(directory: str, server: str, start_delay: float, fail: bool, log: str) -> None:
    """One server's process: comes up after ``start_delay`` s (or finishes at once, having
    failed), then takes every step, logging when each starts and ends."""
    turns = Turns(Path(directory), SERVERS, poll_s=0.01)
    time.sleep(start_delay)
    if fail:
        turns.finished(server)
        return
    turns.up(server)
    turns.wait_up(30)
    for step in STEPS:
        turns.wait(STEPS, step, server, 30)
        with open(log, "a") as handle:
            handle.write(f"{time.monotonic():.6f} start {step} {server}\n")
        time.sleep(0.02)  # the step's work: a turn that overlapped another would show
        with open(log, "a") as handle:
            handle.write(f"{time.monotonic():.6f} end {step} {server}\n")
        turns.done(step, server)
    turns.finished(server)


def _run(tmp_path: Path, delays: dict[str, float], failing: set[str] = frozenset()) -> list:
    log = tmp_path / "log.txt"
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_take_turns,
            args=(str(tmp_path / "turns"), name, delays[name], name in failing, str(log)),
        )
        for name in SERVERS
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    return [line.split() for line in log.read_text().splitlines()]


def test_servers_take_each_step_in_order_one_at_a_time(tmp_path: Path):
    """The last server up (vllm, 0.3 s late) still goes first: every step runs server by
    server in turn order, step after step, and no two turns overlap."""
    events = _run(tmp_path, {"vllm": 0.3, "fp8": 0.0, "nvfp4": 0.1})
    starts = [(step, server) for _, kind, step, server in events if kind == "start"]
    assert starts == [(step, server) for step in STEPS for server in SERVERS]
    kinds = [kind for _, kind, _, _ in events]
    assert kinds == ["start", "end"] * len(starts)  # each turn ends before the next starts


def test_a_server_that_failed_to_start_is_skipped(tmp_path: Path):
    events = _run(tmp_path, {"vllm": 0.0, "fp8": 0.0, "nvfp4": 0.0}, failing={"fp8"})
    starts = [(step, server) for _, kind, step, server in events if kind == "start"]
    assert starts == [(step, server) for step in STEPS for server in ("vllm", "nvfp4")]


def test_the_first_step_waits_for_the_start_after_file(tmp_path: Path):
    gate = tmp_path / "other_job_done"
    turns = Turns(tmp_path / "turns", ["vllm"], start_after=gate, poll_s=0.01)
    turns.up("vllm")
    with pytest.raises(TimeoutError, match="every server to answer"):
        turns.wait_up(0.05)
    gate.touch()
    assert turns.wait_up(1) < 1


def test_a_turn_that_never_comes_names_the_server_and_step(tmp_path: Path):
    turns = Turns(tmp_path, SERVERS, poll_s=0.01)
    for name in SERVERS:
        turns.up(name)
    with pytest.raises(TimeoutError, match=r"fp8's turn at 'a_8k_c1'"):
        turns.wait(STEPS, "a_8k_c1", "fp8", 0.05)
    turns.done("a_8k_c1", "vllm")
    with pytest.raises(TimeoutError):  # greedy, an earlier step, is not done by anyone
        turns.wait(STEPS, "a_8k_c1", "fp8", 0.05)
    for name in SERVERS:
        turns.done("greedy", name)
    assert turns.wait(STEPS, "a_8k_c1", "fp8", 1) < 1


def test_names_outside_the_order_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="distinct server names"):
        Turns(tmp_path, ["vllm", "vllm"])
    turns = Turns(tmp_path, SERVERS)
    with pytest.raises(ValueError, match="not in the turn order"):
        turns.up("sglang")
    with pytest.raises(ValueError, match="not one of"):
        turns.wait(STEPS, "c_1m", "vllm", 1)
