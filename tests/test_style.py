"""The tree is ruff clean (lint and format), so CI catches style drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    local = Path(sys.executable).with_name("ruff")
    if local.exists():
        return [str(local)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed")


def test_ruff_check():
    result = subprocess.run([*_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    cmd = [*_ruff(), "format", "--check", "."]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
