"""The balanced decode schedule in serving: the choice, the policy, the planner's buffers."""

from __future__ import annotations

import pytest
import torch

from tests import vllm_glue_testing  # noqa: F401 (vLLM's CPU platform, before vLLM loads)

pytest.importorskip("vllm")

from dsv4_attn.kernels import sparse_decode_schedule as schedule
from dsv4_attn.kernels.sparse_decode_config import BLOCK_N
from dsv4_attn.vllm_glue import balanced
from dsv4_attn.vllm_glue.balanced import BalancedDecodePlanner

CHOICES = [(None, "auto"), ("", "auto"), ("Balanced", "balanced"), (" split ", "split")]


@pytest.mark.parametrize(("value", "choice"), CHOICES)
def test_the_choice_comes_from_the_environment(value, choice, monkeypatch):
    if value is None:
        monkeypatch.delenv(balanced.SCHEDULE_ENV, raising=False)
    else:
        monkeypatch.setenv(balanced.SCHEDULE_ENV, value)
    assert balanced.decode_schedule_choice() == choice


def test_a_bad_choice_names_the_value_and_the_accepted_ones(monkeypatch):
    monkeypatch.setenv(balanced.SCHEDULE_ENV, "greedy")
    with pytest.raises(
        ValueError, match=r"DSV4_ATTN_DECODE_SCHEDULE='greedy'.*auto, balanced, split"
    ):
        balanced.decode_schedule_choice()


def test_no_balanced_schedule_where_the_kernel_does_not_run(monkeypatch):
    monkeypatch.setenv(balanced.SCHEDULE_ENV, "balanced")
    assert not balanced.balanced_capable(torch.device("cpu"), 1 << 20)


def test_the_policy_needs_long_lists_and_enough_work_per_part():
    capacity, parts = schedule.BALANCED_MIN_CAPACITY, 132
    enough = -(-schedule.BALANCED_MIN_KEYS_PER_PART * parts // capacity)
    assert schedule.balanced_pays(enough, capacity, parts)
    assert not schedule.balanced_pays(enough - 1, capacity, parts)
    assert not schedule.balanced_pays(10**6, capacity - 1, parts)
    # The measured cases (H100/H200, 132 parts): 1M context (8320 keys) from 8 tokens, 512K
    # (4224) from 16, 256K (2176) from 32, never at 128K (1152).
    assert schedule.balanced_pays(8, 128 + 8192, 132)
    assert not schedule.balanced_pays(4, 128 + 8192, 132)
    assert schedule.balanced_pays(16, 128 + 4096, 132)
    assert not schedule.balanced_pays(8, 128 + 4096, 132)
    assert schedule.balanced_pays(32, 128 + 2048, 132)
    assert not schedule.balanced_pays(16, 128 + 2048, 132)
    assert not schedule.balanced_pays(512, 128 + 1024, 132)


@pytest.mark.parametrize("choice", ["auto", "balanced"])
def test_which_steps_the_planner_takes(choice, monkeypatch):
    monkeypatch.setenv(balanced.SCHEDULE_ENV, choice)
    long, short = schedule.BALANCED_MIN_CAPACITY, schedule.BALANCED_MIN_CAPACITY - 1
    planner = BalancedDecodePlanner(64, (128, long - 128), 128, torch.device("cpu"), num_parts=132)
    many = -(-schedule.BALANCED_MIN_KEYS_PER_PART * 132 // long)
    assert planner.wants(many)
    assert planner.wants(many - 1) == (choice == "balanced")
    assert not planner.wants(0) and not planner.wants(129)  # nothing to plan; beyond the buffers
    planner = BalancedDecodePlanner(64, (128, short - 128), 128, torch.device("cpu"), num_parts=132)
    assert planner.wants(many) == (choice == "balanced")


def test_the_planner_writes_the_plan_of_its_counts_into_its_buffers():
    gen = torch.Generator().manual_seed(11)
    planner = BalancedDecodePlanner(128, (128, 4096), 40, torch.device("cpu"), num_parts=12)
    addresses = (planner.part_plan.data_ptr(), planner.token_plan.data_ptr())
    for T in (1, 17, 40):
        # Lengths past their lists' widths (and negative ones) count as the widths (as 0).
        window = torch.randint(-5, 140, (T,), generator=gen, dtype=torch.int32)
        extra = torch.randint(-5, 5000, (T,), generator=gen, dtype=torch.int32)
        planner.part_plan.fill_(-7)
        planner.token_plan.fill_(-7)
        plan = planner.build(window, extra)
        want = schedule.build_schedule(
            window.clamp(0, 128) + extra.clamp(0, 4096),
            12,
            schedule.min_share_tiles(-(-(128 + 4096) // BLOCK_N)),
        )
        assert (plan.part_plan.data_ptr(), plan.token_plan.data_ptr()) == addresses
        assert plan.token_plan.shape == (T, 5)
        assert torch.equal(plan.part_plan, want.part_plan)
        assert torch.equal(plan.token_plan, want.token_plan)
