"""Benchmark of the prefill kernels (``python -m dsv4_attn.bench prefill``).

Shapes: dense causal attention at 8K tokens, D in {128, 256, 512}, H in {16, 32, 64}
(D = 512 with K = V, the DeepSeek-V4 latent, as the kernel requires), next to torch SDPA on the
same inputs; sparse prefill shaped like DeepSeek-V4-Flash (H = 64, 128-token window + top-512:
K = 640) and V4-Pro (H = 128, K = 1152) at T = 4096. TFLOP/s count the masked work only (visible
query-key pairs, or valid gathered entries); the bf16 matmul ceiling is measured in the same run.
Each sparse row also times a memory-only kernel on the same bytes (:mod:`.gather_copy`: Q, the
listed rows per 64-head block, O) as its memory floor: ``copy/ours`` near 1 means the kernel
runs at the speed of its loads. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import math

import torch

from dsv4_attn import fmha_ops
from dsv4_attn.bench.anchors import import_flash_mla
from dsv4_attn.bench.gather_copy import excess_over_rounding, gather_copy, gather_copy_reference
from dsv4_attn.bench.timing import format_table, measure_ceilings, time_cuda_us, write_json
from dsv4_attn.prefill_cases import (
    make_dense_case,
    make_hca_sparse_case,
    make_random_sparse_case,
    make_v4_sparse_case,
)

COLUMNS = [
    ("kind", "kind", "s"),
    ("D", "D", "d"),
    ("H", "H", "d"),
    ("Hk", "Hk", "d"),
    ("tokens", "tokens", "d"),
    ("K", "K", "d"),
    ("median_us", "us", ".0f"),
    ("tflops", "TFLOP/s", ".1f"),
    ("of_ceiling", "/ceil", ".2f"),
    ("sdpa_us", "sdpa us", ".0f"),
    ("sdpa_tflops", "sdpa TF/s", ".1f"),
    ("vs_sdpa", "x sdpa", ".2f"),
    ("target", "target", "s"),
    ("flashmla_us", "FlashMLA us", ".0f"),
    ("vs_flashmla", "x FlashMLA", ".2f"),
    ("max_abs_diff_vs_flashmla", "max|d| FM", ".4f"),
    ("copy_us", "copy us", ".0f"),
    ("copy_of_ours", "copy/ours", ".2f"),
    ("copy_of_flashmla", "copy/FM", ".2f"),
]

# (rows per load, warps, stages) of the memory-only copy kernel; its best time is the floor.
_COPY_CONFIGS = ((16, 4, 3), (32, 8, 3), (16, 4, 4))


def _sdpa_time(case, reps: int) -> float | None:
    """Median microseconds of torch SDPA on the same inputs ([B, H, S, D] views), or None."""
    q, k, v = (t.transpose(1, 2) for t in (case.q, case.k, case.v))
    enable_gqa = q.shape[1] != k.shape[1]

    def call():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, scale=case.scale, enable_gqa=enable_gqa
        )

    try:
        return time_cuda_us(call, reps=reps, warmup=2)["median_us"]
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        print(f"  sdpa failed for D={case.q.shape[-1]} H={case.q.shape[2]}: {exc}".splitlines()[0])
        torch.cuda.empty_cache()
        return None


def dense_rows(dims, heads, seqlen: int, reps: int, ceiling: float) -> list[dict]:
    """Causal rows; head_dim <= 256 is timed with both row-split mainloops (``-ov1`` with the
    intra-warpgroup overlap, the default; ``-ov0`` plain ping-pong)."""
    from dsv4_attn.kernels import fmha as fmha_kernel

    rows = []
    for d in dims:
        for h in heads:
            kv_shared = d == 512
            case = make_dense_case(
                [(seqlen, seqlen)],
                h,
                h,
                d,
                causal=True,
                kv_shared=kv_shared,
                device="cuda",
                seed=d + h,
            )
            flops = case.flops()
            sdpa = _sdpa_time(case, max(3, reps // 2))
            # One sequence, packed as the kernel takes it; the ops layer runs the overlap
            # mainloop, so the plain one is launched through the kernel's own entry.
            q, k, v = (t.flatten(0, 1) for t in (case.q, case.k, case.v))
            cu = torch.tensor([0, seqlen], dtype=torch.int32, device="cuda")
            for overlap in (1, 0) if d <= 256 else (0,):

                def call(q=q, k=k, v=v, cu=cu, scale=case.scale, overlap=overlap):
                    return fmha_kernel.run_dense(
                        q,
                        k,
                        v,
                        cu,
                        cu,
                        seqlen,
                        True,
                        None,
                        None,
                        scale,
                        intra_wg_overlap=bool(overlap),
                    )

                t = time_cuda_us(call, reps=reps)["median_us"]
                tflops = flops / (t * 1e6)
                kind = "dense-causal-k=v" if kv_shared else f"dense-causal-ov{overlap}"
                rows.append(
                    {
                        "kind": kind,
                        "D": d,
                        "H": h,
                        "Hk": h,
                        "tokens": seqlen,
                        "K": None,
                        "median_us": t,
                        "flops": flops,
                        "tflops": tflops,
                        "of_ceiling": tflops / ceiling,
                        "sdpa_us": sdpa,
                        "sdpa_tflops": flops / (sdpa * 1e6) if sdpa else None,
                        "vs_sdpa": sdpa / t if sdpa else None,
                        "target": "0.9x sdpa" if d <= 256 else ">=450",
                        "meets_target": (sdpa is not None and sdpa / t >= 0.9)
                        if d <= 256
                        else tflops >= 450,
                    }
                )
                print(f"{kind} D={d} H={h}: {t:.0f} us, {tflops:.1f} TFLOP/s", flush=True)
            del case
            torch.cuda.empty_cache()
    return rows


def _flash_mla_sparse(flash_mla, case):
    """FlashMLA's sparse prefill on the same rows and lists (lists padded to its tile of 128
    with -1; per-token lengths passed as topk_length)."""
    T, K = case.indices.shape
    padded = -(-K // 128) * 128
    indices = torch.full((T, 1, padded), -1, dtype=torch.int32, device=case.q.device)
    counted = torch.arange(K, device=case.q.device)[None] < case.lens[:, None]
    indices[:, 0, :K] = torch.where(counted, case.indices, -1)
    kv = case.kv.view(-1, 1, case.kv.shape[-1])

    def call():
        return flash_mla.flash_mla_sparse_fwd(
            case.q, kv, indices, case.scale, 512, case.sink, case.lens
        )

    return call


def _against_flashmla(flash_mla, case, ours, reps: int, name: str) -> dict:
    """FlashMLA's time on ``case`` and how it compares with ours (``ours``: our median µs),
    max |Δ| of the two outputs; ``{"flashmla_error": ...}`` when FlashMLA refuses the shape."""
    fm_call = _flash_mla_sparse(flash_mla, case)
    try:
        fm_out = fm_call()[0]
    except RuntimeError as exc:  # a shape FlashMLA refuses: say so, time the rest
        error = str(exc).splitlines()[0][:200]
        print(f"FlashMLA refused {name}: {error}", flush=True)
        return {"flashmla_error": error}
    out = fmha_ops.sparse_prefill(*case.args(), backend="cutedsl", check_values=False)[0]
    fm_t = time_cuda_us(fm_call, reps=reps)["median_us"]
    return {
        "flashmla_us": fm_t,
        "flashmla_tflops": case.flops() / (fm_t * 1e6),
        "vs_flashmla": fm_t / ours,
        "meets_target": fm_t / ours >= 1.1,
        "max_abs_diff_vs_flashmla": (out.float() - fm_out.float()).abs().max().item(),
    }


def _copy_floor(case, reps: int) -> dict:
    """Best median over :data:`_COPY_CONFIGS` of the memory-only kernel on the case's bytes
    (16 of its tokens checked against the float64 reference first, so a floor is never timed
    on a kernel that skipped work)."""
    q, kv, indices, lens = case.q, case.kv, case.indices, case.lens
    out = torch.full_like(q, float("nan"))
    gather_copy(q, kv, indices, lens, out=out)
    checked = torch.linspace(0, q.shape[0] - 1, 16, device=q.device).long()
    ref = gather_copy_reference(q[checked], kv, indices[checked], lens[checked])
    err = excess_over_rounding(out[checked], ref)
    if not err <= 1e-3:
        raise RuntimeError(f"gather_copy disagrees with its reference by {err} past bf16 rounding")
    del ref
    best = None
    for entries, warps, stages in _COPY_CONFIGS:

        def call(entries=entries, warps=warps, stages=stages):
            return gather_copy(
                q,
                kv,
                indices,
                lens,
                out=out,
                entries_per_load=entries,
                num_warps=warps,
                num_stages=stages,
            )

        t = time_cuda_us(call, reps=reps)["median_us"]
        if best is None or t < best["copy_us"]:
            best = {"copy_us": t, "copy_config": [entries, warps, stages]}
    return best


def _sparse_configs(tokens: int) -> list[tuple[str, int, object]]:
    """(name, heads, case maker): the benchmark's shapes (s_kv 32K, pure top-k) and the layouts the
    backend runs (window 128 + top-k; the window alone; HCA: every visible entry then the window,
    the last ``tokens`` of a 32K and of a 1M context)."""
    return [
        (
            "topk512-skv32k",
            64,
            lambda: make_random_sparse_case(
                tokens, 64, 32768, 512, lens="full", hole_fraction=0.0, device="cuda", seed=1
            ),
        ),
        (
            "topk1024-skv32k",
            128,
            lambda: make_random_sparse_case(
                tokens, 128, 32768, 1024, lens="full", hole_fraction=0.0, device="cuda", seed=2
            ),
        ),
        ("v4flash", 64, lambda: make_v4_sparse_case(tokens, 64, 512, device="cuda", seed=512)),
        ("v4pro", 128, lambda: make_v4_sparse_case(tokens, 128, 1024, device="cuda", seed=1024)),
        # A window-only layer (V4.1's ratio 0); V4.1's ratio 1 and 2 prefill lists are v4flash's.
        ("window-only", 64, lambda: make_v4_sparse_case(tokens, 64, 0, device="cuda", seed=128)),
        ("hca-ctx32k", 64, lambda: make_hca_sparse_case(tokens, 64, 32768, device="cuda", seed=3)),
        ("hca-ctx1m", 64, lambda: make_hca_sparse_case(tokens, 64, 1 << 20, device="cuda", seed=4)),
    ]


def sparse_rows(tokens: int, reps: int, ceiling: float, against: str | None) -> list[dict]:
    flash_mla = import_flash_mla() if against == "flashmla" else None
    rows = []
    for name, h, make in _sparse_configs(tokens):
        case = make()
        args = case.args()

        def call(args=args):
            return fmha_ops.sparse_prefill(*args, backend="cutedsl", check_values=False)

        t = time_cuda_us(call, reps=reps)["median_us"]
        flops = case.flops()
        tflops = flops / (t * 1e6)
        row = {
            "kind": f"sparse-{name}",
            "D": case.q.shape[-1],
            "H": h,
            "Hk": 1,
            "tokens": tokens,
            "K": case.indices.shape[1],
            "valid_entries": case.num_valid(),
            "median_us": t,
            "flops": flops,
            "tflops": tflops,
            "of_ceiling": tflops / ceiling,
            "sdpa_us": None,
            "sdpa_tflops": None,
            "vs_sdpa": None,
            "target": ">=1.1x flashmla",
        }
        if flash_mla is not None:
            row.update(_against_flashmla(flash_mla, case, t, reps, f"sparse-{name}"))
        row.update(_copy_floor(case, reps))
        row["copy_of_ours"] = row["copy_us"] / t
        if row.get("flashmla_us"):
            row["copy_of_flashmla"] = row["copy_us"] / row["flashmla_us"]
        rows.append(row)
        print(f"sparse {name}: {row}", flush=True)
        del case, args
        torch.cuda.empty_cache()
    return rows


def fit_cta_costs(widths: list[int], times_us: list[float], tokens: int, sms: int) -> dict:
    """Least-squares fit of ``time = waves * (fixed + steps * step)`` over a sweep of list
    widths (one 64-head CTA per token, ``waves = tokens / sms``, ``steps = width / 128``).

    Returns ``fixed_us`` (a CTA's cost that does not scale with its keys: launch, Q load,
    first fill, epilogue) and ``step_us`` (one step of 128 keys). Needs two widths or more.
    """
    if len(widths) < 2:
        raise ValueError(f"a cost fit needs at least two widths, got {widths}")
    waves = tokens / sms
    xs = [w / 128 for w in widths]
    ys = [t / waves for t in times_us]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    step = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return {"fixed_us": mean_y - step * mean_x, "step_us": step}


def sweep_rows(tokens: int, widths: list[int], reps: int, against: str | None) -> list[dict]:
    """Pure top-k lists of growing width at H 64 (s_kv 32K, no holes): ours and FlashMLA's
    time per CTA split into a fixed part and a part per 128-key step (:func:`fit_cta_costs`)."""
    flash_mla = import_flash_mla() if against == "flashmla" else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for width in widths:
        case = make_random_sparse_case(
            tokens,
            64,
            32768,
            width,
            lens="full",
            hole_fraction=0.0,
            device="cuda",
            seed=width,
        )
        args = case.args()

        def call(args=args):
            return fmha_ops.sparse_prefill(*args, backend="cutedsl", check_values=False)

        row = {
            "width": width,
            "tokens": tokens,
            "median_us": time_cuda_us(call, reps=reps)["median_us"],
        }
        if flash_mla is not None:
            row.update(
                _against_flashmla(flash_mla, case, row["median_us"], reps, f"sweep width {width}")
            )
        rows.append(row)
        print(f"sweep width {width}: {row}", flush=True)
        del case, args
        torch.cuda.empty_cache()
    fits = {"ours": fit_cta_costs(widths, [r["median_us"] for r in rows], tokens, sms)}
    timed = [r for r in rows if "flashmla_us" in r]
    if len(timed) >= 2:
        fm_widths = [r["width"] for r in timed]
        fm_times = [r["flashmla_us"] for r in timed]
        fits["flashmla"] = fit_cta_costs(fm_widths, fm_times, tokens, sms)
    for name, fit in fits.items():
        print(
            f"sweep fit {name}: {fit['fixed_us']:.2f} us per CTA fixed, "
            f"{fit['step_us']:.2f} us per 128-key step ({sms} SMs)",
            flush=True,
        )
    for row in rows:
        row["fit"] = fits
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench prefill")
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=4096, help="sparse prefill tokens")
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--skip-sparse", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--against",
        choices=["flashmla"],
        help="also time FlashMLA's sparse "
        "prefill on the same rows and lists (imported when present)",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        metavar="WIDTH",
        help="also time pure top-k lists of these widths (default 128 256 512 1024 2048) at "
        "H 64 and fit each kernel's time per CTA as fixed + per 128-key step",
    )
    parser.add_argument("--json", default="bench_prefill.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the prefill benchmark times CUDA kernels: no CUDA device found")
    ceilings = measure_ceilings()
    print(
        f"{ceilings.device}: bf16 matmul {ceilings.bf16_tflops:.0f} TFLOP/s, "
        f"copy {ceilings.copy_gbps:.0f} GB/s",
        flush=True,
    )
    rows = []
    if not args.skip_dense:
        rows += dense_rows(args.dims, args.heads, args.seqlen, args.reps, ceilings.bf16_tflops)
    if not args.skip_sparse:
        rows += sparse_rows(args.tokens, args.reps, ceilings.bf16_tflops, args.against)
    sweep = []
    if args.sweep is not None:
        sweep = sweep_rows(
            args.tokens, args.sweep or [128, 256, 512, 1024, 2048], args.reps, args.against
        )
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float) and not math.isfinite(value):
                row[key] = None
    print()
    print(format_table(rows, COLUMNS))
    print(f"bf16 ceiling (8192^3 matmul, same run): {ceilings.bf16_tflops:.0f} TFLOP/s")
    write_json(args.json, "prefill", ceilings, rows + sweep)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
