"""The fused-MoE warmup: which token counts it runs (every block config of vLLM's fused-MoE kernel
with every residue of the token count mod 16), the config read from a MoE layer as vLLM's
Triton experts read it, and the dummy steps it asks of a worker.

The workers and runners here are stand-ins that record the steps asked of them; the real steps
run on the GPU server, where vLLM's runner executes them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.platforms import current_platform
from vllm.utils import platform_utils

from dsv4_attn.vllm_glue import moe_warmup

# ---------------------------------------------------------------------------------------------
# The rule, on a hand-written config function

# (first count, last count, config name): the intervals of equal config, written by hand; "a"
# comes back after "b", and "d" is a single count.
INTERVALS = [(1, 5, "a"), (6, 40, "b"), (41, 100, "a"), (101, 117, "c"), (118, 118, "d")]
LAST_NAME = "e"  # 119 and above


def hand_config(num_tokens: int) -> dict[str, str]:
    for first, last, name in INTERVALS:
        if first <= num_tokens <= last:
            return {"name": name}
    return {"name": LAST_NAME}


def hand_intervals(max_tokens: int) -> list[tuple[int, int]]:
    """The hand-written intervals cut at ``max_tokens``."""
    spans = [(first, last) for first, last, _ in INTERVALS] + [(119, max_tokens)]
    return [(first, min(last, max_tokens)) for first, last in spans if first <= max_tokens]


@pytest.mark.parametrize("max_tokens", [1, 5, 15, 16, 40, 100, 118, 119, 134, 135, 400])
def test_counts_reach_every_config_and_residue(max_tokens):
    counts = moe_warmup.moe_warmup_token_counts(hand_config, max_tokens)
    assert counts == sorted(set(counts))
    assert all(1 <= m <= max_tokens for m in counts)
    # Brute force over every count: each (config, M mod 16) that serving can meet is run.
    needed = {(hand_config(m)["name"], m % 16) for m in range(1, max_tokens + 1)}
    assert {(hand_config(m)["name"], m % 16) for m in counts} == needed
    # Per interval: one consecutive run of 16 counts, or the whole interval when shorter.
    for first, last in hand_intervals(max_tokens):
        inside = [m for m in counts if first <= m <= last]
        assert len(inside) == min(16, last - first + 1), (first, last, inside)
        assert inside == list(range(inside[0], inside[0] + len(inside)))
    assert counts[0] == 1  # Triton's other integer specialization: equal to 1


def test_no_counts_without_tokens():
    assert moe_warmup.moe_warmup_token_counts(hand_config, 0) == []


# ---------------------------------------------------------------------------------------------
# config_of from vLLM's own config functions

CONFIGS_DIR = Path(vllm_fused_moe.__file__).parent / "configs"


@pytest.fixture
def h200(monkeypatch):
    """vLLM names its tuned-config files after the GPU: report an H200 (this machine may have
    none), with no user config folder and no batch-invariant mode; vLLM's caches are cleared
    around the test."""
    monkeypatch.setattr(current_platform, "get_device_name", lambda device_id=0: "NVIDIA H200")
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    caches = (platform_utils.get_device_name_as_file_name, vllm_fused_moe.get_moe_configs)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def layer_fields(
    experts: int, n: int, k: int, quant: FusedMoEQuantConfig | None = None, top_k: int = 2
) -> dict[str, object]:
    """What vLLM's MoE layer (``RoutedExperts``) holds and the warmup reads: ``w13_weight``
    [E, 2N, K] and ``w2_weight`` [E, K, N] (shapes only: meta tensors), ``top_k``, the quant
    method's fused-MoE quant config and the activation dtype entering the MoE."""
    return {
        "w13_weight": torch.empty(experts, 2 * n, k, device="meta"),
        "w2_weight": torch.empty(experts, k, n, device="meta"),
        "top_k": top_k,
        "quant_method": SimpleNamespace(moe_quant_config=quant or FusedMoEQuantConfig.make()),
        "moe_config": SimpleNamespace(in_dtype=torch.bfloat16),
    }


