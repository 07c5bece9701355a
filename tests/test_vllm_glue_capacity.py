"""NVFP4's capacity in vLLM's own KV accounting: the V4-Flash and V4-Pro layer schedules' specs as
each backend's server builds them, planned by vLLM 0.33's functions (CPU); the per-group bytes of
the breakdown against the specs of real attention layers built through vLLM's model hook. And
DeepSeek-V4.1-Flash in vLLM's two V4.1 modes: the specs against those of vLLM's own V4.1 layers,
the figures against a derivation by hand, admission against vLLM's KV cache manager."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm")

from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.vllm_glue import capacity as cap
from dsv4_attn.vllm_glue.compressor_state import state_dtype
from tests import vllm_glue_testing as vt

MEMORY = 60 * 2**30


@pytest.mark.parametrize("schedule", list(cap.SCHEDULES))
@pytest.mark.parametrize("max_model_len", [131072, 1048576])
def test_nvfp4_holds_at_least_1_35x_the_tokens_of_fp8(schedule, max_model_len):
    layers = cap.SCHEDULES[schedule]
    vllm = cap.capacity(layers, "vllm", MEMORY, max_model_len)
    fp8 = cap.capacity(layers, "dsv4_nvfp4-fp8", MEMORY, max_model_len)
    nvfp4 = cap.capacity(layers, "dsv4_nvfp4-nvfp4", MEMORY, max_model_len)
    assert fp8 == vllm  # --kv-cache-dtype fp8: vLLM's own layout, to the byte
    assert nvfp4.tokens / fp8.tokens >= 1.35, (nvfp4, fp8)
    assert nvfp4.tokens / vllm.tokens >= 1.35
    # A block id costs the widest group's bytes: with NVFP4 that is a KV group (the compressed
    # caches), no longer the CSA compressor's state.
    assert nvfp4.bytes_per_block < fp8.bytes_per_block
    assert nvfp4.blocks_per_request == fp8.blocks_per_request


@pytest.mark.parametrize("backend", ["vllm", "dsv4_nvfp4-nvfp4"])
def test_blocks_per_request_is_vllms_rounded_up_count(backend, monkeypatch):
    """A request takes whole blocks: vLLM's concurrency is ``num_blocks / sum over groups of
    cdiv(max memory, page bytes)``. Every group spec of these schedules is a
    ``UniformTypeKVCacheSpecs``, whose max memory is already whole pages; with it one byte
    short of that (the division no longer exact), the per-request count must still be the
    rounded-up one of vLLM's own :func:`get_max_concurrency_for_kv_cache_config`, unchanged
    from the whole-page count."""
    from vllm.v1.core import kv_cache_planning, kv_cache_utils
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    schedule, length = cap.SCHEDULES["V4-Flash"], 100003
    whole_pages = cap.capacity(schedule, backend, MEMORY, length)
    original = UniformTypeKVCacheSpecs.max_memory_usage_bytes
    monkeypatch.setattr(
        UniformTypeKVCacheSpecs,
        "max_memory_usage_bytes",
        lambda spec, config: original(spec, config) - 1,
    )
    got = cap.capacity(schedule, backend, MEMORY, length)

    config = cap._planner_config("auto" if "nvfp4-nvfp4" in backend else "fp8_ds_mla", length, 8192)
    specs = cap.layer_specs(schedule, backend, config)
    groups = kv_cache_planning.get_kv_cache_groups(config, specs)
    for group in groups:
        spec = group.kv_cache_spec
        assert spec.max_memory_usage_bytes(config) % spec.page_size_bytes != 0  # not exact
    kv_config = kv_cache_planning.get_kv_cache_config_from_groups(config, groups, MEMORY)
    concurrency = kv_cache_utils.get_max_concurrency_for_kv_cache_config(config, kv_config)
    assert got.num_blocks == kv_config.num_blocks
    assert got.num_blocks / got.blocks_per_request == concurrency
    assert got.blocks_per_request == whole_pages.blocks_per_request


# The NVFP4 row layout as documented in dsv4_attn.kv_cache: a 352-B data row (224 B of e2m1 pairs,
# 64 bf16 RoPE values) and a 32-B scale row per token, a page being its rows with nothing added.
NVFP4_DATA_ROW_BYTES = 224 + 64 * 2
NVFP4_SCALE_ROW_BYTES = 28 + 1 + 3


@pytest.mark.parametrize(
    ("block_size", "compress_ratio"),
    [(64, 1), (256, 1), (256, 4), (256, 128), (64, 4)],
    ids=["swa64", "swa256", "csa256", "hca256", "csa64"],
)
def test_nvfp4_spec_pages_are_the_documented_layout(block_size, compress_ratio):
    """The page bytes vLLM allocates for an NVFP4 cache: ``block_size / compress_ratio`` rows of
    352 + 32 B, exactly (no padding: such pages are multiples of 128 B already), for the SWA
    pages (64 tokens in serving) and the compressed ones (256-token blocks, ratios 4 and 128)."""
    from dsv4_attn.vllm_glue import kv_spec

    rows = block_size // compress_ratio
    expected = rows * (NVFP4_DATA_ROW_BYTES + NVFP4_SCALE_ROW_BYTES)
    assert NVFP4_DATA_ROW_BYTES + NVFP4_SCALE_ROW_BYTES == 384
    assert expected % 128 == 0
    if compress_ratio == 1:
        spec = kv_spec.swa_cache_spec(block_size, 128)
    else:
        spec = kv_spec.compressed_cache_spec(block_size, compress_ratio)
    assert spec.page_size_bytes == expected


def test_the_widest_nvfp4_group_is_a_kv_group():
    """Which group sets the block cost: with NVFP4 the compressed caches (a KV group), with an
    fp32 CSA state instead (what vLLM's compressor keeps) the state group would, at 1.165x."""
    from vllm.v1.core import kv_cache_planning

    config = cap._planner_config("auto", 131072, 8192)
    layers = cap.SCHEDULES["V4-Flash"]
    groups = kv_cache_planning.get_kv_cache_groups(
        config, cap.layer_specs(layers, "dsv4_nvfp4-nvfp4", config)
    )
    widest = max(groups, key=lambda g: g.kv_cache_spec.page_size_bytes)
    assert all(".compressor." not in name for name in widest.layer_names)
    assert any(name.endswith("self_attn") for name in widest.layer_names)


@pytest.mark.parametrize("schedule", list(cap.SCHEDULES))
def test_the_split_prices_a_block_at_its_fp8_window_group(schedule):
    """The split (window in vLLM's fp8_ds_mla rows, compressed caches in NVFP4 rows): the window
    specs are vLLM's fp8 ones, the compressed caches' pages NVFP4's. Its capacity lies between
    fp8's and all-NVFP4's, below NVFP4's 1.35x, because a block id now costs the widest group's
    bytes and that is a window group of fp8 pages (all-NVFP4: a compressed-cache group)."""
    from vllm.v1.core import kv_cache_planning

    layers = cap.SCHEDULES[schedule]
    fp8_config = cap._planner_config("fp8_ds_mla", 131072, 8192)
    split = cap.layer_specs(layers, "dsv4_nvfp4-split", fp8_config)
    fp8 = cap.layer_specs(layers, "dsv4_nvfp4-fp8", fp8_config)
    nvfp4 = cap.layer_specs(layers, "dsv4_nvfp4-nvfp4", cap._planner_config("auto", 131072, 8192))
    assert split.keys() == fp8.keys()
    compressed = [name for name in split if name.endswith("self_attn")]
    assert compressed
    assert all(split[n].page_size_bytes == nvfp4[n].page_size_bytes for n in compressed)
    assert all(split[n] == fp8[n] for n in split if n.endswith(".swa_cache"))
    tokens = {b: cap.capacity(layers, b, MEMORY, 131072).tokens for b in cap.BACKENDS}
    assert tokens["dsv4_nvfp4-fp8"] < tokens["dsv4_nvfp4-split"] < tokens["dsv4_nvfp4-nvfp4"]
    assert tokens["dsv4_nvfp4-split"] / tokens["dsv4_nvfp4-fp8"] < 1.35
    groups = kv_cache_planning.get_kv_cache_groups(fp8_config, split)
    widest = max(groups, key=lambda g: g.kv_cache_spec.page_size_bytes)
    assert all(name.endswith(".swa_cache") for name in widest.layer_names)


def test_the_state_rule():
    assert state_dtype(KVFormat.NVFP4, 4, HEAD_DIM) == torch.bfloat16
    assert state_dtype(KVFormat.NVFP4, 128, HEAD_DIM) == torch.float32
    assert state_dtype(KVFormat.NVFP4, 4, 128) == torch.float32  # the indexer's compressor
    assert state_dtype(KVFormat.FP8_DS_MLA, 4, HEAD_DIM) == torch.float32


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        cap.layer_specs([4], "flashinfer", cap._planner_config("auto", 4096, 8192))


@pytest.mark.parametrize("backend", cap.BACKENDS)
def test_breakdown_adds_up_to_vllms_bytes_per_request(backend):
    """Per group, the blocks a 1M-token V4-Flash request takes at the widest group's price sum
    to the per-request bytes of vLLM's own accounting; each group holds at most what it is
    charged, the widest exactly that; every cache of every layer is in one group."""
    schedule, length = cap.SCHEDULES["V4-Flash"], 1048576
    groups = cap.breakdown(schedule, backend, length)
    total = cap.capacity(schedule, backend, 60 * 2**30, length)
    assert sum(g.charged_bytes for g in groups) == total.bytes_per_request
    assert all(g.needed_bytes <= g.charged_bytes for g in groups)
    assert max(g.bytes_per_block for g in groups) == total.bytes_per_block
    counted: dict[str, int] = {}
    for group in groups:
        for part in group.holds.split(" + "):
            n, kind = part.split(" x ")
            counted[kind] = counted.get(kind, 0) + int(n)
    csa, hca = schedule.count(4), schedule.count(128)
    assert counted == {
        "window rows": len(schedule),
        "CSA rows": csa,
        "HCA rows": hca,
        "indexer keys": csa,
        "CSA compressor state": csa,
        "HCA compressor state": hca,
        "indexer compressor state": csa,
    }


# V4-Flash's cache shapes: a 512-value head (448 nope + 64 RoPE), a 128-token window, 128-value
# indexer keys. The tiny model of the glue tests has the same ones (its other sizes, which no
# cache spec reads, are small).
V4_FLASH_CACHE_SHAPES = {"head_dim": 512, "qk_rope_head_dim": 64, "sliding_window": 128}
V4_FLASH_INDEX_HEAD_DIM = 128


def real_page_bytes(kv_cache_dtype: str) -> dict[str, int]:
    """``page_size_bytes`` of the spec each cache of the tiny model's real layers (built with
    ``--attention-backend DSV4_NVFP4 --kv-cache-dtype kv_cache_dtype`` through vLLM's model hook,
    block size 256 as vLLM's worker sets it) gives vLLM, by the cache's kind (the names of
    :func:`capacity.breakdown`'s ``holds``)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    model = vt.tiny_model(kv_cache_dtype)
    config = model.vllm_config
    pages: dict[str, set[int]] = {}
    for name, module in config.compilation_config.static_forward_context.items():
        if not isinstance(module, AttentionLayerBase):
            continue
        spec = module.get_kv_cache_spec(config)
        if spec is None:  # the sliding-only layer's attention: its rows are its SWA cache's
            continue
        kind = {1: "window-only", 4: "CSA", 128: "HCA"}[vt.RATIOS[int(name.split(".")[2])]]
        if name.endswith(".swa_cache"):
            kind = "window rows"
        elif name.endswith(".indexer.k_cache"):
            kind = "indexer keys"
        elif name.endswith(".indexer.compressor.state_cache"):
            kind = "indexer compressor state"
        elif name.endswith(".compressor.state_cache"):
            kind += " compressor state"
        else:
            assert name.endswith(".attn"), name
            kind += " rows"
        pages.setdefault(kind, set()).add(spec.page_size_bytes)
    assert all(len(sizes) == 1 for sizes in pages.values()), pages  # one size per kind
    return {kind: sizes.pop() for kind, sizes in pages.items()}


@pytest.mark.parametrize(
    ("backend", "kv_cache_dtype"),
    [("dsv4_nvfp4-nvfp4", "auto"), ("dsv4_nvfp4-fp8", "fp8"), ("vllm", "fp8")],
)
def test_breakdown_bytes_are_the_real_layers_spec_page_sizes(backend, kv_cache_dtype):
    """Each V4-Flash group's page sizes and bytes per block in the breakdown are those of the
    specs real layers give vLLM: per kind of cache, the ``page_size_bytes`` of vLLM 0.33's spec
    object from the tiny model's layers (same cache shapes as V4-Flash), times the number of
    such caches the group holds. With ``fp8`` every spec the layers give is vLLM's own code, so
    it is also what vLLM's FlashMLA backend (``vllm``) charges."""
    config = vt.tiny_config_dict()
    assert {k: config[k] for k in V4_FLASH_CACHE_SHAPES} == V4_FLASH_CACHE_SHAPES
    assert config["index_head_dim"] == V4_FLASH_INDEX_HEAD_DIM
    real = real_page_bytes(kv_cache_dtype)
    assert set(real) == {
        "window rows",
        "CSA rows",
        "HCA rows",
        "indexer keys",
        "CSA compressor state",
        "HCA compressor state",
        "indexer compressor state",
    }
    groups = cap.breakdown(cap.SCHEDULES["V4-Flash"], backend, 131072)
    for group in groups:
        held = [part.split(" x ") for part in group.holds.split(" + ")]
        assert group.page_bytes == tuple(sorted({real[kind] for _, kind in held})), group
        assert group.bytes_per_block == sum(int(n) * real[kind] for n, kind in held), group


# vLLM's scheduler-side KV cache manager (vllm.v1.core.kv_cache_manager.KVCacheManager, pure
# Python), over the KVCacheConfig the planner computes, driven the way vLLM 0.33's scheduler drives
# it: the admission and decode-time block counts of capacity.py are checked against what that
# manager asks for and holds, not against a re-derivation of their formulas.
HEADLINE_MEMORY = 7 * 2**30
HEADLINE_PROMPT = 129024  # + 2,048 outputs: a 131,072-token context
BATCHED_TOKENS = 8192


def planned_kv_config(schedule: cap.Schedule, backend: str, memory_bytes: int, max_model_len: int):
    """The planner config, vLLM's KV cache groups, and the scheduler's ``KVCacheConfig`` (one
    spec per group, as the engine core hands it to the scheduler) for ``memory_bytes`` of KV."""
    from vllm.v1.core import kv_cache_planning, kv_cache_utils

    config, groups = cap._groups(schedule, backend, max_model_len, BATCHED_TOKENS)
    kv_config = kv_cache_planning.get_kv_cache_config_from_groups(config, groups, memory_bytes)
    return config, groups, kv_cache_utils.generate_scheduler_kv_cache_config([kv_config])


def bytes_per_block(schedule: cap.Schedule, backend: str, max_model_len: int = 131072) -> int:
    """What one block id costs in vLLM's planning (the widest group's bytes), in bytes."""
    from vllm.v1.core import kv_cache_planning

    config, groups = cap._groups(schedule, backend, max_model_len, BATCHED_TOKENS)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    return kv_cache_planning._get_kv_cache_bytes_per_block(groups, layout)


def kv_manager(
    schedule: cap.Schedule, backend: str, memory_bytes: int, max_model_len: int = 131072
):
    """vLLM's ``KVCacheManager`` as its scheduler builds it (no prefix caching, the planner's
    ``max_in_flight_tokens``: two batches in flight with async scheduling)."""
    from types import SimpleNamespace

    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    config, _, kv_config = planned_kv_config(schedule, backend, memory_bytes, max_model_len)
    engine = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=config.cache_config.block_size,
            enable_prefix_caching=False,
            prefix_match_unit=None,
        ),
        parallel_config=config.parallel_config,
        kv_transfer_config=None,
    )
    block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(kv_config, engine)
    return KVCacheManager(
        kv_config,
        max_model_len,
        block_size,
        hash_block_size,
        max_in_flight_tokens=config.max_in_flight_tokens,
        enable_caching=False,
    )


