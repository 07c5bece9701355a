"""Benchmark of the Hopper sparse-decode kernel (``python -m dsv4_attn.bench decode``).

Shapes: V4-Flash (H=64, a 128-slot window + 512 compressed entries), V4-Pro (H=128,
128 + 1024), T in {1, 8, 64, 128, 256} decode tokens of separate requests, plus HCA at 1M context
(H=64, 128 + 8192); FP8_DS_MLA and NVFP4 caches. Every token reads its own random rows of one
large cache (no reuse between tokens), the L2 is flushed before each timed call.

Per row: kernel time (median), effective GB/s (valid KV rows in their cache format + q + out),
TFLOP/s (QK^T and PV), the floor from ceilings measured in the same run, the SDPA fallback's time
on the same inputs and the speed-up over it. Prints a table and writes JSON.

``--against flashmla``: ours (FP8 and NVFP4 caches) next to FlashMLA's sparse decode on the FP8
bytes of the same rows (same slot ids, q, sink and softmax scale; :mod:`dsv4_attn.bench.anchors`
has the mapping), in one process, L2 flushed, medians. ``b`` requests of ``s_q = 2`` tokens
(``--batches``, T = 2b); the shapes above plus V4-Flash at the per-GPU head counts of tensor
parallelism (32, 16, 8: FlashMLA runs them as vLLM does, q zero-padded to 64 heads, output sliced
back; ours runs the real head count). Per row: both our times, FlashMLA's, FlashMLA / ours per
format (> 1: ours is faster), for the HCA shapes also ours on the balanced schedule (plan made
once, as FlashMLA's) and the plan's own time, the floors, max |ours fp8 - FlashMLA| and the
project's target where one applies (:func:`targets`). Without flash_mla importable it says so
once and times ours. The NVFP4 caches hold their own random rows (same distribution, same slot
ids): only the FP8 comparison needs the same bytes.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from types import ModuleType

import torch

from dsv4_attn import fallback, kv_cache
from dsv4_attn.bench import anchors
from dsv4_attn.bench.timing import (
    Ceilings,
    cuda_graph_replay,
    decode_roofline,
    decode_traffic,
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
    # A window-only layer: V4's ratio 0 and 1, V4.1's ratio 0 (at V4.1-Flash's 64 heads). V4.1's
    # ratio 1 and 2 layers read the window + their top-512, v4-flash's lists: their compressed
    # pages hold 64 // ratio entries, which changes a slot's address, not the kernel's work.
    "window-only": (64, 128, 0),
}
TP_SHAPES = {  # V4-Flash at the per-GPU head counts of tensor parallelism 2, 4 and 8
    "v4-flash-tp2": (32, 128, 512),
    "v4-flash-tp4": (16, 128, 512),
    "v4-flash-tp8": (8, 128, 512),
}
# Uneven work (the balanced schedule's case, docs/design.md §4.1.6): HCA at a 1M .. 128K
# context where each request has its own number of compressed entries, uniform in [0, 8192] ..
# [0, 1024] (the tokens of a request share it).
RAGGED_SHAPES = {
    "hca-1m-ragged": (64, 128, 8192),
    "hca-512k-ragged": (64, 128, 4096),
    "hca-256k-ragged": (64, 128, 2048),
    "hca-128k-ragged": (64, 128, 1024),
}
# The HCA shapes are also timed on the balanced schedule (``fp8 bal us``, its plan made once
# outside the timing as FlashMLA's is; ``plan us`` alone), as a server runs HCA layers.
BALANCED_SHAPES = ("hca-1m", *RAGGED_SHAPES)
ALL_SHAPES = {**SHAPES, **TP_SHAPES, **RAGGED_SHAPES}
TOKENS = (1, 8, 64, 128, 256)
BATCHES = (1, 32, 64, 128, 256)  # requests b with --against (T = b * s_q)
S_Q = 2  # tokens per request with --against (decode with one speculative token)
OURS = (KVFormat.FP8_DS_MLA, KVFormat.NVFP4)  # the formats timed with --against
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
AGAINST_COLUMNS = [
    ("shape", "shape", "s"),
    ("H", "H", "d"),
    ("b", "b", "d"),
    ("T", "T", "d"),
    ("fp8_us", "fp8 us", ".1f"),
    ("nvfp4_us", "nvfp4 us", ".1f"),
    ("flashmla_us", "FlashMLA us", ".1f"),
    ("fp8_balanced_us", "fp8 bal us", ".1f"),
    ("plan_us", "plan us", ".1f"),
    ("vs_flashmla_fp8", "FM/fp8", ".2f"),
    ("vs_flashmla_nvfp4", "FM/nvfp4", ".2f"),
    ("vs_flashmla_balanced", "FM/bal", ".2f"),
    ("floor_us", "floor us", ".1f"),
    ("nvfp4_floor_us", "nvfp4 floor", ".1f"),
    ("max_abs_diff_vs_flashmla", "max|d| FM", ".4f"),
    ("target", "target", "s"),
    ("meets_target", "met", ""),
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


def make_case(
    pool: _RowPool,
    fmt: KVFormat,
    T: int,
    H: int,
    window: int,
    extra: int,
    ragged_group: int | None = None,
) -> DecodeCase:
    """``T`` tokens of ``H`` heads, each with ``window`` window rows and ``extra`` compressed
    rows of its own; with ``ragged_group``, every group of that many consecutive tokens (one
    request) counts a random number of its compressed rows, uniform in ``[0, extra]``."""
    cache = pool.cache(fmt, WINDOW_BLOCK, T * window)
    q = (torch.randn(T, H, HEAD_DIM, generator=pool.gen, device=pool.device) * 0.5).to(
        torch.bfloat16
    )
    full = torch.full((T,), window, dtype=torch.int32, device=pool.device)
    efull = torch.full((T,), extra, dtype=torch.int32, device=pool.device)
    if ragged_group is not None:
        if T % ragged_group:
            raise ValueError(f"{T} tokens are not whole requests of {ragged_group}")
        per_request = torch.randint(
            0,
            extra + 1,
            (T // ragged_group,),
            generator=pool.gen,
            device=pool.device,
            dtype=torch.int32,
        )
        efull = per_request.repeat_interleave(ragged_group)
    sink = torch.randn(H, generator=pool.gen, device=pool.device)
    window_scope = KVScope(
        cache, fmt, WINDOW_BLOCK, pool.slots(T, window, cache.shape[0] * WINDOW_BLOCK), full
    )
    if extra == 0:  # a window-only layer: no second list
        return DecodeCase(q, window_scope, sink, HEAD_DIM**-0.5, None)
    ecache = pool.cache(fmt, EXTRA_BLOCK, T * extra)
    extra_scope = KVScope(
        ecache, fmt, EXTRA_BLOCK, pool.slots(T, extra, ecache.shape[0] * EXTRA_BLOCK), efull
    )
    return DecodeCase(q, window_scope, sink, HEAD_DIM**-0.5, extra_scope)


def cases(pool: _RowPool, formats, shapes, tokens):
    """``(fmt, shape, T, case)`` for every format x shape x token count, in that order."""
    for fmt_name in formats:
        fmt = KVFormat.parse(fmt_name)
        for shape in shapes:
            H, window, extra = ALL_SHAPES[shape]
            ragged = 1 if shape in RAGGED_SHAPES else None
            for T in tokens:
                yield fmt, shape, T, make_case(pool, fmt, T, H, window, extra, ragged)


def run(shapes, tokens, formats, reps: int, fallback_reps: int):
    from dsv4_attn.kernels import sparse_decode

    device = torch.device("cuda")
    ceilings = measure_ceilings()
    rows = []
    for fmt, shape, T, case in cases(_RowPool(device), formats, shapes, tokens):
        H, window, extra = ALL_SHAPES[shape]
        args = case.args()
        _require_kernel(sparse_decode, case, f"{shape} T={T}")
        capacity = sparse_decode.key_capacity(case.window, case.extra)
        splits, _ = sparse_decode.resolve_splits(T, H, capacity, device)
        kernel = time_cuda_us(lambda a=args: sparse_decode.sparse_attention(*a), reps=reps)
        slow = time_cuda_us(
            lambda a=args: fallback.sparse_attention(*a), reps=fallback_reps, warmup=1
        )
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


def in_format(pool: _RowPool, case: DecodeCase, fmt: KVFormat) -> DecodeCase:
    """``case`` (same q, sink, scale, slot ids and lens) over the pool's ``fmt`` caches, each at
    least as large as the case's own (so every slot id stays valid)."""

    def move(scope: KVScope) -> KVScope:
        cache = pool.cache(fmt, scope.block_size, scope.cache.shape[0] * scope.block_size)
        return replace(scope, cache=cache, fmt=fmt)

    extra = move(case.extra) if case.extra is not None else None
    return replace(case, window=move(case.window), extra=extra)


