"""Tests of the split-KV combine (``dsv4_attn.kernels.combine``).

CPU: the merge's numbers through a torch emulation of the kernel (``tests.combine_emulation``):
random sparse-decode problems, each token's key list cut into pieces (empty pieces, and tokens
whose every piece is empty, among them), each piece's partial from the float64 reference without
the sink, encoded as the decode kernel stores it, merged by the emulation, against the reference
on the whole list with the sink; every kind of sink, row magnitudes from 2^-120 to 2^120, the
split-major and the balanced (compact slot) layouts. CI: every combine variant compiles for
sm_90a without spills. GPU (``pytest -m gpu``, an sm_90 device): the real kernel on the same
encoded partials against the reference and the emulation (which ties the kernel to what the CPU
tests check), and the real decode kernel's partials merged by the emulation as by the kernel.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from dsv4_attn import kv_cache, reference
from dsv4_attn.kernels import sparse_decode
from dsv4_attn.kv_cache import HEAD_DIM
from dsv4_attn.testing import assert_rows_close, make_decode_case
from tests import combine_emulation as emu

# Per-token row magnitudes (powers of two, cycled over the tokens): the 2^k row scale must keep
# rows near both ends of fp32 / bf16's range (2^-120 clamps k at its top, 120).
EXPONENTS = (0, 100, -100, 120, -120, 37, -61)
# The output is bf16 (relative rounding <= 2^-9 per value) from fp16 partials with 11 significant
# bits near each row's top: per row within 2^-8 of the reference's norm.
OUT_TOL = 2.0**-8
SINKS = (None, "finite", "inf", "-inf", "mixed")


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


@dataclass
class Problem:
    """Per token one key list over its own rows: ``kv`` bf16 ``[T * K, 512]``, ``indices``
    int64 ``[T, K]`` (-1 holes), ``lens`` int64 ``[T]``; ``q`` bf16 ``[T, H, 512]``, ``sink``
    fp32 ``[H]`` or None, ``scale`` the softmax scale."""

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    lens: torch.Tensor
    sink: torch.Tensor | None
    scale: float


def _problem(T: int, H: int, sink: str | None, seed: int) -> Problem:
    """A random decode problem (bf16 cache, window and compressed scopes, holes, random lengths:
    token 0 has no keys) as one flat key list per token; token ``t``'s rows scaled by
    ``2^EXPONENTS[t % 7]`` and its query by the inverse (the scores stay of order 1)."""
    case = make_decode_case(
        T, H, "bf16", window=48, extra=24, seed=seed, hole_rate=0.15, lens="random", sink=sink
    )
    rows, valid = [], []
    for scope in (case.window, case.extra):
        slots = torch.arange(scope.cache.shape[0] * scope.block_size)
        cache_rows = kv_cache.read(scope.cache, slots, scope.fmt, scope.block_size)
        rows.append(cache_rows[scope.indices.clamp(min=0).long()])  # [T, K_scope, 512]
        positions = torch.arange(scope.capacity)
        valid.append((positions[None, :] < scope.lens[:, None]) & (scope.indices >= 0))
    rows, valid = torch.cat(rows, 1), torch.cat(valid, 1)
    K = rows.shape[1]
    exps = torch.tensor([EXPONENTS[t % len(EXPONENTS)] for t in range(T)], dtype=torch.float32)
    kv = (rows.float() * torch.exp2(exps)[:, None, None]).to(torch.bfloat16).view(T * K, HEAD_DIM)
    q = (case.q.float() * torch.exp2(-exps)[:, None, None]).to(torch.bfloat16)
    own = torch.arange(T * K).view(T, K)
    indices = torch.where(valid, own, -1)
    return Problem(q, kv, indices, torch.full((T,), K), case.sink, case.scale)


def _cuts(T: int, K: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """Piece boundaries ``[T, S + 1]`` (0 first, K last, random in between, repeats making empty
    pieces); token 1 has every key in its last piece, token 2 in its first."""
    inner = torch.randint(0, K + 1, (T, S - 1), generator=gen).sort(1).values
    inner[1], inner[2] = 0, K
    ends = torch.tensor([[0, K]]).expand(T, 2)
    return torch.cat([ends[:, :1], inner, ends[:, 1:]], 1)


def _piece_partials(p: Problem, cuts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each piece's normalized partial and lse from the float64 reference (no sink): float64
    ``[S, T, H, 512]`` and ``[S, T, H]``."""
    S = cuts.shape[1] - 1
    T, K = p.indices.shape
    j = torch.arange(K)[None, None, :]
    inside = (j >= cuts[:, :-1].T[:, :, None]) & (j < cuts[:, 1:].T[:, :, None])  # [S, T, K]
    pieces = torch.where(inside, p.indices[None], -1)
    # One reference call, the pieces as S * T query tokens.
    o, lse = reference.sparse_attention(
        p.q.repeat(S, 1, 1), p.kv, pieces.reshape(S * T, K), p.lens.repeat(S), None, p.scale
    )
    return o.view(S, T, *o.shape[1:]), lse.view(S, T, -1)


