"""Compile cache for the CuTeDSL kernels, keyed on every compile-time parameter.

``cute.compile`` keeps no cache of its own in nvidia-cutlass-dsl 4.8 (explicit compiles always
rebuild), so each kernel family keeps one :class:`CompileCache`: the key is a frozen dataclass
holding every compile-time parameter, the value the TVM-FFI executable. Kernels are compiled
against fake tensors (symbolic shapes and strides), so one executable serves every shape, and
with ``--gpu-arch sm_90a`` compiling needs no GPU (CI compiles every variant on a CPU machine).
A compiled executable is called with torch tensors directly and launches on the current torch
stream (``use_tvm_ffi_env_stream``), so it works under CUDA-graph capture.

Disk cache: executables are exported as object files (``export_to_c``) into
:func:`cache_directory` — ``DSV4_ATTN_KERNEL_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/dsv4_attn/kernels`` (``~/.cache/dsv4_attn/kernels``); an empty value or ``0``
keeps kernels in memory only — and reloaded by later processes (``cute.runtime.load_module``,
milliseconds instead of seconds of compiling): a server's second start compiles nothing, and
``python -m dsv4_attn.kernels.precompile`` fills the cache before the first. Loading links native
code into the process, so the cache is guarded (:class:`DiskCache`):

* a file is named by a hash of the key, the kernels' source files, the CuTeDSL / TVM-FFI versions,
  the CuTeDSL runtime library variant (cu12 / cu13) and the machine, so a changed kernel or
  another build never loads a stale object;
* a file carries the SHA-256 and length of its object; a file that does not match (truncated,
  corrupted, flipped) is never loaded: the kernel is rebuilt and the file rewritten;
* the directory must belong to this user and be writable by nobody else; otherwise the cache
  is not used at all (kernels compile in memory, one WARNING per directory);
* writers write a uniquely named temporary file and rename it into place, so processes (or
  containers sharing the directory) never see or produce a half-written file.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

from dsv4_attn.log import get_logger

__all__ = [
    "CACHE_DIR_ENV",
    "COMPILE_OPTIONS",
    "CompileCache",
    "DiskCache",
    "cache_directory",
    "compile_keeping_cubin",
    "compile_tvm_ffi",
    "cubin_bytes",
    "fake_stream",
    "keeping_cubins",
]

logger = get_logger(__name__)

COMPILE_OPTIONS = "--enable-tvm-ffi --gpu-arch sm_90a"
CACHE_DIR_ENV = "DSV4_ATTN_KERNEL_CACHE_DIR"
_EXPORTED_NAME = "func"
_REFUSED_DIRS: set[str] = set()  # cache directories already warned about (one warning each)


def cache_directory() -> Path | None:
    """Where compiled kernels persist: ``$DSV4_ATTN_KERNEL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dsv4_attn/kernels`` (``~/.cache/dsv4_attn/kernels`` without it); None
    (memory only) when the variable is set to an empty string or ``0``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is not None:
        return None if configured.strip() in ("", "0") else Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4_attn" / "kernels"