def targets(shape: str, b: int) -> dict[str, float]:
    """The project's targets for one ``--against`` row (empty when none applies): minimum
    FlashMLA-time / our-time ratios per format (``"fp8"``, ``"nvfp4"``) at b >= 64 (V4-Flash:
    fp8 1.5, nvfp4 2.0; V4-Pro: fp8 1.25; V4-Flash at the TP head counts: fp8 2.0; a
    window-only layer, V4.1's ratio 0: fp8 1.3), and at b = 1 a maximum of our time in µs in
    both formats (``"max_us"``: 10)."""
    found: dict[str, float] = {}
    if b == 1:
        found["max_us"] = 10.0
    if b >= 64:
        if shape == "v4-flash":
            found.update(fp8=1.5, nvfp4=2.0)
        elif shape == "v4-pro":
            found["fp8"] = 1.25
        elif shape in TP_SHAPES:
            found["fp8"] = 2.0
        elif shape == "window-only":
            found["fp8"] = 1.3
    return found


def describe_targets(found: dict[str, float]) -> str | None:
    """One-line form of :func:`targets`, e.g. ``"fp8>=1.5x nvfp4>=2.0x"``; None when empty."""
    parts = [f"{k}>={v}x" for k, v in found.items() if k != "max_us"]
    if "max_us" in found:
        parts.append(f"<={found['max_us']:g}us")
    return " ".join(parts) or None


