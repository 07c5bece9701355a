"""KV-cache codecs: byte layouts against independent packers, error bounds, slot isolation."""

from __future__ import annotations

import math
import struct
import zlib
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import KVFormat

# ---------------------------------------------------------------------------------------------
# Independent scalar implementations of the formats, written from the documented spec only.
# ---------------------------------------------------------------------------------------------


def e4m3_value(code: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F/0xFF are NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_POSITIVE = sorted((e4m3_value(c), c) for c in range(0x7F))  # 0 .. 448, finite, sign +


def e4m3_nearest_even(x: float) -> int:
    """Code of the e4m3 value nearest x (|x| <= 448), ties to the even code."""
    mag = abs(x)
    best = min(E4M3_POSITIVE, key=lambda vc: (abs(vc[0] - mag), vc[1] & 1))
    return best[1] | (0x80 if x < 0 and best[0] != 0 else 0)


def e4m3_round_up(x: float) -> int:
    return next(c for v, c in E4M3_POSITIVE if v >= x)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_nearest_even(y: float | Fraction) -> int:
    mag = abs(y)
    code = min(range(8), key=lambda c: (abs(Fraction(E2M1[c]) - mag), c & 1))
    return code | (8 if y < 0 else 0)


def ceil_log2(x: float) -> int:
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else e


def bf16_bytes(value: float) -> bytes:
    return struct.pack("<f", value)[2:4]  # bf16 = the high half of the float32 pattern


def bf16_round(value: float) -> float:
    """The bfloat16 nearest ``value`` (ties to even): 8 significant bits, and below 2^-126 the
    subnormals' fixed spacing 2^-133."""
    if value == 0:
        return value
    _, exponent = math.frexp(value)  # |value| in [2^(exponent - 1), 2^exponent)
    quantum = 2.0 ** max(exponent - 8, -133)
    return round(value / quantum) * quantum  # round() ties to even


def pack_fp8_ds_mla_page(token_rows: dict[int, list[float]], block_size: int) -> bytes:
    """One page of vLLM's fp8_ds_mla layout from the spec: data rows, scale rows, pad to 576."""
    data = bytearray(block_size * 576)
    scales = bytearray(block_size * 8)
    for pos, row in token_rows.items():
        for b in range(7):
            block = row[64 * b : 64 * (b + 1)]
            exponent = ceil_log2(max(max(abs(v) for v in block), 1e-4) / 448.0)
            for i, v in enumerate(block):
                data[pos * 576 + 64 * b + i] = e4m3_nearest_even(v / 2.0**exponent)
            scales[pos * 8 + b] = exponent + 127
        for i, v in enumerate(row[448:]):
            data[pos * 576 + 448 + 2 * i : pos * 576 + 450 + 2 * i] = bf16_bytes(v)
    page = bytes(data + scales)
    return page + bytes(-len(page) % 576)


def pack_nvfp4_token(row: list[float]) -> tuple[bytes, bytes]:
    """(352-B data row, 32-B scale row) from the documented NVFP4 rule, in exact (rational)
    arithmetic."""
    nope = [Fraction(float(np.float32(v))) for v in row[:448]]
    amax = max(abs(v) for v in nope)
    g_exp = 0
    if amax > 0:  # smallest e with amax <= 2688 * 2^e
        g_exp = ceil_log2(float(amax)) - 13
        while amax > 2688 * Fraction(2) ** g_exp:
            g_exp += 1
        g_exp = max(-127, min(127, g_exp))
    G = Fraction(2) ** g_exp
    codes, block_scales = [], []
    for b in range(28):
        block = nope[16 * b : 16 * (b + 1)]
        block_amax = max(abs(v) for v in block)
        s_code = next(c for v, c in E4M3_POSITIVE if 6 * Fraction(v) * G >= block_amax)
        step = Fraction(e4m3_value(s_code)) * G
        block_scales.append(s_code)
        codes += [e2m1_nearest_even(v / step) if step > 0 else (8 if v < 0 else 0) for v in block]
    packed = bytes(codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(224))
    rope = b"".join(bf16_bytes(v) for v in row[448:])
    return packed + rope, bytes(block_scales) + bytes([g_exp + 127, 0, 0, 0])


def unpack_nvfp4_token(data: bytes, scales: bytes) -> list[float]:
    G = 2.0 ** (scales[28] - 127)
    out = []
    for j in range(448):
        nibble = (data[j // 2] >> (4 * (j % 2))) & 0xF
        value = E2M1[nibble & 7] * (-1 if nibble & 8 else 1)
        out.append(value * e4m3_value(scales[j // 16]) * G)
    for i in range(64):
        out.append(struct.unpack("<f", b"\0\0" + data[224 + 2 * i : 226 + 2 * i])[0])
    return out


def unpack_fp8_ds_mla_token(data: bytes, scales: bytes) -> list[float]:
    out = [e4m3_value(data[i]) * 2.0 ** (scales[i // 64] - 127) for i in range(448)]
    for i in range(64):
        out.append(struct.unpack("<f", b"\0\0" + data[448 + 2 * i : 450 + 2 * i])[0])
    return out


BF16_MIN_SUBNORMAL = 2.0**-133


def random_rows(gen: torch.Generator, n: int, kind: str = "normal") -> torch.Tensor:
    x = torch.randn(n, 512, generator=gen)
    if kind == "mixed":  # magnitudes spanning 1e-8 .. 1e8 across blocks of 16
        magnitude = torch.logspace(-8, 8, 32)[torch.randint(0, 32, (n, 32), generator=gen)]
        x = x * magnitude.repeat_interleave(16, 1)
    elif kind == "small":
        x = x * 1e-6
    elif kind == "tiny":  # row maxima 1e-36 .. 1e-40 and bf16 subnormals: G clamps to 2^-127
        magnitude = torch.tensor([1e-36, 1e-37, 1e-38, 1e-39, 1e-40])[torch.arange(n) % 5]
        x = x * magnitude[:, None]
        x[:, 1], x[:, 2] = BF16_MIN_SUBNORMAL, -BF16_MIN_SUBNORMAL
        x[5::10, 0] = 2688 * 2.0**-127  # the largest maximum whose exponent is -127 unclamped
    elif kind == "near_zero":  # blocks of zeros, subnormals, tiny and unit values mixed
        levels = torch.tensor([0.0, BF16_MIN_SUBNORMAL, 1e-39, 1e-37, 1e-30, 1.0])
        pick = torch.randint(0, 6, (n, 32), generator=gen)
        pick[::3] = pick[::3].clamp(max=3)  # every third row tiny throughout
        x = x * levels[pick].repeat_interleave(16, 1)
        x[3::4] = -0.0  # every fourth row all zeros
    elif kind == "huge":
        x = x * 1e30
    elif kind == "zero":
        x = torch.zeros(n, 512)
    elif kind == "edges":  # block maxima on, just above and just below 6 * s_b * G boundaries
        codes = torch.randint(1, 127, (n, 28), generator=gen)
        boundary = 6 * torch.tensor([e4m3_value(int(c)) for c in codes.flatten()]).view(n, 28)
        nudge = torch.randint(-1, 2, (n, 28), generator=gen)  # -1, 0, +1 bf16 ulp
        bits = boundary.to(torch.bfloat16).view(torch.int16) + nudge.to(torch.int16)
        peak = bits.view(torch.bfloat16).float()
        x = torch.rand(n, 512, generator=gen) * 2 - 1
        x[:, :448] = x[:, :448] * peak.repeat_interleave(16, 1)
        x[:, :448].view(n, 28, 16)[:, :, 0] = peak  # each block's max sits on the edge
        x[:, 0] = 2688.0  # the row maximum itself on a G boundary: G = 1
    elif kind == "ties":  # values on e2m1/e4m3 midpoints after scaling
        x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 64).repeat(n, 1)
        x = x * torch.where(torch.rand(n, 512, generator=gen) < 0.5, -1.0, 1.0)
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------


def test_sizes():
    assert kv_cache.bytes_per_token("fp8_ds_mla") == 584
    assert kv_cache.bytes_per_token(KVFormat.NVFP4) == 384
    assert 1 - 384 / 584 > 0.34  # "34% smaller than FP8"
    assert kv_cache.page_layout("fp8_ds_mla", 64).page_bytes == 37440  # 64*584 padded to 576
    assert kv_cache.page_layout("nvfp4", 64).page_bytes == 64 * 384
    assert kv_cache.allocate(3, 64, "nvfp4").shape == (3, 64 * 384)


@pytest.mark.parametrize("block_size", [64, 2, 5])
def test_fp8_ds_mla_page_is_byte_identical_to_independent_packer(block_size):
    gen = torch.Generator().manual_seed(block_size)
    rows = torch.cat(
        [random_rows(gen, 3, "normal"), random_rows(gen, 1, "small"), random_rows(gen, 1, "zero")]
    )
    rows = rows[: min(5, block_size)]
    positions = torch.randperm(block_size, generator=gen)[: rows.shape[0]]
    cache = kv_cache.allocate(2, block_size, "fp8_ds_mla")
    kv_cache.write(cache, positions + block_size, rows, "fp8_ds_mla", block_size)  # block 1
    expected = pack_fp8_ds_mla_page(
        {int(p): [float(v) for v in r.float()] for p, r in zip(positions, rows, strict=True)},
        block_size,
    )
    assert bytes(cache[1].tolist()) == expected
    assert not cache[0].any()


def test_fp8_ds_mla_reads_bytes_from_independent_packer():
    gen = torch.Generator().manual_seed(11)
    rows = random_rows(gen, 4, "mixed")
    page = pack_fp8_ds_mla_page({p: [float(v) for v in r.float()] for p, r in enumerate(rows)}, 4)
    cache = torch.tensor(list(page), dtype=torch.uint8).view(1, -1)
    decoded = kv_cache.read(cache, torch.arange(4), "fp8_ds_mla", 4)
    for p in range(4):
        expected = unpack_fp8_ds_mla_token(page[p * 576 : (p + 1) * 576], page[4 * 576 + 8 * p :])
        assert decoded[p].float().tolist() == pytest.approx(expected, rel=0, abs=0)


@pytest.mark.parametrize(
    "kind", ["normal", "mixed", "small", "tiny", "near_zero", "huge", "zero", "ties", "edges"]
)
def test_nvfp4_bytes_match_independent_packer(kind):
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    rows = random_rows(gen, 10 if kind in ("tiny", "near_zero") else 3, kind)
    data, scales = kv_cache.encode_rows(rows, "nvfp4")
    for i, row in enumerate(rows):
        exp_data, exp_scales = pack_nvfp4_token([float(v) for v in row.float()])
        assert bytes(data[i].tolist()) == exp_data
        assert bytes(scales[i].tolist()) == exp_scales
        decoded = kv_cache.decode_rows(data[i : i + 1], scales[i : i + 1], "nvfp4")[0]
        # Values below 2^-126 land on bf16's subnormal grid; above, they are exact in bf16.
        expected = [bf16_round(v) for v in unpack_nvfp4_token(exp_data, exp_scales)]
        assert decoded.float().tolist() == expected


def test_pow2_is_exact_over_the_scale_range():
    """The UE8M0 scale helper against exact math: 2^e for every e in [-127, 127], the two ends
    and 2^-126 (the smallest normal float32, next to the one subnormal, 2^-127) included."""
    exponents = list(range(-127, 128))
    got = kv_cache._pow2(torch.tensor(exponents, dtype=torch.int32))
    assert got.dtype == torch.float32
    assert got.tolist() == [math.ldexp(1.0, e) for e in exponents]


@pytest.mark.parametrize(
    "amax",
    [
        2.0**-115,  # G = 2^-126: 2688 * 2^-127 < 2^-115 <= 2688 * 2^-126
        2688 * 2.0**-126,  # the largest row maximum with G = 2^-126
        (1.3125 + 2.0**-7) * 2.0**-116,  # the bf16 just above 2688 * 2^-127
    ],
    ids=["2^-115", "2688*2^-126", "above_2688*2^-127"],
)
def test_nvfp4_token_scale_of_two_to_minus_126(amax):
    """Rows whose token scale G is exactly 2^-126, the smallest normal float32: the bytes match
    the independent packer (scale byte 1) and the decode its exact unpacking."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(amax).encode()))
    rows = (torch.rand(3, 512, generator=gen) * 2 - 1) * amax
    rows[:, 0] = amax
    rows = rows.to(torch.bfloat16)
    assert rows.float()[:, :448].abs().amax().item() == amax  # amax is a bf16 value
    data, scales = kv_cache.encode_rows(rows, "nvfp4")
    assert scales[:, 28].tolist() == [1, 1, 1]  # -126 + 127
    decoded = kv_cache.decode_rows(data, scales, "nvfp4")
    for i, row in enumerate(rows):
        exp_data, exp_scales = pack_nvfp4_token([float(v) for v in row.float()])
        assert bytes(data[i].tolist()) == exp_data
        assert bytes(scales[i].tolist()) == exp_scales
        expected = [bf16_round(v) for v in unpack_nvfp4_token(exp_data, exp_scales)]
        assert decoded[i].float().tolist() == expected


def _fp8_bound(x: torch.Tensor) -> torch.Tensor:
    blocks = x[:, :448].double().view(-1, 7, 64)
    amax = blocks.abs().amax(-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return (2.0**-4 * blocks.abs() + 2.0**-10 * scale[..., None]).view(-1, 448)


def _nvfp4_bound(x: torch.Tensor) -> torch.Tensor:
    """The documented error bound, plus 2^-134: a decoded value below 2^-126 rounds to bf16's
    subnormal grid (spacing 2^-133); above, the decoded products are exact in bf16."""
    blocks = x[:, :448].double().view(-1, 28, 16)
    amax_b = blocks.abs().amax(-1)
    amax_t = amax_b.amax(-1)
    exponent = torch.ceil(torch.log2(amax_t / 2688)).clamp(-127, 127)
    G = torch.where(amax_t > 0, torch.exp2(exponent), 1.0)
    step = 1.125 * amax_b / 6 + 2.0**-9 * G[:, None]
    return (torch.maximum(blocks.abs() / 4, step[..., None] / 4) + 2.0**-134).view(-1, 448)


BOUNDS = {"fp8_ds_mla": _fp8_bound, "nvfp4": _nvfp4_bound, "bf16": lambda x: 0 * x[:, :448]}


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(["fp8_ds_mla", "nvfp4", "bf16"]),
    kind=st.sampled_from(["normal", "mixed", "small", "tiny", "near_zero", "huge", "zero", "ties"]),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_error_bounds(fmt, kind, n, seed):
    rows = random_rows(torch.Generator().manual_seed(seed), n, kind)
    back = kv_cache.decode_rows(*kv_cache.encode_rows(rows, fmt), fmt)
    err = (back.double() - rows.double()).abs()
    assert torch.equal(back[:, 448:], rows[:, 448:]), "RoPE values must round-trip exactly"
    assert torch.all(err[:, :448] <= BOUNDS[fmt](rows)), f"max err {err.max().item()}"
    assert torch.isfinite(back.float()).all()


@pytest.mark.parametrize("kind", ["tiny", "near_zero"])
def test_nvfp4_round_trip_of_tiny_rows(kind):
    """Rows whose maximum lies below 2688 * 2^-128 (the token exponent clamps to -127) or is a
    bf16 subnormal, and rows mixing such blocks with zeros and unit values: the decode is
    finite, zeros (all-zero rows too) decode to exactly zero, every nope value lies within the
    format's bound (float64), and a clamped row's token scale byte is 0 (G = 2^-127)."""
    rows = random_rows(torch.Generator().manual_seed(zlib.crc32(kind.encode())), 40, kind)
    data, scales = kv_cache.encode_rows(rows, "nvfp4")
    back = kv_cache.decode_rows(data, scales, "nvfp4")
    x, y = rows.double(), back.double()
    assert torch.isfinite(y).all()
    assert torch.equal(back[:, 448:], rows[:, 448:])
    assert bool((y[x == 0] == 0).all())
    err = (y - x).abs()[:, :448]
    assert torch.all(err <= _nvfp4_bound(rows)), f"max err {err.max().item()}"
    amax = x[:, :448].abs().amax(dim=1)
    clamped = (amax > 0) & (amax < 2688 * 2.0**-128)
    assert int(clamped.sum()) >= 10
    assert bool((scales[clamped, 28] == 0).all())
    if kind == "near_zero":
        assert bool((x[3::4] == 0).all() and (y[3::4] == 0).all())


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(["fp8_ds_mla", "nvfp4", "bf16"]),
    block_size=st.sampled_from([1, 3, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_write_touches_only_its_slots(fmt, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 3
    row_bytes = kv_cache.page_layout(fmt, block_size).page_bytes + 7
    cache = torch.randint(0, 256, (num_blocks, row_bytes), generator=gen, dtype=torch.uint8)
    before = cache.clone()
    n = int(torch.randint(1, num_blocks * block_size + 1, (1,), generator=gen))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.2] = -1  # skipped
    rows = random_rows(gen, n, "normal")
    kv_cache.write(cache, slots, rows, fmt, block_size)

    layout = kv_cache.page_layout(fmt, block_size)
    expected = before.clone()
    data, scales = kv_cache.encode_rows(rows, fmt)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, p = divmod(slot, block_size)
        d0 = p * layout.data_row_bytes
        expected[b, d0 : d0 + layout.data_row_bytes] = data[i]
        s0 = layout.scale_offset + p * layout.scale_row_bytes
        expected[b, s0 : s0 + layout.scale_row_bytes] = scales[i]
    assert torch.equal(cache, expected)
    keep = slots >= 0
    back = kv_cache.read(cache, slots, fmt, block_size)
    assert torch.equal(back[keep], kv_cache.decode_rows(data, scales, fmt)[keep])
    assert not back[~keep].any(), "slot -1 reads as zeros"


def test_strided_cache_view_round_trips():
    """vLLM hands out page views whose row stride exceeds the page (packed layers)."""
    gen = torch.Generator().manual_seed(2)
    backing = torch.zeros(4, 2 * 37440, dtype=torch.uint8)
    cache = backing[:, 37440:]
    rows = random_rows(gen, 5, "normal")
    slots = torch.tensor([0, 63, 64, 200, 255])
    kv_cache.write(cache, slots, rows, "fp8_ds_mla", 64)
    assert not backing[:, :37440].any()
    expected = kv_cache.decode_rows(*kv_cache.encode_rows(rows, "fp8_ds_mla"), "fp8_ds_mla")
    assert torch.equal(kv_cache.read(cache, slots, "fp8_ds_mla", 64), expected)


def _good_write_args():
    return {
        "cache": kv_cache.allocate(2, 4, "nvfp4"),
        "slots": torch.tensor([0, 7]),
        "rows": torch.randn(2, 512).to(torch.bfloat16),
        "fmt": "nvfp4",
        "block_size": 4,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows": torch.randn(2, 512)}, "rows must be a bfloat16 tensor, got torch.float32"),
        ({"rows": torch.randn(2, 511).bfloat16()}, "rows must be \\[N, 512\\], got shape"),
        ({"slots": torch.tensor([0, 8])}, "slot 8 is out of range: slots must lie in \\[-1, 8\\)"),
        ({"slots": torch.tensor([-2, 1])}, "slot -2 is out of range"),
        ({"slots": torch.tensor([1, 1])}, "must not repeat"),
        ({"slots": torch.tensor([0.0, 1.0])}, "int32 or int64"),
        ({"slots": torch.tensor([0, 1, 2])}, "slots must be \\[N=2\\]"),
        ({"cache": torch.zeros(2, 100, dtype=torch.uint8)}, "page of 1536 contiguous bytes"),
        ({"cache": torch.zeros(2, 1536)}, "uint8 tensor"),
        ({"fmt": "fp4"}, "unknown KV-cache format 'fp4'; expected one of: fp8_ds_mla, nvfp4, bf16"),
        ({"block_size": 0}, "block_size must be a positive int, got 0"),
    ],
)
def test_bad_input_raises_value_error_naming_it(change, message):
    args = _good_write_args()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kv_cache.write(**args)


def test_read_rejects_bad_slots():
    cache = kv_cache.allocate(1, 4, "bf16")
    with pytest.raises(ValueError, match="slot 4 is out of range"):
        kv_cache.read(cache, torch.tensor([4]), "bf16", 4)


def test_format_parse_accepts_names():
    assert KVFormat.parse("NVFP4") is KVFormat.NVFP4
    assert KVFormat.parse("fp8_ds_mla") is KVFormat.FP8_DS_MLA
    assert KVFormat.parse(KVFormat.BF16) is KVFormat.BF16


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
@pytest.mark.parametrize(
    "slot_list", [[-1, 0, -1, 9, -1], [-1, -1, -1, -1, -1], [3, -1, -1, 0, -1], [15, 14, 0]]
)
def test_write_unchecked_places_rows_and_leaves_holes_harmless(fmt, slot_list):
    """The graph-safe writer aims hole rows at a valid row's slot (or slot 0 with its own bytes):
    the cache must equal one where only the valid rows were placed, by hand."""
    gen = torch.Generator().manual_seed(len(slot_list))
    slots = torch.tensor(slot_list)
    rows = random_rows(gen, len(slot_list), "normal")
    layout = kv_cache.page_layout(fmt, 4)
    cache = torch.randint(0, 256, (4, layout.page_bytes + 9), generator=gen, dtype=torch.uint8)
    expected = cache.clone()
    data, scales = kv_cache.encode_rows(rows, fmt)
    for i, slot in enumerate(slot_list):
        if slot >= 0:
            b, p = divmod(slot, 4)
            d0, s0 = p * layout.data_row_bytes, layout.scale_offset + p * layout.scale_row_bytes
            expected[b, d0 : d0 + layout.data_row_bytes] = data[i]
            expected[b, s0 : s0 + layout.scale_row_bytes] = scales[i]
    kv_cache.write_unchecked(cache, slots, rows, fmt, 4)
    assert torch.equal(cache, expected)


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4.1's records, against vLLM's own V4.1 readers and writer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [KVFormat.MXFP8_DS, KVFormat.NVFP4_DS], ids=lambda f: f.value)
def test_v41_records_round_trip_within_their_error_bound(fmt):
    """Decoded values lie within the record's quantization step of the input, per 32 (MXFP8)
    or 16 (NVFP4) value block; an all-zero row decodes to zeros."""
    gen = torch.Generator().manual_seed(41)
    rows = torch.cat([random_rows(gen, 64, "normal"), torch.zeros(1, 512, dtype=torch.bfloat16)])
    data, scales = kv_cache.encode_rows(rows, fmt)
    assert data.shape == (65, kv_cache.bytes_per_token(fmt)) and scales.shape == (65, 0)
    got = kv_cache.decode_rows(data, scales, fmt).double()
    x = rows.double()
    assert torch.equal(got[-1], x[-1])
    block = 32 if fmt is KVFormat.MXFP8_DS else 16
    xb, gb = x.view(65, -1, block), got.view(65, -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    if fmt is KVFormat.MXFP8_DS:
        # e4m3 keeps 3 mantissa bits; its smallest step at the block's scale 2^e is 2^(e - 9).
        scale = 2.0 ** torch.ceil(torch.log2(amax.clamp(min=1e-4) / 448))
        bound = xb.abs() / 16 + scale * 2.0**-10
    else:
        # e2m1 steps are at most 1/4 of the value or 1/4 of the scale; the e4m3 scale is
        # amax / 6 rounded (at most 1/16 off), so a value at amax may saturate by that much.
        scale = (amax / 6).clamp(min=2.0**-9)
        bound = torch.maximum(xb.abs() / 4, scale * 17 / 64) + amax / 16
    assert bool(((gb - xb).abs() <= bound + 1e-30).all())


def test_v41_records_read_by_vllms_v41_readers():
    """Pages of V4.1 records written here, read back by vLLM's own V4.1 gather kernels (Triton,
    in its CPU interpreter in a child process): the same bf16 rows as this codec decodes. (Its
    writers' bytes are compared on the GPU, below: the interpreter converts to e4m3 rounding
    ties away from zero, the GPU to the nearest even, as this codec does.)"""
    pytest.importorskip("vllm")
    from tests import vllm_glue_testing as vt

    code = "from tests.test_kv_cache import check_v41_records as c; c()"
    assert "V4.1 records compared: 2" in vt.run_in_triton_interpreter(code)


def check_v41_records() -> None:
    from vllm.models.deepseek_v41.common.ops import cache_utils

    from tests import vllm_glue_testing as vt

    gen = torch.Generator().manual_seed(4101)
    block, pages, n = 4, 5, 14
    rows = random_rows(gen, n, "normal")
    rows[3] = 0
    rows[5] *= 1e-6
    table = torch.randperm(pages, generator=gen).int()[None]
    compared = 0
    for fmt, name, scale_dim, quant_block in (
        (KVFormat.MXFP8_DS, "_dequantize_and_gather_k_mxfp8_kernel", 16, 32),
        (KVFormat.NVFP4_DS, "_dequantize_and_gather_k_nvfp4_kernel", 32, 16),
    ):
        layout = kv_cache.page_layout(fmt, block)
        cache = torch.zeros(pages, layout.page_bytes + 16, dtype=torch.uint8)
        slots = torch.tensor([int(table[0, t // block]) * block + t % block for t in range(n)])
        kv_cache.write(cache, slots, rows, fmt, block)
        out = torch.full((1, n, 512), float("nan"), dtype=torch.bfloat16)
        kernel = vt.vllm_triton_kernel_fn(getattr(cache_utils, name))
        kernel[(1, 4)](
            out,
            out.stride(0),
            out.stride(1),
            cache,
            torch.tensor([n], dtype=torch.int32),
            table,
            0,
            None,
            max_blocks_per_seq=table.shape[1],
            head_dim=512,
            scale_dim=scale_dim,
            quant_block=quant_block,
            cache_block_size=block,
            block_stride=cache.stride(0),
        )
        assert torch.equal(out[0], kv_cache.read(cache, slots, fmt, block)), fmt
        compared += 1

    print(f"V4.1 records compared: {compared}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("fmt", "writer"),
    [
        (KVFormat.MXFP8_DS, "_rope_quant_insert_mxfp8_kernel"),
        (KVFormat.NVFP4_DS, "_rope_quant_insert_nvfp4_kernel"),
    ],
    ids=["mxfp8_ds", "nvfp4_ds"],
)
def test_gpu_v41_records_are_the_bytes_vllms_v41_writers_write(fmt, writer):
    """vLLM's own V4.1 record writers (compiled, on the GPU; cos 1 / sin 0 makes their RoPE the
    identity, ratio 1 writes every token) and this codec lay down the same bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if fmt is KVFormat.NVFP4_DS and torch.cuda.get_device_capability() < (10, 0):
        # Its e2m1 packing is PTX `cvt.rn.satfinite.e2m1x2.f32`, which ptxas refuses below sm_100
        # ("not supported on .target sm_90a"): vLLM writes this record on Blackwell only.
        pytest.skip("vLLM's NVFP4_DS writer needs sm_100+ (cvt .e2m1x2)")
    fused = pytest.importorskip("vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache")
    gen = torch.Generator().manual_seed(4102)
    block, pages, n = 4, 9, 33
    rows = random_rows(gen, n, "normal")
    rows[3] = 0
    rows[5] *= 1e-6
    rows[7] *= 1e4
    slots = torch.randperm(pages * block, generator=gen)[:n]
    layout = kv_cache.page_layout(fmt, block)
    theirs = torch.zeros(pages, layout.page_bytes, dtype=torch.uint8, device="cuda")
    cos_sin = torch.cat([torch.ones(n, 32), torch.zeros(n, 32)], dim=1).cuda()
    getattr(fused, writer)[(n,)](
        rows.cuda(),
        torch.arange(n, device="cuda"),
        cos_sin,
        theirs,
        slots.cuda(),
        COS_STRIDE=64,
        CACHE_STRIDE=theirs.stride(0),
        CACHE_BLOCK=block,
        COMPRESS_RATIO=1,
        SANITIZE_CACHE_NANS=False,
    )
    ours = torch.zeros(pages, layout.page_bytes, dtype=torch.uint8)
    kv_cache.write(ours, slots, rows, fmt, block)
    assert torch.equal(theirs.cpu(), ours)
