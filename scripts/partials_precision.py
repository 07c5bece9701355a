"""What narrower split-KV partials cost in accuracy (CPU emulation, float64): attention of
64 heads over ``N`` random keys, split into ``S`` splits whose normalized partial outputs are
rounded to fp32, to bf16, or to fp16 after a power-of-two row scale (what the kernel writes:
each row's largest magnitude lands in [2^14, 2^15), see ``fp16_row_scale``), merged as the
combine kernel merges them, and the result rounded to bf16 (the kernel's output). Prints the
worst error relative to max |out| over a few random cases, beside the final bf16 rounding alone.

    python scripts/partials_precision.py
"""

import torch

HEADS, DIM = 64, 512


def fp16_row_scale(part: torch.Tensor) -> torch.Tensor:
    """Each row of ``part`` times 2^k, rounded to fp16, times 2^-k: k puts the row's largest
    magnitude in [2^14, 2^15) (the kernel's k = clamp(14 - floor(log2 max), -113, 120))."""
    amax = part.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    k = (14 - torch.floor(torch.log2(amax))).clamp(-113, 120)
    return (part * 2.0**k).to(torch.float16).double() * 2.0**-k


def worst_errors(splits: int, keys: int = 640, trials: int = 5) -> dict[str, float]:
    gen = torch.Generator().manual_seed(splits)
    names = ("fp32 partials", "bf16 partials", "fp16 partials, row scale")
    worst = dict.fromkeys((*names, "output rounding alone"), 0.0)
    rounding = {
        names[0]: lambda part: part.to(torch.float32).double(),
        names[1]: lambda part: part.to(torch.bfloat16).double(),
        names[2]: fp16_row_scale,
    }
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
        for name, rounded in rounding.items():
            merged = sum(torch.exp(lse - lse_all)[:, None] * rounded(part)
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
