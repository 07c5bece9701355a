"""One decode step of one DeepSeek-V4 attention layer, piece by piece: how much of it is the
attention kernel, and how much is everything this backend adds around it.

``python -m dsv4_attn.bench step [--batch 64] [--heads 64] [--context 8192] [--json PATH]``

A decode batch of ``b`` requests (one token each; ``--spec`` more with MTP), V4-Flash shapes by
default (64 heads, window 128, CSA top-k 512, HCA over the whole context). Per layer kind (SWA-only,
CSA, HCA) it times, each captured in a CUDA graph and replayed as vLLM's FULL decode graphs do:

* ``insert`` — q RMSNorm + RoPE, KV RoPE + NVFP4 encode + paged store (one Triton kernel);
* ``store`` — NVFP4 encode + store of the compressor's staged rows (CSA/HCA; vLLM's compressor
  kernel before it is vLLM's compression math, the same with vLLM's own backend, so not counted);
* ``slots`` — a CSA layer's top-k entries mapped to cache slots;
* ``attention`` — the sparse-decode kernel (and its split-KV combine);

plus, once per step for all layers, ``metadata`` (the three builders' kernels). It prints, per
kind, the outside-kernel time over the kernel time (target <= 15%), both as the outside pieces'
own graph (``outside/attn``, which pays a graph launch of its own) and as what they add to the
kernel when all pieces replay in one graph (``added/attn``, the cost inside vLLM's FULL decode
graph), and the kernel launches per layer per step, counted with the torch profiler. With vLLM
importable (the serve environment) it also times the fp8 path, whose insert is vLLM's fused op.
"""

from __future__ import annotations

import argparse

import torch

from dsv4_attn.bench.timing import (
    Ceilings,
    cuda_graph_replay,
    measure_ceilings,
    report,
    time_cuda_us,
)
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.scope import KVScope
from dsv4_attn.testing import random_cache

__all__ = ["main"]

WINDOW = 128
SWA_BLOCK = 64
CACHE_BLOCK = 256  # tokens per compressed-cache block (vLLM's DeepSeek-V4 block size)
KINDS = {"swa": 1, "csa": 4, "hca": 128}