def fake_stream() -> Any:
    """A stand-in stream argument: the real one is the current torch stream at call time."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_tvm_ffi(entry: Callable[..., Any], *fake_args: Any, options: str = "") -> Any:
    """``cute.compile`` for sm_90a with the TVM-FFI launcher; ``fake_args`` exclude the stream."""
    import cutlass.cute as cute

    return cute.compile(entry, *fake_args, fake_stream(), options=f"{COMPILE_OPTIONS} {options}")


@contextlib.contextmanager
def keeping_cubins(dump_dir: str | os.PathLike) -> Iterator[None]:
    """Within it, every kernel compiled through :func:`compile_tvm_ffi` keeps its cubin under
    ``dump_dir`` (read it with :func:`cubin_bytes`)."""
    global COMPILE_OPTIONS
    original = COMPILE_OPTIONS
    COMPILE_OPTIONS = f"{original} --keep-cubin --dump-dir={dump_dir}"
    try:
        yield
    finally:
        COMPILE_OPTIONS = original


def cubin_bytes(compiled: Any) -> bytes:
    """The cubin of a kernel compiled inside :func:`keeping_cubins`."""
    cubin = compiled.artifacts.CUBIN
    if isinstance(cubin, str):  # with --dump-dir the artifact is the file's path
        with open(cubin, "rb") as f:
            cubin = f.read()
    return cubin


def compile_keeping_cubin(build: Callable[[], Any], dump_dir: str | os.PathLike) -> bytes:
    """The cubin of ``build()`` (a function that compiles one kernel through
    :func:`compile_tvm_ffi`), kept by ptxas under ``dump_dir``: what the CPU tests disassemble
    and read register / stack use from."""
    with keeping_cubins(dump_dir):
        return cubin_bytes(build())


def _fingerprint_sources() -> list[Path]:
    """The source files whose bytes a compiled object depends on: this package's kernel sources
    and the modules outside it whose values the kernels compile in (``dsv4_attn.kv_cache``: the
    head dimension and the cache formats' byte layouts)."""
    from dsv4_attn import kv_cache

    return [*sorted(Path(__file__).parent.glob("*.py")), Path(kv_cache.__file__)]


@functools.cache
def _source_fingerprint() -> str:
    """Hash of everything a cached object depends on besides its key: the sources of
    :func:`_fingerprint_sources`, the DSL versions, the runtime libraries it links against (by
    variant and size, not install path: ``cu13/libcute_dsl_runtime.so`` or ``cu12/...``, so any
    install of the same build shares objects) and the machine."""
    import cutlass
    import cutlass.cute as cute
    import tvm_ffi

    digest = hashlib.sha256()
    for path in _fingerprint_sources():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(str(getattr(cutlass, "__version__", "?")).encode())
    digest.update(str(getattr(tvm_ffi, "__version__", "?")).encode())
    for lib in map(Path, cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)):
        size = lib.stat().st_size if lib.exists() else -1
        digest.update(f"{lib.parent.parent.name}/{lib.name}|{size}".encode())
    digest.update(f"{platform.system()}|{platform.machine()}".encode())
    return digest.hexdigest()


@functools.cache
def _preload_runtime_libraries() -> None:
    # Objects loaded from disk resolve CUDA-runtime symbols against the DSL's runtime libraries,
    # which must be loaded globally first.
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


class DiskCache:
    """Compiled objects in one directory, checked before they are loaded (see the module
    docstring). File format: :data:`MAGIC`, the SHA-256 of the object (32 bytes), its length
    (8 bytes, little-endian), the object."""

    MAGIC = b"DSV4KC1\n"
    SUFFIX = ".kc"
    _HEADER = len(MAGIC) + 32 + 8

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def usable(self) -> bool:
        """Create the directory (mode 0700) if needed; whether it is safe to load from: a
        directory of this user's, writable by no one else. Warns once per directory if not."""
        reason = self._unsafe_reason()
        if reason is None:
            return True
        if str(self.directory) not in _REFUSED_DIRS:
            _REFUSED_DIRS.add(str(self.directory))
            logger.warning(
                "dsv4_attn: kernel cache %s is not used (%s); kernels compile in memory. Set %s "
                "to a directory of your own with mode 0700 or 0755.",
                self.directory,
                reason,
                CACHE_DIR_ENV,
            )
        return False

    def _unsafe_reason(self) -> str | None:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = self.directory.stat()
        except OSError as exc:
            return f"cannot create or read it: {exc}"
        if not stat.S_ISDIR(info.st_mode):
            return "not a directory"
        if info.st_uid != os.geteuid():
            return f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
        return None

    def path(self, stem: str) -> Path:
        return self.directory / f"{stem}{self.SUFFIX}"

    def read(self, stem: str) -> bytes | None:
        """The object stored under ``stem`` if present and intact; None if absent. Raises
        ValueError naming what is wrong with a damaged file."""
        try:
            data = self.path(stem).read_bytes()
        except FileNotFoundError:
            return None
        if len(data) < self._HEADER or not data.startswith(self.MAGIC):
            raise ValueError(f"{len(data)} bytes without a valid header")
        digest = data[len(self.MAGIC) : len(self.MAGIC) + 32]
        length = int.from_bytes(data[len(self.MAGIC) + 32 : self._HEADER], "little")
        payload = data[self._HEADER :]
        if len(payload) != length:
            raise ValueError(f"object of {len(payload)} bytes, its header says {length}")
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError("object does not match its SHA-256")
        return payload

    def write(self, stem: str, payload: bytes) -> None:
        """Store ``payload`` under ``stem``: a uniquely named temporary file renamed into place."""
        header = self.MAGIC + hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "little")
        fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header + payload)
            os.replace(tmp, self.path(stem))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _export_object(compiled: Any) -> bytes:
    """The object file of a compiled executable (``export_to_c`` writes it to a path)."""
    with tempfile.TemporaryDirectory(prefix="dsv4_attn_export_") as private:
        path = Path(private) / "kernel.o"
        compiled.export_to_c(object_file_path=str(path), function_name=_EXPORTED_NAME)
        return path.read_bytes()


