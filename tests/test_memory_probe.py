"""The memory probe: which code made torch's caching allocator map memory, from a snapshot.

CPU tests read hand-made snapshots in torch's format; the GPU test reads one torch itself
recorded, so the format the summary relies on is the real one."""

from __future__ import annotations

import pickle

import pytest
import torch

from dsv4_attn.e2e import memory_probe
from dsv4_attn.e2e.memory_probe import MemoryProbe, growth_site, segment_growth

MIB = 1 << 20


def _frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


TORCH = _frame("/site/torch/nn/functional.py", 5200, "pad")
OURS = _frame("/tmp/site/dsv4_attn/vllm_glue/prefill.py", 120, "gather_rows")
VLLMS = _frame("/tmp/site/vllm/models/deepseek_v4/attention.py", 600, "forward")


def test_growth_site_is_the_innermost_frame_of_vllm_or_this_package():
    assert growth_site([TORCH, OURS, VLLMS]) == "dsv4_attn/vllm_glue/prefill.py:120 (gather_rows)"
    assert growth_site([TORCH, VLLMS, OURS]) == (
        "vllm/models/deepseek_v4/attention.py:600 (forward)"
    )
    # "vllm_glue/" is this package's, not vLLM's: only the dsv4_attn/ prefix names it
    glue_only = _frame("/x/dsv4_attn/vllm_glue/attention.py", 9, "forward_mqa")
    assert growth_site([glue_only]).startswith("dsv4_attn/vllm_glue/attention.py:9")
    assert growth_site([TORCH]) == "/site/torch/nn/functional.py:5200 (pad)"
    assert growth_site([]) == "(no stack recorded)"


def test_segment_growth_sums_mapped_memory_by_site_largest_first():
    snapshot = {
        "segments": [{"total_size": 6 * MIB}, {"total_size": 2 * MIB}],
        "device_traces": [
            [
                {"action": "alloc", "size": 999 * MIB, "frames": [OURS]},  # not a new segment
                {"action": "segment_alloc", "size": 2 * MIB, "frames": [TORCH, OURS]},
                {"action": "segment_alloc", "size": 4 * MIB, "frames": [VLLMS]},
                {"action": "segment_map", "size": 1 * MIB, "frames": [OURS]},
                {"action": "segment_free", "size": 3 * MIB, "frames": []},
                {"action": "segment_unmap", "size": 1 * MIB, "frames": []},
            ]
        ],
    }
    growth = segment_growth(snapshot)
    assert growth["reserved_mib"] == 8.0
    assert growth["mapped_mib"] == 7.0 and growth["unmapped_mib"] == 4.0
    assert growth["growth_by_site"] == [
        {"site": "vllm/models/deepseek_v4/attention.py:600 (forward)", "segments": 1, "mib": 4.0},
        {"site": "dsv4_attn/vllm_glue/prefill.py:120 (gather_rows)", "segments": 2, "mib": 3.0},
    ]
    assert segment_growth(snapshot, top=1)["growth_by_site"][0]["mib"] == 4.0


def test_the_extension_fits_vllms_worker():
    """vLLM mixes a worker extension into its GPU worker and asserts that no attribute of the
    extension exists on the worker already; every probe method is callable through
    collective_rpc by name."""
    from vllm.v1.worker.gpu_worker import Worker

    names = [n for n in dir(MemoryProbe) if not n.startswith("__")]
    assert names == [
        "dsv4_memory_dump",
        "dsv4_memory_growth",
        "dsv4_memory_record",
        "dsv4_memory_stats",
    ]
    assert not any(hasattr(Worker, n) for n in names)


def test_cli_prints_the_summary_of_a_dumped_snapshot(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    snapshot = {
        "segments": [],
        "device_traces": [[{"action": "segment_alloc", "size": 3 * MIB, "frames": [OURS]}]],
    }
    path.write_bytes(pickle.dumps(snapshot))
    memory_probe.main([str(path)])
    assert '"mapped_mib": 3.0' in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_probe_traces_a_new_segment_to_its_caller(tmp_path):
    """On CUDA: after record, an allocation bigger than any free cached block maps a new
    segment, and the dump names this test's function (a file under no package the probe looks
    for, so the innermost frame) with at least the tensor's size. Earlier tests in the process
    may leave segments partly in use, which empty_cache keeps: the size is chosen above their
    largest free block."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.empty_cache()
    free_blocks = [
        block["size"]
        for segment in torch.cuda.memory._snapshot()["segments"]
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    size = max([96 * MIB, *(b + 2 * MIB for b in free_blocks)])
    probe = MemoryProbe()
    probe.dsv4_memory_record()
    try:
        before = probe.dsv4_memory_stats()
        big = torch.empty(size, dtype=torch.uint8, device="cuda")
        after = probe.dsv4_memory_stats()
        so_far = probe.dsv4_memory_growth()
    finally:
        growth = probe.dsv4_memory_dump(str(tmp_path / "snap_{rank}.pickle"))
    size_mib = size / MIB - 0.1  # the probe rounds to 0.1 MiB
    assert after["allocated_mib"] - before["allocated_mib"] >= size_mib
    assert after["peak_allocated_mib"] >= after["allocated_mib"]
    assert growth["snapshot"].endswith("snap_0.pickle")
    assert growth["mapped_mib"] >= size_mib and so_far["mapped_mib"] >= size_mib
    top = growth["growth_by_site"][0]
    assert "test_gpu_probe_traces_a_new_segment_to_its_caller" in top["site"]
    assert top["mib"] >= size_mib
    del big


def test_record_keeps_only_segment_events_where_torch_can(monkeypatch):
    """The history is a ring: with every block event in it, a soak's early segments fall out
    within minutes. The probe asks torch to skip block events, and records everything on a
    torch without ``skip_actions`` rather than fail."""
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        if "skip_actions" in kwargs and len(calls) > 1:
            raise TypeError("unexpected keyword argument 'skip_actions'")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    MemoryProbe().dsv4_memory_record("500")
    assert calls[0]["max_entries"] == 500
    assert set(calls[0]["skip_actions"]) == {"alloc", "free_requested", "free_completed"}
    MemoryProbe().dsv4_memory_record("500")  # the second call plays an older torch
    assert "skip_actions" not in calls[-1] and calls[-1]["max_entries"] == 500
