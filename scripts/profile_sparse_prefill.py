"""Launch the sparse-prefill kernel on the V4-Flash shape a few times (for ncu profiling).

Run from anywhere (``scripts/profile_prefill.sh`` runs it under ncu); the checkout it lives in is
put first on ``sys.path``, so no install is needed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dsv4_attn.kernels import fmha
from dsv4_attn.prefill_cases import make_v4_sparse_case

case = make_v4_sparse_case(4096, 64, 512, device="cuda", seed=0)
for _ in range(3):
    fmha.run_sparse(case.q, case.kv, case.indices, case.lens, case.sink, case.scale)
torch.cuda.synchronize()
