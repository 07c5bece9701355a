"""The whole prefill attention of one DeepSeek-V4 layer for one prompt, new path against old.

``python -m dsv4_attn.bench prefill-layer [--prompts 4096,32768,131072] [--json PATH]``

One request whose prompt of ``P`` tokens is prefilled in steps of ``--step-tokens`` (vLLM's
chunked prefill; each step sees the prompt's earlier tokens from the cache; V4-Flash: 64 heads,
window 128, CSA top-k 512, HCA over every entry; NVFP4 cache filled with random rows, random
top-k picks among each token's visible entries). Per layer kind it times, on the same caches
and queries:

* ``old`` — every token through the sparse-decode kernel, reading its own rows from the pages
  (the decode path, for comparison);
* ``new`` — what ``forward_mqa`` runs (:mod:`dsv4_attn.vllm_glue.prefill`): gather the
  request's rows to bf16 once, build the index lists, the gathered FMHA kernel; also each piece
  alone (``gather``, ``index``, ``fmha``).

Target: a 32K prompt's CSA layer at least 5x faster gathered than through the decode path. The
outputs of both paths are compared (max |diff|, bf16); both are checked against the float64
reference in the tests.
"""

from __future__ import annotations

import argparse

import torch

from dsv4_attn import ops
from dsv4_attn.bench.timing import measure_ceilings, report, time_cuda_us
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.layer_kind import Family, compressed_of
from dsv4_attn.scope import KVScope
from dsv4_attn.testing import random_cache

__all__ = ["main"]

WINDOW = 128
SWA_BLOCK = 64
CACHE_BLOCK = 256
KINDS = {"swa": 1, "csa": 4, "hca": 128}


