"""Launch the sparse-prefill kernel on the V4-Flash shape a few times (for ncu profiling)."""

import torch

from dsv4_attn.kernels import fmha
from dsv4_attn.prefill_cases import make_v4_sparse_case

case = make_v4_sparse_case(4096, 64, 512, device="cuda", seed=0)
for _ in range(3):
    fmha.run_sparse(case.q, case.kv, case.indices, case.lens, case.sink, case.scale)
torch.cuda.synchronize()