def _check_cases_covered(piece_lse: torch.Tensor) -> None:
    """The problem holds what the test is about: a token (head) whose every piece is empty, and
    an empty piece beside non-empty ones."""
    empty = piece_lse == float("-inf")
    assert empty.all(0).any(), "no row without keys"
    assert (empty.any(0) & ~empty.all(0)).any(), "no empty piece in a row with keys"


def _assert_matches_reference(out, lse, ref_out, ref_lse) -> None:
    """``out`` bf16 / ``lse`` fp32 against the float64 reference: every row within
    :data:`OUT_TOL` of its own norm (no floor: a zero reference row must be exactly 0, a row of
    2^-120 is held to its own scale); lse -inf exactly where the reference's is."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_rows_close(out, ref_out, OUT_TOL, floor=0.0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(lse == float("-inf"), ~finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_splits", [2, 5, 32])
@pytest.mark.parametrize("sink", SINKS, ids=str)
def test_emulated_combine_matches_reference(sink, num_splits):
    """Split-major partials of 2 to 32 pieces per token (some empty, all of token 0's), their
    rows 2^-120 to 2^120, merged with each kind of sink: the reference on the whole lists."""
    T, H = 9, 4
    p = _problem(T, H, sink, _seed("split", sink, num_splits))
    gen = torch.Generator().manual_seed(_seed("cuts", sink, num_splits))
    o_s, lse_s = _piece_partials(p, _cuts(T, p.indices.shape[1], num_splits, gen))
    _check_cases_covered(lse_s)
    o_part, lse_part = emu.encode_partials(o_s, lse_s)  # empty pieces' rows: NaN, never read
    out, lse = emu.combine(o_part, lse_part, p.sink)
    ref_out, ref_lse = reference.sparse_attention(p.q, p.kv, p.indices, p.lens, p.sink, p.scale)
    norms = ref_out.norm(dim=-1)
    nonzero = norms[norms > 0]
    if sink != "inf":  # rows from ~2^-120 to ~2^120 were merged
        assert nonzero.max() / nonzero.min() > 2.0**200
    _assert_matches_reference(out, lse, ref_out, ref_lse)


def _token_plan(pieces: list[int]) -> torch.Tensor:
    """A balanced token plan ``[T, 5]`` int32 with these pieces per token: a cut token's slots
    follow the previous cut token's; a token of one piece has slot -1. (The kernel reads only
    columns 2 and 3.)"""
    plan = torch.zeros(len(pieces), 5, dtype=torch.int32)
    slot = 0
    for t, n in enumerate(pieces):
        plan[t, 2] = n
        plan[t, 3] = slot if n > 1 else -1
        slot += n if n > 1 else 0
    return plan


def _balanced_partials(
    o_s: torch.Tensor, lse_s: torch.Tensor, pieces: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-major float64 partials ``[S, T, H, ...]`` laid out in the compact slots of
    :func:`_token_plan` (token t's first ``pieces[t]`` pieces): ``[slots, H, ...]``."""
    o_slots = [o_s[s, t] for t, n in enumerate(pieces) if n > 1 for s in range(n)]
    lse_slots = [lse_s[s, t] for t, n in enumerate(pieces) if n > 1 for s in range(n)]
    return torch.stack(o_slots), torch.stack(lse_slots)


