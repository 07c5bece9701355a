"""Index-list validation shared by the sparse entry points, and the rule for untrusted lists
(:func:`counted_entries` and what is built on it) against a per-entry brute force."""

from __future__ import annotations

import re
import zlib
from dataclasses import replace

import pytest
import torch

from dsv4_attn.index_checks import (
    check_index_lists,
    check_index_values,
    counted_entries,
    int32_lists,
    sanitized_lists,
)
from dsv4_attn.testing import make_decode_case, poison_lists, poisoned_scope

CPU = torch.device("cpu")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
DTYPES = {"int32": torch.int32, "int64": torch.int64}


def test_accepts_valid_lists_and_ignores_entries_past_lens():
    indices = torch.tensor([[0, 7, 99], [-1, 3, -5]], dtype=torch.int32)
    lens = torch.tensor([2, 2])
    check_index_lists("", indices, lens, 2, CPU)
    check_index_values("", indices, lens, 8, "slot", "8")


@pytest.mark.parametrize(
    ("indices", "lens", "message"),
    [
        (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32), "indices must be an int32/int64"),
        (
            torch.zeros(2, 3, dtype=torch.int64),
            [1, 1],
            "lens must be an int32/int64 tensor, got list",
        ),
        (torch.zeros(3, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), r"\[T=2, K\]"),
        (
            torch.zeros(2, 3, dtype=torch.int64),
            torch.zeros(3, dtype=torch.int64),
            r"lens must be \[T=2\]",
        ),
    ],
)
def test_list_errors_name_the_value(indices, lens, message):
    with pytest.raises(ValueError, match=message):
        check_index_lists("extra_", indices, lens, 2, CPU)


@pytest.mark.parametrize(
    ("indices", "lens", "message"),
    [
        ([[0, 1]], [3], r"extra_lens must lie in \[0, K=2\], got values from 3 to 3"),
        ([[0, 8]], [2], r"extra_indices hold row 8: rows must lie in \[-1, N=8\), -1 meaning skip"),
        ([[-2, 0]], [1], r"hold row -2"),
    ],
)
def test_value_errors_name_the_value(indices, lens, message):
    with pytest.raises(ValueError, match=message):
        check_index_values("extra_", torch.tensor(indices), torch.tensor(lens), 8, "row", "N=8")


def test_int32_lists_make_every_id_past_int32_a_hole_not_its_low_word():
    """int64 ids whose low 32 bits name a slot (2^32 + 5, -2^32 + 3, int64's extremes) are
    holes once narrowed; ids inside int32 keep their value; int64 lengths are clamped."""
    big = [2**32 + 5, -(2**32) + 3, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]
    indices = torch.tensor([[5, -1, 7, -9, *big]], dtype=torch.int64)
    lens = torch.tensor([2**32 + 3], dtype=torch.int64)
    narrow, narrow_lens = int32_lists(indices, lens)
    assert narrow.dtype == narrow_lens.dtype == torch.int32
    assert narrow.tolist() == [[5, -1, 7, -9, *[-1] * len(big)]]
    assert narrow_lens.tolist() == [indices.shape[1]]
    lens = torch.tensor([-(2**40), 3, 2**40], dtype=torch.int64)
    assert int32_lists(torch.zeros(3, 4, dtype=torch.int64), lens)[1].tolist() == [0, 3, 4]


def test_int32_lists_keep_the_entries_that_count():
    """Narrowing keeps exactly the entries :func:`counted_entries` counts, on random int64
    lists with a fifth of the ids beyond int32 (low words inside the cache)."""
    gen = torch.Generator().manual_seed(7)
    limit = 1000
    indices = torch.randint(-3, limit + 3, (64, 48), generator=gen)
    wide = torch.rand(64, 48, generator=gen) < 0.2
    shift = torch.randint(1, 2**20, (64, 48), generator=gen) * 2**32
    indices = torch.where(wide, indices + shift * torch.where(indices % 2 == 0, 1, -1), indices)
    lens = torch.randint(-5, 60, (64,), generator=gen)
    narrow, narrow_lens = int32_lists(indices, lens)
    assert wide.any() and torch.equal(
        counted_entries(narrow, narrow_lens, limit), counted_entries(indices, lens, limit)
    )


