"""What bf16 split-KV partials would cost in accuracy (CPU emulation, float64): attention of
64 heads over ``N`` random keys, split into ``S`` splits whose normalized partial outputs are
rounded to fp32 (what the kernel writes) or bf16, merged as the combine kernel merges them, and
the result rounded to bf16 (the kernel's output). Prints the worst error relative to max |out|
over a few random cases, beside the final bf16 rounding alone.

    python scripts/partials_precision.py
"""

import torch

HEADS, DIM = 64, 512


def worst_errors(splits: int, keys: int = 640, trials: int = 5) -> dict[str, float]:
    gen = torch.Generator().manual_seed(splits)
    worst = {"fp32 partials": 0.0, "bf16 partials": 0.0, "output rounding alone": 0.0}
    for _ in range(trials):
        q = torch.randn(HEADS, DIM, dtype=torch.float64, generator=gen) * 2
        k = torch.randn(keys, DIM, dtype=torch.float64, generator=gen)
        v = torch.randn(keys, DIM, dtype=torch.float64, generator=gen) * 3
        scores = q @ k.T / DIM**0.5
        exact = torch.softmax(scores, -1) @ v
        scale = exact.abs().max()
        parts, lses = [], []
        for idx in torch.arange(keys).chunk(splits):
            lse = torch.logsumexp(scores[:, idx], -1)
            parts.append(torch.exp(scores[:, idx] - lse[:, None]) @ v[idx])
            lses.append(lse)
        lse_all = torch.logsumexp(torch.stack(lses), 0)
        for name, dtype in (("fp32 partials", torch.float32), ("bf16 partials", torch.bfloat16)):
            merged = sum(torch.exp(lse - lse_all)[:, None] * part.to(dtype).double()
                         for part, lse in zip(parts, lses, strict=True))  # fmt: skip
            error = (merged.to(torch.bfloat16).double() - exact).abs().max() / scale
            worst[name] = max(worst[name], float(error))
        alone = (exact.to(torch.bfloat16).double() - exact).abs().max() / scale
        worst["output rounding alone"] = max(worst["output rounding alone"], float(alone))
    return worst


def main() -> None:
    for splits in (2, 10, 29):
        errors = worst_errors(splits)
        print(f"{splits:3} splits: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