# Pieces per token; token 0 (no keys) is cut in three, as a list of holes only can be.
BALANCED_PIECES = [3, 1, 2, 5, 1, 4, 2, 1, 32]


def _balanced_case(sink: str, seed: int):
    """A problem cut per :data:`BALANCED_PIECES` (a token of n pieces: its last 32 - n empty),
    its partials in compact slots, the token plan, the reference on whole lists."""
    T, H = len(BALANCED_PIECES), 4
    p = _problem(T, H, sink, seed)
    K = p.indices.shape[1]
    gen = torch.Generator().manual_seed(seed)
    cuts = _cuts(T, K, 32, gen)
    for t, n in enumerate(BALANCED_PIECES):
        cuts[t, n:] = K  # pieces n.. of token t are empty, and not in its slots
    o_s, lse_s = _piece_partials(p, cuts)
    # Per cut token, which of its slots (rows [n, H]) are empty: a token with no key in any
    # slot, and a token with empty slots beside written ones.
    empty = [lse_s[:n, t] == float("-inf") for t, n in enumerate(BALANCED_PIECES) if n > 1]
    assert any(e.all() for e in empty), "no cut token without keys"
    assert any((e.any(0) & ~e.all(0)).any() for e in empty), "no empty slot in a token with keys"
    o_slots, lse_slots = _balanced_partials(o_s, lse_s, BALANCED_PIECES)
    ref_out, ref_lse = reference.sparse_attention(p.q, p.kv, p.indices, p.lens, p.sink, p.scale)
    return p, o_slots, lse_slots, _token_plan(BALANCED_PIECES), ref_out, ref_lse


@pytest.mark.parametrize("sink", ["finite", "mixed"])
def test_emulated_balanced_combine_matches_reference(sink):
    """Cut tokens merged from their compact slots; tokens of one piece (finished by the decode
    kernel) keep their rows untouched."""
    p, o_slots, lse_slots, plan, ref_out, ref_lse = _balanced_case(sink, _seed("balanced", sink))
    o_part, lse_part = emu.encode_partials(o_slots, lse_slots)
    out = torch.full(ref_out.shape, float("nan"), dtype=torch.bfloat16)
    lse = torch.full(ref_lse.shape, float("nan"), dtype=torch.float32)
    emu.combine_balanced(o_part, lse_part, p.sink, plan, out, lse)
    cut = plan[:, 2] > 1
    assert out[~cut].isnan().all() and lse[~cut].isnan().all()
    _assert_matches_reference(out[cut], lse[cut], ref_out[cut], ref_lse[cut])


def test_encoding_puts_each_row_top_in_the_top_binade():
    """The decode kernel's row scale (sparse_decode_sm90's epilogue): the largest stored
    magnitude in [2^14, 2^15) unless k is clamped to [-113, 120], every value o * 2^k rounded
    once to fp16; the pair holds (lse, k)."""
    gen = torch.Generator().manual_seed(_seed("encode"))
    exps = torch.tensor([0, 5, -20, 100, -100, -105, -130, 125, 126])
    o = torch.randn(len(exps), HEAD_DIM, generator=gen, dtype=torch.float64)
    o = (o * torch.exp2(exps.double())[:, None]).float().double()  # values fp32 holds exactly
    lse = torch.randn(len(exps), generator=gen, dtype=torch.float64)
    lse[1] = float("-inf")
    o_part, pair = emu.encode_partials(o, lse)
    assert o_part.dtype == torch.float16 and pair.dtype == torch.float32
    assert o_part[1].isnan().all()  # a split without keys: its row never written
    assert torch.equal(pair[:, 0], lse.float())
    for r in (0, 2, 3, 4, 5, 6, 7, 8):
        _, e = math.frexp(float(o[r].abs().max()))  # max in [2^(e-1), 2^e)
        k = min(max(15 - e, -113), 120)
        assert float(pair[r, 1]) == k, r
        top = float(o_part[r].float().abs().max())
        assert top <= 2.0**15  # a value just below 2^15 may round up to it
        assert top >= 2.0**14 or k in (-113, 120), r
        assert torch.equal(o_part[r], (o[r] * 2.0**k).to(torch.float16)), r


