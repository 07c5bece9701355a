"""Roofline arithmetic of the benchmarks (CPU: no timing, just the counts); the CUDA-graph
timing helper (GPU)."""

from __future__ import annotations

import pytest
import torch

from dsv4_attn.bench.timing import Ceilings, cuda_graph_replay, decode_roofline, format_table
from dsv4_attn.testing import make_decode_case


def test_decode_roofline_counts_valid_rows_q_and_out():
    case = make_decode_case(3, 8, "nvfp4", 16, 4, seed=2, hole_rate=0.25, distinct=False)
    valid = int((case.window.indices >= 0).sum()) + int((case.extra.indices >= 0).sum())
    expected_bytes = valid * 384 + 2 * (3 * 8 * 512 * 2)
    expected_flops = 4 * 8 * 512 * valid
    ceilings = Ceilings(copy_gbps=1000.0, bf16_tflops=1.0, device="test")
    row = decode_roofline(case, 10.0, ceilings)
    assert row["bytes"] == expected_bytes and row["flops"] == expected_flops
    assert row["gbps"] == expected_bytes / 10e3
    assert row["tflops"] == expected_flops / 10e6
    floor = max(expected_bytes / 1e6, expected_flops / 1e6)
    assert row["floor_us"] == floor and row["of_floor"] == floor / 10.0


def test_format_table_aligns_and_marks_missing():
    text = format_table([{"a": 1.5, "b": None}], [("a", "A", ".2f"), ("b", "B", "d")])
    assert text.splitlines() == ["   A  B", "----  -", "1.50  -"]


@pytest.mark.gpu
def test_cuda_graph_replay_reruns_the_captured_work():
    src = torch.randn(1 << 16, device="cuda")
    dst = torch.full_like(src, float("nan"))  # poisoned: the replay must write every element
    replay = cuda_graph_replay(lambda: dst.copy_(src * 2))
    src.copy_(torch.randn_like(src))  # fresh inputs after the capture
    dst.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, src * 2)