def new_request(index: int, prompt_len: int, output_len: int):
    """A waiting vLLM ``Request`` of ``prompt_len`` tokens that generates ``output_len``."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=output_len)
    return Request(f"req-{index}", [index] * prompt_len, params, None, arrival_time=0.0)


@dataclass
class Served:
    """What vLLM's manager did with a burst of identical requests."""

    num_blocks: int  # the pool, null block included
    most_running: int  # most requests running (admitted, unfinished) at once
    decode_blocks: int  # most block ids in use while all running requests decode, frees caught up
    preempted: bool  # a running request's allocation failed (vLLM would preempt there)


def serve(
    schedule: cap.Schedule,
    backend: str,
    memory_bytes: int,
    prompt_len: int,
    output_len: int,
    num_requests: int,
    max_model_len: int = 131072,
) -> Served:
    """Requests of ``prompt_len`` tokens arriving at once, scheduled as vLLM 0.33's
    ``AsyncScheduler`` does with chunked prefill (``BATCHED_TOKENS`` a step) and the default
    admission gate, until one has all its ``output_len`` tokens scheduled (before any finishes),
    nothing is admitted, or a running request cannot get its blocks.

    Each step (``Scheduler.schedule``): running requests first, in order, each its next prefill
    chunk or one decode token within the token budget (``allocate_slots(request, n)``), then
    waiting requests in order while ``allocate_slots(..., full_sequence_must_fit=True)`` admits
    them and budget remains; then ``_update_after_schedule`` (computed and in-flight tokens
    advance; a request past its prompt gets an output placeholder). The engine's batch queue holds
    two steps, so a step's output is processed (``update_from_output``: in-flight tokens settle,
    the sampled token is appended) only after the next step is scheduled: the sliding-window
    frees, which ``allocate_slots`` makes on the settled tokens, lag as on the server. Preemption
    is not mirrored: the run stops at the first failed running allocation and says so. Prefix
    caching is off: the requests stand for prompts that share no block."""
    from vllm.v1.request import RequestStatus

    manager = kv_manager(schedule, backend, memory_bytes, max_model_len)
    waiting = [new_request(i, prompt_len, output_len) for i in range(num_requests)]
    running: list = []
    in_flight: list = []  # the previous step's (request, tokens, sampled a token)
    most_running = decode_blocks = 0

    def result(preempted: bool = False) -> Served:
        num_blocks = manager.block_pool.num_gpu_blocks
        return Served(num_blocks, most_running, decode_blocks, preempted)

    while True:
        manager.new_step_starts()
        budget, scheduled = BATCHED_TOKENS, []
        for request in running:
            if budget == 0:
                break
            new = request.num_tokens_with_spec + request.num_output_placeholders
            new = min(new - request.num_computed_tokens, budget)
            assert new > 0
            if manager.allocate_slots(request, new) is None:
                return result(preempted=True)
            scheduled.append((request, new))
            budget -= new
        if running and all(r.num_output_tokens for r in running):  # the last chunks' frees done
            in_use = (
                manager.block_pool.num_gpu_blocks - 1 - manager.block_pool.get_num_free_blocks()
            )
            decode_blocks = max(decode_blocks, in_use)  # the null block is never free
        while budget > 0 and waiting:
            request = waiting[0]
            new = min(request.num_tokens, budget)
            blocks = manager.allocate_slots(
                request, new, full_sequence_must_fit=True, has_scheduled_reqs=bool(running)
            )
            if blocks is None:
                break
            running.append(waiting.pop(0))
            request.status = RequestStatus.RUNNING
            scheduled.append((request, new))
            budget -= new
        if not running:
            return result()
        most_running = max(most_running, len(running))
        for request, new in scheduled:
            request.num_computed_tokens += new
            request.num_in_flight_tokens += new
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders
            )
            if not request.is_prefill_chunk:
                request.num_output_placeholders += 1
        if any(r.num_output_tokens + r.num_output_placeholders >= output_len for r in running):
            return result()
        for request, new, sampled in in_flight:
            request.num_in_flight_tokens -= new
            if sampled:
                request.append_output_token_ids(0)
                request.num_output_placeholders -= 1
        in_flight = [(r, new, not r.is_prefill_chunk) for r, new in scheduled]


