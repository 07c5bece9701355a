"""Temporary folders for files that several tests share through a cached builder (a checkpoint,
a config): they outlive any one test and are removed when the test process exits. A test's own
files go under pytest's ``tmp_path``."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def temp_dir(prefix: str) -> Path:
    """A new empty folder under the system's temporary folder, named ``prefix...``, removed with
    everything in it at interpreter exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
