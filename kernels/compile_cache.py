"""Compile cache for the CuTeDSL kernels, keyed on every compile-time parameter.

``cute.compile`` keeps no cache of its own in nvidia-cutlass-dsl 4.8 (explicit compiles always
rebuild), so each kernel family keeps one :class:`CompileCache`: the key is a frozen dataclass
holding every compile-time parameter, the value the TVM-FFI executable. Kernels are compiled
against fake tensors (symbolic shapes and strides), so one executable serves every shape, and
with ``--gpu-arch sm_90a`` compiling needs no GPU (CI compiles every variant on a CPU machine).
A compiled executable is called with torch tensors directly and launches on the current torch
stream (``use_tvm_ffi_env_stream``), so it works under CUDA-graph capture.

Optional disk cache: with ``DSV4_ATTN_KERNEL_CACHE_DIR`` set, executables are exported there as
object files (``export_to_c``) and reloaded by later processes (``cute.runtime.load_module``,
milliseconds instead of seconds of compiling). File names hash the key, the kernels' source
files and the CuTeDSL / TVM-FFI versions, so a changed kernel never loads a stale object.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_DIR_ENV",
    "COMPILE_OPTIONS",
    "CompileCache",
    "compile_keeping_cubin",
    "compile_tvm_ffi",
    "fake_stream",
]

logger = logging.getLogger(__name__)

COMPILE_OPTIONS = "--enable-tvm-ffi --gpu-arch sm_90a"
CACHE_DIR_ENV = "DSV4_ATTN_KERNEL_CACHE_DIR"
_EXPORTED_NAME = "func"


def fake_stream() -> Any:
    """A stand-in stream argument: the real one is the current torch stream at call time."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_tvm_ffi(entry: Callable[..., Any], *fake_args: Any, options: str = "") -> Any:
    """``cute.compile`` for sm_90a with the TVM-FFI launcher; ``fake_args`` exclude the stream."""
    import cutlass.cute as cute

    return cute.compile(entry, *fake_args, fake_stream(), options=f"{COMPILE_OPTIONS} {options}")


def compile_keeping_cubin(build: Callable[[], Any], dump_dir: str | os.PathLike) -> bytes:
    """The cubin of ``build()`` (a function that compiles one kernel through
    :func:`compile_tvm_ffi`), kept by ptxas under ``dump_dir``: what the CPU tests disassemble
    and read register / stack use from."""
    global COMPILE_OPTIONS
    original = COMPILE_OPTIONS
    COMPILE_OPTIONS = f"{original} --keep-cubin --dump-dir={dump_dir}"
    try:
        compiled = build()
    finally:
        COMPILE_OPTIONS = original
    cubin = compiled.artifacts.CUBIN
    if isinstance(cubin, str):  # with --dump-dir the artifact is the file's path
        with open(cubin, "rb") as f:
            cubin = f.read()
    return cubin


@functools.cache
def _source_fingerprint() -> str:
    """Hash of this package's kernel sources and the DSL versions."""
    import cutlass
    import tvm_ffi

    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(str(getattr(cutlass, "__version__", "?")).encode())
    digest.update(str(getattr(tvm_ffi, "__version__", "?")).encode())
    return digest.hexdigest()


@functools.cache
def _preload_runtime_libraries() -> None:
    # Objects loaded from disk resolve CUDA-runtime symbols against the DSL's runtime libraries,
    # which must be loaded globally first.
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


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

    def object_path(self, key: Hashable, directory: str | os.PathLike) -> Path:
        """Where the disk cache keeps ``key``'s object file inside ``directory``."""
        digest = hashlib.sha256(f"{self.name}|{key!r}|{_source_fingerprint()}".encode())
        return Path(directory) / f"{self.name}-{digest.hexdigest()[:32]}.o"

    def _load_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        directory = os.environ.get(CACHE_DIR_ENV)
        if not directory:
            return build()
        path = self.object_path(key, directory)
        if path.exists():
            try:
                import cutlass.cute as cute

                _preload_runtime_libraries()
                module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
                return getattr(module, _EXPORTED_NAME)
            except Exception as exc:  # a broken or foreign object: rebuild it
                logger.warning(
                    "dsv4_attn: cannot load cached kernel %s (%s); recompiling", path, exc
                )
        compiled = build()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.o")
            compiled.export_to_c(object_file_path=str(tmp), function_name=_EXPORTED_NAME)
            tmp.replace(path)
        except Exception as exc:
            logger.warning("dsv4_attn: cannot store kernel %s in the disk cache (%s)", path, exc)
        return compiled

    def __contains__(self, key: Hashable) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def clear(self) -> None:
        with self._lock:
            self._compiled.clear()
