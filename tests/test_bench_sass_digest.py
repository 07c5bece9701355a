"""``python -m dsv4_attn.bench sass-digest``: the serving kernels' SASS, digested and compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_attn.bench.sass_digest import compare

ROOT = Path(__file__).resolve().parents[1]


def _record(name: str, sass: str) -> dict:
    return {"name": name, "key": f"{name}-key", "sass": sass, "cubin": sass, "lines": 10}


def test_compare_names_each_kernel_same_differs_or_missing():
    ours = [_record("decode", "a"), _record("combine", "b"), _record("fmha", "c")]
    theirs = [_record("decode", "a"), _record("combine", "x")]
    assert compare(ours, theirs) == ["same", "differs", "missing"]
    # another kernel at the same position is not compared with this one
    assert compare([_record("fmha", "a")], [_record("decode", "a")]) == ["missing"]


def _digest(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dsv4_attn.bench", "sass-digest", "--fmha-head-dims", ""]
    return subprocess.run(
        [*command, "--json", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_two_processes_compile_the_same_sass_and_a_change_is_named(tmp_path):
    """The serving set compiled in two processes: the same SASS kernel by kernel; with one
    recorded digest changed, that kernel (and only it) is named and the exit status is 1."""
    pytest.importorskip("cutlass")
    from dsv4_attn.kernels import sass

    if sass.find_cuda_tool("nvdisasm") is None:
        pytest.skip("nvdisasm is not installed")
    first = _digest(tmp_path / "first.json")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    records = json.loads((tmp_path / "first.json").read_text())["rows"]
    names = [r["name"] for r in records]
    # decode (final, split, balanced for HCA) and combine per layer kind and format, and the
    # gathered prefill FMHA
    assert set(names) == {"sparse_decode_sm90", "split_combine", "fmha"}
    assert names.count("sparse_decode_sm90") == 14 and names.count("fmha") == 1
    assert all(r["lines"] > 100 and len(r["sass"]) == 64 for r in records)
    decode = [r["sass"] for r in records if r["name"] == "sparse_decode_sm90"]
    assert len(set(decode)) == len(decode)  # every variant its own code

    changed = json.loads((tmp_path / "first.json").read_text())
    changed["rows"][3]["sass"] = "0" * 64
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    second = _digest(tmp_path / "second.json", "--against", str(tmp_path / "changed.json"))
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-3000:]
    verdicts = [r["verdict"] for r in json.loads((tmp_path / "second.json").read_text())["rows"]]
    assert verdicts == ["same"] * 3 + ["differs"] + ["same"] * (len(records) - 4)
    assert f"{len(records)} kernels, 1 not the same" in second.stdout