def _load_object(payload: bytes) -> Any:
    """Link a verified object into the process, from a private copy (nobody can swap the file
    between the check and the load)."""
    import cutlass.cute as cute

    _preload_runtime_libraries()
    with tempfile.TemporaryDirectory(prefix="dsv4_attn_load_") as private:
        path = Path(private) / "kernel.o"
        path.write_bytes(payload)
        module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, _EXPORTED_NAME)


class CompileCache:
    """Thread-safe map from a compile key to its compiled executable (built once per process)."""

    def __init__(self, name: str):
        self.name = name
        self._compiled: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The executable for ``key``: from memory, else from the disk cache, else ``build()``."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._load_or_build(key, build)
                self._compiled[key] = compiled
        return compiled

    def file_stem(self, key: Hashable) -> str:
        """The name (without suffix) the disk cache keeps ``key``'s object under."""
        digest = hashlib.sha256(f"{self.name}|{key!r}|{_source_fingerprint()}".encode())
        return f"{self.name}-{digest.hexdigest()[:32]}"

    def object_path(self, key: Hashable, directory: str | os.PathLike) -> Path:
        """Where the disk cache keeps ``key``'s object file inside ``directory``."""
        return DiskCache(directory).path(self.file_stem(key))

    def _load_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        directory = cache_directory()
        disk = DiskCache(directory) if directory is not None else None
        if disk is None or not disk.usable():
            return self._build(key, build, "kept in memory")
        stem = self.file_stem(key)
        try:
            payload = disk.read(stem)
            if payload is not None:
                return _load_object(payload)
        except Exception as exc:  # damaged, or an object this runtime cannot link: rebuild
            logger.warning(
                "dsv4_attn: cached kernel %s not loaded (%s); recompiling", disk.path(stem), exc
            )
        compiled = self._build(key, build, f"stored in {directory}")
        try:
            disk.write(stem, _export_object(compiled))
        except Exception as exc:
            logger.warning(
                "dsv4_attn: cannot store kernel %s in the disk cache (%s)", disk.path(stem), exc
            )
        return compiled

    def _build(self, key: Hashable, build: Callable[[], Any], where: str) -> Any:
        """``build()``, logged with its time: a server log then shows every kernel it compiled
        (none where the disk cache held them all)."""
        start = time.perf_counter()
        compiled = build()
        logger.info(
            "dsv4_attn: compiled %s %r in %.1f s (%s)",
            self.name,
            key,
            time.perf_counter() - start,
            where,
        )
        return compiled

    def __contains__(self, key: Hashable) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def clear(self) -> None:
        with self._lock:
            self._compiled.clear()
