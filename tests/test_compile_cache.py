"""CI tests of the kernel compile cache: one build per key, the disk cache round trip, and a disk
cache that never loads a damaged file, refuses a directory others can write, and survives two
processes writing the same key at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_attn.kernels import compile_cache
from dsv4_attn.kernels.compile_cache import CACHE_DIR_ENV, CompileCache, DiskCache

ROOT = Path(__file__).resolve().parents[1]


def test_builds_once_per_key(monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, "")  # memory only
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


# ---- the file format, without compiling anything ----------------------------------------------


def _private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    return directory


def test_disk_cache_returns_exactly_what_was_written(tmp_path):
    disk = DiskCache(_private_dir(tmp_path))
    payload = os.urandom(5000)
    assert disk.read("k") is None
    disk.write("k", payload)
    assert disk.read("k") == payload
    assert [p.name for p in disk.directory.iterdir()] == ["k.kc"]  # no temporary file left


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[: len(data) // 2], "its header says"),  # truncated object
        (lambda data: data[:20], "without a valid header"),  # truncated header
        (lambda data: data[:-256] + bytes(b ^ 0xFF for b in data[-256:]), "SHA-256"),  # flipped
        (lambda data: b"\x7fELF" + data[4:], "without a valid header"),  # a bare object file
        (lambda data: data + b"\x00", "its header says"),  # appended bytes
    ],
)
def test_disk_cache_refuses_damaged_files(tmp_path, damage, message):
    disk = DiskCache(_private_dir(tmp_path))
    disk.write("k", os.urandom(4096))
    path = disk.path("k")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        disk.read("k")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o722])
def test_a_directory_others_can_write_is_not_used(tmp_path, mode, dsv4_logs, monkeypatch):
    monkeypatch.setattr(compile_cache, "_REFUSED_DIRS", set())
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    assert not DiskCache(directory).usable()
    assert not DiskCache(directory).usable()
    warnings = [r.getMessage() for r in dsv4_logs.records if "is not used" in r.getMessage()]
    assert len(warnings) == 1 and "writable by group or others" in warnings[0]


def test_a_directory_of_another_user_is_not_used(tmp_path, monkeypatch):
    directory = _private_dir(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: directory.stat().st_uid + 1)
    assert "not by this user" in DiskCache(directory)._unsafe_reason()


def test_a_missing_directory_is_created_private(tmp_path):
    directory = tmp_path / "a" / "b"
    assert DiskCache(directory).usable()
    assert directory.stat().st_mode & 0o077 == 0


# ---- through real compiled kernels ------------------------------------------------------------


def _combine_key():
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    from dsv4_attn.kernels import sparse_decode
    from dsv4_attn.kernels.combine import CombineConfig

    key = CombineConfig(has_sink=True)
    return key, lambda: sparse_decode.build_combine_kernel(key)


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    key, build = _combine_key()
    directory = _private_dir(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, str(directory))
    writer = CompileCache("combine_test")
    writer.get(key, build)
    path = writer.object_path(key, directory)
    assert path.exists() and DiskCache(directory).read(path.stem) is not None

    # A fresh cache (as in a new process) loads the object instead of compiling.
    reader = CompileCache("combine_test")
    loaded = reader.get(key, lambda: pytest.fail("compiled although the object was on disk"))
    assert callable(loaded)
    # Another key (or changed kernel sources) maps to another file.
    from dsv4_attn.kernels.combine import CombineConfig

    assert writer.object_path(CombineConfig(has_sink=False), directory) != path


def test_a_flipped_object_is_rebuilt_not_loaded(tmp_path, monkeypatch, dsv4_logs):
    """256 flipped bytes inside the object: the cache must not link it, but compile again and
    replace the file with a good one."""
    key, build = _combine_key()
    directory = _private_dir(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, str(directory))
    CompileCache("combine_test").get(key, build)
    path = CompileCache("combine_test").object_path(key, directory)
    good = path.read_bytes()
    middle = len(good) // 2
    path.write_bytes(
        good[:middle] + bytes(b ^ 0xA5 for b in good[middle : middle + 256]) + good[middle + 256 :]
    )
    loads = []
    monkeypatch.setattr(compile_cache, "_load_object", lambda payload: loads.append(payload))
    builds = []
    CompileCache("combine_test").get(key, lambda: builds.append(1) or build())
    assert builds == [1] and loads == []
    assert any("does not match its SHA-256" in r.getMessage() for r in dsv4_logs.records)
    assert DiskCache(directory).read(path.stem) is not None  # rewritten intact


def test_the_key_names_the_runtime_variant(monkeypatch, tmp_path):
    """Objects built against another CuTeDSL runtime library get other names: two builds whose
    runtime libraries have the same file name and size, one under ``cu12/``, the other under
    ``cu13/``, never share a file; two installs of one build (same variant, name and size, other
    site-packages) do (the key names the variant, not the install path)."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    def library(site: str, variant: str) -> Path:
        path = tmp_path / site / "nvidia_cutlass_dsl" / variant / "lib" / "libcute_dsl_runtime.so"
        path.parent.mkdir(parents=True)
        path.write_bytes(bytes(4096))  # same size for every variant: only the folder differs
        return path

    def stem_linking(lib: Path) -> str:
        compile_cache._source_fingerprint.cache_clear()
        monkeypatch.setattr(cute.runtime, "find_runtime_libraries", lambda **_: [str(lib)])
        return CompileCache("k").file_stem(("same", "key"))

    try:
        cu12 = stem_linking(library("site_a", "cu12"))
        cu13 = stem_linking(library("site_a", "cu13"))
        cu13_elsewhere = stem_linking(library("site_b", "cu13"))
    finally:
        compile_cache._source_fingerprint.cache_clear()
    assert cu12 != cu13
    assert cu13 == cu13_elsewhere