def test_int32_lists_return_int32_inputs_as_they_are():
    indices = torch.tensor([[3, 2**31 - 1]], dtype=torch.int32)
    lens = torch.tensor([9], dtype=torch.int32)
    narrow, narrow_lens = int32_lists(indices, lens)
    assert narrow is indices and narrow_lens is lens


# ----------------------------------------------------------------------------------------------
# The untrusted-list rule, one entry at a time (plain Python ints: no tensor op of the code under
# test is in the oracle)
# ----------------------------------------------------------------------------------------------


def brute_counted(indices: list[list[int]], lens: list[int], limit: int) -> list[list[bool]]:
    """Entry ``(t, k)`` counts iff ``k < clamp(lens[t], 0, K)`` and ``0 <= indices[t][k] <
    limit``: the rule every backend applies to lists it did not check."""
    out = []
    for t, row in enumerate(indices):
        width = len(row)
        n = min(max(lens[t], 0), width)
        out.append([k < n and 0 <= row[k] < limit for k in range(width)])
    return out


def brute_value_error(
    indices: list[list[int]], lens: list[int], width: int, limit: int
) -> tuple[str, object] | None:
    """What :func:`check_index_values` must reject, found entry by entry: ``("lens", (lo, hi))``
    when a length lies outside ``[0, K]``, else ``("ids", bad)`` with the set of ids outside
    ``[-1, limit)`` among the first ``lens[t]`` entries of each row, else None."""
    if not lens:
        return None
    if any(n < 0 or n > width for n in lens):
        return "lens", (min(lens), max(lens))
    bad = {indices[t][k] for t in range(len(lens)) for k in range(lens[t])}
    bad = {v for v in bad if v < -1 or v >= limit}
    return ("ids", bad) if bad else None


