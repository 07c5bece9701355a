"""The balanced decode schedule: every tile of every token in exactly one part, pieces and
partial slots as the kernel and the combine read them, parts within their bound."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn.kernels.sparse_decode_config import BLOCK_N
from dsv4_attn.kernels.sparse_decode_schedule import (
    TOKEN_OVERHEAD_TILES,
    build_schedule,
    max_partial_slots,
    min_share_tiles,
    num_parts,
)


def walk(schedule, key_counts):
    """What the kernel does with a plan, in Python: per part, its (token, first tile, end tile,
    slot or -1) items, in the order it runs them."""
    part_plan = schedule.part_plan.tolist()
    token_plan = schedule.token_plan.tolist()
    items = []
    for p, (lo, hi, first, last) in enumerate(part_plan):
        mine = []
        for t in range(first, last + 1):
            at, tiles, pieces, slot_base, first_part = token_plan[t]
            j0 = min(max(lo - at, 0), tiles)
            j1 = min(max(hi - at, 0), tiles)
            if j1 > j0:
                slot = slot_base + p - first_part if pieces > 1 else -1
                mine.append((t, j0, j1, slot))
        items.append(mine)
    return items


def check(key_counts, parts, min_share=2):
    counts = torch.tensor(key_counts, dtype=torch.int32)
    schedule = build_schedule(counts, parts, min_share)
    assert schedule.part_plan.dtype == torch.int32 and schedule.token_plan.dtype == torch.int32
    assert schedule.part_plan.shape == (parts, 4)
    assert schedule.token_plan.shape == (len(key_counts), 5)
    items = walk(schedule, key_counts)
    tiles = [max(1, math.ceil(c / BLOCK_N)) for c in key_counts]
    covered = [[0] * n for n in tiles]
    slots_seen = {}
    for mine in items:
        for t, j0, j1, slot in mine:
            for j in range(j0, j1):
                covered[t][j] += 1
            slots_seen.setdefault(t, []).append(slot)
    for t, row in enumerate(covered):
        assert row == [1] * tiles[t], f"token {t}: tiles covered {row}"
    token_plan = schedule.token_plan.tolist()
    used = []
    for t, slots in slots_seen.items():
        pieces, slot_base = token_plan[t][2], token_plan[t][3]
        assert pieces == len(slots), (t, pieces, slots)
        if pieces == 1:
            assert slots == [-1]
        else:
            assert slots == list(range(slot_base, slot_base + pieces)), (t, slots)
            used += slots
    assert sorted(used) == list(range(len(used))), "slots are compact and distinct"
    assert len(used) <= max_partial_slots(parts)
    # Each part: a share, give or take the boundaries' moves to token edges (the slack, at
    # each end), plus the overhead of a cut token's second piece (charged once on the line).
    total = sum(n + TOKEN_OVERHEAD_TILES for n in tiles)
    share = max(math.ceil(total / parts), min_share)
    for mine in items:
        load = sum(j1 - j0 + TOKEN_OVERHEAD_TILES for _, j0, j1, _ in mine)
        assert load <= share + 2 * slack_tiles(share) + TOKEN_OVERHEAD_TILES, (load, share)
    return schedule, items


def slack_tiles(share):
    """How far the schedule moves a boundary to a token's edge (its docstring's rule)."""
    return TOKEN_OVERHEAD_TILES + share // 16


@pytest.mark.parametrize("seed", range(40))
def test_random_counts_cover_every_tile_once(seed):
    gen = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 600, (1,), generator=gen))
    cap = int(torch.randint(1, 9000, (1,), generator=gen))
    counts = torch.randint(0, cap + 1, (T,), generator=gen).tolist()
    parts = int(torch.randint(1, 140, (1,), generator=gen))
    check(counts, parts, min_share_tiles(math.ceil(cap / BLOCK_N)))


def test_boundaries_near_a_token_edge_move_to_it():
    # Tokens of 8 tiles + 2 overhead on 3 parts of 10: every boundary is a token edge.
    _, items = check([256] * 3, 3)
    assert [[(t, j0, j1) for t, j0, j1, _ in m] for m in items] == [
        [(0, 0, 8)],
        [(1, 0, 8)],
        [(2, 0, 8)],
    ]
    # 4 tokens of 10 on 3 parts (share 14, slack 2 + 14 // 16 = 2): the boundary at 14 lies 4
    # into token 1 and 6 before its end, so token 1 is cut; the one at 28 lies 2 before token
    # 2's end and moves there.
    schedule, items = check([256] * 4, 3)
    assert schedule.token_plan[:, 2].tolist() == [1, 2, 1, 1]
    assert schedule.part_plan[:, :2].tolist() == [[0, 14], [14, 30], [30, 40]]


def test_ragged_batch_is_balanced():
    # Half the tokens long, half short: no part carries much more than the mean.
    counts = [8320, 128] * 64
    schedule, items = check(counts, 132)
    total = sum(math.ceil(c / BLOCK_N) + TOKEN_OVERHEAD_TILES for c in counts)
    loads = [sum(j1 - j0 + TOKEN_OVERHEAD_TILES for _, j0, j1, _ in m) for m in items]
    mean = math.ceil(total / 132)
    assert max(loads) <= mean + 2 * slack_tiles(mean) + TOKEN_OVERHEAD_TILES
    assert schedule.token_plan[:, 2].max() > 1  # long tokens are cut


def test_small_batch_splits_to_min_share():
    # One request of two tokens with 8320 keys (260 tiles): shares of at least 9 tiles
    # (260 / 32 pieces, rounded up), so at most 32 pieces per token (29 or 30).
    assert min_share_tiles(260) == 9
    schedule, items = check([8320, 8320], 132, min_share_tiles(260))
    pieces = schedule.token_plan[:, 2].tolist()
    assert all(29 <= n <= 30 for n in pieces), pieces
    assert max(sum(j1 - j0 for _, j0, j1, _ in m) for m in items) <= 9 + 2 * slack_tiles(9)


def test_tokens_without_keys_get_a_part():
    _, items = check([0, 0, 5000, 0], 8)
    owners = {t for m in items for t, *_ in m}
    assert owners == {0, 1, 2, 3}


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="non-empty 1-D"):
        build_schedule(torch.zeros(0, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        build_schedule(torch.ones(3, dtype=torch.int32), 0)


def test_num_parts_fill_the_sms():
    assert num_parts(132, 1) == 132 and num_parts(132, 2) == 66 and num_parts(1, 2) == 1
