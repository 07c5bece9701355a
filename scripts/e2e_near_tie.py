"""Look at one greedy step of the tiny DeepSeek-V4 under several attention paths (CPU).

    python scripts/e2e_near_tie.py --seed 4 --heads 64 --step 20

The storage-matched oracle (HF eager on the cache format's rows) runs greedy for ``step + 2``
tokens; then every path is teacher-forced over that sequence and prints, at ``step``, its argmax
and the oracle's top-1 minus top-2 logit as that path sees it. A sign that flips between paths of
equal or better precision (e.g. the float64 reference with q in bf16 vs in fp32) marks a decision
that no implementation decides "correctly": a near-tie of the model itself.
"""

from __future__ import annotations

import argparse

import torch

from dsv4_attn.e2e import harness
from dsv4_attn.e2e.attention_route import route_attention, simulate_kv_format
from dsv4_attn.e2e.tiny_model import TinySpec, build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=harness.CASE_SEED)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--step", type=int, default=20)
    parser.add_argument("--kv-format", default="fp8_ds_mla")
    args = parser.parse_args()
    if args.step < 0:
        raise SystemExit(f"--step must be >= 0, got {args.step}")
    torch.set_num_threads(1)
    spec = TinySpec(seed=args.seed, num_heads=args.heads)
    model = build_tiny_model(spec)
    prompt = harness.make_prompt(spec.vocab_size, seed=args.seed)
    prompt_len, fmt = prompt.shape[1], args.kv_format
    with simulate_kv_format(model, fmt):
        oracle = harness.greedy(model, prompt, args.step + 2)
    sequence = torch.cat([prompt, oracle.tokens[None, :]], dim=1)

    oracle_name = "HF eager, q/out bf16 (the oracle)"
    paths = {}
    with simulate_kv_format(model, fmt):
        paths[oracle_name] = harness.teacher_forced(model, sequence, prompt_len)
    with simulate_kv_format(model, fmt, q_dtype=None, round_output=False):
        paths["HF eager, q/out fp32"] = harness.teacher_forced(model, sequence, prompt_len)
    for backend in ("sdpa", "reference"):
        with route_attention(model, fmt, backend=backend):
            paths[f"ops {backend}, q bf16"] = harness.teacher_forced(model, sequence, prompt_len)
    with route_attention(model, fmt, backend="reference", q_dtype=None):
        paths["ops reference, q fp32"] = harness.teacher_forced(model, sequence, prompt_len)

    step = args.step
    first, second = paths[oracle_name][step].topk(2).indices.tolist()
    print(f"seed {args.seed}, H {args.heads}, {fmt}, step {step}: oracle top-2 {first}, {second}")
    for name, logits in paths.items():
        margin = float(logits[step, first] - logits[step, second])
        print(f"  {name:<36} argmax {int(logits[step].argmax()):>5}   "
              f"logit[{first}] - logit[{second}] = {margin:+.5f}")  # fmt: skip


if __name__ == "__main__":
    main()
