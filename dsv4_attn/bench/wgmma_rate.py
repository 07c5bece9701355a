"""Tensor-pipe rate of one bf16 wgmma shape (``python -m dsv4_attn.bench wgmma-rate``).

Runs :class:`dsv4_attn.kernels.wgmma_rate.WgmmaRate` (one CTA per SM, each warpgroup issuing
groups of 32 m64nNk16 wgmmas, K = 512 per group, then waiting, as the decode kernel's QK does)
for N in {32, 64, 128, 256}, A from registers (RS) or SMEM (SS), one or two warpgroups per SM.
Per row: µs (median), ns per wgmma per SM, TFLOP/s and its share of the measured bf16 matmul
ceiling. Each variant's checksum (the sum of every accumulator) is checked against float64
first. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse

import torch

from dsv4_attn.bench.timing import measure_ceilings, report, time_cuda_us

COLUMNS = [
    ("n", "N", "d"),
    ("a", "A", "s"),
    ("warpgroups", "WGs/SM", "d"),
    ("median_us", "us", ".1f"),
    ("ns_per_wgmma", "ns/wgmma/SM", ".2f"),
    ("tflops", "TFLOP/s", ".0f"),
    ("of_ceiling", "of matmul", ".2f"),
    ("checksum_rel_err", "checksum err / sum|terms|", ".1e"),
]


def run(ns, warpgroup_counts, reps: int) -> tuple[list[dict], object]:
    from dsv4_attn.kernels.wgmma_rate import GROUP, K_TILE, M, build_wgmma_rate_kernel

    device = torch.device("cuda")
    ceilings = measure_ceilings()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for n in ns:
        src = torch.randn((M + n) * K_TILE, device=device).to(torch.bfloat16)
        a = src[: M * K_TILE].view(M, K_TILE).double()
        b = src[M * K_TILE :].view(n, K_TILE).double()
        # Every group adds A B^T over the K_TILE columns GROUP / k_blocks times.
        products = a @ b.T
        per_group = products.sum().item() * (GROUP * 16 // K_TILE)
        # fp32 accumulation error scales with the magnitudes summed, not with their signed sum.
        per_group_abs = products.abs().sum().item() * (GROUP * 16 // K_TILE)
        rounds = max(200, 64_000 // n)
        for warpgroups in warpgroup_counts:
            for a_in_registers in (True, False):
                kernel = build_wgmma_rate_kernel(n, a_in_registers, warpgroups, rounds)
                out = torch.full((sms * 128 * warpgroups,), float("nan"), device=device)
                kernel(src, out)
                torch.cuda.synchronize()
                want = per_group * rounds * sms * warpgroups
                got = out.double().sum().item()
                scale = per_group_abs * rounds * sms * warpgroups
                rel_err = abs(got - want) / scale
                if not rel_err < 1e-3:
                    raise AssertionError(
                        f"wgmma-rate N={n} RS={a_in_registers} WGs={warpgroups}: checksum "
                        f"{got} vs float64 {want} (error {rel_err:.2e} of the sum of |terms|)"
                    )
                t = time_cuda_us(lambda k=kernel, s=src, o=out: k(s, o), reps=reps)
                wgmmas_per_sm = GROUP * rounds * warpgroups
                flops = 2 * M * n * 16 * wgmmas_per_sm * sms
                tflops = flops / (t["median_us"] * 1e6)
                rows.append(
                    {
                        "n": n,
                        "a": "RS" if a_in_registers else "SS",
                        "warpgroups": warpgroups,
                        "rounds": rounds,
                        "median_us": t["median_us"],
                        "ns_per_wgmma": t["median_us"] * 1e3 / wgmmas_per_sm,
                        "tflops": tflops,
                        "of_ceiling": tflops / ceilings.bf16_tflops,
                        "checksum_rel_err": rel_err,
                    }
                )
    return rows, ceilings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench wgmma-rate")
    parser.add_argument("--n", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--warpgroups", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="wgmma_rate.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("wgmma-rate needs a Hopper GPU")
    rows, ceilings = run(args.n, args.warpgroups, args.reps)
    note = "one CTA per SM; groups of 32 m64nNk16 bf16 wgmmas (K = 512), wait after each"
    report(args.json, "wgmma_rate", ceilings, rows, COLUMNS, note)


if __name__ == "__main__":
    main()
