"""The balanced decode schedule in serving: the choice, the policy, the planner's buffers."""

from __future__ import annotations

import pytest
import torch

from tests import vllm_glue_testing  # noqa: F401 (vLLM's CPU platform, before vLLM loads)

pytest.importorskip("vllm")

from dsv4_attn.kernels import sparse_decode
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


def test_the_policy_needs_long_lists_and_enough_tokens():
    tokens, capacity = sparse_decode.BALANCED_MIN_TOKENS, sparse_decode.BALANCED_MIN_CAPACITY
    assert sparse_decode.balanced_pays(tokens, capacity)
    assert not sparse_decode.balanced_pays(tokens - 1, capacity)
    assert not sparse_decode.balanced_pays(tokens, capacity - 1)


@pytest.mark.parametrize("choice", ["auto", "balanced"])
def test_which_steps_the_planner_takes(choice, monkeypatch):
    monkeypatch.setenv(balanced.SCHEDULE_ENV, choice)
    long, short = sparse_decode.BALANCED_MIN_CAPACITY, sparse_decode.BALANCED_MIN_CAPACITY - 1
    few, many = sparse_decode.BALANCED_MIN_TOKENS - 1, sparse_decode.BALANCED_MIN_TOKENS
    planner = BalancedDecodePlanner(64, long, 64, torch.device("cpu"), num_parts=8)
    assert planner.wants(many)
    assert planner.wants(few) == (choice == "balanced")
    assert not planner.wants(0) and not planner.wants(65)  # nothing to plan; beyond the buffers
    planner = BalancedDecodePlanner(64, short, 64, torch.device("cpu"), num_parts=8)
    assert planner.wants(many) == (choice == "balanced")


def test_the_planner_writes_the_plan_of_its_counts_into_its_buffers():
    gen = torch.Generator().manual_seed(11)
    planner = BalancedDecodePlanner(128, 128 + 4096, 40, torch.device("cpu"), num_parts=12)
    addresses = (planner.part_plan.data_ptr(), planner.token_plan.data_ptr())
    for T in (1, 17, 40):
        window = torch.randint(0, 129, (T,), generator=gen, dtype=torch.int32)
        extra = torch.randint(0, 4097, (T,), generator=gen, dtype=torch.int32)
        planner.part_plan.fill_(-7)
        planner.token_plan.fill_(-7)
        plan = planner.build(window, extra)
        want = schedule.build_schedule(
            window + extra, 12, schedule.min_share_tiles(-(-(128 + 4096) // BLOCK_N))
        )
        assert (plan.part_plan.data_ptr(), plan.token_plan.data_ptr()) == addresses
        assert plan.token_plan.shape == (T, 5)
        assert torch.equal(plan.part_plan, want.part_plan)
        assert torch.equal(plan.token_plan, want.token_plan)
