"""Disassemble a cubin with ``nvdisasm`` (when installed) and count its SASS opcodes.

The CPU tests use it to catch what ptxas does silently: when it cannot prove a wgmma pipeline
safe it serializes it, waiting (``WARPGROUP.DEPBAR``) after every ``HGMMA`` — its C7514/C7515
"Potential Performance Loss" notes, which CuTeDSL does not show — and the tensor cores idle
between the k-steps of every MMA.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter

__all__ = [
    "count_moves_before_wgmma",
    "count_opcodes",
    "disassemble",
    "find_cuda_tool",
    "moves_before_wgmma",
    "opcode_counts",
    "opcodes",
    "wgmma_counts",
]

# "/*0250*/    @!P0 USETMAXREG.DEALLOC.CTAPOOL 0x88 ;": the opcode after an optional predicate.
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")


def find_cuda_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (``nvdisasm``, ``cuobjdump``): on PATH, or the copy Triton
    ships; None if neither exists."""
    tool = shutil.which(name)
    if tool is not None:
        return tool
    try:
        import triton
    except ImportError:
        return None
    return shutil.which(
        name, path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    )


def disassemble(cubin: bytes, tool: str | None = None) -> str:
    """``nvdisasm -c`` of ``cubin``. Raises FileNotFoundError when ``nvdisasm`` is not installed."""
    tool = tool or find_cuda_tool("nvdisasm")
    if tool is None:
        raise FileNotFoundError("nvdisasm is not installed (neither on PATH nor in triton)")
    with tempfile.TemporaryDirectory(prefix="sass_") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout


def opcode_counts(cubin: bytes, tool: str | None = None) -> Counter[str]:
    """How many times each SASS opcode (with its modifiers, e.g. ``HGMMA.64x32x16.F32.BF16``)
    appears in ``cubin``. Raises FileNotFoundError when ``nvdisasm`` is not installed."""
    return count_opcodes(disassemble(cubin, tool))


def opcodes(sass_text: str) -> list[str]:
    """The opcodes of ``nvdisasm -c`` output in program order (predicates dropped)."""
    return [m.group(1) for line in sass_text.splitlines() if (m := _INSTRUCTION.match(line))]


def moves_before_wgmma(cubin: bytes, tool: str | None = None, window: int = 16) -> int:
    """:func:`count_moves_before_wgmma` of ``cubin``'s SASS."""
    return count_moves_before_wgmma(disassemble(cubin, tool), window)


def count_moves_before_wgmma(sass_text: str, window: int = 16) -> int:
    """How many ``R2UR`` moves (register -> uniform register) are followed by an ``HGMMA``
    within ``window`` instructions: a wgmma descriptor built in regular registers and moved over
    before its MMA (what a runtime stage index makes ptxas do), rather than a value made uniform
    once outside the MMA loop."""
    ops = opcodes(sass_text)
    return sum(
        1
        for i, op in enumerate(ops)
        if op.split(".")[0] == "R2UR"
        and any(o.startswith("HGMMA") for o in ops[i + 1 : i + 1 + window])
    )


def count_opcodes(sass_text: str) -> Counter[str]:
    """Opcode counts of ``nvdisasm -c`` output (predicates dropped, modifiers kept)."""
    return Counter(opcodes(sass_text))


def wgmma_counts(cubin: bytes, tool: str | None = None) -> tuple[int, int]:
    """``(HGMMA instructions, WARPGROUP.DEPBAR waits)`` in ``cubin``: a pipelined kernel has a
    few waits per MMA loop, a serialized one about as many waits as HGMMAs."""
    counts = opcode_counts(cubin, tool)
    hgmma = sum(n for op, n in counts.items() if op.startswith("HGMMA"))
    waits = sum(n for op, n in counts.items() if op.startswith("WARPGROUP.DEPBAR"))
    return hgmma, waits
