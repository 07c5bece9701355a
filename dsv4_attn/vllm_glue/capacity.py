"""KV-cache capacity of DeepSeek-V4 layer schedules in vLLM's own accounting, per backend.

vLLM 0.33 packs DeepSeek-V4's caches into groups (SWA caches, compressed caches with the CSA
indexer's keys, and the compressors' states), and one block id costs the bytes of the *widest*
group whichever group holds it; a request reserves a number of block ids per group (a whole
context's worth for the compressed caches, a window's worth for the SWA caches and states).
So the capacity follows the widest group, not the rows alone. :func:`capacity` builds every
layer's KV spec as a server of each backend would (vLLM's own FlashMLA path, ``DSV4_NVFP4`` with
fp8_ds_mla rows, ``DSV4_NVFP4`` with NVFP4 rows and its compressor-state rule of
:mod:`.compressor_state`) and runs vLLM's planning functions on them.

How many requests of a given length a server *runs* at once is another figure
(:func:`requests_at_once`): vLLM admits a new request only while the free blocks hold its
admission reservation (:func:`admission_blocks`, nearly all of it the compressor states' window
groups sized for two batches in flight), and a running request then holds only its windows and
compressed rows (:func:`decode_blocks_per_request`). Near one reservation's worth of memory the
1.40x blocks of NVFP4 run several times the requests (7 against 1 at 7 GiB and 128K tokens).

DeepSeek-V4.1 (:class:`V41Schedule`, :data:`V41_SCHEDULES`) is a variant of the same accounting:
only its KV-source layers own a compressed cache (and, those that are index sources too, the
indexer's key cache), a ratio-2 source's compressor keeps a ring of one block per request
(``CircularBufferSpec``), ratio 1 none, and every layer's window cache takes SWA bounded replay
(``prefix_replay_tokens`` = the window, ``prefix_cacheable=False``: vLLM's default on GPUs with
its model runner V2; no figure here depends on it). Its backends (:data:`V41_BACKENDS`) are
vLLM's own two modes: ``vllm``, its Hopper path with ``--kv-cache-dtype fp8`` (584 B
fp8_ds_mla records for the window and the compressed caches, 64-token blocks), and
``vllm-nvfp4_ds_mla``, DeepSeek's mode, which vLLM runs on SM100 only (the window in 528 B MXFP8
records, the compressed caches in 288 B NVFP4 records, 128-token blocks), planned here as an
SM100 server plans it.

``python -m dsv4_attn.vllm_glue.capacity`` prints the V4-Flash, V4-Pro and V4.1-Flash figures; with
``--breakdown`` also, per cache group, what it holds, its bytes per block, the blocks a
``max_model_len`` request takes and the bytes that costs against the bytes it holds
(:func:`breakdown`): the difference is what the widest group's block price adds.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch
from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
from vllm.models.deepseek_v4.compressor import CompressorStateCache
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
from vllm.v1.core import kv_cache_planning, kv_cache_utils
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheSpec

from dsv4_attn.kernels.precompile import CACHE_BLOCK_TOKENS, SWA_BLOCK_TOKENS
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.layer_kind import Family, layer_kinds
from dsv4_attn.vllm_glue import kv_spec
from dsv4_attn.vllm_glue.compressor_state import state_dtype

__all__ = [
    "BACKENDS",
    "SCHEDULES",
    "V41_BACKENDS",
    "V41_SCHEDULES",
    "Capacity",
    "GroupCost",
    "V41Schedule",
    "admission_blocks",
    "backends_of",
    "breakdown",
    "capacity",
    "decode_blocks_per_request",
    "layer_specs",
    "requests_at_once",
]

# compress_ratios of the main layers (1: sliding window only; 4: CSA; 128: HCA).
SCHEDULES: dict[str, list[int]] = {
    # 43 layers: two sliding-only, then CSA and HCA alternating (21 CSA, 20 HCA).
    "V4-Flash": [1, 1] + [4 if i % 2 == 0 else 128 for i in range(2, 43)],
    # 61 layers: HCA, HCA, then CSA and HCA alternating (30 CSA, 31 HCA).
    "V4-Pro": [128, 128] + [4 if i % 2 == 0 else 128 for i in range(2, 61)],
}
BACKENDS = ("vllm", "dsv4_nvfp4-fp8", "dsv4_nvfp4-nvfp4", "dsv4_nvfp4-split")
"""vLLM's own FlashMLA path; DSV4_NVFP4 with fp8_ds_mla rows, with NVFP4 rows, and split: the
window in fp8_ds_mla rows (vLLM's layout), the compressed caches in NVFP4 rows (a candidate
cache mode, accounted here before it is built)."""
"""vLLM's own backend (fp8_ds_mla), DSV4_NVFP4 with ``--kv-cache-dtype fp8``, and with NVFP4."""

