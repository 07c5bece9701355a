"""The split-KV combine kernel against another version of it (diagnostic): the same partials
merged by both, their outputs compared, each timed alone and after the decode kernel (µs,
CUDA-graph replays, L2 flushed, medians of 30), for the current kernel's 1- and 4-warp widths.

The other version is a copy of ``kernels/combine.py`` from history that reads the same
partial format (fp16 scaled rows and (lse, k) pairs; the fp32
versions before it, e.g. ``06df2a6``, ran against the decode kernel of their day):

    git show <commit>:kernels/combine.py > /tmp/combine_old.py
    python scripts/combine_ab.py /tmp/combine_old.py [OUT.json]

Cases: V4-Flash, V4-Pro and TP 8 at small T (split launch), HCA 1M with full, 2048-, 512-entry
and ragged lists (split and balanced). JSON to ``OUT.json`` (default ``$OUT/combine_ab.json``).
"""

import functools
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dsv4_attn.bench.decode import _RowPool, make_case
from dsv4_attn.bench.timing import cuda_graph_replay, time_cuda_us
from dsv4_attn.kernels import sparse_decode as sd
from dsv4_attn.kernels.combine import CombineConfig
from dsv4_attn.kernels.compile_cache import compile_tvm_ffi
from dsv4_attn.kv_cache import KVFormat

# (shape, heads, compressed capacity, entries per token: None = capacity, -1 = ragged, T)
CASES = [
    *(("v4-flash", 64, 512, None, T) for T in (2, 4, 8, 16, 64)),
    ("v4-pro", 128, 1024, None, 2), ("tp8", 8, 512, None, 2),
    *(("hca-1m", 64, 8192, 8192, T) for T in (2, 4, 16, 64, 256)),
    *(("hca-1m", 64, 8192, 2048, T) for T in (2, 16, 64)),
    ("hca-1m", 64, 8192, 512, 16), ("hca-1m", 64, 8192, -1, 32), ("hca-1m", 64, 8192, -1, 128),
]  # fmt: skip


def us(fn) -> float:
    return time_cuda_us(cuda_graph_replay(fn), reps=30)["median_us"]


def build_other(path: str, balanced: bool):
    """The other version's combine kernel (has_sink=True), compiled like the current one."""
    spec = importlib.util.spec_from_file_location("combine_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    kernel = module.SplitCombine(module.CombineConfig(has_sink=True, balanced=balanced))
    return compile_tvm_ffi(kernel, *sd.combine_fake_args(True, balanced))


def launches(case, T, H, out, lse):
    """``(mode, decode call, combine arguments, balanced)`` of the case's split and balanced runs
    (the balanced one from 2048 entries on; the split one only while it splits)."""
    q, window, sink, scale, extra = case.args()
    scale_log2 = float(scale) * math.log2(math.e)
    args = (q, window.cache, window.indices, window.lens, *sd._extra_args(extra), sink)
    decode_cache = sd._caches()[0]
    splits, per_split = sd.resolve_splits(T, H, sd.key_capacity(window, extra), q.device)
    if splits > 1 and T < 128:
        parts = sd._partials(None, *sd.workspace_shape(splits, T, H), q.device)
        config = sd.decode_config(window, sink, extra, True)
        decode = decode_cache.get(config, lambda: sd.build_decode_kernel(config))
        call = functools.partial(decode, *args, *parts, *sd._NOT_BALANCED, scale_log2, splits,
                                 per_split)  # fmt: skip
        yield "split", call, (*parts, sink, out, lse, None), False
    if extra.capacity >= 2048:
        plan = sd.balanced_plan(window, extra, H)
        parts = sd._partials(None, *sd.balanced_workspace_shape(plan.num_parts, H), q.device)
        config = sd.decode_config(window, sink, extra, False, balanced=True)
        decode = decode_cache.get(config, lambda: sd.build_decode_kernel(config))
        call = functools.partial(decode, *args, out, lse, *parts, plan.part_plan,
                                 plan.token_plan, scale_log2, 1, 0)  # fmt: skip
        yield "balanced", call, (*parts, sink, out, lse, plan.token_plan), True


def main() -> None:
    other_path = sys.argv[1]
    default = os.path.join(os.environ.get("OUT", "."), "combine_ab.json")
    path = sys.argv[2] if len(sys.argv) > 2 else default
    pool = _RowPool(torch.device("cuda"))
    combine_cache = sd._caches()[1]
    other = {balanced: build_other(other_path, balanced) for balanced in (False, True)}
    rows = []
    for shape, H, capacity, count, T in CASES:
        case = make_case(pool, KVFormat.FP8_DS_MLA, T, H, 128, capacity,
                         2 if count == -1 else None)  # fmt: skip
        if count is not None and count >= 0:
            case.extra.lens.fill_(count)
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=pool.device)
        lse = torch.empty(T, H, dtype=torch.float32, device=pool.device)
        row = {"shape": shape, "H": H, "entries": count, "T": T}
        for mode, decode, combine_args, balanced in launches(case, T, H, out, lse):
            kernels = {"other": other[balanced]}
            for warps in (1, 4):
                config = CombineConfig(True, balanced, warps)
                kernels[f"{warps}warp"] = combine_cache.get(
                    config, lambda c=config: sd.build_combine_kernel(c)
                )
            decode()
            kernels["other"](*combine_args)
            torch.cuda.synchronize()
            ref_out, ref_lse = out.float().clone(), lse.clone()
            row[f"{mode}_decode_us"] = us(decode)
            for name, kernel in kernels.items():
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                decode()
                kernel(*combine_args)
                torch.cuda.synchronize()
                row[f"{mode}_{name}_max_diff"] = float((out.float() - ref_out).abs().max())
                row[f"{mode}_{name}_lse_max_diff"] = float((lse - ref_lse).abs().max())
                merge = functools.partial(kernel, *combine_args)
                row[f"{mode}_{name}_combine_us"] = us(merge)
                row[f"{mode}_{name}_call_us"] = us(lambda d=decode, m=merge: (d(), m()))
        rows.append(row)
        print(row, flush=True)
    Path(path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
    print("json:", path)


if __name__ == "__main__":
    main()
