"""Read a kernel's register count and stack frame straight from its cubin (no CUDA tools needed).

A cubin is an ELF file whose ``.nv.info`` sections hold ``EIATTR`` records, among them
``EIATTR_REGCOUNT`` (0x2f), ``EIATTR_FRAME_SIZE`` (0x11) and ``EIATTR_MAX_STACK_SIZE`` (0x23),
the per-thread local-memory frame. Our kernels keep no arrays in local memory, so a non-zero
frame means ptxas spilled registers. Used by the CI compile tests to fail on spills.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["KernelResources", "cubin_resources"]

_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
_EIATTR_MAX_STACK_SIZE = 0x23
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4


@dataclass(frozen=True)
class KernelResources:
    """Per-thread resources of one kernel in a cubin."""

    name: str
    registers: int
    frame_bytes: int  # local-memory stack frame (spills, local arrays)
    max_stack_bytes: int


def _sections(elf: bytes) -> list[tuple[str, int, int, int]]:
    """(name, offset, size, sh_info) of every section of a little-endian ELF64 file."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a little-endian ELF64 cubin")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = []
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off, _type, _flags, _addr, offset, size, _link, info = struct.unpack_from(
            "<IIQQQQII", elf, base
        )
        headers.append((name_off, offset, size, info))
    strtab_off = headers[shstrndx][1]

    def name_at(off: int) -> str:
        end = elf.index(b"\x00", strtab_off + off)
        return elf[strtab_off + off : end].decode()

    return [(name_at(n), off, size, info) for n, off, size, info in headers]


def _eiattr_values(data: bytes, attr: int) -> list[int]:
    """Values of every ``attr`` record (SVAL records carry (symbol index, value))."""
    values, pos = [], 0
    while pos + 2 <= len(data):
        fmt, code = data[pos], data[pos + 1]
        pos += 2
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", data, pos)
            payload = data[pos + 2 : pos + 2 + size]
            pos += 2 + size
            if code == attr and size >= 8:
                values.append(struct.unpack_from("<I", payload, 4)[0])
        elif fmt == _EIFMT_HVAL:
            pos += 2
        elif fmt == _EIFMT_BVAL:
            pos += 1
        elif fmt == _EIFMT_NVAL:
            pos += 2
        else:
            break
    return values


def cubin_resources(cubin: bytes) -> list[KernelResources]:
    """Resources of every kernel (``.text.*`` section) of a cubin.

    Values are the largest recorded in the cubin (the kernels we check come one per cubin).
    """
    sections = _sections(cubin)
    regs, frames, stacks = [0], [0], [0]
    for name, offset, size, _ in sections:
        if name.startswith(".nv.info"):
            data = cubin[offset : offset + size]
            regs += _eiattr_values(data, _EIATTR_REGCOUNT)
            frames += _eiattr_values(data, _EIATTR_FRAME_SIZE)
            stacks += _eiattr_values(data, _EIATTR_MAX_STACK_SIZE)
    return [
        KernelResources(name[len(".text.") :], max(regs), max(frames), max(stacks))
        for name, _, _, _ in sections
        if name.startswith(".text.")
    ]