_WINDOW = 128
_INDEXER_HEAD = 128 + 4  # fp8 keys and their scale
_INDEXER_DIM = 128


@dataclass(frozen=True)
class V41Schedule:
    """A DeepSeek-V4.1 model's layers as its KV caches see them (its ``config.json`` fields).

    Attributes:
        compress_ratios: per main layer, 0 (window only), 1 (one compressed entry per
            position) or 2 (one per pair of positions).
        kv_sources: ``kv_source_layer_ids``, the only layers with a compressed cache and a
            compressor; a compressed layer reads the newest source at or below it.
        index_sources: ``index_source_layer_ids``, the layers with an indexer; those that are
            KV sources too own the indexer's key cache, the others write their KV source's.
    """

    compress_ratios: tuple[int, ...]
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]


V41_SCHEDULES: dict[str, V41Schedule] = {
    # 40 layers: two window-only, 18 of ratio 2 (KV sources 2, 8, 14), 20 of ratio 1 (source
    # 20). vLLM holds no V4.1-Flash config. Its code fixes index sources 2 (the first
    # compressed layer needs one at or below it, and a window-only layer cannot hold an
    # indexer), 24, 28, 32 and 36 (the ratio-1 indexers after the candidate source, named in
    # nvidia/model.py) and so 20 (their KV source, whose key cache they write); 8 and 14 make
    # the published eight. Only the KV sources among them own a key cache: any list holding
    # 2, 8, 14 and 20 (index sources = KV sources included) gives the same caches.
    "V4.1-Flash": V41Schedule(
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_sources=(2, 8, 14, 20),
        index_sources=(2, 8, 14, 20, 24, 28, 32, 36),
    ),
}
V41_BACKENDS = ("vllm", "vllm-nvfp4_ds_mla")
"""vLLM's own V4.1 modes: ``--kv-cache-dtype fp8`` on Hopper (its FlashMLA layer), and
``--kv-cache-dtype nvfp4_ds_mla`` (its mega-attention layer, SM100 only)."""

Schedule = list[int] | V41Schedule
"""A V4 schedule (its compress ratios) or a V4.1 one."""


@dataclass(frozen=True)
class _V41Mode:
    kv_cache_dtype: str  # --kv-cache-dtype
    gpu_family: int  # the compute capability family vLLM runs the mode on
    block_size: int  # cache_config.block_size there: the least size all its backends take
    mega: bool  # its attention class: mega attention, else FlashMLA


_V41_MODES = {
    "vllm": _V41Mode("fp8", 90, 64, mega=False),
    "vllm-nvfp4_ds_mla": _V41Mode("nvfp4_ds_mla", 100, 128, mega=True),
}
_V41_SPECULATIVE_TOKENS = 0  # no drafter: the compressor's ring holds max(8, 2) rows


def backends_of(schedule: Schedule) -> tuple[str, ...]:
    """The backends :func:`capacity` plans ``schedule`` for (V4's or V4.1's)."""
    return V41_BACKENDS if isinstance(schedule, V41Schedule) else BACKENDS


@contextmanager
def _gpu_family(family: int) -> Iterator[None]:
    """vLLM's platform answering as a GPU of compute capability ``family`` (90: Hopper, 100:
    SM100) where V4.1's cache code asks (``is_device_capability_family``: the window record,
    the indexer's page alignment, the backends' kernel block sizes), whatever this host is."""
    from vllm.platforms import current_platform

    def is_family(capability: int, device_id: int = 0) -> bool:
        return capability == family

    with mock.patch.object(current_platform, "is_device_capability_family", is_family):
        yield


def _v41_layer_class(mode: _V41Mode):
    """vLLM's attention class of ``mode``: its backend, its window cache's backend and its
    preferred packed record are class attributes."""
    if mode.mega:
        from vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn import (
            DeepseekV4MegaAttnAttention,
        )

        return DeepseekV4MegaAttnAttention
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

    return DeepseekV4FlashMLAAttention


