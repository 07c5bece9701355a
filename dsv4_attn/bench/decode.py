"""Benchmark of the Hopper sparse-decode kernel (``python -m dsv4_attn.bench decode``).

Shapes (issue 4): V4-Flash (H=64, a 128-slot window + 512 compressed entries), V4-Pro (H=128,
128 + 1024), T in {1, 8, 64, 128, 256} decode tokens of separate requests, plus HCA at 1M context
(H=64, 128 + 8192); FP8_DS_MLA and NVFP4 caches. Every token reads its own random rows of one
large cache (no reuse between tokens), the L2 is flushed before each timed call.

Per row: kernel time (median), effective GB/s (valid KV rows in their cache format + q + out),
TFLOP/s (QK^T and PV), the floor from ceilings measured in the same run, the SDPA fallback's time
on the same inputs and the speed-up over it. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import math

import torch

from dsv4_attn import fallback, kv_cache
from dsv4_attn.bench.timing import (
    decode_roofline,
    format_table,
    measure_ceilings,
    report,
    time_cuda_us,
)
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.scope import KVScope
from dsv4_attn.testing import DecodeCase

SHAPES = {  # name: (heads, window, compressed entries)
    "v4-flash": (64, 128, 512),
    "v4-pro": (128, 128, 1024),
    "hca-1m": (64, 128, 8192),
}
TOKENS = (1, 8, 64, 128, 256)
WINDOW_BLOCK, EXTRA_BLOCK = 64, 16

COLUMNS = [
    ("fmt", "fmt", "s"),
    ("shape", "shape", "s"),
    ("T", "T", "d"),
    ("H", "H", "d"),
    ("splits", "splits", "d"),
    ("median_us", "us", ".1f"),
    ("gbps", "eff GB/s", ".0f"),
    ("tflops", "TFLOP/s", ".1f"),
    ("floor_us", "floor us", ".1f"),
    ("of_floor", "floor/t", ".2f"),
    ("fallback_us", "sdpa us", ".0f"),
    ("speedup", "x sdpa", ".1f"),
]


class _RowPool:
    """One large cache per (format, block size) of random rows, written on the GPU once."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self._caches: dict[tuple[KVFormat, int], torch.Tensor] = {}

    def cache(self, fmt: KVFormat, block_size: int, num_slots: int) -> torch.Tensor:
        key = (fmt, block_size)
        have = self._caches.get(key)
        if have is not None and have.shape[0] * block_size >= num_slots:
            return have
        self._caches.pop(key, None)
        torch.cuda.empty_cache()
        blocks = math.ceil(num_slots / block_size)
        cache = kv_cache.allocate(blocks, block_size, fmt, device=self.device)
        chunk = 1 << 18
        channel_scale = torch.exp(torch.randn(HEAD_DIM, generator=self.gen, device=self.device))
        for start in range(0, blocks * block_size, chunk):
            slots = torch.arange(start, min(blocks * block_size, start + chunk), device=self.device)
            rows = torch.randn(len(slots), HEAD_DIM, generator=self.gen, device=self.device)
            kv_cache.write(cache, slots, (rows * channel_scale).to(torch.bfloat16), fmt, block_size)
        self._caches[key] = cache
        return cache

    def slots(self, T: int, width: int, num_slots: int) -> torch.Tensor:
        """Per token ``width`` slots of its own range (tokens never share rows), int32."""
        base = torch.arange(T, device=self.device)[:, None] * width
        offsets = torch.argsort(torch.rand(T, width, generator=self.gen, device=self.device), dim=1)
        return ((base + offsets) % num_slots).to(torch.int32)


def make_case(pool: _RowPool, fmt: KVFormat, T: int, H: int, window: int, extra: int):
    cache = pool.cache(fmt, WINDOW_BLOCK, T * window)
    ecache = pool.cache(fmt, EXTRA_BLOCK, T * extra)
    q = (torch.randn(T, H, HEAD_DIM, generator=pool.gen, device=pool.device) * 0.5).to(
        torch.bfloat16
    )
    full = torch.full((T,), window, dtype=torch.int32, device=pool.device)
    efull = torch.full((T,), extra, dtype=torch.int32, device=pool.device)
    sink = torch.randn(H, generator=pool.gen, device=pool.device)
    window_scope = KVScope(
        cache, fmt, WINDOW_BLOCK, pool.slots(T, window, cache.shape[0] * WINDOW_BLOCK), full
    )
    extra_scope = KVScope(
        ecache, fmt, EXTRA_BLOCK, pool.slots(T, extra, ecache.shape[0] * EXTRA_BLOCK), efull
    )
    return DecodeCase(q, window_scope, sink, HEAD_DIM**-0.5, extra_scope)


def run(shapes, tokens, formats, reps: int, fallback_reps: int):
    from dsv4_attn.kernels import sparse_decode

    device = torch.device("cuda")
    ceilings = measure_ceilings()
    pool = _RowPool(device)
    rows = []
    for fmt_name in formats:
        fmt = KVFormat.parse(fmt_name)
        for shape in shapes:
            H, window, extra = SHAPES[shape]
            for T in tokens:
                case = make_case(pool, fmt, T, H, window, extra)
                args = case.args()
                scopes = (case.window, case.sink, case.extra)
                reason = sparse_decode.unsupported_reason(case.q, *scopes)
                if reason is not None:
                    raise SystemExit(f"the kernel does not run {shape} T={T}: {reason}")
                capacity = sparse_decode.key_capacity(case.window, case.extra)
                splits, _ = sparse_decode.resolve_splits(T, H, capacity, device)
                kernel = time_cuda_us(lambda a=args: sparse_decode.sparse_attention(*a), reps=reps)
                slow = time_cuda_us(lambda a=args: fallback.sparse_attention(*a),
                                    reps=fallback_reps, warmup=1)  # fmt: skip
                t = kernel["median_us"]
                rows.append(
                    {
                        "fmt": fmt.value,
                        "shape": shape,
                        "T": T,
                        "H": H,
                        "window": window,
                        "extra": extra,
                        "splits": splits,
                        **kernel,
                        **decode_roofline(case, t, ceilings),
                        "fallback_us": slow["median_us"],
                        "speedup": slow["median_us"] / t,
                    }
                )
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
                del case, args
    return rows, ceilings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench decode")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--formats", nargs="+", default=["fp8_ds_mla", "nvfp4"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--fallback-reps", type=int, default=5)
    parser.add_argument("--json", default="bench_decode.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the decode benchmark times CUDA kernels: no CUDA device found")
    rows, ceilings = run(args.shapes, args.tokens, args.formats, args.reps, args.fallback_reps)
    report(args.json, "decode", ceilings, rows, COLUMNS, "L2 flushed before each call")