class StandInExperts(RoutedExperts):
    """A ``RoutedExperts`` holding only what the warmup reads (vLLM's constructor needs a full
    vLLM config)."""

    def __init__(self, **fields: object) -> None:
        torch.nn.Module.__init__(self)
        for name, value in fields.items():
            setattr(self, name, value)


def default_starts(experts: int) -> list[int]:
    """First counts of the intervals of vLLM's default bf16 config over 1..8192 tokens: block M
    16 / 32 / 64 / 128 above 32, 96, 512; block N and K and the stage count change at 64 and 32
    (already starts), 8 warps above 128; GROUP_SIZE_M 16 once M // E > 128, i.e. M >= 129 E."""
    return [1, 33, 65, 97, 129, 513, 129 * experts]


@pytest.mark.parametrize("experts", [8, 16])
def test_counts_from_vllms_default_config(h200, experts):
    """N = 96 has no tuned table, so vLLM's ``get_default_config`` decides; the expert count,
    read from the weights, moves the GROUP_SIZE_M step."""
    config_of = moe_warmup.layer_moe_config_of(SimpleNamespace(**layer_fields(experts, 96, 64)))
    assert config_of(1500)["BLOCK_SIZE_M"] == 128
    assert config_of(700)["BLOCK_SIZE_M"] == 128
    assert config_of(700)["GROUP_SIZE_M"] == 1
    assert config_of(129 * experts - 1)["GROUP_SIZE_M"] == 1
    assert config_of(129 * experts)["GROUP_SIZE_M"] == 16
    expected = [m for start in default_starts(experts) for m in range(start, start + 16)]
    assert moe_warmup.moe_warmup_token_counts(config_of, 8192) == expected


@pytest.mark.parametrize("dtype", [None, "fp8_w8a8"])
def test_config_of_reads_vllms_tuned_table(h200, dtype):
    """E = 8, N = 14336 on an H200 has tuned tables, one per dtype, that vLLM finds by the
    expert count and N of the weights and the quant config's dtype name: at a table's keys the
    config is the table's entry."""
    name = "E=8,N=14336,device_name=NVIDIA_H200" + ("" if dtype is None else f",dtype={dtype}")
    table = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    other = "E=8,N=14336,device_name=NVIDIA_H200" + (",dtype=fp8_w8a8" if dtype is None else "")
    other_table = json.loads((CONFIGS_DIR / f"{other}.json").read_text())
    quant = FusedMoEQuantConfig.make(current_platform.fp8_dtype()) if dtype else None
    config_of = moe_warmup.layer_moe_config_of(
        SimpleNamespace(**layer_fields(8, 14336, 4096, quant))
    )
    keys = [key for key in table if key.isdigit()]
    assert any(table[key] != other_table[key] for key in keys)  # the dtype decides
    for key in keys:
        assert config_of(int(key)) == table[key], key


def test_config_of_passes_the_block_shape(h200):
    """Block-quantized fp8 (no tuned table for N = 96): vLLM's block-wise default takes
    BLOCK_SIZE_K from the block shape and keeps BLOCK_SIZE_M at 64 above 64 tokens, where the
    per-tensor fp8 default has K = 128 and M = 128 above 512 tokens."""
    fp8 = current_platform.fp8_dtype()
    block = FusedMoEQuantConfig.make(fp8, block_shape=[128, 64])
    per_tensor = FusedMoEQuantConfig.make(fp8)
    blocked = moe_warmup.layer_moe_config_of(SimpleNamespace(**layer_fields(8, 96, 64, block)))
    plain = moe_warmup.layer_moe_config_of(SimpleNamespace(**layer_fields(8, 96, 64, per_tensor)))
    assert (blocked(1500)["BLOCK_SIZE_M"], blocked(1500)["BLOCK_SIZE_K"]) == (64, 64)
    assert (plain(1500)["BLOCK_SIZE_M"], plain(1500)["BLOCK_SIZE_K"]) == (128, 128)