def admits(schedule: cap.Schedule, backend: str, prompt_len: int, free: int) -> bool:
    """Whether vLLM's manager, with exactly ``free`` free blocks (a pool with blocks taken out of
    it), admits a fresh request of ``prompt_len`` tokens: its first chunk's
    ``allocate_slots(..., full_sequence_must_fit=True)``, as the scheduler's waiting loop calls
    it."""
    manager = kv_manager(schedule, backend, (free + 2) * bytes_per_block(schedule, backend))
    manager.block_pool.get_new_blocks(manager.block_pool.get_num_free_blocks() - free)
    assert manager.block_pool.get_num_free_blocks() == free
    request = new_request(0, prompt_len, 16)
    new = min(prompt_len, BATCHED_TOKENS)
    return manager.allocate_slots(request, new, full_sequence_must_fit=True) is not None


@pytest.mark.parametrize("backend", ["vllm", "dsv4_nvfp4-nvfp4"])
@pytest.mark.parametrize(
    ("schedule", "prompt_len"),
    [("V4-Flash", 10001), ("V4-Flash", HEADLINE_PROMPT), ("V4-Pro", 100003)],
    ids=["flash-10001", "flash-129024", "pro-100003"],
)
def test_admission_blocks_are_what_vllms_manager_asks(backend, schedule, prompt_len):
    """vLLM's manager admits a fresh request with exactly :func:`capacity.admission_blocks` free
    blocks and refuses it with one fewer: every block of the prompt in the compressed caches'
    group, and in the sliding-window groups up to their cap (a 10,001-token prompt is below every
    cap, 100,003 and 129,024 tokens above them all; 10,001 and 100,003 end mid-block)."""
    layers = cap.SCHEDULES[schedule]
    need = cap.admission_blocks(layers, backend, prompt_len)
    assert admits(layers, backend, prompt_len, need)
    assert not admits(layers, backend, prompt_len, need - 1)


