"""Forced split counts of the split-KV decode launch at small token counts (diagnostic): how far
the planner's choice (:func:`dsv4_attn.kernels.sparse_decode.plan_splits`) is from the best.

FP8 cache, CUDA-graph replays, L2 flushed, medians of 30 (µs). Shapes: V4-Flash, V4-Pro, V4-Flash
at TP 8, HCA at 1M (full lists, and every token with 2048 or 512 of its 8192 entries). JSON to
the first argument (default ``$OUT/decode_split_sweep.json``). On a Hopper GPU:

    python scripts/decode_split_sweep.py [OUT.json]
"""

import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dsv4_attn.bench.decode import _RowPool, make_case
from dsv4_attn.bench.timing import cuda_graph_replay, time_cuda_us
from dsv4_attn.kernels import sparse_decode as sd
from dsv4_attn.kv_cache import KVFormat

# name: (heads, window, compressed capacity, compressed count per token or None = capacity)
SHAPES = {
    "v4-flash": (64, 128, 512, None),
    "v4-pro": (128, 128, 1024, None),
    "tp8": (8, 128, 512, None),
    "hca-1m": (64, 128, 8192, None),
    "hca-1m-2048": (64, 128, 8192, 2048),
    "hca-1m-512": (64, 128, 8192, 512),
}
SPLITS = {
    "v4-flash": (1, 2, 3, 4, 5, 7, 10, 14, 20),
    "v4-pro": (1, 2, 3, 4, 6, 9, 12, 18, 36),
    "tp8": (1, 2, 3, 4, 5, 7, 10, 20),
    "hca-1m": (16, 29, 32, 48, 65, 130),
    "hca-1m-2048": (8, 16, 29, 32, 65),
    "hca-1m-512": (8, 16, 29, 32, 65),
}


def main() -> None:
    default = os.path.join(os.environ.get("OUT", "."), "decode_split_sweep.json")
    path = sys.argv[1] if len(sys.argv) > 1 else default
    pool = _RowPool(torch.device("cuda"))
    rows = []
    for name, (H, window, capacity, count) in SHAPES.items():
        for T in (2, 4, 8, 16, 32, 64) if capacity <= 1024 else (2, 4, 8, 16):
            case = make_case(pool, KVFormat.FP8_DS_MLA, T, H, window, capacity)
            if count is not None:
                case.extra.lens.fill_(count)
            q, scope, _, _, extra = case.args()
            out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=q.device)
            lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
            planned, _ = sd.resolve_splits(T, H, sd.key_capacity(scope, extra), q.device)
            row = {"shape": name, "T": T, "planned_splits": planned, "us": {}}
            for splits in sorted({*SPLITS[name], planned}):
                call = functools.partial(sd.sparse_attention, *case.args(), num_splits=splits,
                                         out=out, lse=lse)  # fmt: skip
                row["us"][splits] = time_cuda_us(cuda_graph_replay(call), reps=30)["median_us"]
            best = min(row["us"], key=row["us"].get)
            print(f"{name:12} T={T:3}  planned {planned:3}: {row['us'][planned]:6.1f} us   "
                  f"best {best:3}: {row['us'][best]:6.1f} us", flush=True)  # fmt: skip
            rows.append(row)
    Path(path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
    print("json:", path)


if __name__ == "__main__":
    main()