# ----------------------------------------------------------------------------------------------
# CI: compilation
# ----------------------------------------------------------------------------------------------


def _combine_variants() -> list:
    if sparse_decode.kernel_stack_error() is not None:
        return []  # pytest reports the empty parameter set as skipped
    from dsv4_attn.kernels.precompile import combine_variants

    return combine_variants()


@pytest.mark.parametrize("config", _combine_variants(), ids=repr)
def test_combine_compiles_without_spills(config, tmp_path):
    from dsv4_attn.kernels import compile_cache
    from dsv4_attn.kernels.resource_usage import read_resources

    cubin = compile_cache.compile_keeping_cubin(
        lambda: sparse_decode.build_combine_kernel(config), tmp_path
    )
    (kernel,) = read_resources(cubin)
    assert kernel.frame_bytes == 0
    assert 0 < kernel.registers <= 168  # three 128-thread CTAs fit an SM


# ----------------------------------------------------------------------------------------------
# GPU tests
# ----------------------------------------------------------------------------------------------


def _needs_hopper() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    if (reason := sparse_decode.kernel_stack_error()) is not None:
        pytest.skip(reason)


def _assert_matches_emulation(
    out: torch.Tensor, emulated: torch.Tensor, magnitude: torch.Tensor, splits: int
) -> None:
    """bf16 ``out`` within a rounding of the emulation's, value by value: a bf16 step (the
    kernel's PTX exp2 / log2 / reciprocal differ from exact ones by ~2^-22, so a value near a
    bf16 tie may round the other way), plus the fp32 accumulation's error bound over ``splits``
    terms, ``splits * 2^-23 * sum_s |w_s o_s| f`` (the compiler may fuse the kernel's
    multiply-adds, which the emulation rounds twice; with cancellation across splits that sum
    is larger than the value). ``magnitude`` is that sum: the emulated combine of the partials'
    absolute values. Below fp32's normal range the kernel's flush-to-zero arithmetic may drop
    what the emulation keeps: ``splits * 2^-126`` more. Zero rows exactly zero."""
    got, want = out.float().cpu(), emulated.float()
    bound = want.abs() * 2.0**-7 + (magnitude.float().abs() * 2.0**-23 + 2.0**-126) * splits
    bad = ~((got - want).abs() <= bound)
    assert not bad.any(), f"{int(bad.sum())} values differ from the emulation past a rounding"