@pytest.mark.parametrize(("backend", "measured"), [("vllm", 1), ("dsv4_nvfp4-nvfp4", 7)])
def test_requests_at_once_is_what_vllms_manager_runs_at_7_gib(backend, measured):
    """7 GiB of KV, V4-Flash, 129,024-token prompts and 2,048 outputs: vLLM's manager, driven as
    its scheduler drives it, runs as many requests at once as the H200 server did (1 with vLLM's
    backend, whose admission takes 96% of its pool; 7 with NVFP4), never preempting, and
    :func:`capacity.requests_at_once` says so."""
    layers = cap.SCHEDULES["V4-Flash"]
    served = serve(layers, backend, HEADLINE_MEMORY, HEADLINE_PROMPT, 2048, measured + 3)
    assert not served.preempted
    assert served.most_running == measured
    predicted = cap.requests_at_once(
        layers, backend, HEADLINE_MEMORY, HEADLINE_PROMPT + 2048, output_len=2048
    )
    assert predicted == served.most_running


def check_requests_at_once_at_the_block_boundary(layers, backend, output_len, spare, k=3):
    """A pool of ``R + k D + spare`` blocks (R: what admitting a ``HEADLINE_PROMPT``-token
    prompt takes, vLLM's own; D: what vLLM's manager holds for one decoding request, measured
    with the request alone) runs ``k + spare`` requests at once in vLLM's manager, as
    :func:`capacity.requests_at_once` says."""
    prompt_len = HEADLINE_PROMPT
    need = cap.admission_blocks(layers, backend, prompt_len)
    price = bytes_per_block(layers, backend)
    alone = serve(layers, backend, 2 * need * price, prompt_len, output_len, 1)
    assert not alone.preempted and alone.most_running == 1
    # what decode_blocks_per_request counts for the whole context
    assert alone.decode_blocks == cap.decode_blocks_per_request(
        layers, backend, prompt_len + output_len
    )
    num_blocks = need + k * alone.decode_blocks + spare
    served = serve(layers, backend, num_blocks * price, prompt_len, output_len, k + 3)
    assert served.num_blocks == num_blocks
    assert not served.preempted
    assert served.most_running == k + spare
    predicted = cap.requests_at_once(
        layers, backend, num_blocks * price, prompt_len + output_len, output_len=output_len
    )
    assert predicted == served.most_running