def test_model_config_comes_from_its_first_moe_layer(h200):
    first = StandInExperts(**layer_fields(8, 96, 64))
    second = StandInExperts(**layer_fields(16, 96, 64))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), first, second)
    config_of = moe_warmup.model_moe_config_of(model)
    assert config_of is not None
    assert config_of(1100)["GROUP_SIZE_M"] == 16  # 8 experts; with 16 it would be 1
    assert moe_warmup.model_moe_config_of(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


# ---------------------------------------------------------------------------------------------
# warm_moe on stand-in workers


def stand_in_worker(
    *, v2: bool = False, max_batched: int = 600, model: torch.nn.Module | None = None, **runner_kw
) -> SimpleNamespace:
    """A worker whose runner records its dummy steps (``runner.steps``); ``model`` defaults to
    one MoE layer of 8 experts, N = 96 (vLLM's default configs)."""
    runner = SimpleNamespace(
        is_pooling_model=False,
        max_num_reqs=4,
        vllm_config=SimpleNamespace(use_v2_model_runner=v2),
        steps=[],
        **runner_kw,
    )
    runner._dummy_run = lambda **kwargs: runner.steps.append(kwargs)
    if model is None:
        model = torch.nn.Sequential(StandInExperts(**layer_fields(8, 96, 64)))
    return SimpleNamespace(
        model_runner=runner,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_batched),
        get_model=lambda: model,
        execute_model=object(),
        sample_tokens=object(),
    )


def default_counts(max_tokens: int, experts: int = 8) -> list[int]:
    """The counts for vLLM's default bf16 configs (see :func:`default_starts`) up to
    ``max_tokens``, each interval's first 16 counts."""
    starts = [s for s in default_starts(experts) if s <= max_tokens]
    ends = [s - 1 for s in starts[1:]] + [max_tokens]
    return [m for s, e in zip(starts, ends, strict=True) for m in range(s, min(e, s + 15) + 1)]


