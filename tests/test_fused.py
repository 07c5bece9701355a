"""The Triton kernels of :mod:`dsv4_attn.fused` against the torch code they replace.

CPU (CI): the checks of ``tests/fused_checks.py`` run in Triton's interpreter, in a child pytest
started with ``TRITON_INTERPRET=1``. GPU (``pytest -m gpu``): the same checks, compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
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


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2])
def test_nvfp4_ds_writer_cuda(ratio):
    _compiled()
    for seed in range(3):
        check_nvfp4_ds_writer("cuda", ratio, seed)


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
    # V4.1's NVFP4_DS writer has no part in the stand's V4 steps: it never compiles there.
    assert counts.pop("_rope_quant_insert_nvfp4_ds_kernel") == 0
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
    yield (
        kw._rope_quant_insert_nvfp4_ds_kernel,
        {
            "latent_ptr": p["bf16"],
            "latent_stride": "i32",
            "positions_ptr": p["i64"],
            "cos_sin_ptr": p["f32"],
            "cos_sin_stride": "i32",
            "slots_ptr": p["i64"],
            "cache_ptr": p["u8"],
            "page_stride": "i32",
            "block_size": "i32",
            "RATIO": "constexpr",
            "RECORD_BYTES": "constexpr",
        },
        {"RATIO": 2, "RECORD_BYTES": 288},
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
    assert len(names) == 18, names


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
    "_rope_quant_insert_nvfp4_ds_kernel": (set(), {"positions_ptr", "slots_ptr"}),
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


# ----------------------------------------------------------------------------------------------
# V4.1's NVFP4_DS writer (rope_quant_insert_nvfp4_ds) against the torch codec
# ----------------------------------------------------------------------------------------------

_DS_BLOCK = 4  # records per page
_DS_PAGES = 8
_DS_TOKENS = 24
_DS_MAX_POS = 64
_IDENTITY_ROW = 0  # cos_sin row (1, 0): the rotation changes nothing
_NEAR_IDENTITY_ROW = 2  # cos_sin row (1 - 2^-24, 0): each RoPE value x becomes pred_f32(x)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _bf16_pred(x: torch.Tensor) -> torch.Tensor:
    """The bf16 value next below |x| toward 0, with x's sign (x nonzero bf16)."""
    bits = x.abs().view(torch.int16) - 1
    return bits.view(torch.bfloat16) * x.sign()


def _midpoint_row(gen: torch.Generator) -> torch.Tensor:
    """bf16 [512]: per 16-value block an e4m3 value S (random code 1..126, subnormals
    included), the block's amax 6 S, the 7 e2m1 midpoints times S and their bf16 predecessors
    (quotients just below the midpoints), random signs. Every value is exact in bf16."""
    codes = torch.randint(1, 127, (32,), generator=gen, dtype=torch.int32)
    scale = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()[:, None]
    mids = torch.tensor(_E2M1_MIDPOINTS)[None, :] * scale
    block = torch.cat([6 * scale, mids, mids, torch.zeros_like(scale)], dim=1).bfloat16()
    block[:, 8:15] = _bf16_pred(block[:, 8:15])
    signs = torch.randint(0, 2, block.shape, generator=gen) * 2 - 1
    return (block * signs.bfloat16()).reshape(512)