def _v41_layer_specs(schedule: V41Schedule, backend: str, config) -> dict[str, KVCacheSpec]:
    """Every cache layer's spec of a V4.1 server of ``backend``, named and ordered as vLLM
    registers them, each as vLLM's worker hands it on (``customize_attention_spec`` with the
    cache's backend). vLLM's own spec and backend methods run on stand-ins holding what each
    cache's constructor sets (``models/deepseek_v41/attention.py``, ``compressor.py``) for a
    server without a drafter, with SWA bounded replay on."""
    from vllm.models.deepseek_v41 import attention as v41
    from vllm.models.deepseek_v41.compressor import CompressorStateCache as RingCache
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.worker.utils import customize_attention_spec

    mode = _V41_MODES[backend]
    layer_class = _v41_layer_class(mode)
    cache = config.cache_config
    specs: dict[str, KVCacheSpec] = {}

    def add(name: str, cache_class: type, module: SimpleNamespace) -> None:
        spec = cache_class.get_kv_cache_spec(module, config)
        specs[name] = customize_attention_spec(cache_class.get_attn_backend(module), spec)

    with _gpu_family(mode.gpu_family):
        # Writes the record's name back to cache_config, as the layers do.
        cache_dtype, torch_dtype = v41._resolve_dsv4_kv_cache_dtype(
            layer_class.use_fp8_ds_mla_layout,
            mode.kv_cache_dtype,
            cache,
            layer_class.packed_kv_cache_dtype.fget(None),
        )
        mxfp8 = v41._use_v41_mxfp8_kv_record()
        swa_bytes = 528 if mxfp8 else 584
        compressed_bytes = 288 if cache_dtype == "nvfp4_ds_mla" else swa_bytes
        if cache_dtype == "nvfp4_ds_mla" and not mxfp8:
            raise ValueError("nvfp4_ds_mla needs the V4.1 KV records, which only SM100 has")
        alignment = 512 if mxfp8 else 576
        index_head = v41._indexer_k_cache_head_dim(_INDEXER_DIM, dsa_indexer_uses_fp4(config))
        ring_rows = max(8, 1 << (_V41_SPECULATIVE_TOKENS + 2 - 1).bit_length())
        ratios = schedule.compress_ratios
        kinds = layer_kinds(
            Family.V41, ratios, len(ratios), schedule.kv_sources, schedule.index_sources
        )
        for kind in kinds:
            prefix, ratio = f"model.layers.{kind.layer_id}.attn", kind.compress_ratio
            owns = kind.owns_compressed  # a KV source: it registers its caches
            if owns:
                attention = SimpleNamespace(
                    is_kv_source=True,
                    kv_cache_dtype=cache_dtype,
                    kv_cache_torch_dtype=torch_dtype,
                    head_dim=HEAD_DIM,
                    compress_ratio=ratio,
                    kv_page_alignment=alignment,
                    compressed_bytes_per_token=compressed_bytes,
                    backend_cls=layer_class.backend_cls,
                )
                add(prefix, v41.DeepseekV4Attention, attention)
            if owns and kind.layer_id in schedule.index_sources:
                indexer = SimpleNamespace(
                    cache_config=cache,
                    head_dim=index_head,
                    dtype=torch.uint8,
                    compress_ratio=ratio,
                    sparse_logits=config.attention_config.indexer_sparse_logits,
                    rocm_mxfp4=False,
                )
                add(f"{prefix}.indexer.k_cache", v41.DeepseekV4IndexerCache, indexer)
            swa = SimpleNamespace(
                cache_config=cache,
                backend_cls=layer_class.swa_backend_cls,
                bounded_replay=True,
                block_size=32,
                head_dim=HEAD_DIM,
                dtype=torch_dtype,
                window_size=_WINDOW,
                packed_bytes_per_token=swa_bytes,
                packed_page_alignment=alignment,
                packed_block_stride_alignment=(
                    math.lcm(swa_bytes, compressed_bytes) if mxfp8 else None
                ),
            )
            add(f"{prefix}.swa_cache", DeepseekV4SWACache, swa)
            if owns and ratio > 1:  # the compressor's ring of the open pair's rows
                ring = SimpleNamespace(
                    block_size=ring_rows, state_dim=2 * HEAD_DIM, dtype=torch.float32
                )
                add(f"{prefix}.compressor.state_cache", RingCache, ring)
    return specs