@pytest.fixture
def kernel_sources(tmp_path, monkeypatch):
    """A private copy of the sources the disk-cache key is computed from (``kernels/*.py`` and
    ``dsv4_attn/kv_cache.py``, whose head dimension and layouts the kernels compile in):
    ``compile_cache.__file__`` and ``kv_cache.__file__`` point into it, so a test can change a
    source's bytes without touching the checkout. The fingerprint cache is cleared on both
    sides."""
    from dsv4_attn import kv_cache

    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    copy = tmp_path / "kernels"
    copy.mkdir()
    for source in Path(compile_cache.__file__).parent.glob("*.py"):
        (copy / source.name).write_bytes(source.read_bytes())
    shared = tmp_path / "dsv4_attn"
    shared.mkdir()
    (shared / "kv_cache.py").write_bytes(Path(kv_cache.__file__).read_bytes())
    compile_cache._source_fingerprint.cache_clear()
    monkeypatch.setattr(compile_cache, "__file__", str(copy / "compile_cache.py"))
    monkeypatch.setattr(kv_cache, "__file__", str(shared / "kv_cache.py"))
    yield tmp_path
    compile_cache._source_fingerprint.cache_clear()


def _flip_one_byte(path: Path) -> bytes:
    """Change one byte in the middle of ``path`` (same length); returns the original bytes."""
    original = path.read_bytes()
    middle = len(original) // 2
    path.write_bytes(original[:middle] + bytes([original[middle] ^ 0x01]) + original[middle + 1 :])
    return original


def _stem(key) -> str:
    """The disk-cache name of ``key``, computed afresh from the sources as they are now."""
    compile_cache._source_fingerprint.cache_clear()
    return CompileCache("combine").file_stem(key)


def _kernel_source_names() -> list[str]:
    kernels = sorted(p.name for p in Path(compile_cache.__file__).parent.glob("*.py"))
    return [f"kernels/{name}" for name in kernels] + ["dsv4_attn/kv_cache.py"]


@pytest.mark.parametrize("name", _kernel_source_names())
def test_the_key_follows_every_byte_of_the_kernel_sources(kernel_sources, name):
    """One byte changed in any source of the kernel package, or in the cache formats the
    kernels compile in, names the object differently, and the original bytes name it as before
    (the name follows the bytes, not the files' place)."""
    key = ("same", "key")
    original_stem = _stem(key)
    saved = _flip_one_byte(kernel_sources / name)
    assert _stem(key) != original_stem
    (kernel_sources / name).write_bytes(saved)
    assert _stem(key) == original_stem


def test_the_copied_sources_name_objects_as_the_checkout_does(kernel_sources, monkeypatch):
    """Control for the test above: the private copy, unchanged, gives the checkout's names."""
    key = ("same", "key")
    copied = _stem(key)
    monkeypatch.undo()  # back to the checkout's compile_cache.__file__
    assert _stem(key) == copied


def test_an_object_compiled_from_other_source_bytes_is_not_loaded(
    kernel_sources, tmp_path, monkeypatch
):
    """An object stored while a kernel source had other bytes (a stale build of the same key)
    is loaded while the sources are unchanged, and never once one byte of them changed: the
    kernel is built again and stored under the new name. Nothing is compiled: the build, the
    export and the load are stand-ins."""
    from dsv4_attn.kernels.combine import CombineConfig

    directory = _private_dir(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, str(directory))
    key = CombineConfig(has_sink=True)
    stale = b"object built from the old sources" * 64
    compile_cache._source_fingerprint.cache_clear()
    DiskCache(directory).write(CompileCache("combine").file_stem(key), stale)

    loads, builds = [], []
    monkeypatch.setattr(compile_cache, "_load_object", lambda payload: loads.append(payload))
    monkeypatch.setattr(compile_cache, "_export_object", lambda compiled: b"fresh object")

    def build() -> object:
        builds.append(1)
        return object()

    # Sources unchanged: the stored object is what a new process loads (so the stand-ins see a
    # load when there is one).
    CompileCache("combine").get(key, build)
    assert loads == [stale] and builds == []

    _flip_one_byte(kernel_sources / "kernels" / "combine.py")
    compile_cache._source_fingerprint.cache_clear()
    fresh = CompileCache("combine")
    built = fresh.get(key, build)
    assert loads == [stale] and builds == [1] and built is not None
    assert DiskCache(directory).read(fresh.file_stem(key)) == b"fresh object"


_WRITER = """
import os, sys
os.getpid = lambda: 1  # as in two containers, each its own PID namespace
from dsv4_attn.kernels.compile_cache import DiskCache
disk = DiskCache(sys.argv[1])
payload = bytes.fromhex(sys.argv[2]) * 40000
for _ in range(int(sys.argv[3])):
    disk.write("shared", payload)
    got = disk.read("shared")
    assert got is not None and len(got) == len(payload), "read a half-written file"
print("OK")
"""


def test_two_processes_writing_one_key_never_leave_a_broken_file(tmp_path):
    """Two writers (same pid, as across containers) storing different objects under one name
    at once: every read in either sees a whole object, the final file is one of the two, and no
    temporary file is left behind."""
    directory = _private_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(directory), tag, "150"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tag in ("a5", "5a")
    ]
    for writer in writers:
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0 and "OK" in out, err[-2000:]
    final = DiskCache(directory).read("shared")
    assert final in (bytes.fromhex("a5") * 40000, bytes.fromhex("5a") * 40000)
    assert [p.name for p in directory.iterdir()] == ["shared.kc"]
