"""Compile the sparse-decode kernel variants ahead of time (no GPU needed).

``python -m dsv4_attn.kernels.precompile DIR`` compiles every variant of :func:`decode_variants`
and :func:`combine_variants` for sm_90a and stores them in the disk cache ``DIR`` (see
:mod:`dsv4_attn.kernels.compile_cache`); a process started with
``DSV4_ATTN_KERNEL_CACHE_DIR=DIR`` then loads them in milliseconds instead of compiling.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

from dsv4_attn.kernels.combine import CombineConfig
from dsv4_attn.kernels.sparse_decode_config import SparseDecodeConfig

__all__ = ["combine_variants", "decode_variants"]


def decode_variants(
    block_size: int = 64, extra_block_size: int = 16, index_dtype: str = "int32"
) -> list[SparseDecodeConfig]:
    """Every code path of the decode kernel for one pair of page sizes and one index dtype:
    format x (extra scope or not) x (sink or not) x (final output, split partials, or the
    balanced schedule's both: with the extra scope, where long key lists come from)."""
    outputs = ((False, False), (True, False), (False, True))  # (write_partial, balanced)
    return [
        SparseDecodeConfig(fmt, block_size, extra, index_dtype, index_dtype, sink, *output)
        for fmt, extra, sink, output in itertools.product(
            ("fp8_ds_mla", "nvfp4"), (extra_block_size, 0), (True, False), outputs
        )
        if extra or not output[1]
    ]


def combine_variants() -> list[CombineConfig]:
    return [
        CombineConfig(has_sink=sink, balanced=balanced, warps_per_row=warps)
        for sink in (True, False)
        for balanced in (False, True)
        for warps in (1, 4)
    ]


def main(argv: list[str] | None = None) -> None:
    from dsv4_attn.kernels import sparse_decode
    from dsv4_attn.kernels.compile_cache import CACHE_DIR_ENV

    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.kernels.precompile")
    parser.add_argument("directory")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--extra-block-size", type=int, default=16)
    parser.add_argument("--index-dtype", choices=("int32", "int64"), default="int32")
    args = parser.parse_args(argv)
    os.environ[CACHE_DIR_ENV] = args.directory
    decode_cache, combine_cache = sparse_decode._caches()
    for config in decode_variants(args.block_size, args.extra_block_size, args.index_dtype):
        start = time.perf_counter()
        decode_cache.get(config, lambda c=config: sparse_decode.build_decode_kernel(c))
        print(f"{time.perf_counter() - start:6.1f} s  {config}", flush=True)
    for config in combine_variants():
        combine_cache.get(config, lambda c=config: sparse_decode.build_combine_kernel(c))
        print(f"          {config}", flush=True)


if __name__ == "__main__":
    main()