@dataclass(frozen=True)
class Capacity:
    """One backend's KV capacity for one schedule and configuration."""

    bytes_per_block: int  # what one block id costs (the widest group)
    num_blocks: int
    tokens: int  # vLLM's "KV cache size" at this memory (max_model_len x concurrency)
    blocks_per_request: int  # block ids a max_model_len request reserves, all groups
    bytes_per_request: int


@dataclass(frozen=True)
class GroupCost:
    """One of vLLM's KV cache groups and what a ``max_model_len`` request costs in it."""

    holds: str  # the caches of its layers, e.g. "20 x HCA rows + 21 x CSA rows"
    page_bytes: tuple[int, ...]  # distinct page sizes of its layers' caches
    bytes_per_block: int  # its own: the sum of its layers' pages
    blocks_per_request: int
    needed_bytes: int  # blocks_per_request x bytes_per_block: what its pages hold
    charged_bytes: int  # blocks_per_request x the widest group's bytes per block


def _planner_config(
    cache_dtype: str,
    max_model_len: int,
    max_num_batched_tokens: int,
    block_size: int = CACHE_BLOCK_TOKENS,
    attention_config=None,
):
    """The fields of a VllmConfig that vLLM's KV planning reads (single GPU, no context
    parallelism, async scheduling: two batches of tokens in flight). ``attention_config``
    defaults to one without HiSparse (all the planner reads of it)."""
    from vllm.config.cache import _layout_from_name

    if attention_config is None:
        attention_config = SimpleNamespace(hisparse_config=None)
    cache = SimpleNamespace(
        cache_dtype=cache_dtype,
        block_size=block_size,
        num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None,
        get_resolved_kv_cache_layout=lambda: _layout_from_name("BLHNC"),
    )
    return SimpleNamespace(
        cache_config=cache,
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=max_num_batched_tokens
        ),
        attention_config=attention_config,
        model_config=SimpleNamespace(max_model_len=max_model_len, supports_kv_cache_grouping=False),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1),
        max_in_flight_tokens=2 * max_num_batched_tokens,
    )


def _state_spec(compress_ratio: int, head_dim: int, dtype: torch.dtype, config) -> KVCacheSpec:
    coff = 1 + (compress_ratio == 4)
    state = SimpleNamespace(
        block_size=4 if compress_ratio == 4 else 8,
        state_dim=2 * coff * head_dim,
        dtype=dtype,
        sliding_window=coff * compress_ratio,
    )
    return CompressorStateCache.get_kv_cache_spec(state, config)


def layer_specs(schedule: Schedule, backend: str, config) -> dict[str, KVCacheSpec]:
    """Every cache layer's spec, named as vLLM registers them, for ``backend`` (one of
    :func:`backends_of` ``schedule``); ``config`` as :func:`_planner_config` builds it (for
    V4.1, :func:`_v41_planner_config`)."""
    if backend not in backends_of(schedule):
        raise ValueError(f"backend must be one of {backends_of(schedule)}, got {backend!r}")
    if isinstance(schedule, V41Schedule):
        return _v41_layer_specs(schedule, backend, config)
    nvfp4 = backend == "dsv4_nvfp4-nvfp4"  # the window in NVFP4 rows
    compressed_nvfp4 = nvfp4 or backend == "dsv4_nvfp4-split"
    fmt = KVFormat.NVFP4 if compressed_nvfp4 else KVFormat.FP8_DS_MLA
    specs: dict[str, KVCacheSpec] = {}
    for i, ratio in enumerate(schedule):
        prefix = f"model.layers.{i}.self_attn"
        if ratio == 4:  # the indexer's keys and its compressor's state (vLLM's, fp32)
            indexer = SimpleNamespace(
                cache_config=config.cache_config,
                head_dim=_INDEXER_HEAD,
                dtype=torch.uint8,
                compress_ratio=4,
            )
            specs[f"{prefix}.indexer.k_cache"] = DeepseekV4IndexerCache.get_kv_cache_spec(
                indexer, config
            )
            specs[f"{prefix}.indexer.compressor.state_cache"] = _state_spec(
                4, _INDEXER_DIM, torch.float32, config
            )
        if nvfp4:
            specs[f"{prefix}.swa_cache"] = kv_spec.swa_cache_spec(SWA_BLOCK_TOKENS, _WINDOW)
        else:
            swa = SimpleNamespace(
                cache_config=config.cache_config,
                bounded_replay=False,
                block_size=SWA_BLOCK_TOKENS,
                head_dim=HEAD_DIM,
                dtype=torch.uint8,
                window_size=_WINDOW,
                packed_bytes_per_token=584,
                packed_page_alignment=576,
                packed_block_stride_alignment=None,
            )
            specs[f"{prefix}.swa_cache"] = DeepseekV4SWACache.get_kv_cache_spec(swa, config)
        if ratio > 1:
            if compressed_nvfp4:
                specs[prefix] = kv_spec.compressed_cache_spec(CACHE_BLOCK_TOKENS, ratio)
            else:
                attention = SimpleNamespace(
                    compress_ratio=ratio,
                    kv_cache_dtype="fp8_ds_mla",
                    head_dim=HEAD_DIM,
                    kv_cache_torch_dtype=torch.uint8,
                )
                specs[prefix] = DeepseekV4Attention.get_kv_cache_spec(attention, config)
            dtype = state_dtype(fmt, ratio, HEAD_DIM) if backend != "vllm" else torch.float32
            specs[f"{prefix}.compressor.state_cache"] = _state_spec(ratio, HEAD_DIM, dtype, config)
    return specs


