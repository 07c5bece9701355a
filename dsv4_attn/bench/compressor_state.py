"""What the compressor state's dtype costs: ``python -m dsv4_attn.bench compressor-state``.

DSV4_NVFP4 keeps the CSA compressor's state in bf16 (:mod:`dsv4_attn.vllm_glue.compressor_state`:
the fp32 state group would cap NVFP4's KV capacity). This measures the accuracy cost, on the CPU:
random sequences go through a paged state of each dtype in chunks of random sizes (chunked
prefill: entries whose window spans two chunks included), their compressed entries come out of
:func:`~dsv4_attn.vllm_glue.compressor_state.compress_rows` (the torch twin of the kernel the
server runs), and each is compared with the float64 reference on the fp32 inputs
(:func:`dsv4_attn.reference.compressed_entries`): the row itself (bf16, as the cache writer gets
it) and the row as the cache holds it, after NVFP4 or FP8 encoding. Scores are drawn with a
spread ``sigma`` (1: flat softmax weights, 16: a few positions dominate).

Prints a table, writes JSON (``--json``).
"""

from __future__ import annotations

import argparse

import torch

from dsv4_attn import kv_cache, reference
from dsv4_attn.bench.timing import format_table, write_json
from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.vllm_glue.compressor_state import compress_rows

__all__ = ["main", "measure"]

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = [
    ("sigma", "score sigma", ".0f"),
    ("state", "state", "s"),
    ("entries", "entries", "d"),
    ("row_median", "row err med", ".2e"),
    ("row_max", "row err max", ".2e"),
    ("nvfp4_median", "NVFP4 err med", ".3e"),
    ("nvfp4_max", "NVFP4 err max", ".3e"),
    ("fp8_median", "FP8 err med", ".3e"),
    ("fp8_max", "FP8 err max", ".3e"),
]


def _relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per-row ``|got - want| / |want|`` (L2), float64 ``[N]``."""
    return (got.double() - want).norm(dim=-1) / want.norm(dim=-1)


def _through_state(kv, score, state_dtype, ratio, weight, eps, cos_sin, chunks, gen):
    """Entries of one sequence computed chunk by chunk from a paged state of ``state_dtype``."""
    L, width = kv.shape
    bs = 4
    blocks = -(-L // bs)
    pages = torch.randperm(blocks + 7, generator=gen)[:blocks]
    state = torch.full((blocks + 7, bs, 2 * width), float("nan"), dtype=state_dtype)
    table = pages[None].int()
    D = width // (2 if ratio == 4 else 1)
    rows = torch.full((L, D), float("nan"), dtype=torch.bfloat16)
    start = 0
    for size in chunks:
        if start >= L:
            break
        pos = torch.arange(start, min(L, start + size))
        # vLLM's save kernel: each position's kv and scores, rounded to the state's dtype.
        state[pages[pos // bs], pos % bs] = torch.cat([kv[pos], score[pos]], dim=1).to(state_dtype)
        out_rows = torch.where((pos + 1) % ratio == 0, pos, -1)
        zeros = torch.zeros(len(pos), dtype=torch.int32)
        compress_rows(state, table, zeros, pos, pos, out_rows, rows, ratio, weight, eps, cos_sin)
        start += size
    return rows[ratio - 1 :: ratio]


def measure(length: int, sigmas: list[float], seed: int) -> list[dict]:
    """One row per (score sigma, state dtype): errors of the entries of a ``length``-token
    sequence against the float64 reference, before and after the cache's encoding."""
    ratio, C, D = 4, 2, kv_cache.HEAD_DIM
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.rand(D, generator=gen) + 0.5).to(torch.bfloat16)
    cos_sin = torch.randn(length, 64, generator=gen)
    out = []
    for sigma in sigmas:
        kv = torch.randn(length, C * D, generator=gen) * torch.exp(
            torch.randn(C * D, generator=gen)
        )
        score = torch.randn(length, C * D, generator=gen) * sigma
        want = reference.compressed_entries(kv, score, ratio, weight, 1e-6, cos_sin)
        chunks = torch.randint(1, 700, (length,), generator=gen).tolist()
        for name, dtype in STATE_DTYPES.items():
            rows = _through_state(kv, score, dtype, ratio, weight, 1e-6, cos_sin, chunks, gen)
            row = {"sigma": sigma, "state": name, "entries": rows.shape[0], "length": length}
            errors = {"row": _relative(rows, want)}
            for fmt, key in ((KVFormat.NVFP4, "nvfp4"), (KVFormat.FP8_DS_MLA, "fp8")):
                decoded = kv_cache.decode_rows(*kv_cache.encode_rows(rows, fmt), fmt)
                errors[key] = _relative(decoded, want)
            for key, err in errors.items():
                row[f"{key}_median"] = float(err.median())
                row[f"{key}_max"] = float(err.max())
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench compressor-state")
    parser.add_argument("--length", type=int, default=4096, help="tokens of each sequence")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--json", default="bench_compressor_state.json")
    args = parser.parse_args(argv)
    rows = measure(args.length, args.sigmas, args.seed)
    print(format_table(rows, COLUMNS))
    print(
        "errors: |row - reference| / |reference| per entry (L2), reference in float64 on the "
        "fp32 inputs; NVFP4 / FP8: the row as the cache holds it"
    )
    write_json(args.json, "compressor-state", None, rows)
    print(f"wrote {args.json}")