@pytest.mark.gpu
@pytest.mark.parametrize("warps_per_row", [1, 4])
@pytest.mark.parametrize("balanced", [False, True], ids=["split", "balanced"])
def test_combine_kernel_matches_reference_and_emulation(balanced, warps_per_row):
    """The combine kernel on emulated partials (empty splits' rows NaN, outputs poisoned with
    NaN first), finite sink: against the float64 reference on the whole lists, per row, and
    against the emulation (what the CPU tests check) within a rounding."""
    from dsv4_attn.kernels.combine import CombineConfig

    _needs_hopper()
    combine = sparse_decode.build_combine_kernel(CombineConfig(True, balanced, warps_per_row))
    key = ("gpu", balanced, warps_per_row)
    if balanced:
        p, o_s, lse_s, plan, ref_out, ref_lse = _balanced_case("finite", _seed(*key))
    else:
        T, H, S = 9, 64, 33
        p = _problem(T, H, "finite", _seed(*key))
        gen = torch.Generator().manual_seed(_seed(*key, "cuts"))
        o_s, lse_s = _piece_partials(p, _cuts(T, p.indices.shape[1], S, gen))
        plan = None
        ref_out, ref_lse = reference.sparse_attention(p.q, p.kv, p.indices, p.lens, p.sink, p.scale)
    o_part, lse_part = emu.encode_partials(o_s, lse_s)
    emu_out = torch.full(ref_out.shape, float("nan"), dtype=torch.bfloat16)
    emu_lse = torch.full(ref_lse.shape, float("nan"), dtype=torch.float32)
    magnitude = torch.full_like(emu_out, float("nan"))  # sum_s |w_s o_s| f: the error scale
    if balanced:
        emu.combine_balanced(o_part, lse_part, p.sink, plan, emu_out, emu_lse)
        emu.combine_balanced(o_part.abs(), lse_part, p.sink, plan, magnitude, emu_lse.clone())
        splits = int(plan[:, 2].max())
    else:
        emu_out, emu_lse = emu.combine(o_part, lse_part, p.sink)
        magnitude, _ = emu.combine(o_part.abs(), lse_part, p.sink)
        splits = S
    out = torch.full(ref_out.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full(ref_lse.shape, float("nan"), dtype=torch.float32, device="cuda")
    combine(
        o_part.cuda(),
        lse_part.cuda(),
        p.sink.float().cuda(),
        out,
        lse,
        plan.cuda() if plan is not None else None,
    )
    torch.cuda.synchronize()
    out, lse = out.cpu(), lse.cpu()
    cut = plan[:, 2] > 1 if balanced else torch.ones(out.shape[0], dtype=torch.bool)
    if balanced:  # tokens of one piece: the decode kernel's rows, left alone
        assert out[~cut].isnan().all() and lse[~cut].isnan().all()
    _assert_matches_reference(out[cut], lse[cut], ref_out[cut], ref_lse[cut])
    _assert_matches_emulation(out[cut], emu_out[cut], magnitude[cut], splits)
    torch.testing.assert_close(lse[cut], emu_lse[cut], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_ds_mla"])
def test_decode_kernel_partials_are_encoded_and_merged_as_emulated(fmt):
    """The decode kernel's own partials (forced splits, poisoned workspace): every row with keys
    scaled to [2^14, 2^15) (or k clamped), an empty split's lse -inf; and the emulated combine
    of those partials equals the kernel's merged output within a rounding."""
    _needs_hopper()
    T, H, S = 5, 64, 9
    case = make_decode_case(
        T,
        H,
        fmt,
        window=128,
        extra=300,
        seed=_seed("decode", fmt),
        device="cuda",
        hole_rate=0.2,
        lens="random",
        sink="finite",
    )
    capacity = sparse_decode.key_capacity(case.window, case.extra)
    splits, _ = sparse_decode.resolve_splits(T, H, capacity, case.q.device, S)
    assert splits > 1
    o_shape, lse_shape = sparse_decode.workspace_shape(splits, T, H)
    o_ws = torch.full(o_shape, float("nan"), dtype=torch.float16, device="cuda")
    lse_ws = torch.full(lse_shape, float("nan"), dtype=torch.float32, device="cuda")
    out, lse = sparse_decode.sparse_attention(*case.args(), num_splits=S, workspace=(o_ws, lse_ws))
    torch.cuda.synchronize()
    o_part, lse_part, out, lse = o_ws.cpu(), lse_ws.cpu(), out.cpu(), lse.cpu()
    written = lse_part[..., 0] > float("-inf")
    assert not lse_part[..., 0].isnan().any()
    k = lse_part[..., 1]
    top = o_part.float().abs().amax(-1)
    assert (k == k.round()).all() and (k >= -113).all() and (k <= 120).all()
    assert (top[written] <= 2.0**15).all()  # a value just below 2^15 may round up to it
    assert ((top[written] >= 2.0**14) | (k[written] == 120)).all()
    emu_out, emu_lse = emu.combine(o_part, lse_part, case.sink.cpu())
    magnitude, _ = emu.combine(o_part.abs(), lse_part, case.sink.cpu())
    _assert_matches_emulation(out, emu_out, magnitude, splits)
    assert torch.equal(lse == float("-inf"), emu_lse == float("-inf"))
    finite = emu_lse > float("-inf")
    torch.testing.assert_close(lse[finite], emu_lse[finite], rtol=1e-5, atol=1e-5)
