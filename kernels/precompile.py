"""Compile the kernels a DeepSeek-V4 server uses ahead of time, into the kernel disk cache.

    python -m dsv4_attn.kernels.precompile [--kv-cache-dtype auto|fp8|all] [--model DIR]

A ``vllm serve <DeepSeek-V4> --attention-backend DSV4_NVFP4`` launches a fixed set of kernel
variants (:func:`compile_layer_kernels` per layer kind): the sparse-decode kernel for the cache
format and the page sizes of each layer kind (final output, split partials, and for HCA layers the
balanced schedule's), its combine kernels, and the gathered prefill FMHA. The set depends only on
the cache format and on the page sizes vLLM gives DeepSeek-V4 (:data:`SWA_BLOCK_TOKENS`-token
window pages, :data:`CACHE_BLOCK_TOKENS`-token compressed blocks: 64 rows for CSA, 2 for HCA):
heads per rank, batch, lengths and model size are runtime values. One run therefore covers
V4-Flash and V4-Pro at every tensor- and data-parallel size, for the DSL install it runs under.

Kernels go to :func:`~dsv4_attn.kernels.compile_cache.cache_directory` (``--cache-dir`` or
``DSV4_ATTN_KERNEL_CACHE_DIR`` to choose another); a server started afterwards loads them in
milliseconds. Without this command, a server compiles what it uses in its profiling run and stores
it there, so only its first start pays. Compiling needs no GPU (sm_90a is the target).

:func:`decode_variants` and :func:`combine_variants` list every code path of those kernels (also
those no server uses: no sink), for the tests that compile them all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

from dsv4_attn.kernels.combine import CombineConfig
from dsv4_attn.kernels.sparse_decode_config import SparseDecodeConfig
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.layer_kind import Compressed, Family, compressed_of

__all__ = [
    "CACHE_BLOCK_TOKENS",
    "SWA_BLOCK_TOKENS",
    "combine_variants",
    "compile_layer_kernels",
    "compile_serving_layer",
    "decode_variants",
    "model_compress_ratios",
]

SWA_BLOCK_TOKENS = 64
"""Tokens per page of vLLM 0.33's DeepSeek-V4 sliding-window cache (``DeepseekV4SWACache``)."""
CACHE_BLOCK_TOKENS = 256
"""Tokens per block of the compressed caches: the one block size vLLM's DeepSeek-V4 backends
accept (``get_supported_kernel_block_sizes``)."""
DEEPSEEK_V4_RATIOS = (1, 4, 128)
"""Compression ratios of DeepSeek-V4's layer kinds: window only, CSA, HCA."""
_CSA_RATIO = 4
_FORMATS = {
    "auto": (KVFormat.NVFP4,),
    "fp8": (KVFormat.FP8_DS_MLA,),
    "all": (KVFormat.NVFP4, KVFormat.FP8_DS_MLA),
}


def decode_variants(block_size: int = 64, extra_block_size: int = 16) -> list[SparseDecodeConfig]:
    """Every code path of the decode kernel for one pair of page sizes:
    format x (extra scope or not) x (sink or not) x (final output, split partials, or the
    balanced schedule's both: with the extra scope, where long key lists come from)."""
    outputs = ((False, False), (True, False), (False, True))  # (write_partial, balanced)
    return [
        SparseDecodeConfig(fmt, block_size, extra, sink, *output)
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


def compile_layer_kernels(
    fmt: KVFormat,
    compressed: Compressed | None,
    swa_block_size: int,
    cache_block_size: int,
    balanced: bool,
) -> None:
    """Compile (or load from the disk cache) what one serving layer launches: the decode kernel
    on its page sizes (``swa_block_size`` tokens per window page; ``cache_block_size / ratio``
    rows per compressed page of the ``compressed`` entries it reads, none for a window-only
    layer), with the balanced schedule's variants where ``balanced``, and the gathered prefill
    FMHA (skipped where its module cannot be imported: the fallback serves prefill then)."""
    from dsv4_attn.kernels import sparse_decode

    extra_rows = cache_block_size // compressed.ratio if compressed is not None else 0
    sparse_decode.compile_variants(fmt, swa_block_size, extra_rows, balanced)
    try:
        from dsv4_attn.kernels import fmha
    except ImportError:
        return
    fmha.compile_variant(fmha.sparse_variant())


def compile_serving_layer(fmt: KVFormat, compress_ratio: int) -> None:
    """:func:`compile_layer_kernels` on the page sizes vLLM gives DeepSeek-V4, with the balanced
    schedule's variants for HCA layers (a ratio above CSA's: the only ones that may run it)."""
    balanced = compress_ratio > _CSA_RATIO
    compressed = compressed_of(Family.V4, compress_ratio)
    compile_layer_kernels(fmt, compressed, SWA_BLOCK_TOKENS, CACHE_BLOCK_TOKENS, balanced)


def model_compress_ratios(model: str | os.PathLike) -> tuple[int, ...]:
    """The compression ratios of a DeepSeek-V4 checkpoint's layers, from its ``config.json``
    (``compress_rates`` per layer type, or the older ``compress_ratios`` list); 1 = window
    only."""
    path = Path(model)
    config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    if isinstance(config.get("compress_rates"), dict):
        rates = config["compress_rates"]
        ratios = {max(1, int(rates.get(kind, 0))) for kind in config.get("layer_types", rates)}
    elif isinstance(config.get("compress_ratios"), list):
        ratios = {max(1, int(r)) for r in config["compress_ratios"]}
    else:
        raise ValueError(f"{path}: no compress_rates or compress_ratios: not a DeepSeek-V4 config")
    return tuple(sorted(ratios))


def main(argv: list[str] | None = None) -> None:
    from dsv4_attn.kernels import compile_cache

    parser = argparse.ArgumentParser(
        prog="python -m dsv4_attn.kernels.precompile",
        description="Compile every kernel a DSV4_NVFP4 server of DeepSeek-V4 uses into the "
        "kernel disk cache.",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=sorted(_FORMATS),
        default="all",
        help="the server's --kv-cache-dtype (auto = NVFP4); all: both formats (default)",
    )
    parser.add_argument(
        "--model",
        help="a checkpoint directory (or its config.json): only the "
        "layer kinds it has (default: DeepSeek-V4's window-only, CSA and HCA)",
    )
    parser.add_argument(
        "--cache-dir",
        help=f"where to store them (default: "
        f"${compile_cache.CACHE_DIR_ENV}, else ~/.cache/dsv4_attn/kernels)",
    )
    args = parser.parse_args(argv)
    if args.cache_dir:
        os.environ[compile_cache.CACHE_DIR_ENV] = args.cache_dir
    directory = compile_cache.cache_directory()
    if directory is None or not compile_cache.DiskCache(directory).usable():
        raise SystemExit(f"no usable kernel cache directory ({directory}): set --cache-dir")
    ratios = model_compress_ratios(args.model) if args.model else DEEPSEEK_V4_RATIOS
    start = time.perf_counter()
    for fmt in _FORMATS[args.kv_cache_dtype]:
        for ratio in ratios:
            began = time.perf_counter()
            compile_serving_layer(fmt, ratio)
            print(
                f"{time.perf_counter() - began:6.1f} s  {fmt.value:10s} compress ratio {ratio}",
                flush=True,
            )
    print(f"{time.perf_counter() - start:6.1f} s  in all; kernels in {directory}", flush=True)


if __name__ == "__main__":
    main()