def meets_targets(row: dict, found: dict[str, float]) -> bool | None:
    """False when a measured value misses a target, True when every target is met, None when
    none applies or one cannot be judged (no FlashMLA time, a format not timed)."""
    verdicts: list[bool | None] = []
    for fmt in ("fp8", "nvfp4"):
        if fmt in found:
            ratio = row.get(f"vs_flashmla_{fmt}")
            verdicts.append(None if ratio is None else ratio >= found[fmt])
        if "max_us" in found:
            t = row.get(f"{fmt}_us")
            verdicts.append(None if t is None else t <= found["max_us"])
    if False in verdicts:
        return False
    if not verdicts or None in verdicts:
        return None
    return True


def against_row(
    shape: str, b: int, s_q: int, ours_us: dict[str, float], floors: dict[str, float], fm: dict
) -> dict:
    """One ``--against`` row. ``ours_us`` / ``floors``: µs per format value timed
    (``"fp8_ds_mla"``, ``"nvfp4"``); ``fm``: what :func:`time_flashmla` returned, or empty (no
    FlashMLA)."""
    H, window, extra = ALL_SHAPES[shape]
    fm_heads = anchors.flashmla_heads(H) if anchors.flashmla_refusal(H, []) is None else None
    fp8_us = ours_us.get(KVFormat.FP8_DS_MLA.value)
    nvfp4_us = ours_us.get(KVFormat.NVFP4.value)
    fm_us = fm.get("flashmla_us")
    row = {
        "shape": shape,
        "H": H,
        "flashmla_heads": fm_heads,
        "b": b,
        "s_q": s_q,
        "T": b * s_q,
        "window": window,
        "extra": extra,
        "fp8_us": fp8_us,
        "nvfp4_us": nvfp4_us,
        "flashmla_us": fm_us,
        "fp8_balanced_us": ours_us.get("balanced"),
        "plan_us": ours_us.get("plan"),
        "vs_flashmla_balanced": fm_us / ours_us["balanced"]
        if fm_us and "balanced" in ours_us
        else None,
        "vs_flashmla_fp8": fm_us / fp8_us if fm_us and fp8_us else None,
        "vs_flashmla_nvfp4": fm_us / nvfp4_us if fm_us and nvfp4_us else None,
        "floor_us": floors.get(KVFormat.FP8_DS_MLA.value),
        "nvfp4_floor_us": floors.get(KVFormat.NVFP4.value),
        "max_abs_diff_vs_flashmla": fm.get("max_abs_diff_vs_flashmla"),
        "fp8_max_abs_out": fm.get("fp8_max_abs_out"),
    }
    found = targets(shape, b)
    row.update(target=describe_targets(found), meets_target=meets_targets(row, found))
    if "flashmla_error" in fm:
        row["flashmla_error"] = fm["flashmla_error"]
    return row