@pytest.mark.parametrize("backend", ["vllm", "dsv4_nvfp4-nvfp4"])
@pytest.mark.parametrize("spare", [0, 1])
def test_requests_at_once_is_exact_at_the_block_boundary(backend, spare):
    """A pool of ``R + k D + spare`` blocks (R: what admitting the prompt takes; D: what vLLM's
    manager holds for one decoding request) runs ``k + spare`` requests at once: with none spare,
    the null block leaves the request after k decoding ones one block short. 256 outputs keep a
    decoding 129,024-token request in one 256-token block of its compressed caches, so from its
    second decode step on it holds D, whenever the next request is tried."""
    check_requests_at_once_at_the_block_boundary(cap.SCHEDULES["V4-Flash"], backend, 256, spare)


# DeepSeek-V4.1-Flash in vLLM's own V4.1 modes: fp8 on Hopper (FlashMLA) and nvfp4_ds_mla
# (mega attention, SM100 only).
V41_FLASH = cap.V41_SCHEDULES["V4.1-Flash"]
V41_MODES = [
    # (backend, --kv-cache-dtype, GPU capability family, vLLM's attention class there)
    ("vllm", "fp8", 90, "vllm.models.deepseek_v41.nvidia.flashmla.DeepseekV4FlashMLAAttention"),
    (
        "vllm-nvfp4_ds_mla",
        "nvfp4_ds_mla",
        100,
        "vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn.DeepseekV4MegaAttnAttention",
    ),
]


