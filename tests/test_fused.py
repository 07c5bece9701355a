"""The Triton kernels of :mod:`dsv4_attn.fused` against the torch code they replace.

CPU (CI): the checks of ``tests/fused_checks.py`` run in Triton's interpreter, in a child pytest
started with ``TRITON_INTERPRET=1``. GPU (``pytest -m gpu``): the same checks, compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fused_checks import (
    KINDS,
    check_compress_rows,
    check_decode_schedule,
    check_gather,
    check_insert,
    check_metadata,
    check_metadata_edges,
    check_prefill_index,
    check_staged_rows,
    fused_modules,
)

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_match_torch_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not gpu",
        str(ROOT / "tests" / "fused_checks.py"),
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary


def _compiled():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return fused_modules()


# ----------------------------------------------------------------------------------------------
# GPU: compiled
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_staged_rows_cuda(kind):
    for seed in range(3):
        check_staged_rows(_compiled(), "cuda", kind, seed)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "padded"), [(6, 8), (64, 64), (100, 128), (128, 128)])
def test_insert_cuda(heads, padded):
    for seed in range(3):
        check_insert(_compiled(), "cuda", heads, padded, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gather_cuda(kind):
    for seed in range(3):
        check_gather(_compiled(), "cuda", kind, seed)


@pytest.mark.gpu
def test_prefill_index_cuda():
    for seed in range(8):
        check_prefill_index(_compiled(), "cuda", seed)


@pytest.mark.gpu
def test_metadata_cuda():
    for seed in range(12):
        check_metadata(_compiled(), "cuda", seed)


@pytest.mark.gpu
def test_metadata_edges_cuda():
    check_metadata_edges(_compiled(), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("ratio", "dtype"), [(4, torch.bfloat16), (4, torch.float32), (16, torch.bfloat16)]
)
def test_compress_rows_cuda(ratio, dtype):
    for seed in range(3):
        check_compress_rows(_compiled(), "cuda", ratio, dtype, seed)


@pytest.mark.gpu
def test_decode_schedule_cuda():
    for seed in range(12):
        check_decode_schedule(_compiled(), "cuda", seed)


# ----------------------------------------------------------------------------------------------
# CPU: every kernel compiles for sm_90 (Triton's own ptxas; no GPU needed)
# ----------------------------------------------------------------------------------------------

_PTR = {"bf16": "*bf16", "f32": "*fp32", "i32": "*i32", "i64": "*i64", "u8": "*u8", "i8": "*i8"}


def _kernels():
    """(kernel, signature, constexprs) as the wrappers of dsv4_attn.fused launch them."""
    from dsv4_attn.fused import kv_writers as kw
    from dsv4_attn.fused import step_metadata as sm

    p = _PTR
    meta_head = {
        "query_start_ptr": p["i32"],
        "seq_lens_ptr": p["i32"],
        "slot_mapping_ptr": p["i64"],
        "num_reqs": "i32",
        "block_table_ptr": p["i32"],
        "bt_stride": "i32",
        "bt_width": "i32",
    }
    yield (
        kw._store_staged_rows_kernel,
        {
            "rows_ptr": p["bf16"],
            "rows_stride": "i32",
            "write_slots_ptr": p["i64"],
            "cache_ptr": p["u8"],
            "page_stride": "i32",
            "block_size": "i32",
        },
        {},
    )
    from dsv4_attn.fused import decode_schedule as ds
    from dsv4_attn.fused import kv_gather as kg
    from dsv4_attn.fused import prefill_index as pi

    for has_extra in (True, False):
        yield (
            ds._decode_schedule_kernel,
            {
                "lens_ptr": p["i32"],
                "extra_lens_ptr": p["i32"],
                "window_capacity": "i32",
                "extra_capacity": "i32",
                "T": "i32",
                "parts": "i32",
                "min_share": "i32",
                "part_plan_ptr": p["i32"],
                "token_plan_ptr": p["i32"],
                "HAS_EXTRA": "constexpr",
                "KEYS_PER_TILE": "constexpr",
                "OVERHEAD": "constexpr",
                "SNAP_DIV": "constexpr",
                "BLOCK_P": "constexpr",
                "CHUNK": "constexpr",
            },
            {
                "HAS_EXTRA": has_extra,
                "KEYS_PER_TILE": 32,
                "OVERHEAD": 2,
                "SNAP_DIV": 16,
                "BLOCK_P": 256,
                "CHUNK": 32,
            },
        )

    for mode in (0, 1, 2):
        yield (
            pi._prefill_index_kernel,
            {
                "query_start_ptr": p["i32"],
                "seq_lens_ptr": p["i32"],
                "num_reqs": "i32",
                "first_token": "i32",
                "topk_ptr": p["i32"],
                "topk_stride": "i32",
                "topk": "i32",
                "indices_ptr": p["i32"],
                "indices_stride": "i32",
                "width": "i32",
                "lens_ptr": p["i32"],
                "N": "i32",
                "M": "i32",
                "ratio": "i32",
                "WINDOW": "constexpr",
                "MODE": "constexpr",
                "BLOCK_REQS": "constexpr",
                "BLOCK_COLUMNS": "constexpr",
            },
            {"WINDOW": 128, "MODE": mode, "BLOCK_REQS": 128, "BLOCK_COLUMNS": 256},
        )

    for window in (True, False):
        yield (
            kg._gather_nvfp4_kernel,
            {
                "out_ptr": p["bf16"],
                "out_stride_req": "i32",
                "out_stride_row": "i32",
                "offset": "i32",
                "cache_ptr": p["u8"],
                "page_stride": "i32",
                "block_size": "i32",
                "num_pages": "i32",
                "seq_lens_ptr": p["i32"],
                "gather_lens_ptr": p["i32"],
                "ratio": "i32",
                "block_table_ptr": p["i32"],
                "bt_stride": "i32",
                "bt_width": "i32",
                "WINDOW": "constexpr",
            },
            {"WINDOW": window},
        )
    yield (
        kw._qnorm_rope_nvfp4_insert_kernel,
        {
            "q_ptr": p["bf16"],
            "q_stride_t": "i32",
            "q_stride_h": "i32",
            "kv_ptr": p["bf16"],
            "kv_stride_t": "i32",
            "q_out_ptr": p["bf16"],
            "positions_ptr": p["i64"],
            "cos_sin_ptr": p["f32"],
            "cos_sin_stride": "i32",
            "slots_ptr": p["i64"],
            "num_slots": "i32",
            "cache_ptr": p["u8"],
            "page_stride": "i32",
            "block_size": "i32",
            "num_heads": "i32",
            "padded_heads": "i32",
            "eps": "fp32",
            "HEADS": "constexpr",
        },
        {"HEADS": 8},
    )
    yield (
        sm._window_kernel,
        {
            **meta_head,
            "block_size": "i32",
            "req_out": p["i32"],
            "valid_out": p["i8"],
            "indices_out": p["i32"],
            "indices_stride": "i32",
            "lens_out": p["i32"],
            "WINDOW": "constexpr",
            "WINDOW_P2": "constexpr",
            "BLOCK_REQS": "constexpr",
        },
        {"WINDOW": 128, "WINDOW_P2": 128, "BLOCK_REQS": 128},
    )
    for has_visible, has_counts in ((True, True), (False, True), (False, False)):
        yield (
            sm._compressed_kernel,
            {
                **meta_head,
                "rows_per_block": "i32",
                "ratio": "i32",
                "req_out": p["i32"],
                "valid_out": p["i8"],
                "write_slots_out": p["i64"],
                "staging_rows_out": p["i64"],
                "visible_out": p["i32"],
                "visible_stride": "i32",
                "visible_width": "i32",
                "visible_lens_out": p["i32"],
                "window_lens_out": p["i32"],
                "HAS_VISIBLE": "constexpr",
                "HAS_COUNTS": "constexpr",
                "WINDOW": "constexpr",
                "BLOCK_REQS": "constexpr",
                "BLOCK_ENTRIES": "constexpr",
            },
            {
                "HAS_VISIBLE": has_visible,
                "HAS_COUNTS": has_counts,
                "WINDOW": 128 if has_visible else 0,
                "BLOCK_REQS": 128,
                "BLOCK_ENTRIES": 256,
            },
        )
    from dsv4_attn.fused import compressor as cp

    for state in ("bf16", "f32"):
        yield (
            cp._compress_rows_kernel,
            {
                "state_ptr": p[state],
                "state_stride_block": "i32",
                "state_stride_row": "i32",
                "block_table_ptr": p["i32"],
                "bt_stride": "i32",
                "bt_width": "i32",
                "state_block_size": "i32",
                "token_req_ptr": p["i32"],
                "positions_ptr": p["i64"],
                "state_slots_ptr": p["i64"],
                "out_rows_ptr": p["i64"],
                "norm_weight_ptr": p["bf16"],
                "eps": "fp32",
                "cos_sin_ptr": p["f32"],
                "cos_sin_stride": "i32",
                "out_ptr": p["bf16"],
                "out_stride": "i32",
                "D": "constexpr",
                "C": "constexpr",
                "RATIO": "constexpr",
                "WINDOW_P2": "constexpr",
                "ROPE_DIM": "constexpr",
            },
            {"D": 512, "C": 2, "RATIO": 4, "WINDOW_P2": 8, "ROPE_DIM": 64},
        )
    yield (
        sm._entry_slots_kernel,
        {
            "entries_ptr": p["i32"],
            "entries_stride": "i32",
            "token_req_ptr": p["i32"],
            "valid_ptr": p["i8"],
            "visible_ptr": p["i32"],
            "block_table_ptr": p["i32"],
            "bt_stride": "i32",
            "bt_width": "i32",
            "rows_per_block": "i32",
            "slots_out": p["i32"],
            "slots_stride": "i32",
            "lens_out": p["i32"],
            "width": "i32",
            "BLOCK_ENTRIES": "constexpr",
        },
        {"BLOCK_ENTRIES": 256},
    )


def test_every_kernel_compiles_for_sm90():
    """What the interpreter cannot see (non-constexpr globals, types the compiler rejects):
    each kernel goes through Triton's compiler down to an sm_90 cubin, as on the H100."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = []
    for kernel, signature, constexprs in _kernels():
        assert set(signature) == set(kernel.arg_names), kernel.fn.__name__
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert len(compiled.asm["cubin"]) > 1000
        names.append(kernel.fn.__name__)
    assert len(names) == 16, names
