"""The Triton kernels of :mod:`dsv4_attn.fused` against the torch code they replace.

CPU (CI): the checks of ``tests/fused_checks.py`` run in Triton's interpreter, in a child pytest
started with ``TRITON_INTERPRET=1``. GPU (``pytest -m gpu``): the same checks, compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.fused_checks import KINDS, check_insert, check_metadata, check_staged_rows

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_match_torch_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
           str(ROOT / "tests" / "fused_checks.py")]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary


def _compiled():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4_attn.fused import kv_writers, step_metadata

    return SimpleNamespace(kv_writers=kv_writers, step_metadata=step_metadata)


# ----------------------------------------------------------------------------------------------
# GPU: compiled
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_staged_rows_cuda(kind):
    for seed in range(3):
        check_staged_rows(_compiled(), "cuda", kind, seed)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "padded"), [(6, 8), (64, 64), (100, 128), (128, 128)])
def test_insert_cuda(heads, padded):
    for seed in range(3):
        check_insert(_compiled(), "cuda", heads, padded, seed)


@pytest.mark.gpu
def test_metadata_cuda():
    for seed in range(12):
        check_metadata(_compiled(), "cuda", seed)