def clean_lists(
    T: int, K: int, limit: int, gen: torch.Generator, id_dtype: torch.dtype, len_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists a builder could produce: ids in ``[-1, limit)`` (a fifth holes), lengths in
    ``[0, K]``."""
    indices = torch.randint(0, limit, (T, K), generator=gen)
    indices[torch.rand(T, K, generator=gen) < 0.2] = -1
    lens = torch.randint(0, K + 1, (T,), generator=gen)
    return indices.to(id_dtype), lens.to(len_dtype)


def poisoned(
    name: str, T: int, K: int, limit: int, id_dtype: torch.dtype, len_dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`poison_lists` over :func:`clean_lists`, seeded by ``name``: (clean, poisoned)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    indices, lens = clean_lists(T, K, limit, gen, id_dtype, len_dtype)
    return (indices, lens), poison_lists(indices, lens, limit, gen)


def assert_same_lists(got: list, want: list, what: str) -> None:
    """Nested lists equal, failing with the first differing entry (pytest's own diff of two
    ``[96, 40]`` lists takes minutes to print)."""
    if got == want:
        return
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} rows, expected {len(want)}")
    for t, (row, expected) in enumerate(zip(got, want, strict=True)):
        if row != expected:
            if not isinstance(row, list):
                raise AssertionError(f"{what}[{t}] = {row!r}, expected {expected!r}")
            k = next(
                (k for k, (a, b) in enumerate(zip(row, expected, strict=False)) if a != b), None
            )
            if k is None:
                raise AssertionError(f"{what}[{t}]: {len(row)} entries, expected {len(expected)}")
            raise AssertionError(f"{what}[{t}][{k}] = {row[k]!r}, expected {expected[k]!r}")


LIMIT = 1000
DTYPE_PAIRS = [(i, n) for i in DTYPES for n in DTYPES]


@pytest.mark.parametrize(("id_dtype", "len_dtype"), DTYPE_PAIRS)
def test_poison_lists_poison_as_documented(id_dtype, len_dtype):
    """Changed lengths lie outside ``[0, K]`` (with the dtype's extremes among them), changed ids
    outside ``[-1, limit)`` (with the extremes, and for int64 ids past int32 whose low word is
    a slot); everything else is the input's; dtype and shape kept, the inputs untouched."""
    T, K = 400, 24
    gen = torch.Generator().manual_seed(zlib.crc32(f"poison-{id_dtype}-{len_dtype}".encode()))
    indices, lens = clean_lists(T, K, LIMIT, gen, DTYPES[id_dtype], DTYPES[len_dtype])
    saved = indices.clone(), lens.clone()
    bad_ids, bad_lens = poison_lists(indices, lens, LIMIT, gen)
    assert bad_ids.dtype == indices.dtype and bad_lens.dtype == lens.dtype
    assert bad_ids.shape == indices.shape and bad_lens.shape == lens.shape
    assert torch.equal(indices, saved[0]) and torch.equal(lens, saved[1])
    old_ids, new_ids = indices.tolist(), bad_ids.tolist()
    changed_ids = [
        new_ids[t][k] for t in range(T) for k in range(K) if new_ids[t][k] != old_ids[t][k]
    ]
    changed_lens = [b for a, b in zip(lens.tolist(), bad_lens.tolist(), strict=True) if a != b]
    assert all(v < -1 or v >= LIMIT for v in changed_ids)
    assert all(n < 0 or n > K for n in changed_lens)
    # About an eighth of the ids and a quarter of the lengths, with every kind present.
    assert 0.08 < len(changed_ids) / (T * K) < 0.17 and 0.15 < len(changed_lens) / T < 0.35
    id_info, len_info = torch.iinfo(DTYPES[id_dtype]), torch.iinfo(DTYPES[len_dtype])
    assert {id_info.min, id_info.max, LIMIT, -2} <= set(changed_ids)
    assert {len_info.min, len_info.max, -1, K + 1} <= set(changed_lens)
    # Past int32 yet a slot in the low word, besides the extremes (int64's minimum has low word 0).
    low_word_slots = {
        v
        for v in set(changed_ids) - {id_info.min, id_info.max}
        if not INT32_MIN <= v <= INT32_MAX and 0 <= (v & 0xFFFFFFFF) < LIMIT
    }
    assert len(low_word_slots) == (2 if id_dtype == "int64" else 0), low_word_slots


@pytest.mark.parametrize(("id_dtype", "len_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize("seed", range(3))
def test_counted_and_sanitized_lists_follow_the_rule_entry_by_entry(id_dtype, len_dtype, seed):
    """On poisoned lists (lengths outside ``[0, K]``, ids outside ``[-1, limit)``, dtype
    extremes, int64 ids whose low word is a slot): ``counted_entries`` is the brute force's
    mask; ``sanitized_lists`` keeps the counted ids, makes every other id -1, clamps every
    length into ``[0, K]``, keeps the dtypes, and its lists count what the poisoned ones do."""
    T, K = 96, 40
    _, (indices, lens) = poisoned(
        f"rule-{id_dtype}-{len_dtype}-{seed}", T, K, LIMIT, DTYPES[id_dtype], DTYPES[len_dtype]
    )
    ids, ns = indices.tolist(), lens.tolist()
    want = brute_counted(ids, ns, LIMIT)
    got = counted_entries(indices, lens, LIMIT)
    assert got.dtype == torch.bool
    assert_same_lists(got.tolist(), want, "counted_entries")
    assert any(n < 0 for n in ns) and any(n > K for n in ns)  # the clamp is exercised

    clean_ids, clean_lens = sanitized_lists(indices, lens, LIMIT)
    assert clean_ids.dtype == indices.dtype and clean_lens.dtype == lens.dtype
    assert_same_lists(
        clean_ids.tolist(),
        [[ids[t][k] if want[t][k] else -1 for k in range(K)] for t in range(T)],
        "sanitized ids",
    )
    assert_same_lists(clean_lens.tolist(), [min(max(n, 0), K) for n in ns], "sanitized lens")
    counted = brute_counted(clean_ids.tolist(), clean_lens.tolist(), LIMIT)
    assert_same_lists(counted, want, "counted by the sanitized lists")
    assert brute_value_error(clean_ids.tolist(), clean_lens.tolist(), K, LIMIT) is None


@pytest.mark.parametrize(("id_dtype", "len_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize("seed", range(3))
def test_int32_lists_follow_the_rule_entry_by_entry(id_dtype, len_dtype, seed):
    """Narrowed poisoned lists: int32 results; an int64 id inside int32 keeps its value, one
    outside becomes -1 (never its low word); an int64 length is clamped into ``[0, K]``; int32
    inputs come back as they are; and the narrowed lists count, by the brute force, exactly the
    entries the poisoned ones count, with the same ids."""
    T, K = 96, 40
    _, (indices, lens) = poisoned(
        f"narrow-{id_dtype}-{len_dtype}-{seed}", T, K, LIMIT, DTYPES[id_dtype], DTYPES[len_dtype]
    )
    ids, ns = indices.tolist(), lens.tolist()
    narrow, narrow_lens = int32_lists(indices, lens)
    assert narrow.dtype == narrow_lens.dtype == torch.int32
    if id_dtype == "int32":
        assert narrow is indices
    assert_same_lists(
        narrow.tolist(),
        [[v if INT32_MIN <= v <= INT32_MAX else -1 for v in row] for row in ids],
        "narrowed ids",
    )
    if len_dtype == "int32":
        assert narrow_lens is lens
    else:
        assert_same_lists(narrow_lens.tolist(), [min(max(n, 0), K) for n in ns], "narrowed lens")
    want = brute_counted(ids, ns, LIMIT)
    got_ids, got_lens = narrow.tolist(), narrow_lens.tolist()
    assert_same_lists(brute_counted(got_ids, got_lens, LIMIT), want, "counted when narrowed")
    assert all(got_ids[t][k] == ids[t][k] for t in range(T) for k in range(K) if want[t][k])


def test_int32_lists_at_the_limits_of_int32():
    """Ids at int32's extremes keep their value, one past them is a hole; a limit at int32's
    maximum counts ``2^31 - 2`` and never the low word of ``2^32 + 5``."""
    limit = INT32_MAX
    ids = [INT32_MAX, INT32_MIN, INT32_MAX - 1, INT32_MAX + 1, INT32_MIN - 1, 2**32 + 5, 5]
    indices = torch.tensor([ids], dtype=torch.int64)
    lens = torch.tensor([len(ids)], dtype=torch.int64)
    narrow, narrow_lens = int32_lists(indices, lens)
    assert narrow.tolist() == [[INT32_MAX, INT32_MIN, INT32_MAX - 1, -1, -1, -1, 5]]
    want = brute_counted([ids], [len(ids)], limit)
    assert want == [[False, False, True, False, False, False, True]]
    assert brute_counted(narrow.tolist(), narrow_lens.tolist(), limit) == want
    assert counted_entries(indices, lens, limit).tolist() == want


_ID_MESSAGE = re.compile(r"^ex_indices hold slot (-?\d+): slots must lie in \[-1, N=1000\) here, ")
_LENS_MESSAGE = re.compile(
    r"^ex_lens must lie in \[0, K=(\d+)\], got values from (-?\d+) to (-?\d+)$"
)


@pytest.mark.parametrize(("id_dtype", "len_dtype"), DTYPE_PAIRS)
def test_check_index_values_raises_exactly_when_the_brute_force_finds_a_bad_value(
    id_dtype, len_dtype
):
    """Over many small lists (poisoned ids with clean lengths, clean ids with poisoned lengths,
    both poisoned): a ValueError iff the brute force finds a length outside ``[0, K]`` (the
    message giving the lengths' range) or, within the lengths, an id outside ``[-1, limit)``
    (the message naming one such id); silence otherwise."""
    outcomes = {"lens": 0, "ids": 0, None: 0}
    for seed in range(60):
        T, K = 1 + seed % 5, 1 + seed % 7
        (indices, lens), (bad_ids, bad_lens) = poisoned(
            f"check-{id_dtype}-{len_dtype}-{seed}", T, K, LIMIT, DTYPES[id_dtype], DTYPES[len_dtype]
        )
        for ids_t, lens_t in ((bad_ids, lens), (indices, bad_lens), (bad_ids, bad_lens)):
            want = brute_value_error(ids_t.tolist(), lens_t.tolist(), K, LIMIT)
            outcomes[want[0] if want else None] += 1
            if want is None:
                check_index_values("ex_", ids_t, lens_t, LIMIT, "slot", "N=1000", " here")
                continue
            with pytest.raises(ValueError) as error:
                check_index_values("ex_", ids_t, lens_t, LIMIT, "slot", "N=1000", " here")
            message = str(error.value)
            if want[0] == "lens":
                match = _LENS_MESSAGE.match(message)
                assert match, message
                assert tuple(int(g) for g in match.groups()) == (K, *want[1]), message
            else:
                match = _ID_MESSAGE.match(message)
                assert match and int(match.group(1)) in want[1], message
    # Each outcome happened often enough to mean something.
    assert min(outcomes.values()) >= 10, outcomes


def test_check_index_values_accepts_no_tokens_and_holes():
    """No token: nothing to check, whatever the width; -1 is a hole, not an error, and ids
    past the lengths are never looked at."""
    check_index_values(
        "", torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 1, "slot", "1"
    )
    indices = torch.tensor([[-1, 0, 2**40, -(2**40)]], dtype=torch.int64)
    assert brute_value_error(indices.tolist(), [2], 4, 1) is None
    check_index_values("", indices, torch.tensor([2]), 1, "slot", "1")
    assert brute_value_error(indices.tolist(), [3], 4, 1)[0] == "ids"
    with pytest.raises(ValueError, match=f"hold slot {2**40}:"):
        check_index_values("", indices, torch.tensor([3]), 1, "slot", "1")


@pytest.mark.parametrize("kind", ["int32", "int64"])
def test_poisoned_scope_pairs_poisoned_lists_with_their_brute_force_sanitization(kind):
    """``poisoned_scope`` gives the scope with poisoned lists (same cache, format, block size,
    dtypes) and the scope a backend must compute from them: every id the brute force does not
    count is -1, every length clamped into ``[0, K]``, the counted ids unchanged."""
    case = make_decode_case(6, 1, "nvfp4", window=32, seed=3, block_size=16, lens="random")
    base = replace(case.window, indices=case.window.indices.to(DTYPES[kind]))
    gen = torch.Generator().manual_seed(zlib.crc32(f"scope-{kind}".encode()))
    bad, clean = poisoned_scope(base, gen)
    limit = base.cache.shape[0] * base.block_size
    for scope in (bad, clean):
        assert scope.cache is base.cache and scope.fmt is base.fmt
        assert scope.block_size == base.block_size
        assert scope.indices.dtype == base.indices.dtype and scope.lens.dtype == base.lens.dtype
    ids, ns = bad.indices.tolist(), bad.lens.tolist()
    K = len(ids[0])
    assert not torch.equal(bad.indices, base.indices) or not torch.equal(bad.lens, base.lens)
    want = brute_counted(ids, ns, limit)
    assert clean.indices.tolist() == [
        [ids[t][k] if want[t][k] else -1 for k in range(K)] for t in range(len(ids))
    ]
    assert clean.lens.tolist() == [min(max(n, 0), K) for n in ns]