def _v41_planner_config(backend: str, max_model_len: int, max_num_batched_tokens: int):
    """:func:`_planner_config` of a V4.1 server of ``backend``: its ``--kv-cache-dtype``, its
    GPU's block size and vLLM's default attention config (the indexer's FP8 keys)."""
    from vllm.config.attention import AttentionConfig

    if backend not in V41_BACKENDS:
        raise ValueError(f"backend must be one of {V41_BACKENDS}, got {backend!r}")
    mode = _V41_MODES[backend]
    return _planner_config(
        mode.kv_cache_dtype,
        max_model_len,
        max_num_batched_tokens,
        block_size=mode.block_size,
        attention_config=AttentionConfig(),
    )


def _groups(schedule: Schedule, backend: str, max_model_len: int, max_num_batched_tokens: int):
    """The planner config and vLLM's KV cache groups of ``backend``'s layers."""
    if isinstance(schedule, V41Schedule):
        config = _v41_planner_config(backend, max_model_len, max_num_batched_tokens)
    else:
        cache_dtype = "auto" if backend == "dsv4_nvfp4-nvfp4" else "fp8_ds_mla"
        config = _planner_config(cache_dtype, max_model_len, max_num_batched_tokens)
    groups = kv_cache_planning.get_kv_cache_groups(config, layer_specs(schedule, backend, config))
    return config, groups


def capacity(
    schedule: Schedule,
    backend: str,
    memory_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int = 8192,
) -> Capacity:
    """vLLM's KV capacity of ``schedule`` for ``backend`` with ``memory_bytes`` of KV cache."""
    config, groups = _groups(schedule, backend, max_model_len, max_num_batched_tokens)
    kv_config = kv_cache_planning.get_kv_cache_config_from_groups(config, groups, memory_bytes)
    tokens, _ = kv_cache_utils.get_kv_cache_capacity(config, kv_config)
    bytes_per_block = kv_cache_planning._get_kv_cache_bytes_per_block(
        groups, config.cache_config.get_resolved_kv_cache_layout()
    )
    per_request = sum(
        math.ceil(g.kv_cache_spec.max_memory_usage_bytes(config) / g.kv_cache_spec.page_size_bytes)
        for g in groups
    )
    return Capacity(
        bytes_per_block, kv_config.num_blocks, tokens, per_request, per_request * bytes_per_block
    )


def _window_spec(group):
    """The group's per-layer spec and its sliding window (None for a full-length group)."""
    spec = kv_cache_planning._get_per_layer_spec(group, group.layer_names[0])
    return spec, getattr(spec, "sliding_window", None)


