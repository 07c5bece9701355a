"""Where a decode call's time goes at small token counts: the split launch and the balanced
schedule, each timed as one call and as its decode and combine kernels apart (diagnostic).

HCA shape (64 heads, 128-slot window, lists of up to 8192 compressed entries), FP8 cache, every
token with the same ``count`` compressed entries (a server configured for 1M tokens holding
shorter contexts), CUDA-graph replays, L2 flushed, medians of 30. Uses the kernel module's
private launch helpers to time the two kernels apart. JSON to ``$OUT/decode_parts.json`` (or
the first argument). Run from the repository root on a Hopper GPU:

    python scripts/decode_parts.py [OUT.json]
"""

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

HEADS, WINDOW, CAPACITY = 64, 128, 8192
COUNTS = (8192, 2048, 512)
TOKENS = (2, 4, 16, 64)


def graph_us(fn) -> float:
    return time_cuda_us(cuda_graph_replay(fn), reps=30)["median_us"]


def measure(pool: _RowPool, count: int, T: int) -> dict:
    device = pool.device
    case = make_case(pool, KVFormat.FP8_DS_MLA, T, HEADS, WINDOW, CAPACITY)
    case.extra.lens.fill_(count)
    q, window, sink, scale, extra = case.args()
    scale_log2 = float(scale) * math.log2(math.e)
    decode_cache = sd._caches()[0]
    out = torch.empty(T, HEADS, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(T, HEADS, dtype=torch.float32, device=device)
    scopes = (q, window.cache, window.indices, window.lens, *sd._extra_args(extra), sink)
    row: dict = {"count": count, "T": T}

    splits, tiles_per_split = sd.resolve_splits(T, HEADS, sd.key_capacity(window, extra), device)
    row["splits"] = splits
    row["split_us"] = graph_us(lambda: sd.sparse_attention(*case.args(), out=out, lse=lse))
    if splits > 1:
        o_part, lse_part = sd._partials(None, *sd.workspace_shape(splits, T, HEADS), device)
        config = sd.decode_config(window, sink, extra, True)
        decode = decode_cache.get(config, lambda: sd.build_decode_kernel(config))
        row["split_decode_us"] = graph_us(
            lambda: decode(
                *scopes, o_part, lse_part, *sd._NOT_BALANCED, scale_log2, splits, tiles_per_split
            )
        )
        row["split_combine_us"] = graph_us(
            lambda: sd._merge_partials(o_part, lse_part, sink, out, lse, None)
        )

    plan = sd.balanced_plan(window, extra, HEADS)
    part_plan, token_plan = plan.part_plan.cpu(), plan.token_plan.cpu()
    row["active_parts"] = int((part_plan[:, 1] > part_plan[:, 0]).sum())
    row["share_tiles"] = int(part_plan[0, 1] - part_plan[0, 0])
    row["pieces_per_token"] = token_plan[:, 2].tolist()[:4]
    row["balanced_us"] = graph_us(
        lambda: sd.sparse_attention(*case.args(), out=out, lse=lse, plan=plan)
    )
    o_part, lse_part = sd._partials(None, *sd.balanced_workspace_shape(plan.num_parts, HEADS),
                                    device)  # fmt: skip
    config = sd.decode_config(window, sink, extra, False, balanced=True)
    decode = decode_cache.get(config, lambda: sd.build_decode_kernel(config))
    row["balanced_decode_us"] = graph_us(
        lambda: decode(
            *scopes, out, lse, o_part, lse_part, plan.part_plan, plan.token_plan, scale_log2, 1, 0
        )
    )
    row["balanced_combine_us"] = graph_us(
        lambda: sd._merge_partials(o_part, lse_part, sink, out, lse, plan.token_plan)
    )
    return row


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."),
                                                              "decode_parts.json")  # fmt: skip
    pool = _RowPool(torch.device("cuda"))
    rows = []
    for count in COUNTS:
        for T in TOKENS:
            rows.append(measure(pool, count, T))
            print(rows[-1], flush=True)
    Path(path).write_text(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
            indent=1,
        )
    )
    print("json:", path)


if __name__ == "__main__":
    main()