def test_warm_moe_runs_a_mixed_dummy_step_per_count(h200, monkeypatch, dsv4_logs):
    monkeypatch.delenv(moe_warmup.MOE_WARMUP_ENV, raising=False)
    monkeypatch.setattr(moe_warmup, "_clock", iter([10.0, 12.5]).__next__)
    worker = stand_in_worker(max_batched=600)
    moe_warmup.warm_moe(worker)
    expected = default_counts(600)
    assert len(expected) == 6 * 16
    assert worker.model_runner.steps == [
        {
            "num_tokens": m,
            "skip_eplb": True,
            "is_profile": True,
            "force_attention": True,
            "create_mixed_batch": True,
        }
        for m in expected
    ]
    infos = [r.getMessage() for r in dsv4_logs.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "96 dummy steps" in infos[0] and "2.5 s" in infos[0], infos


def test_warm_moe_stays_within_the_runners_token_limit(h200, monkeypatch):
    monkeypatch.delenv(moe_warmup.MOE_WARMUP_ENV, raising=False)
    worker = stand_in_worker(max_batched=8192, max_num_tokens=100)
    moe_warmup.warm_moe(worker)
    assert [step["num_tokens"] for step in worker.model_runner.steps] == default_counts(100)


def test_warm_moe_takes_the_v2_runners_path(h200, monkeypatch):
    """With vLLM's V2 runner the steps go through vLLM's mixed prefill + decode warmup (the
    worker's execute_model and sample_tokens), as vLLM's DeepSeek-V4 warmup does."""
    from vllm.v1.worker.gpu import warmup as v2_warmup

    monkeypatch.delenv(moe_warmup.MOE_WARMUP_ENV, raising=False)
    calls = []

    def record(runner, execute_model, sample_tokens, num_tokens, **kwargs):
        calls.append((runner, execute_model, sample_tokens, num_tokens))
        return True

    monkeypatch.setattr(v2_warmup, "run_mixed_prefill_decode_warmup", record)
    worker = stand_in_worker(v2=True, max_batched=200)
    moe_warmup.warm_moe(worker)
    runner = worker.model_runner
    assert runner.steps == []
    assert calls == [
        (runner, worker.execute_model, worker.sample_tokens, m) for m in default_counts(200)
    ]


@pytest.mark.parametrize("value, runs", [("0", False), ("1", True), ("", True)])
def test_env_switch_is_read_at_call_time(h200, monkeypatch, value, runs):
    worker = stand_in_worker(max_batched=40)
    monkeypatch.setenv(moe_warmup.MOE_WARMUP_ENV, value)
    moe_warmup.warm_moe(worker)
    assert bool(worker.model_runner.steps) is runs


def test_nothing_runs_without_a_moe_layer_or_for_pooling(h200, monkeypatch, dsv4_logs):
    monkeypatch.delenv(moe_warmup.MOE_WARMUP_ENV, raising=False)
    dense = stand_in_worker(model=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    moe_warmup.warm_moe(dense)
    pooling = stand_in_worker()
    pooling.model_runner.is_pooling_model = True
    moe_warmup.warm_moe(pooling)
    assert dense.model_runner.steps == [] and pooling.model_runner.steps == []
    assert not [r for r in dsv4_logs.records if r.levelno >= logging.INFO]


def test_an_unreadable_moe_layer_skips_the_warmup_with_a_warning(h200, monkeypatch, dsv4_logs):
    """A MoE layer without the fields vLLM 0.33.0's has: the server starts without the
    warmup, and a WARNING says why."""
    monkeypatch.delenv(moe_warmup.MOE_WARMUP_ENV, raising=False)
    fields = layer_fields(8, 96, 64)
    del fields["quant_method"]
    worker = stand_in_worker(model=torch.nn.Sequential(StandInExperts(**fields)))
    moe_warmup.warm_moe(worker)
    assert worker.model_runner.steps == []
    warnings = [r.getMessage() for r in dsv4_logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "quant_method" in warnings[0], warnings


def test_v41_replay_layers_run_eagerly_during_the_warmup_and_get_their_graphs_back(
    h200, monkeypatch
):
    """DeepSeek-V4.1's replay layers would capture a CUDA graph on the default stream for a
    warmup step (a RuntimeError at startup): the steps run with ``replay_cudagraphs`` None,
    and the graphs are back afterwards, also when a step raises."""
    from vllm.v1.worker.gpu import warmup as v2_warmup

    monkeypatch.delenv(moe_warmup.MOE_WARMUP_ENV, raising=False)
    graphs = object()
    seen = []

    def record(runner, execute_model, sample_tokens, num_tokens, **kwargs):
        seen.append(runner.model_state.replay_cudagraphs)
        if num_tokens == fail_at:
            raise RuntimeError("step failed")
        return True

    monkeypatch.setattr(v2_warmup, "run_mixed_prefill_decode_warmup", record)
    for fail_at in (None, default_counts(200)[3]):
        seen.clear()
        worker = stand_in_worker(v2=True, max_batched=200)
        worker.model_runner.model_state = SimpleNamespace(replay_cudagraphs=graphs)
        if fail_at is None:
            moe_warmup.warm_moe(worker)
            assert len(seen) == len(default_counts(200))
        else:
            with pytest.raises(RuntimeError, match="step failed"):
                moe_warmup.warm_moe(worker)
            assert len(seen) == 4
        assert seen and all(g is None for g in seen)
        assert worker.model_runner.model_state.replay_cudagraphs is graphs


def test_vllms_v41_model_state_and_v2_runner_have_the_attributes_the_warmup_sets():
    """The names :func:`warm_moe` reaches for: the V2 runner's ``model_state`` and V4.1's
    ``replay_cudagraphs`` (a vLLM rename would otherwise make the eager switch a no-op)."""
    import inspect

    from vllm.models.deepseek_v41.nvidia.model_state import DeepseekV41ModelState
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert "self.replay_cudagraphs" in inspect.getsource(DeepseekV41ModelState.__init__)
    assert "self.model_state = " in inspect.getsource(GPUModelRunner)