def real_v41_specs(kv_cache_dtype: str, family: int, layer_class_path: str, monkeypatch):
    """The KV cache specs a V4.1 server of the tiny V4.1 config hands vLLM's planner
    (``vllm.v1.worker.gpu.attn_utils.get_kv_cache_spec``: each cache's spec through its
    backend's ``customize_attention_spec``), on a GPU of capability ``family``: vLLM's own V4.1
    attention layers, built on the CPU (meta weights) as a 3-method subclass of vLLM's base
    carrying the backend classes and preferred record of ``layer_class_path``, with model
    runner V2 (so SWA bounded replay on, the GPU default) and the block size vLLM's platform
    picks for the layers' backends."""
    import importlib

    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    module, name = layer_class_path.rsplit(".", 1)
    served = getattr(importlib.import_module(module), name)

    Layer = vt.v41_base_layer(
        backend_cls=served.backend_cls,
        swa_backend_cls=served.swa_backend_cls,
        packed_kv_cache_dtype=served.packed_kv_cache_dtype,
    )

    monkeypatch.setattr(
        current_platform,
        "is_device_capability_family",
        lambda capability, device_id=0: capability == family,
    )
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    vt._distributed_ready()
    args = vt.engine_args(model=vt.tiny_v41_checkpoint(), kv_cache_dtype=kv_cache_dtype)
    config = args.create_engine_config()
    assert config.use_v2_model_runner
    hf_config = config.model_config.hf_config
    topk = torch.empty((8, hf_config.index_topk), dtype=torch.int32, device="meta")
    with (
        set_current_vllm_config(config),
        vt._cpu_events(),
        set_default_torch_dtype(torch.bfloat16),
        torch.device("meta"),
    ):
        for layer in range(hf_config.num_hidden_layers):
            Layer(config, prefix=f"model.layers.{layer}.attn", topk_indices_buffer=topk)
        backends = Platform._find_non_ssm_backends(config)
        block_size = Platform._preferred_block_size_for_backends(backends, 16, config)
        config.cache_config.block_size = block_size  # as the platform sets it after the build
        return get_kv_cache_spec(config)


