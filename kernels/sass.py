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

__all__ = ["count_opcodes", "find_cuda_tool", "opcode_counts", "wgmma_counts"]

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
    return shutil.which(name, path=os.path.join(os.path.dirname(triton.__file__),
                                                 "backends", "nvidia", "bin"))  # fmt: skip


def opcode_counts(cubin: bytes, tool: str | None = None) -> Counter[str]:
    """How many times each SASS opcode (with its modifiers, e.g. ``HGMMA.64x32x16.F32.BF16``)
    appears in ``cubin``. Raises FileNotFoundError when ``nvdisasm`` is not installed."""
    tool = tool or find_cuda_tool("nvdisasm")
    if tool is None:
        raise FileNotFoundError("nvdisasm is not installed (neither on PATH nor in triton)")
    with tempfile.TemporaryDirectory(prefix="sass_") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    return count_opcodes(text)


def count_opcodes(sass_text: str) -> Counter[str]:
    """Opcode counts of ``nvdisasm -c`` output (predicates dropped, modifiers kept)."""
    counts: Counter[str] = Counter()
    for line in sass_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            counts[match.group(1)] += 1
    return counts


def wgmma_counts(cubin: bytes, tool: str | None = None) -> tuple[int, int]:
    """``(HGMMA instructions, WARPGROUP.DEPBAR waits)`` in ``cubin``: a pipelined kernel has a
    few waits per MMA loop, a serialized one about as many waits as HGMMAs."""
    counts = opcode_counts(cubin, tool)
    hgmma = sum(n for op, n in counts.items() if op.startswith("HGMMA"))
    waits = sum(n for op, n in counts.items() if op.startswith("WARPGROUP.DEPBAR"))
    return hgmma, waits