class _Step:
    """Caches, metadata and inputs of one decode step of ``batch`` requests at ``context``."""

    def __init__(self, fmt, batch, heads, context, topk, spec, seed=0) -> None:
        from dsv4_attn.fused import step_metadata

        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.fmt, self.heads, self.topk = fmt, heads, topk
        q_len = 1 + spec
        self.T = T = batch * q_len
        seq = torch.full((batch,), context, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(0, T + 1, q_len, dtype=torch.int32, device=dev)
        self.seq_lens = seq
        pos = (seq[:, None] - q_len + torch.arange(q_len, device=dev)[None]).flatten()
        self.positions = pos.long()
        # Every request owns its own blocks (distinct pages: no sharing through L2).
        swa_blocks = -(-context // SWA_BLOCK)
        cache_blocks = -(-context // CACHE_BLOCK)
        self.swa_table = torch.arange(batch * swa_blocks, device=dev, dtype=torch.int32).view(
            batch, swa_blocks
        )
        self.cache_table = torch.arange(batch * cache_blocks, device=dev, dtype=torch.int32).view(
            batch, cache_blocks
        )
        self.swa_slots = (
            self.swa_table.long().gather(1, (pos.view(batch, q_len) // SWA_BLOCK)) * SWA_BLOCK
            + pos.view(batch, q_len) % SWA_BLOCK
        ).flatten()
        self.cache_slots = self.swa_slots.clone()  # only their sign (valid) matters here
        self.swa_cache = random_cache(batch * swa_blocks * SWA_BLOCK, SWA_BLOCK, fmt, gen, dev)
        self.compressed = {
            ratio: random_cache(
                batch * cache_blocks * (CACHE_BLOCK // ratio), CACHE_BLOCK // ratio, fmt, gen, dev
            )
            for ratio in (4, 128)
        }
        self.q = (torch.randn(T, heads, HEAD_DIM, generator=gen, device=dev) * 2).to(torch.bfloat16)
        self.kv = torch.randn(T, HEAD_DIM, generator=gen, device=dev).to(torch.bfloat16)
        self.cos_sin = torch.randn(context + 8, 64, generator=gen, device=dev)
        self.sink = torch.randn(heads, generator=gen, device=dev)
        self.staged = torch.randn(T, 1, HEAD_DIM, generator=gen, device=dev).to(torch.bfloat16)
        visible = context // 4
        picks = torch.rand(T, visible, generator=gen, device=dev).argsort(dim=1)[:, :topk]
        self.local_topk = picks.to(torch.int32).contiguous()
        # Metadata buffers (the builders' outputs).
        i32 = dict(dtype=torch.int32, device=dev)
        self.token_req = torch.empty(T, **i32)
        self.valid = torch.empty(T, dtype=torch.bool, device=dev)
        self.swa_indices = torch.empty(T, WINDOW, **i32)
        self.swa_lens = torch.empty(T, **i32)
        self.write_slots = {r: torch.empty(T, dtype=torch.int64, device=dev) for r in (4, 128)}
        self.staging_rows = {r: torch.empty(T, dtype=torch.int64, device=dev) for r in (4, 128)}
        self.hca_width = -(-context // 128)
        self.hca_indices = torch.empty(T, self.hca_width, **i32)
        self.hca_lens = torch.empty(T, **i32)
        self.csa_visible = torch.empty(T, **i32)
        self.entry_slots = torch.empty(T, topk, **i32)
        self.entry_lens = torch.empty(T, **i32)
        self.out = torch.empty(T, heads, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        self.step_metadata = step_metadata
        self.metadata()  # the lists the attention reads
        self.slots()

    # The pieces of a step ------------------------------------------------------------------

    def metadata(self) -> None:
        sm = self.step_metadata
        sm.fill_window_metadata(
            self.query_start,
            self.seq_lens,
            self.swa_slots,
            self.swa_table,
            SWA_BLOCK,
            token_req=self.token_req,
            valid=self.valid,
            swa_indices=self.swa_indices,
            swa_lens=self.swa_lens,
        )
        for ratio in (4, 128):
            hca = ratio == 128
            sm.fill_compressed_metadata(
                self.query_start,
                self.seq_lens,
                self.cache_slots,
                self.cache_table,
                CACHE_BLOCK // ratio,
                ratio,
                token_req=self.token_req,
                valid=self.valid,
                write_slots=self.write_slots[ratio],
                staging_rows=self.staging_rows[ratio],
                visible_slots=self.hca_indices if hca else None,
                visible_lens=self.hca_lens if hca else self.csa_visible,
            )

    def insert(self) -> None:
        if self.fmt is KVFormat.NVFP4:
            from dsv4_attn.fused.kv_writers import qnorm_rope_nvfp4_insert

            qnorm_rope_nvfp4_insert(
                self.q,
                self.kv,
                self.positions,
                self.cos_sin,
                1e-6,
                self.heads,
                self.swa_slots,
                self.swa_cache,
                SWA_BLOCK,
            )
        else:
            torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
                self.q,
                self.kv,
                self.swa_cache,
                self.swa_slots,
                self.positions,
                self.cos_sin,
                self.heads,
                1e-6,
                SWA_BLOCK,
            )

    def store(self, ratio: int) -> None:
        from dsv4_attn.fused.kv_writers import store_staged_rows

        rows = CACHE_BLOCK // ratio
        store_staged_rows(
            self.staged.view(-1, HEAD_DIM), self.write_slots[ratio], self.compressed[ratio], rows
        )

    def slots(self) -> None:
        self.step_metadata.fill_entry_slots(
            self.local_topk,
            self.token_req,
            self.valid,
            self.csa_visible,
            self.cache_table,
            CACHE_BLOCK // 4,
            slots=self.entry_slots,
            lens=self.entry_lens,
        )

    def attention(self, ratio: int) -> None:
        from dsv4_attn.kernels import sparse_decode

        window = KVScope(self.swa_cache, self.fmt, SWA_BLOCK, self.swa_indices, self.swa_lens)
        extra = None
        if ratio == 4:
            extra = KVScope(
                self.compressed[4], self.fmt, CACHE_BLOCK // 4, self.entry_slots, self.entry_lens
            )
        elif ratio == 128:
            extra = KVScope(
                self.compressed[128], self.fmt, CACHE_BLOCK // 128, self.hca_indices, self.hca_lens
            )
        sparse_decode.sparse_attention(
            self.q, window, self.sink, HEAD_DIM**-0.5, extra, out=self.out
        )


def _time_graph(fns, reps: int) -> float:
    """Median microseconds of one replay of ``fns`` captured, in order, in one CUDA graph."""
    return time_cuda_us(cuda_graph_replay(lambda: [fn() for fn in fns]), reps=reps)["median_us"]


def _count_launches(fns) -> int:
    from torch.profiler import ProfilerActivity, profile

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and e.name != "Memcpy")


def run(args) -> tuple[list[dict], Ceilings]:
    ceilings = measure_ceilings()
    formats = [KVFormat.NVFP4]
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        formats.append(KVFormat.FP8_DS_MLA)
    except Exception as exc:  # no vLLM CUDA build here: NVFP4 only
        print(f"vLLM's CUDA ops are unavailable ({type(exc).__name__}); timing NVFP4 only")
    rows = []
    for fmt in formats:
        step = _Step(fmt, args.batch, args.heads, args.context, args.topk, args.spec)
        meta_us = _time_graph([step.metadata], args.reps)
        for kind, ratio in KINDS.items():
            pieces = {
                "insert": [step.insert],
                "attention": [lambda s=step, r=ratio: s.attention(r)],
            }
            if ratio > 1 and fmt is KVFormat.NVFP4:
                pieces["store"] = [lambda s=step, r=ratio: s.store(r)]
            if ratio == 4:
                pieces["slots"] = [step.slots]
            times = {name: _time_graph(fns, args.reps) for name, fns in pieces.items()}
            outside = [fn for name, fns in pieces.items() if name != "attention" for fn in fns]
            outside_us = _time_graph(outside, args.reps)
            # The pieces in one graph, in step order, as vLLM's FULL decode graph runs them: what
            # the outside pieces add to the kernel there (no second graph-launch overhead).
            layer_us = _time_graph(outside + pieces["attention"], args.reps)
            launches_outside = _count_launches(outside)
            launches_attention = _count_launches(pieces["attention"])
            kernel = times["attention"]
            rows.append(
                {
                    "fmt": fmt.value,
                    "kind": kind,
                    "T": step.T,
                    "H": args.heads,
                    "context": args.context,
                    "attention_us": kernel,
                    "insert_us": times["insert"],
                    "store_us": times.get("store"),
                    "slots_us": times.get("slots"),
                    "outside_us": outside_us,
                    "outside_share": outside_us / kernel,
                    "layer_us": layer_us,
                    "added_us": layer_us - kernel,
                    "added_share": (layer_us - kernel) / kernel,
                    "metadata_step_us": meta_us,
                    "metadata_per_layer_us": meta_us / args.layers,
                    "share_with_metadata": (outside_us + meta_us / args.layers) / kernel,
                    "launches_outside": launches_outside,
                    "launches_attention": launches_attention,
                    "launches_per_layer": launches_outside + launches_attention,
                }
            )
        del step
        torch.cuda.empty_cache()
    return rows, ceilings


COLUMNS = [
    ("fmt", "fmt", "s"),
    ("kind", "layer", "s"),
    ("T", "T", "d"),
    ("attention_us", "attn us", ".1f"),
    ("insert_us", "insert", ".1f"),
    ("store_us", "store", ".1f"),
    ("slots_us", "slots", ".1f"),
    ("outside_us", "outside us", ".1f"),
    ("outside_share", "outside/attn", ".2f"),
    ("layer_us", "layer us", ".1f"),
    ("added_share", "added/attn", ".2f"),
    ("metadata_step_us", "meta/step", ".1f"),
    ("share_with_metadata", "+meta/layers", ".2f"),
    ("launches_per_layer", "launches/layer", "d"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench step")
    parser.add_argument("--batch", type=int, default=64, help="decode requests")
    parser.add_argument("--spec", type=int, default=0, help="MTP draft tokens per request")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--context", type=int, default=8192, help="tokens per request")
    parser.add_argument("--topk", type=int, default=512, help="CSA top-k")
    parser.add_argument("--layers", type=int, default=43, help="layers sharing one metadata build")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--json", default="bench_out/step.json")
    args = parser.parse_args(argv)
    if args.context < 4 * args.topk:
        raise SystemExit(f"--context must be >= 4 * --topk ({4 * args.topk}), got {args.context}")
    rows, ceilings = run(args)
    note = f"b={args.batch}, s_q={1 + args.spec}, CUDA-graph replays, median of {args.reps}"
    report(args.json, "step", ceilings, rows, COLUMNS, note=note)


if __name__ == "__main__":
    main()