@pytest.mark.parametrize(("backend", "kv_cache_dtype", "family", "layer_class"), V41_MODES)
def test_v41_specs_are_those_of_vllms_own_v41_layers(
    backend, kv_cache_dtype, family, layer_class, monkeypatch
):
    """capacity's V4.1 route (vLLM's spec methods on stand-ins) gives, cache by cache, in the
    same order, exactly the specs vLLM's own V4.1 layers of the tiny V4.1 config give
    (window-only, ratio-2 and ratio-1 layers; KV sources 1 and 3; index source 4 apart from
    them, which owns no key cache): block sizes, records, paddings, alignments, bounded replay,
    the compressor's ring."""
    real = real_v41_specs(kv_cache_dtype, family, layer_class, monkeypatch)
    tiny = cap.V41Schedule(vt.V41_RATIOS, vt.V41_KV_SOURCES, vt.V41_INDEX_SOURCES)
    config = cap._v41_planner_config(backend, vt.MAX_MODEL_LEN, vt.MAX_NUM_BATCHED_TOKENS)
    ours = cap.layer_specs(tiny, backend, config)
    assert list(ours) == list(real)
    assert ours == real
    windows = [spec for name, spec in real.items() if name.endswith(".swa_cache")]
    assert len(windows) == len(vt.V41_RATIOS)
    assert all(s.prefix_replay_tokens == vt.WINDOW and not s.prefix_cacheable for s in windows)
    assert not any(name.startswith("model.layers.4.attn.indexer") for name in real)


