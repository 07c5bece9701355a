"""CI tests of the kernel compile cache: one build per key, and the disk cache round trip."""

from __future__ import annotations

import pytest

from dsv4_attn.kernels.compile_cache import CACHE_DIR_ENV, CompileCache


def test_builds_once_per_key(monkeypatch):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    cache = CompileCache("test")
    calls = []

    def build(tag):
        calls.append(tag)
        return object()

    first = cache.get(("a", 1), lambda: build("a"))
    assert cache.get(("a", 1), lambda: build("again")) is first
    second = cache.get(("a", 2), lambda: build("b"))
    assert second is not first and calls == ["a", "b"] and len(cache) == 2
    cache.clear()
    assert ("a", 1) not in cache


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    from dsv4_attn.kernels import sparse_decode
    from dsv4_attn.kernels.combine import CombineConfig

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    key = CombineConfig(has_sink=True)
    writer = CompileCache("combine_test")
    writer.get(key, lambda: sparse_decode.build_combine_kernel(key))
    path = writer.object_path(key, tmp_path)
    assert path.exists() and path.stat().st_size > 0

    # A fresh cache (as in a new process) loads the object instead of compiling.
    reader = CompileCache("combine_test")
    loaded = reader.get(key, lambda: pytest.fail("compiled although the object was on disk"))
    assert callable(loaded)
    # Another key (or changed kernel sources) maps to another file.
    assert writer.object_path(CombineConfig(has_sink=False), tmp_path) != path
