"""The Triton kernels of :mod:`dsv4_attn.fused` against the torch code they replace.

CPU (CI): the checks of ``tests/fused_checks.py`` run in Triton's interpreter, in a child pytest
started with ``TRITON_INTERPRET=1``. GPU (``pytest -m gpu``): the same checks, compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.fused_checks import (
    KERNEL_VARIANTS,
    KINDS,
    WARM_STEP,
    ServingStand,
    check_compress_rows,
    check_decode_schedule,
    check_gather,
    check_insert,
    check_metadata,
    check_metadata_edges,
    check_prefill_index,
    check_staged_rows,
    fused_kernels,
    fused_modules,
    serving_steps,
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
    check_insert(_compiled(), "cuda", heads, padded, 3, q_norm=False)  # V4.1: no q norm


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


@contextmanager
def _compiles_counted() -> Iterator[list[str]]:
    """The Triton compilations while inside, in order, as ``"kernel: signature attributes
    constants"`` (the attributes: what Triton specialized on, e.g. divisibility by 16): a hook
    on ``knobs.runtime.jit_post_compile_hook`` (where vLLM's JIT monitor hooks), chained to the
    hook before it, which is put back after."""
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook
    compiled: list[str] = []

    def count(**kwargs):
        info = kwargs["compile"]
        compiled.append(
            f"{kwargs['fn'].name}: {info['signature']} {info['configs']} {info['constants']}"
        )
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = count
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = previous


@pytest.mark.gpu
def test_one_compile_serves_every_batch_cuda():
    """After a warm-up step, steps of other batch shapes (request and token counts, first
    tokens, list widths, micro-batch views at any offset) compile nothing: vLLM's JIT monitor
    stays quiet while serving. The warm-up compiles each kernel's per-layer variants, the
    kernels' in-memory caches emptied first (earlier tests' compilations do not count)."""
    fused = _compiled()
    kernels = fused_kernels(fused)
    for kernel in kernels.values():
        kernel.device_caches.clear()
    stand = ServingStand("cuda")
    with _compiles_counted() as compiled:
        stand.step(fused, WARM_STEP)
        torch.cuda.synchronize()
        warm = list(compiled)
        for step in serving_steps():
            stand.step(fused, step)
        torch.cuda.synchronize()
    counts = {name: sum(c.startswith(name + ":") for c in warm) for name in kernels}
    assert counts == KERNEL_VARIANTS, warm
    assert compiled[len(warm) :] == [], "\n".join(compiled[len(warm) :])


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
    for q_norm in (True, False):  # DeepSeek-V4's per-head q norm, V4.1 without
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
                "Q_NORM": "constexpr",
            },
            {"HEADS": 8, "Q_NORM": q_norm},
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
                "window": "i32",
                "window_lens_out": p["i32"],
                "HAS_VISIBLE": "constexpr",
                "HAS_COUNTS": "constexpr",
                "BLOCK_REQS": "constexpr",
                "BLOCK_ENTRIES": "constexpr",
            },
            {
                "HAS_VISIBLE": has_visible,
                "HAS_COUNTS": has_counts,
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
    assert len(names) == 17, names


# ----------------------------------------------------------------------------------------------
# CPU: one compile serves every batch (Triton specializes plain ints and pointers per launch)
# ----------------------------------------------------------------------------------------------

_STEP_POINTERS = {"seq_lens_ptr", "slot_mapping_ptr", "block_table_ptr"}

# Per kernel: (ints whose value follows the batch, pointers that may come as views at a
# batch-dependent offset), neither of which Triton may specialize on. A new batch-dependent
# parameter goes here (and in the kernel's decorator); the ones not named stay specialized.
UNSPECIALIZED: dict[str, tuple[set[str], set[str]]] = {
    "_qnorm_rope_nvfp4_insert_kernel": ({"num_slots"}, {"positions_ptr", "slots_ptr"}),
    "_store_staged_rows_kernel": (set(), set()),
    "_window_kernel": ({"num_reqs", "bt_stride", "bt_width"}, _STEP_POINTERS),
    "_compressed_kernel": (
        {"num_reqs", "bt_stride", "bt_width", "visible_width", "window"},
        _STEP_POINTERS,
    ),
    "_entry_slots_kernel": ({"bt_stride", "bt_width"}, {"block_table_ptr"}),
    "_prefill_index_kernel": (
        {"num_reqs", "first_token", "indices_stride", "width", "N", "M"},
        {"query_start_ptr", "seq_lens_ptr"},
    ),
    "_gather_nvfp4_kernel": (
        {"offset", "num_pages", "bt_stride", "bt_width"},
        {"seq_lens_ptr", "gather_lens_ptr", "block_table_ptr"},
    ),
    "_compress_rows_kernel": (
        {"bt_stride", "bt_width"},
        {"block_table_ptr", "positions_ptr", "state_slots_ptr"},
    ),
    "_decode_schedule_kernel": ({"T"}, set()),
}


def _jit_kernels() -> dict:
    from triton.runtime.jit import JITFunction

    kernels = fused_kernels(fused_modules())
    if not all(isinstance(k, JITFunction) for k in kernels.values()):
        pytest.skip("Triton's interpreter is on (TRITON_INTERPRET): no JIT functions")
    return kernels


def test_batch_dependent_parameters_are_not_specialized():
    """Each kernel's parameters Triton does not specialize (as its launches bind them:
    ``JITFunction.params``) are exactly those of :data:`UNSPECIALIZED`: none missing, none
    unreviewed, none misspelt (Triton ignores a name it does not know)."""
    kernels = _jit_kernels()
    assert set(kernels) == set(UNSPECIALIZED)
    for name, kernel in kernels.items():
        values, alignments = UNSPECIALIZED[name]
        params = {p.name: p for p in kernel.params}
        assert values | alignments <= set(params), name
        assert not any(params[v].is_constexpr for v in values), name
        got_values = {p.name for p in kernel.params if p.do_not_specialize}
        got_alignments = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
        assert got_values == values, name
        assert got_alignments == alignments, name


def _record_launch_keys(monkeypatch) -> dict[str, set]:
    """From now on, each launch of a :mod:`dsv4_attn.fused` kernel records its compile key
    (Triton's own binder for sm_90: the specialization of every argument, constexprs and
    options) by kernel name, instead of compiling and running."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys: dict[str, set] = {}
    for name, kernel in _jit_kernels().items():
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)

        def record(*args, grid, warmup, _name=name, _binder=binder, **kwargs):
            _, specialization, options = _binder(*args, **kwargs)
            keys.setdefault(_name, set()).add((tuple(specialization), str(options)))

        monkeypatch.setattr(kernel, "run", record)
    return keys