def time_flashmla(
    flash_mla: ModuleType,
    case: DecodeCase,
    s_q: int,
    reps: int,
    ours_fp8: torch.Tensor,
    graphs: bool = False,
) -> dict:
    """FlashMLA on ``case`` (FP8): ``flashmla_us`` (median; of CUDA-graph replays with
    ``graphs``), ``max_abs_diff_vs_flashmla`` against our FP8 output ``ours_fp8`` (bf16
    ``[T, H, 512]``) and that output's largest ``|value|`` (``fp8_max_abs_out``), or
    ``flashmla_error`` when it refuses the shape (recorded, not fatal)."""
    widths = [case.window.capacity] + ([case.extra.capacity] if case.extra is not None else [])
    reason = anchors.flashmla_refusal(case.q.shape[1], widths)
    if reason is not None:
        return {"flashmla_error": reason}
    try:
        call = anchors.flashmla_sparse_decode(flash_mla, case, s_q)
        out = call()
        if out.is_cuda:
            torch.cuda.synchronize()  # a refusal inside the launch surfaces here
    except (RuntimeError, AssertionError, ValueError) as exc:
        return {"flashmla_error": str(exc).splitlines()[0][:200]}
    diff = (ours_fp8.float() - out.float()).abs().max().item()
    timed = cuda_graph_replay(call) if graphs else call
    fields = {
        "flashmla_us": time_cuda_us(timed, reps=reps)["median_us"],
        "fp8_max_abs_out": ours_fp8.float().abs().max().item(),  # the scale of the difference
    }
    if math.isfinite(diff):
        fields["max_abs_diff_vs_flashmla"] = diff
    else:
        fields["flashmla_error"] = "ours and FlashMLA differ by a non-finite amount (NaN or inf)"
    return fields


def _require_kernel(sparse_decode, case: DecodeCase, label: str) -> None:
    """Stop the benchmark, naming the case, when the kernel would not run it."""
    reason = sparse_decode.unsupported_reason(case.q, case.window, case.sink, case.extra)
    if reason is not None:
        raise SystemExit(f"the kernel does not run {label}: {reason}")


def _ours(
    sparse_decode,
    case: DecodeCase,
    label: str,
    reps: int | None,
    graphs: bool = False,
    plan=None,
):
    """Our kernel's output (bf16 ``[T, H, 512]``) and, when ``reps``, its median µs (of
    CUDA-graph replays with ``graphs``); ``plan``: a balanced plan, as
    :func:`sparse_attention` takes it."""
    _require_kernel(sparse_decode, case, label)
    args = case.args()
    out = sparse_decode.sparse_attention(*args, plan=plan)[0]
    if not reps:
        return out, None

    def call():
        return sparse_decode.sparse_attention(*args, plan=plan)

    timed = cuda_graph_replay(call) if graphs else call
    return out, time_cuda_us(timed, reps=reps)["median_us"]


