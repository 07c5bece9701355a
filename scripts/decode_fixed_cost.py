"""The fixed cost of a small decode call (diagnostic): an empty CUDA-graph replay (this harness's
floor) and the decode kernel alone with 1 to 20 tiles per CTA, i.e. time = fixed + tiles x per
tile. FP8 cache, CUDA-graph replays, L2 flushed, medians (µs). With ``NCU=1`` it only makes a few
eager calls, for ``ncu -k regex:kernel_cutlass``. JSON to the first argument (default
``$OUT/decode_fixed_cost.json``). On a Hopper GPU:

    python scripts/decode_fixed_cost.py [OUT.json]
"""

import functools
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
from dsv4_attn.kv_cache import KVFormat

CASES = (("v4-flash", 64, 512, 2), ("v4-flash", 64, 512, 16), ("v4-pro", 128, 1024, 8))


def graph_us(fn, reps: int = 30) -> float:
    return time_cuda_us(cuda_graph_replay(fn), reps=reps)["median_us"]


def main() -> None:
    default = os.path.join(os.environ.get("OUT", "."), "decode_fixed_cost.json")
    path = sys.argv[1] if len(sys.argv) > 1 else default
    profiling = bool(os.environ.get("NCU"))
    pool = _RowPool(torch.device("cuda"))
    x = torch.zeros(16, device="cuda")
    result = {"device": torch.cuda.get_device_name()}
    if not profiling:
        result["empty_graph_us"] = graph_us(lambda: x.add_(1.0), 50)
        result["two_empty_kernels_graph_us"] = graph_us(lambda: (x.add_(1.0), x.mul_(1.0)), 50)
    for name, H, capacity, T in CASES:
        case = make_case(pool, KVFormat.FP8_DS_MLA, T, H, 128, capacity)
        q, scope, sink, scale, extra = case.args()
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
        if profiling:
            for _ in range(3):
                sd.sparse_attention(q, scope, sink, scale, extra, out=out, lse=lse)
            torch.cuda.synchronize()
            continue
        scale_log2 = float(scale) * math.log2(math.e)
        args = (q, scope.cache, scope.indices, scope.lens, *sd._extra_args(extra), sink)
        for forced in (1, 2, 5, 10, 20):
            splits, per_split = sd.resolve_splits(T, H, sd.key_capacity(scope, extra), q.device,
                                                  forced)  # fmt: skip
            config = sd.decode_config(scope, sink, extra, splits > 1)
            decode = sd._caches()[0].get(config, lambda c=config: sd.build_decode_kernel(c))
            outputs = (out, lse)
            if splits > 1:
                outputs = sd._partials(None, *sd.workspace_shape(splits, T, H), q.device)
            call = functools.partial(decode, *args, *outputs, *sd._NOT_BALANCED, scale_log2,
                                     splits, per_split)  # fmt: skip
            key = f"{name}_T{T}_decode_alone_{splits}splits_{per_split}tiles_us"
            result[key] = graph_us(call)
            print(f"{key}: {result[key]:.1f}", flush=True)
    if not profiling:
        Path(path).write_text(json.dumps(result, indent=1))
        print("json:", path)


if __name__ == "__main__":
    main()
