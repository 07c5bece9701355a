"""The first-request check: vLLM's JIT-monitor lines counted by kernel, and the request plan."""

from __future__ import annotations

import logging

import pytest

from dsv4_attn.e2e import first_request


@pytest.mark.parametrize("verbose", [False, True])
def test_jit_compiles_counts_the_lines_vllms_monitor_writes(monkeypatch, verbose):
    """The lines come from vLLM's own monitor (its message format, in its verbose and its
    default mode), among other log lines."""
    jit_monitor = pytest.importorskip("vllm.utils.jit_monitor")
    monkeypatch.setattr(jit_monitor, "_mode", "warn")
    monkeypatch.setattr(jit_monitor, "_verbose", True)  # every event logged, not once
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    jit_monitor.logger.addHandler(handler)
    try:
        for name in ["_prefill_index_kernel", "_gather_nvfp4_kernel", "_prefill_index_kernel"]:
            detail = "constexprs={MODE=1}; signature={}" if verbose else None
            jit_monitor._handle_jit_event(
                backend="Triton", event="kernel JIT compilation", fn_name=name, detail=detail
            )
        jit_monitor._handle_jit_event(
            backend="CuTeDSL", event="JIT compilation", fn_name="host_entrypoint"
        )
    finally:
        jit_monitor.logger.removeHandler(handler)
    log = "\n".join(["INFO 11-29 Kernel JIT monitor activated", *lines, "INFO done. ok"])
    assert first_request.jit_compiles(log) == {
        "_prefill_index_kernel": 2,
        "_gather_nvfp4_kernel": 1,
        "host_entrypoint": 1,
    }
    assert first_request.jit_compiles("INFO 11-29 Kernel JIT monitor activated\n") == {}


class _FakeServer:
    """Answers every request in a time set by its prompt length, recording what it was sent."""

    def __init__(self, first_extra: float) -> None:
        self.sent = []
        self.first_extra = first_extra

    def complete(self, request):
        self.sent.append(request)
        extra = self.first_extra if len(self.sent) == 1 else 0.0
        return {"s": len(request.prompt) / 1000 + extra}


def test_first_requests_times_two_fresh_prompts_of_one_length_then_the_spread():
    server = _FakeServer(first_extra=1.5)
    record = first_request.first_requests(server)
    first, second = server.sent[:2]
    assert len(first.prompt) == len(second.prompt) == first_request.LENGTH
    assert first.prompt != second.prompt  # no prefix-cache hit for the second
    assert all(r.max_tokens == 1 for r in server.sent)  # the request's time is its TTFT
    assert record["first_s"] == pytest.approx(1.5 + first_request.LENGTH / 1000)
    assert record["second_s"] == pytest.approx(first_request.LENGTH / 1000)
    assert record["first_over_second"] == pytest.approx(
        (1.5 + first_request.LENGTH / 1000) / (first_request.LENGTH / 1000), abs=1e-3
    )
    sent_lengths = [len(r.prompt) for r in server.sent[2:]]
    assert sent_lengths[: len(first_request.SPREAD)] == list(first_request.SPREAD)
    assert sorted(sent_lengths[len(first_request.SPREAD) :]) == [400, 550, 700, 850]
    assert len(record["at_once_s"]) == 4
