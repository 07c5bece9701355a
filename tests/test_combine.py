"""CI tests of the split-KV combine kernel: every variant compiles for sm_90a without spills.

Its numerics are checked on the GPU through the decode tests (tests/test_sparse_decode.py), which
force split counts from 1 to 200 against the float64 reference.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from dsv4_attn.kernels import compile_cache, sparse_decode
from dsv4_attn.kernels.precompile import combine_variants
from dsv4_attn.kernels.resource_usage import read_resources


@pytest.mark.parametrize("config", combine_variants(), ids=repr)
def test_combine_compiles_without_spills(config, tmp_path):
    cubin = compile_cache.compile_keeping_cubin(
        lambda: sparse_decode.build_combine_kernel(config), tmp_path
    )
    (kernel,) = read_resources(cubin)
    assert kernel.frame_bytes == 0
    assert 0 < kernel.registers <= 168  # three 128-thread CTAs fit an SM