def decode_blocks_per_request(
    schedule: Schedule,
    backend: str,
    context_len: int,
    max_model_len: int = 131072,
    max_num_batched_tokens: int = 8192,
) -> int:
    """Block ids one decoding request of ``context_len`` tokens holds, all groups: a
    sliding-window group (window rows, compressor states) only the blocks its window spans
    (vLLM frees the blocks behind it), ``cdiv(window - 1 + retained, block) + 1``; a full
    group (compressed rows, indexer keys) every block of the context; a ring group (V4.1's
    compressor states) its one block."""
    _, groups = _groups(schedule, backend, max_model_len, max_num_batched_tokens)
    blocks = 0
    for group in groups:
        spec, window = _window_spec(group)
        if isinstance(spec, CircularBufferSpec):
            blocks += 1
        elif window:
            retained = window - 1 + getattr(spec, "extra_retained_tokens", 0)
            blocks += -(-retained // spec.block_size) + 1
        else:
            blocks += -(-context_len // spec.block_size)
    return blocks


def admission_blocks(
    schedule: Schedule,
    backend: str,
    prompt_len: int,
    max_model_len: int = 131072,
    max_num_batched_tokens: int = 8192,
) -> int:
    """Free block ids vLLM's scheduler needs to admit a new request of ``prompt_len`` tokens.

    By default (``scheduler_reserve_full_isl``) a waiting request is admitted only if the free
    blocks hold its whole prompt now: every block of it in a full group, and in a
    sliding-window group up to that group's admission cap, its window plus two batches of
    tokens in flight (``max_admission_blocks_per_request``: 4,099 blocks for the CSA
    compressor states at 8192 batched tokens, whatever the prompt beyond 16K tokens); in a
    ring group (V4.1's compressor states) its one block. Running requests are not held to
    it."""
    config, groups = _groups(schedule, backend, max_model_len, max_num_batched_tokens)
    blocks = 0
    for group in groups:
        spec, window = _window_spec(group)
        need = -(-min(prompt_len, max_model_len) // spec.block_size)
        if isinstance(spec, CircularBufferSpec):
            need = 1
        elif window:
            cap = spec.max_admission_blocks_per_request(config.max_in_flight_tokens, max_model_len)
            need = min(need, cap)
        blocks += need
    return blocks


def requests_at_once(
    schedule: Schedule,
    backend: str,
    memory_bytes: int,
    context_len: int,
    output_len: int = 0,
    max_model_len: int = 131072,
    max_num_batched_tokens: int = 8192,
) -> int:
    """Requests of ``context_len`` tokens (``output_len`` of them generated) that
    ``memory_bytes`` of KV cache runs at once on a vLLM server: a prediction, which
    ``dsv4_attn.e2e.capacity_finder`` measures.

    A request is admitted while the free blocks hold its prompt's :func:`admission_blocks`
    (R), and then holds :func:`decode_blocks_per_request` (D) while it decodes; vLLM keeps one
    block of its pool as the null block. With N blocks, ``k`` decoding requests leave room
    for one more while ``N - 1 - k * D >= R``: at most ``1 + (N - 1 - R) // D`` run at once
    (``(N - 1) // D`` if R were no bound). At 7 GiB and 128K tokens this is 1 for vLLM's
    backend (R takes 96% of its 7,499 blocks) and 7 for NVFP4 (68% of 10,523), what vLLM's own
    KV cache manager runs (tests/test_vllm_glue_capacity.py) and what the servers ran.

    A lower bound by at most one where the margin is a few blocks: requests still early in
    their decode hold a few blocks less than D (vLLM's manager runs 10 NVFP4 requests at 8 GiB
    where this says 9). Where R < D (short prompts, long outputs) vLLM admits more than
    ``(N - 1) // D`` and preempts later: this counts those that fit without preemption."""
    total = capacity(schedule, backend, memory_bytes, max_model_len, max_num_batched_tokens)
    admission = admission_blocks(
        schedule, backend, context_len - output_len, max_model_len, max_num_batched_tokens
    )
    per_request = decode_blocks_per_request(
        schedule, backend, context_len, max_model_len, max_num_batched_tokens
    )
    free = total.num_blocks - 1  # the null block
    if free < admission:
        return 0
    return min(1 + (free - admission) // per_request, free // per_request)


def _cache_kind(name: str, schedule: Schedule) -> str:
    """What the cache ``name`` holds, e.g. "CSA rows" (V4) or "ratio-2 indexer keys" (V4.1,
    whose key pages differ by ratio)."""
    layer = int(name.split(".")[2])
    if isinstance(schedule, V41Schedule):
        ratio = schedule.compress_ratios[layer]
        kind = f"ratio-{ratio}"
        if name.endswith(".indexer.k_cache"):
            return f"{kind} indexer keys"
    else:
        ratio = schedule[layer]
        kind = {1: "window-only", 4: "CSA", 128: "HCA"}.get(ratio, f"ratio {ratio}")
    if name.endswith(".swa_cache"):
        return "window rows"
    if name.endswith(".indexer.k_cache"):
        return "indexer keys"
    if name.endswith(".indexer.compressor.state_cache"):
        return "indexer compressor state"
    if name.endswith(".compressor.state_cache"):
        return f"{kind} compressor state"
    return f"{kind} rows"


def breakdown(
    schedule: Schedule,
    backend: str,
    max_model_len: int,
    max_num_batched_tokens: int = 8192,
) -> list[GroupCost]:
    """Per KV cache group of ``backend``'s layers: what one ``max_model_len`` request needs and
    what vLLM charges for it (every block id at the widest group's bytes per block). The
    charged bytes sum to :attr:`Capacity.bytes_per_request`."""
    config, groups = _groups(schedule, backend, max_model_len, max_num_batched_tokens)
    widest = kv_cache_planning._get_kv_cache_bytes_per_block(
        groups, config.cache_config.get_resolved_kv_cache_layout()
    )
    costs = []
    for group in groups:
        spec = group.kv_cache_spec
        blocks = math.ceil(spec.max_memory_usage_bytes(config) / spec.page_size_bytes)
        layer_specs_ = [kv_cache_planning._get_per_layer_spec(group, n) for n in group.layer_names]
        own = sum(s.page_size_bytes for s in layer_specs_)
        kinds: dict[str, int] = {}
        for name in group.layer_names:
            kind = _cache_kind(name, schedule)
            kinds[kind] = kinds.get(kind, 0) + 1
        holds = " + ".join(f"{n} x {kind}" for kind, n in sorted(kinds.items()))
        pages = tuple(sorted({s.page_size_bytes for s in layer_specs_}))
        costs.append(GroupCost(holds, pages, own, blocks, blocks * own, blocks * widest))
    return costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.vllm_glue.capacity")
    parser.add_argument("--memory-gib", type=float, default=60.0, help="KV cache memory")
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--context",
        type=int,
        nargs="*",
        default=[],
        help="also the requests of these context lengths the memory holds while they decode",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also each cache group's bytes per request, needed and charged",
    )
    args = parser.parse_args(argv)
    memory = int(args.memory_gib * 2**30)
    print(
        f"{'schedule':10} {'max len':>9} {'backend':17} {'B/block':>9} {'tokens':>13} "
        f"{'GB/request':>10} {'vs vllm':>7}"
    )
    schedules: dict[str, Schedule] = {**SCHEDULES, **V41_SCHEDULES}
    for name, schedule in schedules.items():
        for length in args.max_model_len:
            # "vllm": vLLM's own backend (for V4.1, its fp8 mode)
            base = capacity(schedule, "vllm", memory, length, args.max_num_batched_tokens)
            for backend in backends_of(schedule):
                c = capacity(schedule, backend, memory, length, args.max_num_batched_tokens)
                print(
                    f"{name:10} {length:>9} {backend:17} {c.bytes_per_block:>9} "
                    f"{c.tokens:>13,} {c.bytes_per_request / 1e9:>10.2f} "
                    f"{c.tokens / base.tokens:>7.3f}"
                )
                for context in args.context:
                    held = requests_at_once(
                        schedule,
                        backend,
                        memory,
                        context,
                        max_model_len=length,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                    )
                    blocks = decode_blocks_per_request(
                        schedule, backend, context, length, args.max_num_batched_tokens
                    )
                    print(f"    {context:>9}-token requests: {held} at once ({blocks} blocks each)")
                if args.breakdown:
                    for g in breakdown(schedule, backend, length, args.max_num_batched_tokens):
                        print(
                            f"    {g.bytes_per_block:>9} B/block {g.blocks_per_request:>7} "
                            f"blocks  needs {g.needed_bytes / 1e9:6.3f} GB  charged "
                            f"{g.charged_bytes / 1e9:6.3f} GB  pages {g.page_bytes}  "
                            f"{g.holds}"
                        )


if __name__ == "__main__":
    main()