class _Prompt:
    """Caches, queries and both paths' inputs for a ``P``-token prompt at one layer kind."""

    def __init__(
        self, fmt: KVFormat, P: int, ratio: int, heads: int, topk: int, step_tokens: int, gen
    ) -> None:
        from dsv4_attn.vllm_glue import prefill

        dev = torch.device("cuda")
        self.fmt, self.P, self.ratio, self.topk = fmt, P, ratio, topk
        self.q = (torch.randn(P, heads, HEAD_DIM, generator=gen) * 2).to(dev, torch.bfloat16)
        self.sink = torch.randn(heads, generator=gen).to(dev)
        self.swa = random_cache(P, SWA_BLOCK, fmt, gen, dev)
        self.swa_table = torch.arange(self.swa.shape[0], dtype=torch.int32, device=dev)[None]
        pos = torch.arange(P, device=dev)
        # Old path: each token's window slots (the block table is the identity: slot = position).
        offsets = torch.arange(WINDOW, device=dev)
        start = (pos - (WINDOW - 1)).clamp(min=0)
        wlen = (pos - start + 1).int()
        win = torch.where(offsets[None] < wlen[:, None], start[:, None] + offsets[None], -1)
        self.window = KVScope(self.swa, fmt, SWA_BLOCK, win.int(), wlen)
        self.extra = None
        self.local_topk = None
        self.compressed = None
        self.entries = compressed_of(Family.V4, ratio)
        if ratio > 1:
            per_page = CACHE_BLOCK // ratio
            cache = random_cache(max(1, P // ratio), per_page, fmt, gen, dev)
            table = torch.arange(cache.shape[0], dtype=torch.int32, device=dev)[None]
            self.compressed = (cache, table, per_page, ratio)
            count = (pos + 1) // ratio
            if ratio == 4:  # random picks among the visible entries, -1 past the count
                k = torch.arange(topk, device=dev)[None]
                picks = (
                    torch.rand(P, topk, generator=torch.Generator(dev).manual_seed(1), device=dev)
                    * count[:, None]
                ).long()
                local = torch.where(k < count[:, None].clamp(max=topk), picks, -1).int()
                self.local_topk = local
                lens = (local >= 0).sum(1).int()
                self.extra = KVScope(cache, fmt, per_page, local, lens)
            else:
                width = max(1, P // ratio)
                e = torch.arange(width, device=dev)[None]
                hca = torch.where(e < count[:, None], e, -1).int()
                self.extra = KVScope(cache, fmt, per_page, hca, count.clamp(max=width).int())
        # vLLM prefills the prompt in steps of at most max_num_batched_tokens tokens; step k
        # attends its own tokens to everything cached before (prefix) and in the step.
        self.steps = []
        for t0 in range(0, P, step_tokens):
            t1 = min(P, t0 + step_tokens)
            budget = prefill.rows_budget(P, self.entries, WINDOW, step_tokens)
            (chunk,) = prefill.plan_chunks(
                torch.tensor([t0, t1]), torch.tensor([t1]), 0, 1, self.entries, WINDOW, budget
            )
            shapes = prefill.peak_workspace_shapes(P, self.entries, WINDOW, topk, t1 - t0, heads)
            self.steps.append(
                {
                    "tokens": slice(t0, t1),
                    "chunk": chunk,
                    "seq_lens": torch.tensor([t1], dtype=torch.int32, device=dev),
                    "query_lens": torch.tensor([t1 - t0], dtype=torch.int32, device=dev),
                    "query_start": torch.tensor([t0, t1], dtype=torch.int32, device=dev),
                    "rows_ws": torch.empty(chunk.rows, HEAD_DIM, dtype=torch.bfloat16, device=dev),
                    "index_ws": (
                        torch.empty(shapes[1][0], dtype=torch.int32, device=dev),
                        torch.empty(shapes[2][0], dtype=torch.int32, device=dev),
                    ),
                    "lse_ws": torch.empty(shapes[3][0], dtype=torch.float32, device=dev),
                }
            )
        self.out_old = torch.empty_like(self.q)
        self.out_new = torch.empty_like(self.q)
        self.prefill = prefill
        self.gather()
        self.index()
        self.workspace_rows = max(step["chunk"].rows for step in self.steps)

    def old(self) -> None:
        for step in self.steps:
            t = step["tokens"]
            window = self.window.tokens(t.start, t.stop)
            extra = self.extra.tokens(t.start, t.stop) if self.extra is not None else None
            ops.sparse_attention(
                self.q[t],
                window,
                self.sink,
                HEAD_DIM**-0.5,
                extra,
                out=self.out_old[t],
                check_values=False,
            )

    def gather(self) -> None:
        for step in self.steps:
            step["rows"] = self.prefill.gather_rows(
                step["rows_ws"],
                step["chunk"],
                self.fmt,
                step["seq_lens"],
                step["query_lens"],
                WINDOW,
                (self.swa, self.swa_table, SWA_BLOCK),
                self.compressed,
            )

    def index(self) -> None:
        for step in self.steps:
            t = step["tokens"]
            topk = self.local_topk[t] if self.local_topk is not None else None
            step["indices"], step["lens"] = self.prefill.index_lists(
                step["chunk"],
                step["query_start"],
                step["seq_lens"],
                WINDOW,
                self.entries,
                topk,
                step["index_ws"],
            )

    def fmha(self) -> None:
        for step in self.steps:
            t = step["tokens"]
            self.prefill.attend(
                self.q[t],
                step["rows"],
                step["indices"],
                step["lens"],
                self.sink,
                HEAD_DIM**-0.5,
                self.out_new[t],
                step["lse_ws"],
            )

    def new(self) -> None:
        self.gather()
        self.index()
        self.fmha()


def run(args) -> tuple[list[dict], object]:
    ceilings = measure_ceilings()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for P in [int(p) for p in args.prompts.split(",")]:
        for kind in args.kinds.split(","):
            case = _Prompt(
                KVFormat.NVFP4, P, KINDS[kind], args.heads, args.topk, args.step_tokens, gen
            )
            times = {
                name: time_cuda_us(getattr(case, name), reps=args.reps, warmup=2)["median_us"]
                for name in ("old", "gather", "index", "fmha", "new")
            }
            diff = (case.out_old.float() - case.out_new.float()).abs().max().item()
            rows.append(
                {
                    "fmt": "nvfp4",
                    "kind": kind,
                    "prompt": P,
                    "H": args.heads,
                    "old_us": times["old"],
                    "new_us": times["new"],
                    "gather_us": times["gather"],
                    "index_us": times["index"],
                    "fmha_us": times["fmha"],
                    "speedup": times["old"] / times["new"],
                    "workspace_rows": case.workspace_rows,
                    "step_tokens": args.step_tokens,
                    "max_abs_diff": diff,
                }
            )
            print(rows[-1], flush=True)
            del case
            torch.cuda.empty_cache()
    return rows, ceilings


COLUMNS = [
    ("kind", "layer", "s"),
    ("prompt", "prompt", "d"),
    ("old_us", "old us", ".0f"),
    ("new_us", "new us", ".0f"),
    ("speedup", "x old", ".2f"),
    ("gather_us", "gather", ".0f"),
    ("index_us", "index", ".0f"),
    ("fmha_us", "fmha", ".0f"),
    ("workspace_rows", "ws rows", "d"),
    ("max_abs_diff", "max|d|", ".4f"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench prefill-layer")
    parser.add_argument("--prompts", default="4096,32768,131072")
    parser.add_argument("--kinds", default="csa,hca,swa")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=8192,
        help="tokens per prefill step (vLLM's max_num_batched_tokens)",
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default="bench_out/prefill_layer.json")
    args = parser.parse_args(argv)
    rows, ceilings = run(args)
    note = (
        f"one prompt in steps of {args.step_tokens} tokens, NVFP4 cache, H={args.heads}, "
        f"median of {args.reps} whole prefills"
    )
    report(args.json, "prefill-layer", ceilings, rows, COLUMNS, note=note)


if __name__ == "__main__":
    main()
