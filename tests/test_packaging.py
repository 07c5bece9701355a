"""The built wheel: kernels ship as ``dsv4_attn.kernels`` (never a top-level ``kernels``), and the
vLLM plugin entry point is declared."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[zipfile.ZipFile, str]:
    """The wheel pip builds from this checkout, and everything the build printed."""
    out = tmp_path_factory.mktemp("wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-v",
        "-w",
        str(out),
        str(ROOT),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 and "No module named" in result.stderr:
        pytest.skip(f"cannot build a wheel here: {result.stderr.strip()[-200:]}")
    assert result.returncode == 0, result.stderr
    (path,) = out.glob("dsv4_attn-*.whl")
    return zipfile.ZipFile(path), result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(build) -> zipfile.ZipFile:
    return build[0]


def test_build_prints_no_deprecation_warning(build):
    """setuptools stops building deprecated metadata (e.g. a ``project.license`` table) in 2027."""
    log = build[1]
    flagged = [line for line in log.splitlines() if "deprecat" in line.lower()]
    assert not flagged, "\n".join(flagged)


def test_kernels_install_under_the_package(wheel):
    names = wheel.namelist()
    assert "dsv4_attn/kernels/__init__.py" in names
    top_level = {n.split("/")[0] for n in names}
    assert "kernels" not in top_level, sorted(top_level)
    assert not any(n.startswith("tests/") for n in names)


def test_entry_points(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "[vllm.general_plugins]" in text
    assert "dsv4_nvfp4 = dsv4_attn.plugin:register" in text
    assert "dsv4-attn = dsv4_attn.__main__:main" in text


def test_every_source_package_is_in_the_wheel(wheel):
    """A subpackage missing from pyproject's ``packages`` list would vanish from installs."""
    names = set(wheel.namelist())
    for init in (ROOT / "dsv4_attn").rglob("__init__.py"):
        relative = init.relative_to(ROOT).as_posix()
        assert relative in names, f"{relative} is not packaged: add it to pyproject.toml"
