"""Tests of the Hopper sparse-decode kernel interface (``dsv4_attn.kernels.sparse_decode``).

CPU (CI): split planning and the support check. GPU (``pytest -m gpu``, an sm_90 device): the
kernel against the float64 reference on the dequantized rows, on fresh random inputs, with
poisoned outputs, across head counts, both cache formats, lengths from 0 to full, -1 holes,
the four kinds of sink, extra-scope widths 0..8192 and token counts 1..256.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from types import SimpleNamespace

import pytest
import torch

from dsv4_attn import kv_cache, ops, reference
from dsv4_attn.kernels import sparse_decode, sparse_decode_schedule
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.scope import KVScope
from dsv4_attn.testing import assert_rows_close, make_decode_case

# ----------------------------------------------------------------------------------------------
# CPU tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 3, 8, 64, 128, 256, 4096])
@pytest.mark.parametrize("heads", [8, 64, 128])
@pytest.mark.parametrize("capacity", [1, 64, 640, 1152, 8320])
def test_plan_splits_covers_every_tile_once(tokens, heads, capacity):
    splits, per_split = sparse_decode.plan_splits(tokens, heads, capacity, num_sms=132)
    tiles = math.ceil(capacity / sparse_decode.BLOCK_N)
    assert splits >= 1 and per_split >= 1
    assert (splits - 1) * per_split < tiles <= splits * per_split  # no empty trailing split
    ctas = tokens * math.ceil(heads / 64)
    if splits > 1:
        assert per_split >= sparse_decode.MIN_SPLIT_TILES
        assert ctas * splits <= 132  # one wave at most
        assert splits <= sparse_decode.MAX_SPLITS
    if ctas >= 0.8 * 132:
        assert splits == 1


def test_plan_splits_fills_small_batches():
    # 32-key tiles; splits of at least 64 keys (two tiles).
    assert sparse_decode.BLOCK_N == 32 and sparse_decode.MIN_SPLIT_TILES == 2
    # V4-Flash at one token: 20 tiles of keys, one 64-head block -> 10 splits of 2 tiles.
    assert sparse_decode.plan_splits(1, 64, 640, num_sms=132) == (10, 2)
    # HCA at 1M context, one token: 260 tiles, at most 32 splits -> 29 splits of 9 tiles.
    assert sparse_decode.plan_splits(1, 64, 8320, num_sms=132) == (29, 9)
    # 64 tokens: two splits fill one wave (three would start a second).
    assert sparse_decode.plan_splits(64, 64, 640, num_sms=132) == (2, 10)
    assert sparse_decode.plan_splits(256, 64, 640, num_sms=132) == (1, 20)


def test_unsupported_reason_on_cpu_tensors():
    q = torch.zeros(1, 64, HEAD_DIM, dtype=torch.bfloat16)
    cache = kv_cache.allocate(1, 64, KVFormat.FP8_DS_MLA)
    idx = torch.zeros(1, 4, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    window = KVScope(cache, KVFormat.FP8_DS_MLA, 64, idx, lens)
    reason = sparse_decode.unsupported_reason(q, window, None, None)
    assert reason is not None and "CUDA" in reason


def _common_case(fmt: KVFormat, sink: bool, extra: bool, outs: bool):
    """A call of the serving layer's kind (CPU tensors): (q, window, sink, scale, extra, out,
    lse)."""
    case = make_decode_case(
        3, 64, fmt, 128, 512 if extra else None, sink="finite" if sink else None
    )
    q, window, sink_t, scale, extra_s = case.args()
    out = torch.empty(3, 64, HEAD_DIM, dtype=torch.bfloat16) if outs else None
    lse = torch.empty(3, 64, dtype=torch.float32) if outs else None
    return [q, window, sink_t, float(scale), extra_s, out, lse]


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor whose storage starts 8 bytes past a 16-byte boundary."""
    raw = torch.empty(t.numel() * t.element_size() + 32, dtype=torch.uint8)
    start = (16 - raw.data_ptr() % 16) % 16 + 8
    view = raw[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return view.copy_(t)


def _odd_page_stride(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s bytes as pages 8 bytes further apart (the first page still aligned)."""
    pages, page_bytes = cache.shape
    return cache.view(-1).as_strided((pages - 1, page_bytes), (page_bytes + 8, 1))


def _scope(args, which: int, **changes):
    args[which] = dataclasses.replace(args[which], **changes)
    return args


# Each breaks one condition of the kernel's common case (some leave a valid call the kernel
# cannot run, some an invalid call): the flat test must refuse every one.
_NOT_COMMON = {
    "q fp16": lambda a: [a[0].half(), *a[1:]],
    "q 48 heads": lambda a: [a[0][:, :48].contiguous(), *a[1:]],
    "q head dim 256": lambda a: [a[0][..., :256].contiguous(), *a[1:]],
    "q 2-dim": lambda a: [a[0][0], *a[1:]],
    "q strided": lambda a: [a[0].transpose(0, 1).contiguous().transpose(0, 1), *a[1:]],
    "q misaligned": lambda a: [_misaligned(a[0]), *a[1:]],
    "scale int": lambda a: [*a[:3], 1, *a[4:]],
    "scale 0": lambda a: [*a[:3], 0.0, *a[4:]],
    "scale nan": lambda a: [*a[:3], float("nan"), *a[4:]],
    "scale inf": lambda a: [*a[:3], math.inf, *a[4:]],
    "fmt as text": lambda a: _scope(a, 1, fmt=a[1].fmt.value),
    "fmt bf16": lambda a: _scope(a, 1, fmt=KVFormat.BF16),
    "block_size 0": lambda a: _scope(a, 1, block_size=0),
    "block_size bool": lambda a: _scope(a, 1, block_size=True),
    "cache no pages": lambda a: _scope(a, 1, cache=a[1].cache[:0]),
    "cache short pages": lambda a: _scope(a, 1, cache=a[1].cache[:, :-16]),
    "cache int8": lambda a: _scope(a, 1, cache=a[1].cache.view(torch.int8)),
    "cache 1-dim": lambda a: _scope(a, 1, cache=a[1].cache.view(-1)),
    "cache odd page stride": lambda a: _scope(a, 1, cache=_odd_page_stride(a[1].cache)),
    "cache misaligned": lambda a: _scope(a, 1, cache=_misaligned(a[1].cache)),
    "cache strided bytes": lambda a: _scope(a, 1, cache=a[1].cache[:, ::2]),
    "cache of 2^30 slots": lambda a: _scope(
        a, 1, cache=a[1].cache[:1].expand((1 << 30) // a[1].block_size, -1)
    ),
    "cache on meta": lambda a: _scope(a, 1, cache=a[1].cache.to("meta")),
    "block_size past the pages": lambda a: _scope(a, 1, block_size=1 << 30),
    "indices float": lambda a: _scope(a, 1, indices=a[1].indices.float()),
    "indices int16": lambda a: _scope(a, 1, indices=a[1].indices.short()),
    "indices 1-dim": lambda a: _scope(a, 1, indices=a[1].indices[:, 0]),
    "indices rows": lambda a: _scope(a, 1, indices=a[1].indices[:2]),
    "indices strided": lambda a: _scope(a, 1, indices=a[1].indices.t().contiguous().t()),
    "lens rows": lambda a: _scope(a, 1, lens=a[1].lens[:2]),
    "lens strided": lambda a: _scope(a, 1, lens=torch.stack([a[1].lens] * 2, 1)[:, 0]),
    "lens on meta": lambda a: _scope(a, 1, lens=a[1].lens.to("meta")),
    "scope a tuple": lambda a: [a[0], tuple(dataclasses.astuple(a[1])), *a[2:]],
    "extra other format": lambda a: _scope(
        a,
        4,
        fmt=next(f for f in (KVFormat.FP8_DS_MLA, KVFormat.NVFP4) if f is not a[1].fmt),
    ),
    "extra int64 indices": lambda a: _scope(a, 4, indices=a[4].indices.long()),
    "extra int64 lens": lambda a: _scope(a, 4, lens=a[4].lens.long()),
    "extra strided": lambda a: _scope(a, 4, indices=a[4].indices.t().contiguous().t()),
    "sink fp16": lambda a: [*a[:2], a[2].half(), *a[3:]],
    "sink 32 heads": lambda a: [*a[:2], a[2][:32], *a[3:]],
    "sink strided": lambda a: [*a[:2], torch.stack([a[2]] * 2, 1)[:, 0], *a[3:]],
    "sink a list": lambda a: [*a[:2], a[2].tolist(), *a[3:]],
    "out fp32": lambda a: [*a[:5], a[5].float(), a[6]],
    "out strided": lambda a: [*a[:5], a[5].transpose(0, 1).contiguous().transpose(0, 1), a[6]],
    "out 2 tokens": lambda a: [*a[:5], a[5][:2], a[6]],
    "out on meta": lambda a: [*a[:5], a[5].to("meta"), a[6]],
    "lse bf16": lambda a: [*a[:6], a[6].bfloat16()],
    "lse 3-dim": lambda a: [*a[:6], a[6][..., None]],
}


@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
def test_the_flat_check_takes_the_serving_layers_calls(fmt):
    """The common case's flat test accepts what the serving layer passes (with and without
    sink, extra scope and given outputs), each of them valid and supported."""
    for sink, extra, outs in itertools.product([True, False], repeat=3):
        args = _common_case(fmt, sink, extra, outs)
        assert sparse_decode._common_layout(*args), (sink, extra, outs)
        q, window, sink_t, scale, extra_s, out, lse = args
        ops._validate(q, window, sink_t, scale, extra_s, out, lse, check_values=True)
        assert sparse_decode._layout_reason(q, window, sink_t, extra_s) is None


@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("change", list(_NOT_COMMON))
def test_the_flat_check_refuses_what_the_checks_would_question(fmt, change):
    """A call the flat test accepts skips ops' validation and the kernel's support check, so it
    must refuse every call that either would reject or send elsewhere (and each change here
    does change the call: the serving layer's own is accepted, above)."""
    args = _NOT_COMMON[change](_common_case(fmt, sink=True, extra=True, outs=True))
    assert not sparse_decode._common_layout(*args)
    q, window, sink, scale, extra, out, lse = args
    try:
        window, extra = ops._validate(q, window, sink, scale, extra, out, lse, False)
    except (ValueError, AttributeError, TypeError):
        return  # the full checks reject it
    # A valid call the kernel cannot run, or one the flat test leaves to the full checks
    # (a format given as its name, an int scale): it still runs, through the full path.
    assert change in ("fmt as text", "scale int") or (
        sparse_decode._layout_reason(q, window, sink, extra) is not None
    )


@pytest.mark.parametrize("balanced", [False, True])
def test_serving_compiles_the_variants_it_launches(balanced, monkeypatch):
    """What a serving layer compiles in its profiling run (never inside a graph capture): the
    int32 / sink variants with final output and split partials, the combine, and where the
    layer may run the balanced schedule its variant and combine too."""
    from dsv4_attn.kernels.compile_cache import CompileCache

    caches = (CompileCache("decode-test"), CompileCache("combine-test"))
    built = []
    monkeypatch.setattr(sparse_decode, "_caches", lambda: caches)
    monkeypatch.setattr(sparse_decode, "build_decode_kernel", lambda c: built.append(c) or c)
    monkeypatch.setattr(sparse_decode, "build_combine_kernel", lambda c: built.append(c) or c)
    sparse_decode.compile_variants(KVFormat.NVFP4, 64, 2, balanced)
    # The scopes of a serving call: int32 slot lists and lengths, 64-row SWA pages, 2-row HCA
    # pages (what decode_config reads of them).
    int32 = torch.zeros(1, dtype=torch.int32)
    window = SimpleNamespace(fmt=KVFormat.NVFP4, block_size=64, indices=int32, lens=int32)
    extra = SimpleNamespace(fmt=KVFormat.NVFP4, block_size=2, indices=int32, lens=int32)
    sink = torch.zeros(8)
    variants = [
        sparse_decode.decode_config(window, sink, extra, False),
        sparse_decode.decode_config(window, sink, extra, True),
    ]
    # Both combine widths: what a launch of few rows and one of many picks.
    combines = [sparse_decode.combine_config_for(rows, True, False, 132) for rows in (10**6, 1)]
    if balanced:
        variants.append(sparse_decode.decode_config(window, sink, extra, False, balanced=True))
        combines += [sparse_decode.combine_config_for(rows, True, True, 132) for rows in (10**6, 1)]
    assert built == variants + combines


def test_a_balanced_plan_must_fit_the_call():
    """A plan fixes the work split: it excludes ``num_splits`` and must cover the call's tokens
    (both refused before anything is launched)."""
    from dsv4_attn.kernels.sparse_decode_schedule import build_schedule

    q = torch.zeros(2, 64, HEAD_DIM, dtype=torch.bfloat16)
    cache = kv_cache.allocate(1, 64, KVFormat.FP8_DS_MLA)
    window = KVScope(
        cache,
        KVFormat.FP8_DS_MLA,
        64,
        torch.zeros(2, 4, dtype=torch.int32),
        torch.full((2,), 4, dtype=torch.int32),
    )
    plan = build_schedule(torch.full((3,), 4), 4)
    with pytest.raises(ValueError, match="exclude each other"):
        sparse_decode.sparse_attention(q, window, None, 1.0, num_splits=2, plan=plan)
    with pytest.raises(ValueError, match="covers 3 tokens, the call has 2"):
        sparse_decode.sparse_attention(q, window, None, 1.0, plan=plan)


# ----------------------------------------------------------------------------------------------
# GPU tests
# ----------------------------------------------------------------------------------------------

_SINKS = ("none", "finite", "-inf", "+inf")
_EXTRA = (0, 1, 512, 1024, 8192)  # 0: no extra scope at all


def _needs_hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _random_cache(fmt, block_size, num_slots, device, gen):
    """A cache whose every slot holds a random row (values of varied magnitude)."""
    num_blocks = math.ceil(num_slots / block_size)
    cache = kv_cache.allocate(num_blocks, block_size, fmt, device=device)
    n = num_blocks * block_size
    rows = torch.randn(n, HEAD_DIM, generator=gen, device=device)
    rows = rows * torch.exp(torch.randn(n, 1, generator=gen, device=device))  # per-row magnitude
    slots = torch.arange(n, device=device)
    kv_cache.write(cache, slots, rows.to(torch.bfloat16), fmt, block_size)
    return cache


def _random_lists(T, K, num_slots, device, gen, full_rows=True):
    """indices [T, K] with ~10% -1 holes, lens in [0, K] including 0 and K."""
    idx = torch.randint(0, num_slots, (T, K), generator=gen, device=device, dtype=torch.int32)
    holes = torch.rand(T, K, generator=gen, device=device) < 0.1
    idx = torch.where(holes, torch.full_like(idx, -1), idx)
    lens = torch.randint(0, K + 1, (T,), generator=gen, device=device, dtype=torch.int32)
    if T >= 2:
        lens[0] = 0
        lens[-1] = K
    elif full_rows:
        lens[0] = K
    return idx, lens


def _sink(kind, H, device, gen):
    if kind == "none":
        return None
    if kind == "finite":
        return torch.randn(H, generator=gen, device=device) * 2
    return torch.full((H,), float(kind), device=device)


def _reference(q, window, sink, scale, extra):
    """float64 reference on the dequantized rows the indices touch."""

    def rows_and_ids(scope):
        i, n = scope.indices, scope.lens
        counted = torch.arange(i.shape[1], device=i.device)[None, :] < n[:, None]
        slots = torch.where(counted, i, torch.full_like(i, -1))
        unique, local = torch.unique(slots, return_inverse=True)
        rows = kv_cache.read_unchecked(scope.cache, unique, scope.fmt, scope.block_size)
        return rows, torch.where(slots >= 0, local, torch.full_like(local, -1)), n

    kv, local, n = rows_and_ids(window)
    extra_args = (None, None, None) if extra is None else rows_and_ids(extra)
    return reference.sparse_attention(q, kv, local, n, sink, scale, *extra_args)


def _check(out, lse, ref_out, ref_lse, tol=1e-2, row_tol=2e-2):
    """bf16 ``out [T, H, 512]`` and float32 ``lse [T, H]`` against the float64 reference: the
    whole tensor within ``tol`` (relative), and every (token, head) row within ``row_tol`` of
    its own norm (a wrong row moves the whole tensor's error by under 1% at T = H = 128); rows
    with no key (or sink +inf) exactly 0, lse -inf exactly where the reference's is."""
    assert not torch.isnan(out).any(), "NaN in the output (poison not overwritten?)"
    assert not torch.isnan(lse).any(), "NaN in the lse (poison not overwritten?)"
    ref_norm = ref_out.norm()
    err = (out.double() - ref_out).norm()
    if ref_norm > 0:
        assert err / ref_norm <= tol, f"relative error {float(err / ref_norm):.3g}"
    else:
        assert err == 0
    assert_rows_close(out, ref_out, row_tol, name="out")
    # Rows whose reference is zero (no key, or sink = +inf) must be exactly zero.
    zero_rows = ref_out.abs().amax(dim=-1) == 0
    assert (out[zero_rows] == 0).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[~finite] == ref_lse[~finite].float()).all()  # both -inf
    if finite.any():
        assert (lse[finite].double() - ref_lse[finite]).abs().max() <= 1e-2


def _run_and_check(args, **options) -> None:
    """``sparse_attention(*args, **options)`` into NaN-poisoned outputs, checked against the
    float64 reference."""
    q = args[0]
    T, H, _ = q.shape
    out = torch.full((T, H, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=q.device)
    sparse_decode.sparse_attention(*args, out=out, lse=lse, **options)
    torch.cuda.synchronize()
    _check(out, lse, *_reference(*args))


def _graph_case(fmt, T, H, extra_width, seed):
    """Inputs of a CUDA-graph test: (generator, ``sparse_attention`` args) with a 128-key
    window (page 64, 4096 slots) and ``extra_width`` compressed keys (page 16, over
    max(2048, extra_width) slots), a finite sink."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = _random_cache(fmt, 64, 4096, device, gen)
    idx, lens = _random_lists(T, 128, 4096, device, gen)
    extra_slots = max(2048, extra_width)
    ecache = _random_cache(fmt, 16, extra_slots, device, gen)
    extra = KVScope(ecache, fmt, 16, *_random_lists(T, extra_width, extra_slots, device, gen))
    q = torch.randn(T, H, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    sink = torch.randn(H, generator=gen, device=device)
    return gen, (q, KVScope(cache, fmt, 64, idx, lens), sink, HEAD_DIM**-0.5, extra)


def _capture(call):
    """``call`` run once (compiling outside the capture), then captured in a CUDA graph on a
    side stream: (graph, what the captured call returned)."""
    call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        result = call()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result


def _run_case(
    fmt,
    H,
    T,
    extra_width,
    sink_kind,
    seed,
    num_splits=None,
    extra_bs=16,
    index_dtype=torch.int32,
    balanced=False,
):
    """One random case through the kernel against the float64 reference; ``balanced``: on the
    balanced schedule (its plan built from the case's key counts). Returns the case's plan (or
    None) and scopes."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    window_bs = 64

    def lists(K, num_slots):
        return tuple(x.to(index_dtype) for x in _random_lists(T, K, num_slots, device, gen))

    cache = _random_cache(fmt, window_bs, 4096, device, gen)
    window = KVScope(cache, fmt, window_bs, *lists(128, 4096))
    extra = None
    if extra_width:
        ecache = _random_cache(fmt, extra_bs, max(2 * extra_width, 64), device, gen)
        extra = KVScope(ecache, fmt, extra_bs, *lists(extra_width, max(2 * extra_width, 64)))
    q = (torch.randn(T, H, HEAD_DIM, generator=gen, device=device) * 2).to(torch.bfloat16)
    sink = _sink(sink_kind, H, device, gen)
    scale = HEAD_DIM**-0.5
    args = (q, window, sink, scale, extra)
    assert sparse_decode.unsupported_reason(q, window, sink, extra) is None
    out = torch.full((T, H, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=device)
    capacity = sparse_decode.key_capacity(window, extra)
    plan = None
    if balanced:
        plan = sparse_decode_schedule.balanced_plan(window, extra, H)
        shapes = sparse_decode_schedule.balanced_workspace_shape(plan.num_parts, H)
    else:
        splits, _ = sparse_decode.resolve_splits(T, H, capacity, device, num_splits)
        shapes = sparse_decode.workspace_shape(splits, T, H)
    dtypes = sparse_decode.WORKSPACE_DTYPES
    workspace = tuple(
        torch.full(shape, float("nan"), dtype=dtype, device=device)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    sparse_decode.sparse_attention(
        *args, num_splits=num_splits, out=out, lse=lse, workspace=workspace, plan=plan
    )
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(*args)
    _check(out, lse, ref_out, ref_lse)
    return plan


_GPU_CASES = [
    (fmt, H, T, _EXTRA[i % 5], _SINKS[(i + i // 5) % 4])
    for i, (fmt, H, T) in enumerate(
        (fmt, H, T)
        for fmt in (KVFormat.FP8_DS_MLA, KVFormat.NVFP4)
        for H in (8, 64, 128)
        for T in (1, 3, 64, 256)
    )
]


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "H", "T", "extra", "sink"), _GPU_CASES)
def test_kernel_matches_reference(fmt, H, T, extra, sink):
    _needs_hopper()
    _run_case(
        fmt, H, T, extra, sink, seed=zlib.crc32(repr((fmt.value, H, T, extra, sink)).encode())
    )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("extra", _EXTRA)
@pytest.mark.parametrize("sink", _SINKS)
def test_every_extra_width_and_sink(fmt, extra, sink):
    _needs_hopper()
    _run_case(fmt, 64, 3, extra, sink, seed=zlib.crc32(repr((fmt.value, extra, sink, 7)).encode()))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize(("extra_bs", "extra"), [(2, 64), (2, 8192), (64, 512), (64, 1024)])
@pytest.mark.parametrize("H", [64, 128])
def test_vllm_page_sizes(fmt, extra_bs, extra, H):
    """The compressed pages vLLM hands a layer: 256-token blocks hold 2 HCA or 64 CSA entries."""
    _needs_hopper()
    seed = zlib.crc32(repr((fmt.value, extra_bs, extra, H)).encode())
    _run_case(fmt, H, 64, extra, "finite", seed=seed, extra_bs=extra_bs)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("extra", [0, 512])
def test_int64_slot_lists(fmt, extra):
    """int64 indices and lens (narrowed to int32 by the launcher) with -1 holes and partial
    lists."""
    _needs_hopper()
    seed = zlib.crc32(repr((fmt.value, extra, "int64")).encode())
    _run_case(fmt, 64, 37, extra, "finite", seed=seed, index_dtype=torch.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize(("H", "T"), [(16, 2), (64, 37), (128, 64), (64, 150), (8, 120)])
def test_balanced_schedule_with_ragged_lists(fmt, H, T):
    """HCA-like lists (8192 compressed entries, each token its own count in [0, 8192], holes):
    the balanced schedule, where a CTA runs several tokens one after another and long tokens
    are cut into pieces merged by the combine. The plan of each case must do both (else the
    case tests less than it claims)."""
    _needs_hopper()
    seed = zlib.crc32(repr((fmt.value, H, T, "balanced")).encode())
    plan = _run_case(fmt, H, T, 8192, "finite", seed=seed, balanced=True)
    pieces = plan.token_plan[:, 2]
    tokens_per_part = plan.part_plan[:, 3] - plan.part_plan[:, 2] + 1
    assert int(pieces.max()) > 1, "no token was cut"
    if T >= 150:
        assert int(tokens_per_part.max()) > 1, "no part ran several tokens"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize(
    ("H", "T", "extra_width", "schedule"),
    [
        (64, 3, None, "split"),
        (128, 40, 512, "split"),
        (64, 150, 8192, "balanced"),
        (16, 9, 2048, "balanced"),
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_poisoned_metadata_stays_inside_the_caches(fmt, H, T, extra_width, schedule, index_dtype):
    """Lengths outside ``[0, K]`` and slot ids outside the caches (below -1, at and past the
    last slot, the dtype's extremes; int64 also ids and lengths whose low 32 bits are in
    range), as serving passes them (unchecked): the kernel reads nothing outside the caches
    (``compute-sanitizer`` runs this test) and computes exactly what the reference computes
    with those lengths clamped and those ids as holes; the balanced plan is built from the
    poisoned lengths as they are."""
    from dsv4_attn.testing import poisoned_scope

    _needs_hopper()
    device = torch.device("cuda")
    seed = zlib.crc32(repr((fmt.value, H, T, extra_width, schedule, str(index_dtype))).encode())
    gen = torch.Generator(device=device).manual_seed(seed)
    poison_gen = torch.Generator().manual_seed(seed)
    window = KVScope(
        _random_cache(fmt, 64, 4096, device, gen),
        fmt,
        64,
        *(t.to(index_dtype) for t in _random_lists(T, 128, 4096, device, gen)),
    )
    window, clean_window = poisoned_scope(window, poison_gen)
    extra = clean_extra = None
    if extra_width is not None:
        slots = 2 * extra_width
        extra = KVScope(
            _random_cache(fmt, 16, slots, device, gen),
            fmt,
            16,
            *(t.to(index_dtype) for t in _random_lists(T, extra_width, slots, device, gen)),
        )
        extra, clean_extra = poisoned_scope(extra, poison_gen)
    q = (torch.randn(T, H, HEAD_DIM, generator=gen, device=device) * 2).to(torch.bfloat16)
    sink = _sink("finite", H, device, gen)
    args = (q, window, sink, HEAD_DIM**-0.5, extra)
    plan = (
        sparse_decode_schedule.balanced_plan(window, extra, H) if schedule == "balanced" else None
    )
    out = torch.full((T, H, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=device)
    sparse_decode.sparse_attention(*args, out=out, lse=lse, plan=plan)
    torch.cuda.synchronize()
    _check(out, lse, *_reference(q, clean_window, sink, HEAD_DIM**-0.5, clean_extra))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("schedule", ["split", "balanced"])
def test_a_nan_sink_propagates_as_in_the_reference(fmt, schedule):
    """A NaN sink logit: its head's output NaN wherever the token has keys, 0 where it has
    none, lse and every other head as the reference's (the fallback's contract too)."""
    _needs_hopper()
    T, H = 40, 64
    _, args = _graph_case(fmt, T, H, 2048, seed=9)
    q, window, sink, _, extra = args
    window.lens[0] = 0
    extra.lens[0] = 0  # a token without keys
    sink[5] = float("nan")
    plan = (
        sparse_decode_schedule.balanced_plan(window, extra, H) if schedule == "balanced" else None
    )
    out = torch.full((T, H, HEAD_DIM), 7.0, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((T, H), 7.0, dtype=torch.float32, device=q.device)
    sparse_decode.sparse_attention(*args, out=out, lse=lse, plan=plan)
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(*args)
    has_keys = torch.isfinite(ref_lse[:, 5])
    assert not bool(has_keys[0]) and bool(has_keys[1:].all())
    assert torch.isnan(out[1:, 5].float()).all() and (out[0, 5] == 0).all()
    others = [h for h in range(H) if h != 5]
    _check(out[:, others], lse[:, others], ref_out[:, others], ref_lse[:, others])


@pytest.mark.gpu
def test_balanced_schedule_under_cuda_graph_replay():
    """The plan is built on the device from the key counts: a captured plan and call replay
    with other counts (and so another plan) correctly."""
    _needs_hopper()
    T, H = 150, 64
    gen, args = _graph_case(KVFormat.FP8_DS_MLA, T, H, 8192, seed=5)
    q, window, _, _, extra = args
    device, lens, elens = q.device, window.lens, extra.lens

    def call():
        plan = sparse_decode_schedule.balanced_plan(window, extra, H)
        return sparse_decode.sparse_attention(*args, plan=plan)

    graph, (out, lse) = _capture(call)
    for _ in range(2):  # new counts: long and short tokens in other places
        q.copy_(torch.randn(T, H, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16))
        lens.copy_(torch.randint(0, 129, (T,), generator=gen, device=device, dtype=torch.int32))
        elens.copy_(torch.randint(0, 8193, (T,), generator=gen, device=device, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(*args)
        _check(out, lse, ref_out, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 200])
def test_forced_split_counts(fmt, num_splits):
    _needs_hopper()
    _run_case(fmt, 128, 5, 1024, "finite", seed=num_splits * 13 + 1, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("magnitude_log2", [-90, -24, 20, 100])
@pytest.mark.parametrize("balanced", [False, True])
def test_split_partials_keep_any_magnitude(fmt, magnitude_log2, balanced):
    """Split partials are fp16 rows scaled per row by a power of two: rows of any magnitude a
    bf16 cache holds (2^-90 .. 2^100, beyond fp16's 2^-24 .. 2^16) merge like the float64
    reference (q scaled the other way keeps the scores ordinary)."""
    _needs_hopper()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(magnitude_log2 % 97 + 5 * balanced)
    T, H, K = 6, 64, 1024
    num_slots = 4096
    cache = kv_cache.allocate(num_slots // 64, 64, fmt, device=device)
    rows = torch.randn(num_slots, HEAD_DIM, generator=gen, device=device) * 2.0**magnitude_log2
    kv_cache.write(cache, torch.arange(num_slots, device=device), rows.to(torch.bfloat16), fmt, 64)
    window = KVScope(cache, fmt, 64, *_random_lists(T, K, num_slots, device, gen))
    q = torch.randn(T, H, HEAD_DIM, generator=gen, device=device) * 2.0 ** (2 - magnitude_log2)
    args = (q.to(torch.bfloat16), window, None, HEAD_DIM**-0.5, None)
    plan = sparse_decode_schedule.balanced_plan(window, None, H) if balanced else None
    _run_and_check(args, num_splits=None if balanced else 8, plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
def test_split_partials_cost_no_accuracy(fmt):
    """Merging 2 to 30 split partials (fp16 rows under a per-row power-of-two scale) adds no
    error to speak of: the worst error against the float64 reference, relative to its row's
    largest value, stays within 1.25x that of the same call unsplit (which writes its bf16
    output straight from the fp32 accumulators) and of the reference's own bf16 rounding. A
    CPU emulation of the merge puts these partials at 1.00-1.04x the rounding, fp32 partials at
    1.0x and bf16 partials at 1.5-1.9x."""
    _needs_hopper()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(23)
    T, H, K = 2, 64, 1024
    cache = _random_cache(fmt, 64, 4096, device, gen)
    idx = torch.randint(0, 4096, (T, K), generator=gen, device=device, dtype=torch.int32)
    window = KVScope(cache, fmt, 64, idx, torch.full((T,), K, device=device, dtype=torch.int32))
    q = (torch.randn(T, H, HEAD_DIM, generator=gen, device=device) * 2).to(torch.bfloat16)
    args = (q, window, None, HEAD_DIM**-0.5, None)
    ref_out, _ = _reference(*args)
    errors = {}
    for num_splits in (1, 2, 7, 30):
        out, _ = sparse_decode.sparse_attention(*args, num_splits=num_splits)
        torch.cuda.synchronize()
        errors[num_splits] = _row_errors(out, ref_out)
    bound = 1.25 * max(errors[1], _row_errors(ref_out.to(torch.bfloat16), ref_out))
    assert all(error <= bound for error in errors.values()), (errors, bound)


def _row_errors(out, ref_out) -> float:
    """The worst |out - ref| of a row, relative to that row's largest |ref|, over all rows."""
    scale = ref_out.abs().amax(-1, keepdim=True).clamp_min(1e-300)
    return float(((out.double() - ref_out).abs() / scale).max())


def _scored_cache(fmt, block_size, gains, direction, device, gen):
    """A cache whose slot i holds ``gains[i] * direction`` plus a little noise, so a query along
    ``direction`` scores slot i in proportion to ``gains[i]``."""
    n = gains.numel()
    cache = kv_cache.allocate(math.ceil(n / block_size), block_size, fmt, device=device)
    noise = 0.05 * torch.randn(n, HEAD_DIM, generator=gen, device=device)
    rows = gains[:, None] * direction[None, :] + noise
    kv_cache.write(cache, torch.arange(n, device=device), rows.to(torch.bfloat16), fmt, block_size)
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
@pytest.mark.parametrize("profile", ["late_jump", "steady_climb", "falling"])
def test_running_max_that_moves_after_the_first_tile(fmt, profile):
    """The kernel moves its running max only when a tile's scores pass it by 2^8 (lazy
    rescaling). Scores along the key list (128 window + 512 extra keys, 20 tiles) that jump by
    ~60 log2 units in the last tile, climb ~5 per tile (under the threshold in one tile, past it
    over two), or fall: each must match the reference."""
    _needs_hopper()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(11)
    T, H, K_WIN, K_EXTRA = 3, 64, 128, 512
    direction = torch.randn(HEAD_DIM, generator=gen, device=device)
    direction = direction / direction.norm()
    key = torch.arange(K_WIN + K_EXTRA, device=device, dtype=torch.float32)
    # A query of norm 320 h (h in [0.5, 1] per head) scores key k at gain * h * 20.4 log2 units
    # (320 / sqrt(512) * log2(e)): the last tile jumps by up to ~59, a climb of 0.25 per tile
    # is up to ~5 a tile.
    if profile == "late_jump":
        gains = torch.where(key >= K_WIN + K_EXTRA - 32, 3.0, 0.1)
    elif profile == "steady_climb":
        gains = 0.25 * (key // 32)
    else:
        gains = 3.0 - 0.15 * (key // 32)
    window_cache = _scored_cache(fmt, 64, gains[:K_WIN], direction, device, gen)
    extra_cache = _scored_cache(fmt, 16, gains[K_WIN:], direction, device, gen)
    heads = torch.linspace(0.5, 1.0, H, device=device)
    q = (320.0 * heads[None, :, None] * direction[None, None, :]).expand(T, H, HEAD_DIM)
    q = (q + 0.05 * torch.randn(T, H, HEAD_DIM, generator=gen, device=device)).to(torch.bfloat16)

    def scope(cache, bs, width):
        idx = torch.arange(width, device=device, dtype=torch.int32).expand(T, width).contiguous()
        return KVScope(
            cache, fmt, bs, idx, torch.full((T,), width, device=device, dtype=torch.int32)
        )

    args = (
        q,
        scope(window_cache, 64, K_WIN),
        None,
        HEAD_DIM**-0.5,
        scope(extra_cache, 16, K_EXTRA),
    )
    for num_splits in (1, 4):
        _run_and_check(args, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
def test_single_key_returns_the_dequantized_row_exactly(fmt):
    """With one valid key and no sink the output is that row: checks dequantization bit for bit."""
    _needs_hopper()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(5)
    T, H = 300, 8
    cache = _random_cache(fmt, 64, 4096, device, gen)
    idx = torch.randint(0, 4096, (T, 1), generator=gen, device=device, dtype=torch.int32)
    lens = torch.ones(T, dtype=torch.int32, device=device)
    q = torch.randn(T, H, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    window = KVScope(cache, fmt, 64, idx, lens)
    out, lse = sparse_decode.sparse_attention(q, window, None, HEAD_DIM**-0.5)
    rows = kv_cache.read(cache, idx[:, 0], fmt, 64)
    assert torch.equal(out, rows[:, None, :].expand(T, H, HEAD_DIM))
    scores = (q.double() * rows[:, None, :].double()).sum(-1) * HEAD_DIM**-0.5
    assert torch.allclose(lse.double(), scores, atol=1e-3, rtol=1e-4)


def _every_code_cache(fmt, block_size, device):
    """A cache whose rows cycle through every nope code and a sweep of scale bytes.

    FP8: nope byte i of row r is the (i + r)-th of the 254 non-NaN e4m3 codes, block b's UE8M0
    byte is 1 + (7 r + b) % 200 (every scale from 2^-126 to 2^73: larger ones would overflow
    q.k in float32, not the dequantization). NVFP4: nope byte i of row r is (i + r) % 256
    (every pair of e2m1 nibbles), block scale b is (28 r + b) % 127 (every non-negative e4m3),
    the token byte is r % 201. RoPE values are random. Returns (cache, number of rows).
    """
    gen = torch.Generator(device="cpu").manual_seed(3)
    if fmt == KVFormat.FP8_DS_MLA:
        n = 254
        codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
        r = torch.arange(n)[:, None]
        nope = codes[(torch.arange(448)[None, :] + r) % 254]
        scales = torch.zeros(n, 8, dtype=torch.uint8)
        scales[:, :7] = (1 + (7 * r + torch.arange(7)[None, :]) % 200).to(torch.uint8)
    else:
        n = 256
        r = torch.arange(n)[:, None]
        nope = ((torch.arange(224)[None, :] + r) % 256).to(torch.uint8)
        scales = torch.zeros(n, 32, dtype=torch.uint8)
        scales[:, :28] = ((28 * r + torch.arange(28)[None, :]) % 127).to(torch.uint8)
        scales[:, 28] = (r[:, 0] % 201).to(torch.uint8)
    rope = torch.randn(n, 64, generator=gen).to(torch.bfloat16).view(torch.uint8)
    cache = kv_cache.allocate(math.ceil(n / block_size), block_size, fmt, device="cpu")
    data_rows, scale_rows = kv_cache._row_views(cache, kv_cache.page_layout(fmt, block_size))
    slots = torch.arange(n)
    data_rows[slots // block_size, slots % block_size] = torch.cat([nope, rope], dim=1)
    scale_rows[slots // block_size, slots % block_size] = scales
    return cache.to(device), n


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
def test_every_code_and_scale_dequantizes_exactly(fmt):
    """One key per token, no sink: the output is the key's row, bit for bit as the codec reads
    it, for every nope code and a sweep of scales (bf16-subnormal results included)."""
    _needs_hopper()
    device = torch.device("cuda")
    cache, n = _every_code_cache(fmt, 64, device)
    gen = torch.Generator(device=device).manual_seed(5)
    idx = torch.arange(n, device=device, dtype=torch.int32)[:, None]
    lens = torch.ones(n, dtype=torch.int32, device=device)
    q = torch.randn(n, 8, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    out = torch.full((n, 8, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.empty(n, 8, device=device)
    window = KVScope(cache, fmt, 64, idx, lens)
    sparse_decode.sparse_attention(q, window, None, HEAD_DIM**-0.5, out=out, lse=lse)
    rows = kv_cache.read(cache, idx[:, 0], fmt, 64)
    assert torch.isfinite(rows).all()
    # Values, not bit patterns: a -0 row value comes back as +0 (the MMA accumulates from +0).
    mismatch = (out != rows[:, None, :]).any(dim=1)
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} values differ, first at {mismatch.nonzero()[:4].tolist()}"
    )


@pytest.mark.gpu
def test_a_cache_without_pages_is_refused():
    _needs_hopper()
    q = torch.zeros(1, 64, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cache = kv_cache.allocate(1, 64, KVFormat.NVFP4, device="cuda")[:0]  # a 0-page view
    idx = torch.full((1, 4), -1, dtype=torch.int32, device="cuda")
    window = KVScope(
        cache, KVFormat.NVFP4, 64, idx, torch.zeros(1, dtype=torch.int32, device="cuda")
    )
    assert sparse_decode.unsupported_reason(q, window, None, None) == "window.cache has no pages"


@pytest.mark.gpu
def test_cuda_graph_capture_replays_correctly():
    _needs_hopper()
    T, H = 4, 64
    gen, args = _graph_case(KVFormat.NVFP4, T, H, 512, seed=11)
    q, lens, device = args[0], args[1].lens, args[0].device
    graph, (out, lse) = _capture(lambda: sparse_decode.sparse_attention(*args))
    # New inputs in the same buffers, then replay.
    q.copy_(torch.randn(T, H, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16))
    lens.copy_(torch.randint(0, 129, (T,), generator=gen, device=device, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(*args)
    _check(out, lse, ref_out, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KVFormat.FP8_DS_MLA, KVFormat.NVFP4])
def test_more_tokens_than_one_grid_holds(fmt):
    """Past 65535 tokens (the grid's z limit) the launch is sliced: the rows on both sides of
    the slice boundary match the reference."""
    _needs_hopper()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(11)
    T, H = sparse_decode.MAX_GRID_TOKENS + 70, 8
    cache = _random_cache(fmt, 64, 4096, device, gen)
    window = KVScope(cache, fmt, 64, *_random_lists(T, 32, 4096, device, gen))
    q = (torch.randn(T, H, HEAD_DIM, generator=gen, device=device) * 2).to(torch.bfloat16)
    sink = _sink("finite", H, device, gen)
    out = torch.full((T, H, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=device)
    sparse_decode.sparse_attention(q, window, sink, HEAD_DIM**-0.5, out=out, lse=lse)
    torch.cuda.synchronize()
    for rows in (slice(0, 40), slice(sparse_decode.MAX_GRID_TOKENS - 60, T)):
        part = KVScope(cache, fmt, 64, window.indices[rows], window.lens[rows])
        ref_out, ref_lse = _reference(q[rows], part, sink, HEAD_DIM**-0.5, None)
        _check(out[rows], lse[rows], ref_out, ref_lse)


def test_split_partials_are_views_of_the_exact_shapes():
    """The kernel writes its partials as contiguous tensors of the exact split shapes: a
    workspace of those shapes is used as it is, a larger one through views at its start, and
    one of another dtype or layout is refused (never handed to the kernel as it is)."""
    o_shape, lse_shape = sparse_decode.workspace_shape(3, 5, 64)
    o_dtype, lse_dtype = sparse_decode.WORKSPACE_DTYPES
    exact = (torch.empty(o_shape, dtype=o_dtype), torch.empty(lse_shape, dtype=lse_dtype))
    got = sparse_decode._workspace_views(exact, o_shape, lse_shape)
    assert got[0] is exact[0] and got[1] is exact[1]

    larger = (
        torch.empty(2 * math.prod(o_shape), dtype=o_dtype),
        torch.empty(2 * math.prod(lse_shape) + 1, dtype=lse_dtype),
    )
    o, lse = sparse_decode._workspace_views(larger, o_shape, lse_shape)
    assert o.shape == o_shape and lse.shape == lse_shape and o.is_contiguous()
    assert o.data_ptr() == larger[0].data_ptr() and lse.data_ptr() == larger[1].data_ptr()

    _, lse = sparse_decode._workspace_views((exact[0], larger[1]), o_shape, lse_shape)
    assert lse.shape == lse_shape  # each tensor on its own

    wider = (torch.empty((*o_shape[:-1], 2 * o_shape[-1]), dtype=o_dtype), exact[1])
    o, _ = sparse_decode._workspace_views(wider, o_shape, lse_shape)
    assert o.shape == o_shape and o.is_contiguous()  # the start of its storage, reshaped

    transposed = exact[1].transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="not contiguous"):
        sparse_decode._workspace_views((exact[0], transposed), o_shape, lse_shape)
    with pytest.raises(ValueError, match="workspace tensors must be contiguous"):
        sparse_decode._workspace_views((exact[0].float(), exact[1]), o_shape, lse_shape)


@pytest.mark.parametrize(
    ("window_fmt", "extra_fmt", "says"),
    [
        ("fp8_ds_mla", "nvfp4", "window (fp8_ds_mla) and extra (nvfp4) are in two KV formats"),
        ("mxfp8_ds", "nvfp4_ds", "KV-cache format mxfp8_ds has no kernel"),
    ],
)
def test_scopes_in_two_formats_have_a_reason_not_a_launch(window_fmt, extra_fmt, says):
    """The kernel reads one format a call: V4's window-in-8-bit split and V4.1's nvfp4_ds_mla
    get a reason (ops then runs the fallback), never a launch that reads one scope's bytes in
    the other's layout."""
    case = make_decode_case(4, 64, window_fmt, 128, 64, seed=3, extra_fmt=extra_fmt, block_size=64)
    args = (case.q, case.window, case.sink, case.scale, case.extra)
    assert not sparse_decode._common_layout(*args, None, None)
    reason = sparse_decode._layout_reason(*args[:3], case.extra)
    assert reason is not None and says in reason, reason
