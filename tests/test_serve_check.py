"""The request set and the comparison of scripts/gpu_serve.sh (the serving itself runs on GPU)."""

from __future__ import annotations

from types import SimpleNamespace

from dsv4_attn.e2e import serve_check
from dsv4_attn.e2e.serve_check import NEAR_TIE, compare, compare_one, request_plan


def test_plan_covers_every_case_the_serving_check_needs():
    plan = request_plan()
    assert plan == request_plan()  # fixed
    lengths = {r.key: len(r.prompt) for r in plan}
    assert lengths["single_8"] < 128 < lengths["single_200"] and lengths["single_600"] > 512
    prefix = [r.prompt for r in plan if r.phase == "prefix"]
    assert len(prefix) == 3 and all(p[:1100] == prefix[0][:1100] for p in prefix)
    assert len({tuple(p[1100:]) for p in prefix}) == 3
    assert sum(r.phase == "concurrent" for r in plan) == 16
    assert all(not r.logprobs for r in plan if r.phase.startswith("throughput"))
    preempt = [r for r in plan if r.phase == "preemption"]
    assert len(preempt) == 160 and all(len(r.prompt) + r.max_tokens < 4096 for r in preempt)
    assert all(r.max_tokens > 4 * len(r.prompt) for r in preempt)  # they grow while decoding
    assert all(0 < t < serve_check.VOCAB for r in plan for t in r.prompt)


def test_compare_classifies_by_the_reference_margin():
    ref = {
        "token_ids": [5, 6, 7, 8],
        "top2": [[-0.1, -3.0], [-0.5, -0.505], [-0.2, -2.0], [-1, -2]],
    }
    assert compare_one(ref, {"token_ids": [5, 6, 7, 8]}) == {"identical": True, "steps": 4}
    tie = compare_one(ref, {"token_ids": [5, 9, 7, 8]})
    assert tie["first_difference"] == 1 and tie["near_tie"] and tie["ref_margin"] < NEAR_TIE
    real = compare_one(ref, {"token_ids": [4, 6, 7, 8]})
    assert real["first_difference"] == 0 and not real["near_tie"]
    keys = ("single_8", "prefix_0", "preempt_3", "throughput0_1")
    records = {"results": {key: ref for key in keys}}
    other = {"results": {"single_8": {"token_ids": [5, 9, 7, 8]}, "prefix_0": ref}}
    phases = compare(records, other)["phases"]
    assert phases["single"] == {
        "requests": 1,
        "identical": 0,
        "near_tie": 1,
        "different": 0,
        "missing": 0,
    }
    assert phases["prefix"]["identical"] == 1 and phases["preemption"]["missing"] == 1
    assert not any(phase.startswith("throughput") for phase in phases)


def test_throughput_is_the_median_of_the_timed_runs():
    rates = [900.0, 1200.0, 1000.0]
    phases = {f"throughput{i}": {"tok_per_s": rate} for i, rate in enumerate(rates)}
    record = {"phases": {"single": {"tok_per_s": 5.0}, **phases}}
    assert serve_check.throughput(record) == 1000.0
    assert serve_check.throughput({"phases": {"single": {"tok_per_s": 5.0}}}) is None


def test_acceptance_reads_vllms_own_spec_decode_counters():
    """The counters come from vLLM's own Prometheus metrics class, rendered as /metrics
    renders them: two draft positions, two phases of a round."""
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    before = set(prometheus_client.REGISTRY._collector_to_names)
    spec = SpecDecodingProm(
        SimpleNamespace(num_speculative_tokens=2), ["model_name", "engine"], {0: ["m", "0"]}
    )
    try:
        pages = []
        for drafts, accepted_per_pos in ((10, [6, 3]), (30, [12, 5])):
            stats = SpecDecodingStats.new(2)
            stats.num_drafts, stats.num_draft_tokens = drafts, 2 * drafts
            stats.num_accepted_tokens = sum(accepted_per_pos)
            stats.num_accepted_tokens_per_pos = accepted_per_pos
            spec.observe(stats)
            pages.append(serve_check.parse_counters(prometheus_client.generate_latest().decode()))
    finally:
        for collector in set(prometheus_client.REGISTRY._collector_to_names) - before:
            prometheus_client.REGISTRY.unregister(collector)
    first, second = pages
    assert first["vllm:spec_decode_num_drafts_total"] == 10
    assert second["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 6 + 3 + 12 + 5
    record = {
        "phases": {
            "single": {"counters": first},
            "preemption": {"counters": {k: second[k] - first.get(k, 0) for k in second}},
        }
    }
    assert serve_check.acceptance(record) == {
        "drafts": 40,
        "draft_tokens": 80,
        "accepted_tokens": 26,
        "rate": round(26 / 80, 4),
        "mean_length": round(1 + 26 / 40, 4),
    }
    assert serve_check.acceptance({"phases": {"single": {"counters": {}}}}) is None
