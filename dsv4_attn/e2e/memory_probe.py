"""What a running ``vllm serve`` holds in GPU memory, from inside its workers.

``nvidia-smi`` sees one number per GPU (inside a container it lists no process), which mixes
servers that share a GPU and cannot say what grew. This module is a vLLM *worker extension*:
started with

    VLLM_SERVER_DEV_MODE=1 vllm serve CKPT ... \\
        --worker-extension-cls dsv4_attn.e2e.memory_probe.MemoryProbe

every worker gains four methods that vLLM's development endpoint ``POST /collective_rpc``
(``{"method": NAME, "args": [...]}``) calls on all workers:

* ``dsv4_memory_stats()`` — the torch caching allocator's allocated, reserved and peak-allocated
  MiB of the worker's GPU, and the device's used MiB (``cudaMemGetInfo``);
* ``dsv4_memory_record(max_entries)`` — resets the peak and starts torch's allocation history
  (Python stacks, segment events only) so that every later segment the allocator maps is traced
  to its caller;
* ``dsv4_memory_dump(path)`` — writes torch's snapshot (``path`` with ``{rank}`` replaced) and
  returns :func:`segment_growth` of it: the reserved memory added since ``dsv4_memory_record``,
  grouped by the first frame in vLLM's or this package's code;
* ``dsv4_memory_growth(top)`` — that summary so far, recording on.

``python -m dsv4_attn.e2e.memory_probe SNAPSHOT.pickle`` prints that summary for a dumped file.
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections.abc import Iterable

import torch

__all__ = ["MemoryProbe", "growth_site", "segment_growth"]

MIB = float(1 << 20)
# Frames of these packages name the caller of an allocation; torch's own frames do not.
CALLER_PACKAGES = ("dsv4_attn/", "vllm/")
# Allocator events of blocks inside segments; the probe summarises segment events only.
BLOCK_ACTIONS = ["alloc", "free_requested", "free_completed"]


class MemoryProbe:
    """vLLM worker extension (``--worker-extension-cls``); method names carry a ``dsv4_``
    prefix so that they cannot clash with a worker's own attributes (vLLM asserts that)."""

    def dsv4_memory_stats(self) -> dict[str, float | int]:
        free, total = torch.cuda.mem_get_info()
        return {
            "rank": int(getattr(self, "rank", 0)),
            "allocated_mib": round(torch.cuda.memory_allocated() / MIB, 1),
            "reserved_mib": round(torch.cuda.memory_reserved() / MIB, 1),
            "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / MIB, 1),
            "device_used_mib": round((total - free) / MIB, 1),
        }

    def dsv4_memory_record(self, max_entries: str = "100000") -> None:
        torch.cuda.reset_peak_memory_stats()
        # The history is a ring of max_entries events. A serving step allocates and frees
        # hundreds of blocks, so a ring of every event forgets within minutes the segments
        # mapped early in a soak; only segment events are kept where torch can skip the rest.
        try:
            torch.cuda.memory._record_memory_history(
                max_entries=int(max_entries), stacks="python", skip_actions=BLOCK_ACTIONS
            )
        except TypeError:  # a torch without skip_actions
            torch.cuda.memory._record_memory_history(max_entries=int(max_entries), stacks="python")

    def dsv4_memory_growth(self, top: str = "6") -> dict:
        """:func:`segment_growth` so far; the history keeps recording."""
        return segment_growth(torch.cuda.memory._snapshot(), int(top))

    def dsv4_memory_dump(self, path: str) -> dict:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        target = path.format(rank=int(getattr(self, "rank", 0)))
        with open(target, "wb") as f:
            pickle.dump(snapshot, f)
        return {"snapshot": target, **segment_growth(snapshot)}


def growth_site(frames: Iterable[dict]) -> str:
    """``file:line (function)`` of the innermost frame in vLLM's or this package's code (the
    caller whose allocation made the allocator map memory), else of the innermost frame."""
    frames = list(frames)
    for frame in frames:
        filename = frame.get("filename", "")
        for package in CALLER_PACKAGES:
            at = filename.rfind(package)
            if at >= 0:
                return f"{filename[at:]}:{frame.get('line')} ({frame.get('name')})"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} ({f.get('name')})"
    return "(no stack recorded)"


def segment_growth(snapshot: dict, top: int = 12) -> dict:
    """The memory the caching allocator mapped and unmapped while the history was recorded
    (``segment_alloc`` / ``segment_free`` and the expandable-segment ``segment_map`` /
    ``segment_unmap`` events of ``snapshot["device_traces"]``), the mapped bytes grouped by
    :func:`growth_site`, largest first; and the reserved MiB at the snapshot (its segments)."""
    grown: dict[str, list[float]] = {}
    mapped = unmapped = 0
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            action = event.get("action")
            if action in ("segment_alloc", "segment_map"):
                mapped += event["size"]
                site = growth_site(event.get("frames", []))
                entry = grown.setdefault(site, [0, 0.0])
                entry[0] += 1
                entry[1] += event["size"]
            elif action in ("segment_free", "segment_unmap"):
                unmapped += event["size"]
    sites = sorted(grown.items(), key=lambda kv: -kv[1][1])
    return {
        "reserved_mib": round(sum(s["total_size"] for s in snapshot.get("segments", [])) / MIB, 1),
        "mapped_mib": round(mapped / MIB, 1),
        "unmapped_mib": round(unmapped / MIB, 1),
        "growth_by_site": [
            {"site": site, "segments": int(n), "mib": round(size / MIB, 1)}
            for site, (n, size) in sites[:top]
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.e2e.memory_probe")
    parser.add_argument("snapshot", help="a pickle dsv4_memory_dump wrote")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        print(json.dumps(segment_growth(pickle.load(f), args.top), indent=1))


if __name__ == "__main__":
    main()