def _scale_tie_row(gen: torch.Generator) -> torch.Tensor:
    """bf16 [512] whose blocks' amax a makes f32(a * f32(1/6)) fall exactly halfway between two
    e4m3 values (found by search over bf16 amaxes; subnormal and normal e4m3, ties rounding
    down and up to the even code). The other 15 values of a block are smaller."""
    amaxes = torch.arange(0x3000, 0x4600, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    scaled = amaxes.float() * torch.tensor(1 / 6, dtype=torch.float32)
    e4m3 = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    ties = amaxes[torch.isin(scaled, (e4m3[1:] + e4m3[:-1]) / 2)]
    assert ties.numel() > 100
    amax = ties[torch.randint(0, ties.numel(), (32, 1), generator=gen)].float()
    rest = (torch.rand(32, 15, generator=gen) * 2 - 1) * amax * 0.99
    return torch.cat([amax, rest], dim=1).bfloat16().reshape(512)


def _ds_inputs(ratio: int, seed: int):
    """latent bf16 [T, 512], positions int64 [T], cos_sin f32 [64, 64], slots int64 [T], and
    edge_rows (token -> its cos_sin row). Tokens 0..7 are edge cases that all write: zeros,
    tiny (scale clamped to 2^-9), huge (clamped to 448, saturating), e2m1 midpoints, e4m3 ties
    of the scale; the others random, some without a slot, some (ratio 2) closing no group."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"nvfp4_ds {ratio} {seed}".encode()))
    T = _DS_TOKENS
    # Random blocks stay under 6 * 448 (no saturation), for the error bound at the end.
    exponents = torch.randint(-10, 8, (T, 32, 1), generator=gen).float()
    latent = (torch.randn(T, 32, 16, generator=gen) * 2.0**exponents).reshape(T, 512).bfloat16()
    angles = torch.rand(_DS_MAX_POS, 32, generator=gen, dtype=torch.float64) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    cos_sin[_IDENTITY_ROW] = torch.tensor([1.0] * 32 + [0.0] * 32)
    cos_sin[_NEAR_IDENTITY_ROW] = torch.tensor([1.0 - 2.0**-24] * 32 + [0.0] * 32)
    positions = torch.randint(4, _DS_MAX_POS, (T,), generator=gen)
    latent[0] = 0.0
    latent[1] = (torch.randn(512, generator=gen) * 2.0**-12).bfloat16()  # scales clamp to 2^-9
    latent[2] = (torch.randn(512, generator=gen) * 2.0**14).bfloat16()  # clamp to 448, saturate
    latent[2, :16] = 3.0e38  # quotients near bf16's top
    for t in (3, 4, 5, 6):
        latent[t] = _midpoint_row(gen)
    # Rows 3 and 4 rotate by the identity (quotients exactly on midpoints in the RoPE blocks too),
    # 5 and 6 by the near-identity (RoPE quotients one float32 step below the midpoints).
    edge_rows = {3: _IDENTITY_ROW, 4: _IDENTITY_ROW, 5: _NEAR_IDENTITY_ROW, 6: _NEAR_IDENTITY_ROW}
    for t, base in edge_rows.items():
        positions[t] = base + ratio - 1  # closes the group starting at row `base`
    latent[7] = _scale_tie_row(gen)
    for t in (0, 1, 2, 7):
        positions[t] = positions[t] // ratio * ratio + ratio - 1
    slots = torch.randperm(_DS_PAGES * _DS_BLOCK, generator=gen)[:T]
    skip = torch.randperm(T - 8, generator=gen)[:5] + 8
    slots[skip] = -1
    slots[skip[0]] = -3  # any negative slot writes nothing
    return latent, positions, cos_sin, slots, edge_rows


def _rotate_f32(latent: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """float32 [T, 512]: GPT-J RoPE of the last 64 values, each product and sum rounded once."""
    x = latent.float()
    even, odd = x[:, 448::2].clone(), x[:, 449::2].clone()
    cos, sin = cs[:, :32], cs[:, 32:]
    x[:, 448::2] = even * cos - odd * sin
    x[:, 449::2] = even * sin + odd * cos
    return x


def check_nvfp4_ds_writer(device: str, ratio: int, seed: int) -> None:
    """rope_quant_insert_nvfp4_ds's cache bytes == the codec's records of the rotated rows at
    each written slot (and untouched bytes elsewhere); rotation against float64."""
    from dsv4_attn import kv_cache as kc
    from dsv4_attn.fused.kv_writers import rope_quant_insert_nvfp4_ds

    latent, positions, cos_sin, slots, edge_rows = _ds_inputs(ratio, seed)
    writes = (slots >= 0) & ((positions + 1) % ratio == 0)
    assert writes[:8].all() and 0 < int(writes.sum()) < _DS_TOKENS
    if ratio > 1:
        assert ((positions + 1) % ratio != 0).any()  # some tokens close no group
    cs = cos_sin[positions // ratio * ratio]
    rotated = _rotate_f32(latent, cs)

    # The rotation the expected bytes use, against float64 (a few float32 roundings).
    x64 = latent.double()
    e64, o64, c64, s64 = x64[:, 448::2], x64[:, 449::2], cs[:, :32].double(), cs[:, 32:].double()
    for got, want, size in (
        (rotated[:, 448::2], e64 * c64 - o64 * s64, (e64 * c64).abs() + (o64 * s64).abs()),
        (rotated[:, 449::2], e64 * s64 + o64 * c64, (e64 * s64).abs() + (o64 * c64).abs()),
    ):
        assert ((got.double() - want).abs() <= 2.0**-22 * size).all()
    assert torch.equal(rotated[:, :448], latent[:, :448].float())

    # The constructed edge cases occur: RoPE quotients exactly on and one float32 step under
    # e2m1 midpoints (each block's scale is S: its amax is 6 S or pred_f32(6 S)).
    rope = rotated[:, 448:].reshape(-1, 4, 16)
    scale = (rope.abs().amax(-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float()
    q = (rope / scale).abs()
    mids = torch.tensor(_E2M1_MIDPOINTS)
    on = int(torch.isin(q[[3, 4]], mids).sum())
    gap = q[[5, 6]][..., None] - mids  # [..., 7]
    under = int(((gap < 0) & (gap > -(2.0**-20) * mids)).sum())
    assert on == under == 2 * 4 * 7 and not torch.isin(q[[5, 6]], mids).any(), (on, under)

    layout = kc.page_layout(kc.KVFormat.NVFP4_DS, _DS_BLOCK)
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 256, (_DS_PAGES, layout.page_bytes), generator=gen, dtype=torch.uint8)
    expected = start.clone()
    records = expected.view(_DS_PAGES * _DS_BLOCK, 288)
    data, _ = kc._encode_nvfp4_ds(rotated)
    records[slots[writes]] = data[writes]

    cache = start.to(device)
    target = cache.view(_DS_PAGES, _DS_BLOCK, 288) if seed % 2 else cache  # vLLM's 3-D form
    rope_quant_insert_nvfp4_ds(
        latent.to(device),
        positions.to(device),
        cos_sin.to(device),
        target,
        slots.to(device),
        ratio,
        block_size=None if seed % 2 else _DS_BLOCK,
    )
    got = cache.cpu()
    assert torch.equal(got, expected), (got != expected).nonzero()[:8].tolist()

    # Where the rotation is the identity, the public codec on the bf16 rows says the same.
    ident = torch.tensor([t for t, base in edge_rows.items() if base == _IDENTITY_ROW])
    public = start.clone()
    kc.write(public, slots[ident], latent[ident], kc.KVFormat.NVFP4_DS, _DS_BLOCK)
    assert torch.equal(got.view(-1, 288)[slots[ident]], public.view(-1, 288)[slots[ident]])

    # Decoded random rows stay within e2m1's error of the float64 rotation.
    rows = torch.arange(_DS_TOKENS)[writes & (torch.arange(_DS_TOKENS) >= 8)]
    decoded = kc.read(got, slots[rows], kc.KVFormat.NVFP4_DS, _DS_BLOCK).double()
    want = x64[rows].clone()
    want[:, 448::2], want[:, 449::2] = (
        e64[rows] * c64[rows] - o64[rows] * s64[rows],
        e64[rows] * s64[rows] + o64[rows] * c64[rows],
    )
    amax = want.view(-1, 32, 16).abs().amax(-1, keepdim=True).expand(-1, 32, 16).reshape(-1, 512)
    bound = want.abs() / 4 + amax / 8 + 2.0**-10
    assert ((decoded - want).abs() <= bound).all()


def run_nvfp4_ds_checks(device: str) -> None:
    """Every CPU case of :func:`check_nvfp4_ds_writer` (run in the interpreter's child)."""
    for ratio in (1, 2):
        for seed in range(2):
            check_nvfp4_ds_writer(device, ratio, seed)


def test_nvfp4_ds_writer_in_the_triton_interpreter():
    """rope_quant_insert_nvfp4_ds in Triton's interpreter (a child process: Triton reads
    TRITON_INTERPRET at import): ratios 1 and 2, both cache forms, edge rows."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
    code = "from tests.test_fused import run_nvfp4_ds_checks; run_nvfp4_ds_checks('cpu')"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