def run_against(
    flash_mla: ModuleType | None,
    shapes: list[str],
    batches: list[int],
    formats: list[KVFormat],
    s_q: int,
    reps: int,
    device: torch.device | str = "cuda",
    graphs: bool = False,
) -> tuple[list[dict], Ceilings]:
    """The ``--against flashmla`` rows: per shape and batch, ours in ``formats`` and FlashMLA
    (when importable) on the same FP8 rows; with ``graphs`` both are timed as CUDA-graph
    replays."""
    from dsv4_attn.kernels import sparse_decode, sparse_decode_schedule

    device = torch.device(device)
    ceilings = measure_ceilings()
    pool = _RowPool(device)
    rows = []
    for shape in shapes:
        H, window, extra = ALL_SHAPES[shape]
        for b in batches:
            label = f"{shape} b={b} s_q={s_q}"
            ragged = s_q if shape in RAGGED_SHAPES else None
            fp8_case = make_case(pool, KVFormat.FP8_DS_MLA, b * s_q, H, window, extra, ragged)
            ours_us, floors, ours_fp8 = {}, {}, None
            for fmt in formats:
                case = fp8_case if fmt is KVFormat.FP8_DS_MLA else in_format(pool, fp8_case, fmt)
                out, ours_us[fmt.value] = _ours(sparse_decode, case, label, reps, graphs)
                floors[fmt.value] = ceilings.floor_us(*decode_traffic(case))
                if fmt is KVFormat.FP8_DS_MLA:
                    ours_fp8 = out
                del case, out
            if KVFormat.FP8_DS_MLA in formats and shape in BALANCED_SHAPES:
                # The balanced schedule, its plan made once (as FlashMLA's below), and the
                # plan's own time.
                def make_plan(case=fp8_case, heads=H):
                    return sparse_decode_schedule.balanced_plan(case.window, case.extra, heads)

                _, ours_us["balanced"] = _ours(
                    sparse_decode, fp8_case, label, reps, graphs, make_plan()
                )
                timed = cuda_graph_replay(make_plan) if graphs else make_plan
                ours_us["plan"] = time_cuda_us(timed, reps=reps)["median_us"]
            fm = {}
            if flash_mla is not None:
                if ours_fp8 is None:  # FP8 not timed: its output is still the reference
                    ours_fp8, _ = _ours(sparse_decode, fp8_case, label, None)
                fm = time_flashmla(flash_mla, fp8_case, s_q, reps, ours_fp8, graphs)
                if "flashmla_error" in fm:
                    print(f"FlashMLA on {label}: {fm['flashmla_error']}", flush=True)
            rows.append(against_row(shape, b, s_q, ours_us, floors, fm))
            print(format_table(rows[-1:], AGAINST_COLUMNS).splitlines()[-1], flush=True)
            del fp8_case, ours_fp8
    return rows, ceilings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options, with the defaults that depend on ``--against`` filled in (``shapes``,
    ``tokens``/``batches``, ``formats``, ``json``)."""
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.bench decode")
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=list(ALL_SHAPES),
        help=f"default {' '.join(SHAPES)}; with --against also "
        f"{' '.join([*TP_SHAPES, *RAGGED_SHAPES])}",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        help=f"decode tokens T (default {' '.join(map(str, TOKENS))}); not with --against",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="with --against: requests b of --s-q tokens each, T = b * s_q "
        f"(default {' '.join(map(str, BATCHES))})",
    )
    parser.add_argument("--s-q", type=int, default=S_Q, help="with --against: tokens per request")
    parser.add_argument(
        "--formats", nargs="+", help="KV-cache formats of ours (default fp8_ds_mla nvfp4)"
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--fallback-reps", type=int, default=5)
    parser.add_argument(
        "--against",
        choices=["flashmla"],
        help="time FlashMLA's sparse decode on the same FP8 rows (imported when "
        "present) instead of the SDPA fallback",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --against: time CUDA-graph replays of ours and FlashMLA "
        "(device time only, no host launch overhead per call)",
    )
    parser.add_argument(
        "--json", help="default bench_decode.json (bench_decode_vs_flashmla.json with --against)"
    )
    args = parser.parse_args(argv)
    try:
        formats = [KVFormat.parse(f) for f in args.formats or [f.value for f in OURS]]
    except ValueError as exc:
        parser.error(str(exc))
    if args.against is None:
        if args.batches is not None or args.s_q != S_Q or args.cuda_graphs:
            parser.error(
                "--batches, --s-q and --cuda-graphs go with --against (without it use --tokens)"
            )
        args.shapes = args.shapes or list(SHAPES)
        args.tokens = args.tokens or list(TOKENS)
        args.json = args.json or "bench_decode.json"
    else:
        if args.tokens is not None:
            parser.error("--against times b requests of s_q tokens: use --batches, not --tokens")
        if any(f not in OURS for f in formats):
            parser.error(f"--against times {' and '.join(f.value for f in OURS)} only")
        if args.s_q < 1 or min(args.batches or BATCHES) < 1:
            parser.error("--batches and --s-q must be positive")
        args.shapes = args.shapes or list(ALL_SHAPES)
        args.batches = args.batches or list(BATCHES)
        args.json = args.json or "bench_decode_vs_flashmla.json"
    args.formats = [f.value for f in formats]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    flash_mla = anchors.import_flash_mla() if args.against == "flashmla" else None
    if not torch.cuda.is_available():
        raise SystemExit("the decode benchmark times CUDA kernels: no CUDA device found")
    if args.against is None:
        rows, ceilings = run(args.shapes, args.tokens, args.formats, args.reps, args.fallback_reps)
        report(args.json, "decode", ceilings, rows, COLUMNS, "L2 flushed before each call")
        return
    formats = [KVFormat.parse(f) for f in args.formats]
    rows, ceilings = run_against(
        flash_mla, args.shapes, args.batches, formats, args.s_q, args.reps, graphs=args.cuda_graphs
    )
    note = (
        f"L2 flushed before each call; b requests of s_q={args.s_q} tokens; FlashMLA's q "
        "zero-padded to 64 heads below 64; FM/x = FlashMLA us / ours (> 1: ours faster)"
    )
    if args.cuda_graphs:
        note += "; CUDA-graph replays timed (no host launch overhead)"
    if flash_mla is None:
        note += "; flash_mla not importable: ours only"
    report(args.json, "decode-vs-flashmla", ceilings, rows, AGAINST_COLUMNS, note)
