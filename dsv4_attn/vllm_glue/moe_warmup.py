"""Compile vLLM's Triton fused-MoE kernels for every prefill token count before serving.

vLLM runs its fused-MoE GEMM (``fused_moe_kernel``) with a block config chosen per token count
``M`` (``try_get_optimal_moe_config``: a tuned table, else ``get_default_config``), and Triton
compiles one variant per config and per specialization of the kernel's integer arguments:
an ``int`` argument divisible by 16 compiles apart from one that is not (and 1 apart from the
rest). Arguments such as ``num_valid_tokens = M * top_k`` and the padded sorted-token count are
affine in ``M``, so their divisibility by 16 depends on ``M mod 16`` only. vLLM's startup runs
the MoE at ``max_num_batched_tokens`` (the profile run) and at the CUDA-graph capture sizes,
and its DeepSeek-V4 warmup one 16-token step; a prefill of another length can still compile
a variant (seconds) inside a user's request.

:func:`moe_warmup_token_counts` picks token counts that reach every (config, ``M mod 16``)
pair of ``1..max_tokens``; :func:`warm_moe` runs one dummy forward step per count, the way
vLLM's DeepSeek-V4 warmup runs its step. It runs from the hook of that warmup
(:mod:`dsv4_attn.vllm_glue.model_hook`), only for a runner using this package's backends.
Counts the startup already ran are not removed: which ones those are depends on the
CUDA-graph mode and sizes, and a small count costs milliseconds.

The counts are token counts of the forward step; they are the MoE's ``M`` where every rank's
MoE sees the step's tokens (no data-parallel gather or sequence-parallel split of the MoE).
Every rank derives the same counts from the same expert shapes, as the V2 runner's steps,
which go through ``execute_model``, need.

DeepSeek-V4.1's decoder replay layers run a step's trimmed prefill rows through CUDA graphs of
their own (``model_state.replay_cudagraphs``), captured per batch descriptor on first use once
the manager counts as captured, which it does from vLLM's graph capture before this warmup on. A
warmup step's descriptor has no graph, so the replay layers would start a capture on the default
stream, which CUDA refuses ("CUDA graphs must be captured on a non-default stream"); vLLM's own
warmup step (16 tokens) never reaches the trim threshold. The warmup therefore runs those
layers eagerly, as vLLM does without replay graphs, and puts the graphs back afterwards.

Environment:

* ``DSV4_ATTN_MOE_WARMUP=0`` turns the warmup off (read at each call); unset or any other
  value leaves it on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from dsv4_attn.log import get_logger

__all__ = [
    "MOE_WARMUP_ENV",
    "layer_moe_config_of",
    "model_moe_config_of",
    "moe_warmup_token_counts",
    "warm_moe",
]

logger = get_logger(__name__)

MOE_WARMUP_ENV = "DSV4_ATTN_MOE_WARMUP"

# Triton specializes an int argument on its divisibility by this (and on being 1).
_SPECIALIZATION_MODULUS = 16

# Read through the module so that tests can stub the clock.
_clock = time.perf_counter

ConfigOf = Callable[[int], Mapping[str, Any]]


def moe_warmup_token_counts(config_of: ConfigOf, max_tokens: int) -> list[int]:
    """Token counts whose dummy runs compile every fused-MoE kernel variant of ``1..max_tokens``.

    ``config_of(M)`` is vLLM's fused-MoE config (a dict of block sizes, warps, stages) for ``M``
    tokens. ``1..max_tokens`` is split into maximal runs of consecutive counts with equal
    configs; from each run the first 16 counts are taken (all of it when shorter). Triton
    compiles a variant per config and per divisibility by 16 of each integer argument; the
    arguments that change with ``M`` are affine in it, so their divisibility follows
    ``M mod 16``, and 16 consecutive counts take every residue once. The first run starts at 1,
    so ``M = 1`` (Triton's other specialization) is taken too.

    Returns the counts in increasing order (none when ``max_tokens < 1``).
    """
    counts: list[int] = []
    start = 1
    while start <= max_tokens:
        config = config_of(start)
        end = start
        while end < max_tokens and config_of(end + 1) == config:
            end += 1
        counts.extend(range(start, min(end, start + _SPECIALIZATION_MODULUS - 1) + 1))
        start = end + 1
    return counts


def layer_moe_config_of(layer: Any) -> ConfigOf:
    """``M -> config`` of vLLM's Triton fused-MoE kernel for a MoE layer's experts.

    ``layer`` is vLLM's ``RoutedExperts`` (vLLM 0.33.0's fused-MoE layer, which owns the expert
    weights). The arguments are those ``TritonExperts.apply`` passes to
    ``try_get_optimal_moe_config``: the two weights' shapes (``w13_weight`` [E, 2N, K],
    ``w2_weight`` [E, K, N]), the routed top-k plus any fused shared experts (the width of
    ``topk_ids``), the quant config's name for the activation dtype, and its block shape.
    The activation dtype is the one entering the MoE (``moe_config.in_dtype``): the kernel sees
    it quantized when the quant config quantizes activations, and then the name comes from the
    quant flags, not the dtype.
    """
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    quant_config = layer.quant_method.moe_quant_config
    if quant_config is None:  # built on the first forward; the warmup runs after the profile
        quant_config = layer.quant_method.get_fused_moe_quant_config(layer)
    w1_shape = tuple(layer.w13_weight.size())
    w2_shape = tuple(layer.w2_weight.size())
    expert_map_manager = getattr(layer, "expert_map_manager", None)
    top_k = layer.top_k + getattr(expert_map_manager, "num_fused_shared_experts", 0)
    dtype = quant_config.config_name(layer.moe_config.in_dtype)
    block_shape = quant_config.block_shape

    def config_of(num_tokens: int) -> Mapping[str, Any]:
        return try_get_optimal_moe_config(
            w1_shape, w2_shape, top_k, dtype, num_tokens, block_shape=block_shape
        )

    return config_of


def model_moe_config_of(model: torch.nn.Module) -> ConfigOf | None:
    """:func:`layer_moe_config_of` of the model's first fused-MoE layer, or None without one
    (DeepSeek-V4's MoE layers share their expert shapes)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for module in model.modules():
        if isinstance(module, RoutedExperts):
            return layer_moe_config_of(module)
    return None


def _uses_v2_model_runner(runner: Any) -> bool:
    # As vLLM's DeepSeek-V4 warmup tells its runners apart.
    return bool(getattr(getattr(runner, "vllm_config", None), "use_v2_model_runner", False))


def _run_step(worker: Any, num_tokens: int) -> None:
    """One mixed prefill + decode dummy step of ``num_tokens`` tokens, as vLLM's DeepSeek-V4
    warmup runs its own (the V2 runner's step needs 3 tokens or more and skips fewer)."""
    runner = worker.model_runner
    if _uses_v2_model_runner(runner) and runner.max_num_reqs >= 2:
        from vllm.v1.worker.gpu.warmup import run_mixed_prefill_decode_warmup

        run_mixed_prefill_decode_warmup(
            runner,
            worker.execute_model,
            worker.sample_tokens,
            num_tokens,
            req_id_prefix="_dsv4_moe_warmup",
        )
    else:
        runner._dummy_run(
            num_tokens=num_tokens,
            skip_eplb=True,
            is_profile=True,
            force_attention=True,
            create_mixed_batch=True,
        )


@contextmanager
def _eager_replay_layers(runner: Any) -> Iterator[None]:
    """Run DeepSeek-V4.1's decoder replay layers without their CUDA graphs inside the block
    (``model_state.replay_cudagraphs`` set to None, vLLM's eager replay path), restored on
    exit; nothing for a runner without them."""
    state = getattr(runner, "model_state", None)
    graphs = getattr(state, "replay_cudagraphs", None)
    if graphs is None:
        yield
        return
    state.replay_cudagraphs = None
    try:
        yield
    finally:
        state.replay_cudagraphs = graphs


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_moe(worker: Any) -> None:
    """Run a dummy step for each of :func:`moe_warmup_token_counts` up to the scheduler's
    ``max_num_batched_tokens``; nothing without a fused-MoE layer, for a pooling model, or with
    ``DSV4_ATTN_MOE_WARMUP=0``. Logs one INFO line: the number of counts and the seconds."""
    if os.environ.get(MOE_WARMUP_ENV, "1") == "0":
        logger.debug("dsv4-attn: fused-MoE warmup off (%s=0)", MOE_WARMUP_ENV)
        return
    runner = worker.model_runner
    if getattr(runner, "is_pooling_model", False):
        return
    max_tokens = worker.scheduler_config.max_num_batched_tokens
    max_tokens = min(max_tokens, getattr(runner, "max_num_tokens", max_tokens))
    try:
        config_of = model_moe_config_of(worker.get_model())
        counts = [] if config_of is None else moe_warmup_token_counts(config_of, max_tokens)
    except Exception as error:  # vLLM's MoE layer is not as read: serve without the warmup
        logger.warning("dsv4-attn: fused-MoE warmup skipped: %r", error)
        return
    if not counts:
        return
    start = _clock()
    with torch.inference_mode(), _eager_replay_layers(runner):
        for num_tokens in counts:
            _run_step(worker, num_tokens)
    _synchronize()
    logger.info(
        "dsv4-attn: warmed vLLM's fused-MoE kernels with %d dummy steps (1..%d tokens) in %.1f s",
        len(counts),
        max_tokens,
        _clock() - start,
    )
