"""Read per-kernel resource usage (registers, local-memory frame, shared memory) from a cubin.

ptxas records these in the ``.nv.info.<kernel>`` ELF sections as "EIATTR" attributes. Reading
them directly avoids depending on ``cuobjdump`` being installed (it usually is not on CPU CI).
A non-zero frame or stack size means the kernel uses local memory, i.e. register spills.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["KernelResources", "read_resources"]

# EIATTR attribute ids (cuobjdump --dump-elf names them).
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_MIN_STACK_SIZE = 0x12
_EIATTR_MAX_STACK_SIZE = 0x23
_EIATTR_REGCOUNT = 0x2F
# Formats: 1 = no value, 2 = 8-bit, 3 = 16-bit value, 4 = 16-bit size then `size` bytes.
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4


@dataclass(frozen=True)
class KernelResources:
    """Resource usage of one kernel: registers per thread, local bytes, static shared bytes."""

    name: str
    registers: int
    frame_bytes: int
    stack_bytes: int
    static_smem_bytes: int

    @property
    def spills(self) -> bool:
        """True when the kernel uses local memory (register spills or stack)."""
        return self.frame_bytes > 0 or self.stack_bytes > 0


def _sections(elf: bytes) -> list[tuple[str, int, int, int, int]]:
    """``(name, type, offset, size, info)`` of every section of a 64-bit little-endian ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF (cubin)")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = []
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off, sh_type = struct.unpack_from("<II", elf, base)
        offset, size = struct.unpack_from("<QQ", elf, base + 0x18)
        info = struct.unpack_from("<I", elf, base + 0x2C)[0]
        raw.append((name_off, sh_type, offset, size, info))
    str_off = raw[shstrndx][2]

    def name_at(off: int) -> str:
        end = elf.index(b"\x00", str_off + off)
        return elf[str_off + off : end].decode()

    return [(name_at(n), t, o, s, i) for n, t, o, s, i in raw]


def _attributes(blob: bytes) -> list[tuple[int, bytes]]:
    """Decode an ``.nv.info`` section into ``(attribute id, payload)`` records.

    Records are 4-byte aligned: 1-byte format, 1-byte id, then a 16-bit value (``HVAL``) or a
    16-bit size followed by that many bytes (``SVAL``). Stops at anything else.
    """
    out = []
    pos = 0
    while pos + 4 <= len(blob):
        fmt, attr = blob[pos], blob[pos + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", blob, pos + 2)
            out.append((attr, blob[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            out.append((attr, blob[pos + 2 : pos + 4]))
            pos += 4
        else:
            break
    return out


def _symbol_names(elf: bytes, sections) -> dict[int, str]:
    """Symbol-table index -> name."""
    symtab = next((s for s in sections if s[0] == ".symtab"), None)
    strtab = next((s for s in sections if s[0] == ".strtab"), None)
    if symtab is None or strtab is None:
        return {}
    _, _, off, size, _ = symtab
    str_off = strtab[2]
    names = {}
    for i in range(size // 24):  # Elf64_Sym is 24 bytes; st_name first
        (name_off,) = struct.unpack_from("<I", elf, off + 24 * i)
        end = elf.index(b"\x00", str_off + name_off)
        names[i] = elf[str_off + name_off : end].decode()
    return names


def read_resources(cubin: bytes) -> list[KernelResources]:
    """Resource usage of every kernel (``.text.<name>`` section) in ``cubin``."""
    sections = _sections(cubin)
    by_name = {name: (off, size) for name, _, off, size, _ in sections}
    kernels = [name[len(".text.") :] for name, *_ in sections if name.startswith(".text.")]
    symbols = _symbol_names(cubin, sections)
    # Per-function attributes live in the global .nv.info as (symbol index, value) pairs.
    values: dict[tuple[str, int], int] = {}
    if ".nv.info" in by_name:
        off, size = by_name[".nv.info"]
        for attr, payload in _attributes(cubin[off : off + size]):
            if len(payload) >= 8:
                sym, value = struct.unpack_from("<II", payload, 0)
                values[(symbols.get(sym, ""), attr)] = value
    result = []
    for kernel in kernels:
        stack = max(
            values.get((kernel, _EIATTR_MIN_STACK_SIZE), 0),
            values.get((kernel, _EIATTR_MAX_STACK_SIZE), 0),
        )
        result.append(
            KernelResources(
                name=kernel,
                registers=values.get((kernel, _EIATTR_REGCOUNT), 0),
                frame_bytes=values.get((kernel, _EIATTR_FRAME_SIZE), 0),
                stack_bytes=stack,
                static_smem_bytes=by_name.get(f".nv.shared.{kernel}", (0, 0))[1],
            )
        )
    return result