@pytest.mark.parametrize("max_model_len", [131072, 1048576])
def test_v41_flash_figures_are_the_hand_derived_ones(max_model_len):
    """V4.1-Flash at 60 GiB, by hand from the records (``--kv-cache-dtype fp8`` on Hopper:
    584 B window and compressed records, pages padded to 576 B, 64-token blocks;
    ``nvfp4_ds_mla`` on SM100: 528 B window and 288 B compressed records, pages padded to
    512 B, 128-token blocks; both: 32-token window pages, 132 B FP8 index keys, an 8-row fp32
    ring of 2 x 512 floats = 32768 B per ratio-2 source). Only KV sources 2, 8, 14 (ratio 2)
    and 20 (ratio 1) hold compressed rows, index keys and (ratio 2) a ring.

    fp8: window page 32 x 584 = 18688 -> 19008; compressed pages 32 x 584 -> 19008 (ratio 2),
    64 x 584 = 37376 -> 37440 (ratio 1); key pages 32 x 132 = 4224 -> 4608, 64 x 132 = 8448
    -> 8640. The compressed group (one block id = a page of each) is
    3 x (19008 + 4608) + 37440 + 8640 = 116928 B; vLLM fits floor(116928 / 19008) = 6
    windows per window group (7 groups: 6 x 19008 = 114048 B) and the 3 rings in one group
    (98304 B), so the widest is the compressed group: 116928 B per block id.

    nvfp4_ds_mla: window page 32 x 528 = 16896 (33 x 512); compressed pages 64 x 288 = 18432,
    128 x 288 = 36864; key pages 64 x 132 = 8448 -> 8704, 128 x 132 = 16896. Compressed group
    3 x (18432 + 8704) + 36864 + 16896 = 135168 B, which holds exactly 8 windows (5 groups of
    8 x 16896 = 135168 B, a tie), rings 98304 B. The window pages ask for a block stride of
    whole records of both kinds, lcm(528, 288) = 3168: 135168 -> 43 x 3168 = 136224 B.

    A request of L tokens takes in each window group cdiv(127 + 2 x 8192, 32) + 1 = 517
    blocks, cdiv(L, block) in the compressed group, 1 ring block: fp8 7 x 517 + L/64 + 1,
    nvfp4 5 x 517 + L/128 + 1. vLLM's tokens: int(floor(60 GiB / B) / blocks x L).
    At 131072: 550975 blocks / 5668 vs 472930 / 3610, 12,741,248 vs 17,171,158 tokens,
    1.3477x; at 1048576: / 20004 vs / 10778, 28,881,181 vs 46,010,674 tokens, 1.5931x (the
    windows' fixed share shrinks with L, and NVFP4's compressed bytes per token are 0.72x)."""
    memory = 60 * 2**30
    fp8_block = 3 * (19008 + 4608) + 37440 + 8640  # 116928
    nvfp4_group = 3 * (18432 + 8704) + 36864 + 16896  # 135168
    nvfp4_block = -(-nvfp4_group // 3168) * 3168  # 136224
    expected = {}
    for backend, block, tokens_per_block, window_groups in [
        ("vllm", fp8_block, 64, 7),
        ("vllm-nvfp4_ds_mla", nvfp4_block, 128, 5),
    ]:
        blocks = window_groups * 517 + max_model_len // tokens_per_block + 1
        num_blocks = memory // block
        tokens = int(num_blocks / blocks * max_model_len)
        expected[backend] = cap.Capacity(block, num_blocks, tokens, blocks, blocks * block)
        assert cap.capacity(V41_FLASH, backend, memory, max_model_len) == expected[backend]
        # the compressed group is the widest (a tie with the window groups for NVFP4)
        groups = cap.breakdown(V41_FLASH, backend, max_model_len)
        (compressed,) = [g for g in groups if "ratio-2 rows" in g.holds]
        assert compressed.bytes_per_block == max(g.bytes_per_block for g in groups)
        assert compressed.bytes_per_block == (fp8_block if backend == "vllm" else nvfp4_group)
    ratio = expected["vllm-nvfp4_ds_mla"].tokens / expected["vllm"].tokens
    assert round(ratio, 4) == {131072: 1.3477, 1048576: 1.5931}[max_model_len]


def test_v41_breakdown_holds_every_cache_once():
    """Each V4.1-Flash cache in one group, by kind: 40 windows, the 4 sources' compressed rows
    and index keys, 3 rings; the charged bytes sum to vLLM's bytes per request."""
    for backend in cap.V41_BACKENDS:
        groups = cap.breakdown(V41_FLASH, backend, 1048576)
        total = cap.capacity(V41_FLASH, backend, 60 * 2**30, 1048576)
        assert sum(g.charged_bytes for g in groups) == total.bytes_per_request
        counted: dict[str, int] = {}
        for group in groups:
            for part in group.holds.split(" + "):
                n, kind = part.split(" x ")
                counted[kind] = counted.get(kind, 0) + int(n)
        assert counted == {
            "window rows": 40,
            "ratio-2 rows": 3,
            "ratio-1 rows": 1,
            "ratio-2 indexer keys": 3,
            "ratio-1 indexer keys": 1,
            "ratio-2 compressor state": 3,
        }


def test_v41_backends_are_v41s():
    with pytest.raises(ValueError, match="backend must be one of"):
        cap.layer_specs(V41_FLASH, "dsv4_nvfp4-nvfp4", cap._planner_config("auto", 4096, 8192))
    with pytest.raises(ValueError, match="backend must be one of"):
        cap.capacity(V41_FLASH, "dsv4_nvfp4-fp8", MEMORY, 131072)


@pytest.mark.parametrize("backend", cap.V41_BACKENDS)
@pytest.mark.parametrize("prompt_len", [10001, HEADLINE_PROMPT])
def test_v41_admission_blocks_are_what_vllms_manager_asks(backend, prompt_len):
    """V4.1's scheduler gate is V4's (``full_sequence_must_fit``; bounded replay only rewinds
    prefix-cache hits): vLLM's manager admits a fresh V4.1-Flash request with exactly
    :func:`capacity.admission_blocks` free blocks, the ring groups asking for one block, and
    refuses it with one fewer."""
    need = cap.admission_blocks(V41_FLASH, backend, prompt_len)
    assert admits(V41_FLASH, backend, prompt_len, need)
    assert not admits(V41_FLASH, backend, prompt_len, need - 1)


@pytest.mark.parametrize("backend", cap.V41_BACKENDS)
@pytest.mark.parametrize("spare", [0, 1])
def test_v41_requests_at_once_is_exact_at_the_block_boundary(backend, spare):
    """As for V4 (see test_requests_at_once_is_exact_at_the_block_boundary): a pool of
    ``R + k D + spare`` blocks runs ``k + spare`` V4.1-Flash requests at once in vLLM's manager,
    as :func:`capacity.requests_at_once` says. 64 outputs keep a decoding 129,024-token request
    (a whole number of 64- and 128-token blocks) in one block of its compressed caches."""
    check_requests_at_once_at_the_block_boundary(V41_FLASH, backend, 64, spare)


def test_main_prints_the_v41_rows(capsys):
    """``python -m dsv4_attn.vllm_glue.capacity --breakdown`` prints V4.1-Flash's rows (bytes
    per block id, tokens, the ratio to vLLM's fp8 mode) and its groups."""
    cap.main(["--max-model-len", "131072", "--breakdown"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("V4.1-Flash")]
    assert [row[:5] for row in rows] == [
        ["V4.1-Flash", "131072", "vllm", "116928", "12,741,248"],
        ["V4.1-Flash", "131072", "vllm-nvfp4_ds_mla", "136224", "17,171,158"],
    ]
    assert [row[-1] for row in rows] == ["1.000", "1.348"]
    assert any(line.endswith("3 x ratio-2 compressor state") for line in lines)