def test_the_profiling_runs_gather_warm_up_covers_serving(monkeypatch):
    """``prefill.warm_gather``, run by each layer kind in vLLM's profiling run on small caches
    of its own, asks for every gather key that serving steps then ask for (their caches of
    another page count, chunks of every shape): a user's first prefill with earlier context
    compiles nothing. The gathers take their GPU path here (keys recorded, nothing run)."""
    from dsv4_attn.kv_cache import KVFormat
    from dsv4_attn.layer_kind import Family, compressed_of
    from dsv4_attn.vllm_glue import prefill

    keys = _record_launch_keys(monkeypatch)
    monkeypatch.setattr(prefill, "_runs_fused", lambda device: True)
    stand = ServingStand("cpu")
    for ratio in (1, 4, 128):
        kind = compressed_of(Family.V4, ratio)
        prefill.warm_gather(
            KVFormat.NVFP4, kind, stand.WINDOW, stand.SWA_BLOCK, stand.CACHE_BLOCK, "cpu"
        )
    warm = set(keys.pop("_gather_nvfp4_kernel"))
    assert len(warm) == KERNEL_VARIANTS["_gather_nvfp4_kernel"]
    fused = fused_modules()
    for step in [WARM_STEP, *serving_steps()]:
        stand.step(fused, step)
    served = keys["_gather_nvfp4_kernel"]
    assert served, "the serving steps gathered nothing"
    assert served <= warm, served - warm


def test_one_launch_key_serves_every_batch(monkeypatch):
    """What the GPU test :func:`test_one_compile_serves_every_batch_cuda` proves, on the CPU:
    each launch's compile key (Triton's own binder for sm_90: the specialization of every
    argument, constexprs and options), recorded instead of compiling, over the warm-up step and
    then batches of every other shape. The warm-up asks for each kernel's per-layer variants;
    the other batches ask for no new key."""

    keys = _record_launch_keys(monkeypatch)
    fused = fused_modules()
    stand = ServingStand("cpu")
    stand.step(fused, WARM_STEP)
    warm = {name: set(k) for name, k in keys.items()}
    assert {name: len(k) for name, k in warm.items()} == KERNEL_VARIANTS
    for step in serving_steps():
        stand.step(fused, step)
    new = {name: k - warm[name] for name, k in keys.items() if k - warm[name]}
    assert not new, new
