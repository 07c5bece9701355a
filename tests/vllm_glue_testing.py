"""Shared set-up for the vLLM-glue tests: a tiny DeepSeek-V4 checkpoint, real vLLM configs, real
attention layers on CPU with KV caches laid out by vLLM's own planner, and random batches.

Everything expensive is built once per process (``functools.cache``): vLLM's import (~6 s), an
engine config per ``--kv-cache-dtype``, the distributed state, the layers.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tests.temp_dirs import temp_dir

# vLLM resolves its platform on first use; without a GPU it must be told to use the CPU one.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The backend refuses to serve where its Hopper kernels cannot run, unless told to use its torch
# fallback: these CPU tests do (explicitly; the refusal itself is tested in test_vllm_glue_support).
os.environ.setdefault("DSV4_ATTN_ALLOW_FALLBACK", "1")

# The tiny model's layers: one of each attention kind (SWA-only, CSA ratio 4, HCA ratio 128).
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
RATIOS = (1, 4, 128)
NUM_HEADS = 8
INDEX_TOPK = 16
MAX_MODEL_LEN = 4096
MAX_NUM_BATCHED_TOKENS = 2048
SWA_BLOCK = 64
CACHE_BLOCK = 256  # tokens per compressed-cache block
BUILD_BLOCK = 16  # what cache_config.block_size holds while vLLM's CUDA worker builds the layers
WINDOW = 128
KV_CACHE_BYTES = 256 << 20  # what the tests give vLLM's KV-cache planner (CPU memory)


def tiny_config_dict() -> dict:
    """A DeepSeek-V4 ``config.json`` (HF format, as vLLM 0.33.0 reads it) small enough for CPU."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 1024,
        "hidden_size": 256,
        "num_hidden_layers": len(LAYER_TYPES),
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": 1,
        "q_lora_rank": 128,
        "o_lora_rank": 64,
        "o_groups": 2,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": INDEX_TOPK,
        "sliding_window": WINDOW,
        "layer_types": list(LAYER_TYPES),
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "n_shared_experts": 1,
        "max_position_embeddings": MAX_MODEL_LEN,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "torch_dtype": "bfloat16",
    }


def _config_only_checkpoint(prefix: str, config: dict) -> str:
    """A new directory holding ``config`` as ``config.json`` (no weights: load_format dummy)."""
    path = temp_dir(prefix)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


@functools.cache
def tiny_checkpoint() -> str:
    """Directory holding the tiny checkpoint's ``config.json`` (no weights: load_format dummy)."""
    return _config_only_checkpoint("dsv4_tiny_", tiny_config_dict())


# A tiny DeepSeek-V4.1: window-only, ratio-2 and ratio-1 layers, two KV sources (layers 1 and 3)
# and index sources 1, 3 and 4, so layer 5 reads the compressed cache of one source and the
# indexer of another (an index source that is no KV source keeps its keys in its KV source's
# indexer cache, so every KV source is an index source too). Its ratio-1 layers read ratio-2
# caches, which vLLM's config path and layers accept but a served model never has (the served
# tiny V4.1 is tiny_model.V41_RATIOS).
V41_RATIOS = (0, 2, 1, 2, 1, 1)
V41_KV_SOURCES = (1, 3)
V41_INDEX_SOURCES = (1, 3, 4)


def tiny_v41_config_dict() -> dict:
    """A DeepSeek-V4.1 ``config.json`` (text model nested, no vision tower) of the tiny V4's
    sizes, by the package's V4-to-V4.1 rule (``tiny_model.v41_config``)."""
    from dsv4_attn.e2e.tiny_model import v41_config

    text = tiny_config_dict()
    text["mlp_layer_types"] = ["hash_moe"] + ["moe"] * (len(V41_RATIOS) - 1)
    return v41_config(text, V41_RATIOS, V41_KV_SOURCES, V41_INDEX_SOURCES)


@functools.cache
def tiny_v41_checkpoint() -> str:
    """Directory holding the tiny V4.1 checkpoint's ``config.json`` (load_format dummy)."""
    return _config_only_checkpoint("dsv41_tiny_", tiny_v41_config_dict())


def v41_base_layer(**class_attrs) -> type:
    """vLLM's DeepSeek-V4.1 attention base class with its abstract compute left out (64 padded
    heads; ``forward_mqa`` and ``_o_proj`` raise), which builds on the CPU: what the layer
    reads from the config (kinds, sources, cache specs) without a platform's kernels.
    ``class_attrs`` set class attributes, e.g. a served class's ``backend_cls``."""
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    class Layer(DeepseekV4Attention):
        @classmethod
        def get_padded_num_q_heads(cls, num_heads: int) -> int:
            return 64

        def forward_mqa(self, *args):
            raise NotImplementedError

        def _o_proj(self, *args):
            raise NotImplementedError

    for name, value in class_attrs.items():
        setattr(Layer, name, value)
    return Layer


class _NoStream:
    """Stands in for torch.cuda.Stream, which vLLM's V4.1 model creates in __init__."""

    def __init__(self, *args, **kwargs) -> None:
        pass


def v41_vllm_model(path: str, device: str, load: bool):
    """``(config, model)``: vLLM's DeepseekV41ForCausalLM of the checkpoint at ``path`` as
    ``vllm serve --language-model-only`` builds it, on ``device`` ("meta": shapes and dtypes
    only, in a fraction of a second at V4.1-Flash's size), filled by vLLM's default loader when
    ``load`` (strict: it refuses unknown names and parameters the checkpoint misses). Engram
    tables in device memory (the host-memory default needs UVA); the layers' CUDA set-up
    (streams, the SM count, the output projection's FP8 recipe and warm-up) is stood in; none of
    it makes parameters."""
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.engram import EngramConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.models.deepseek_v41.nvidia import flashmla
    from vllm.utils.torch_utils import set_default_torch_dtype

    _distributed_ready()
    config = engine_args(
        model=path,
        load_format="auto" if load else "dummy",
        max_num_seqs=4,
        skip_tokenizer_init=False,
        language_model_only=True,
        engram_config=EngramConfig(cpu_offload=False),
    ).create_engine_config()
    loader = get_model_loader(config.load_config)
    sms = SimpleNamespace(multi_processor_count=4)
    with (
        set_current_vllm_config(config),
        _cpu_events(),
        set_default_torch_dtype(config.model_config.dtype),
        mock.patch.object(torch.cuda, "Stream", _NoStream),
        mock.patch.object(torch.cuda, "get_device_properties", lambda *args: sms),
        mock.patch.object(torch.accelerator, "current_device_index", lambda: 0),
        mock.patch.object(flashmla, "compute_fp8_einsum_recipe", lambda b: ((1, 128, 128), False)),
        mock.patch.object(flashmla, "register_dsv41_o_proj_warmup", lambda layer: None),
        torch.device(device),
    ):
        model = loader.create_model(vllm_config=config, model_config=config.model_config)
        if load:
            loader.load_weights(model, config.model_config)
    return config, model


def engine_args(**overrides):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(
        model=tiny_checkpoint(),
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=16,
    )
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


@functools.cache
def engine_config(attention_backend: str | None = "DSV4_NVFP4", kv_cache_dtype: str = "auto"):
    """A real ``VllmConfig`` for the tiny checkpoint (plugins load through their entry points)."""
    args = engine_args(attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype)
    return args.create_engine_config()


def device() -> torch.device:
    """Where the glue tests build layers: the CPU, or CUDA under ``VLLM_TARGET_DEVICE=cuda``."""
    return torch.device("cuda" if os.environ["VLLM_TARGET_DEVICE"] == "cuda" else "cpu")


@functools.cache
def _distributed_ready() -> bool:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(engine_config()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{temp_dir('dsv4_dist_') / 'store'}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
    return True


class _NoEvent:
    """Stands in for torch.cuda.Event, which the layers create in __init__ (CPU torch lacks it)."""

    def __init__(self, *args, **kwargs) -> None:
        pass


@contextmanager
def _cpu_events() -> Iterator[None]:
    if device().type == "cuda":
        yield
        return
    saved = torch.cuda.Event
    torch.cuda.Event = _NoEvent  # type: ignore[misc]
    try:
        yield
    finally:
        torch.cuda.Event = saved  # type: ignore[misc]


@dataclass
class TinyModel:
    """The tiny model's attention layers (one per ratio) on :func:`device`, KV caches bound."""

    vllm_config: object
    layers: dict[int, object]  # compress ratio -> DSV4NVFP4Attention
    topk_indices_buffer: torch.Tensor  # int32 [max_num_batched_tokens, INDEX_TOPK]
    kv_caches: dict[str, torch.Tensor]  # layer name -> vLLM's [B, H, N, C] view
    kv_cache_config: object


@functools.cache
def tiny_model(kv_cache_dtype: str = "auto") -> TinyModel:
    """Build the layers with ``--attention-backend DSV4_NVFP4`` through vLLM's model hook, and
    allocate their caches with vLLM's KV-cache planner and allocator.

    In the order vLLM's CUDA worker uses (the CPU platform sets the block size earlier): the
    layers are built while ``cache_config.block_size`` is still 16; it becomes 256 afterwards,
    before the KV-cache specs are read and the caches bound.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.models.deepseek_v4.nvidia import model as dsv4_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache

    _distributed_ready()
    config = engine_config("DSV4_NVFP4", kv_cache_dtype)
    where = device()
    # As DeepseekV4Model: one top-k buffer for every CSA layer, a row per schedulable token
    # (vLLM's CPU platform raises max_num_batched_tokens on CPUs without AMX).
    max_tokens = config.scheduler_config.max_num_batched_tokens
    topk = torch.full((max_tokens, INDEX_TOPK), -1, dtype=torch.int32, device=where)
    layers = {}
    # As vLLM's model loader: parameters in the model dtype, on the worker's device.
    with (
        set_current_vllm_config(config),
        _cpu_events(),
        set_default_torch_dtype(torch.bfloat16),
        torch.device(where),
    ):
        attention_cls = dsv4_model._select_dsv4_attn_cls(config)
        config.cache_config.block_size = BUILD_BLOCK
        for layer_id, ratio in enumerate(RATIOS):
            layer = attention_cls(
                config, prefix=f"model.layers.{layer_id}.attn", topk_indices_buffer=topk
            )
            assert layer.compress_ratio == ratio
            layers[ratio] = layer
        config.cache_config.block_size = CACHE_BLOCK  # as update_block_size_for_backend does
        context = config.compilation_config.static_forward_context
        specs = {}
        for name, module in context.items():
            if isinstance(module, AttentionLayerBase):
                spec = module.get_kv_cache_spec(config)
                if spec is not None:
                    specs[name] = spec
        backends = {context[name].get_attn_backend() for name in specs}
        layouts = get_supported_kv_cache_layouts(backends)
        layout = resolve_kv_cache_layout(config, [[x.name for x in layouts]], specs.values())
        config.cache_config.kv_cache_layout = layout.name
        groups = get_global_kv_cache_groups(config, [specs])
        (kv_cache_config,) = get_kv_cache_configs(config, [specs], [KV_CACHE_BYTES], groups)
        caches = allocate_kv_cache(kv_cache_config, where, layout)
        for name, cache in caches.items():
            context[name].bind_kv_cache(cache)
    return TinyModel(config, layers, topk, caches, kv_cache_config)


# ----------------------------------------------------------------------------------------------
# Random batches as vLLM's model runner describes them
# ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """A step: requests (decodes first), their block tables per cache group, and vLLM's
    ``CommonAttentionMetadata`` for the SWA group and for the compressed group."""

    seq_lens: list[int]
    query_lens: list[int]
    num_tokens: int  # rows, including padding rows past the last request
    swa_block_table: torch.Tensor  # int32 [R, max SWA blocks]
    cache_block_table: torch.Tensor  # int32 [R, max 256-token blocks]
    swa_cm: object
    cache_cm: object

    def positions(self) -> list[tuple[int, int]]:
        """(request, position) of every real token, in row order."""
        out = []
        for r, (seq, q) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            out += [(r, p) for p in range(seq - q, seq)]
        return out


def _common_metadata(seq_lens, query_lens, num_tokens, block_table, block: int):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    t = 0
    for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for p in range(s - q, s):
            slots[t] = int(block_table[r, p // block]) * block + p % block
            t += 1
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    positions[:t] = torch.tensor(
        [p for s, q in zip(seq_lens, query_lens, strict=True) for p in range(s - q, s)]
    )
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=slots,
        positions=positions,
        seq_lens_cpu_upper_bound=seq.clone(),
    )


def make_batch(
    gen: torch.Generator,
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    padding: int = 0,
    num_blocks: int = 700,
    on: torch.device | str = "cpu",
) -> Batch:
    """A batch with random block ids, distinct across both groups (they share vLLM's block
    pool, so one physical block holds either SWA or compressed pages); ``padding`` extra rows
    have slot -1. The block tables and the metadata's device tensors live ``on`` that device."""
    swa_width = max(-(-s // SWA_BLOCK) for s in seq_lens)
    cache_width = max(-(-s // CACHE_BLOCK) for s in seq_lens)
    num_reqs = len(seq_lens)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    swa_bt = ids[: num_reqs * swa_width].view(num_reqs, swa_width)
    cache_bt = ids[num_reqs * swa_width :][: num_reqs * cache_width].view(num_reqs, cache_width)
    return batch_from_tables(seq_lens, query_lens, swa_bt, cache_bt, padding, on)


def batch_from_tables(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    swa_block_table: torch.Tensor,
    cache_block_table: torch.Tensor,
    padding: int = 0,
    on: torch.device | str = "cpu",
) -> Batch:
    """A batch on given block tables (``int32 [R, *]``, one per cache group: what a test needs a
    particular block id at a particular place for); ``padding`` extra rows have slot -1. The
    metadata's device tensors live ``on`` that device."""
    num_tokens = sum(query_lens) + padding
    swa_bt = swa_block_table.to(torch.int32)
    cache_bt = cache_block_table.to(torch.int32)
    return Batch(
        list(seq_lens),
        list(query_lens),
        num_tokens,
        swa_bt,
        cache_bt,
        _on(_common_metadata(seq_lens, query_lens, num_tokens, swa_bt, SWA_BLOCK), on),
        _on(_common_metadata(seq_lens, query_lens, num_tokens, cache_bt, CACHE_BLOCK), on),
    )


def _on(cm, where: torch.device | str):
    """``cm`` with its device fields moved (the ``*_cpu`` fields stay on the host)."""
    if torch.device(where).type == "cpu":
        return cm
    import dataclasses

    moved = {
        name: getattr(cm, name).to(where)
        for name in (
            "query_start_loc",
            "seq_lens",
            "block_table_tensor",
            "slot_mapping",
            "positions",
        )
    }
    return dataclasses.replace(cm, **moved)


def random_batch(gen: torch.Generator, max_seq: int = 1200, max_reqs: int = 6) -> Batch:
    """Mixed decodes (query length 1 to 3, as with spec decode) then prefills (chunked: with a
    prefix), short and long sequences, some padding rows."""
    num_reqs = int(torch.randint(1, max_reqs + 1, (1,), generator=gen))
    num_decodes = int(torch.randint(0, num_reqs + 1, (1,), generator=gen))
    seq_lens, query_lens = [], []
    for r in range(num_reqs):
        seq = int(torch.randint(1, max_seq, (1,), generator=gen))
        if r < num_decodes:
            q = min(seq, int(torch.randint(1, 4, (1,), generator=gen)))
        else:
            q = min(seq, int(torch.randint(4, 300, (1,), generator=gen)))
        seq_lens.append(seq)
        query_lens.append(q)
    padding = int(torch.randint(0, 4, (1,), generator=gen))
    return make_batch(gen, seq_lens, query_lens, padding)


# ----------------------------------------------------------------------------------------------
# Brute force: one token at a time, from (request, position) and the block tables
# ----------------------------------------------------------------------------------------------


def attach_planner(builder, num_heads: int, num_parts: int):
    """Give an HCA metadata builder a balanced decode planner of ``num_parts`` parts on the CPU
    (where the builder makes none itself: the kernel it plans for runs on Hopper only); returns
    the planner."""
    from dsv4_attn.vllm_glue.balanced import BalancedDecodePlanner

    assert builder.planner is None
    capacities, max_tokens = (WINDOW, builder.max_entries), builder.hca_lens.shape[0]
    builder.planner = BalancedDecodePlanner(
        num_heads, capacities, max_tokens, torch.device("cpu"), num_parts=num_parts
    )
    return builder.planner


def slot(block_table: torch.Tensor, req: int, row: int, rows_per_block: int) -> int:
    return int(block_table[req, row // rows_per_block]) * rows_per_block + row % rows_per_block


def padded(values: list[int], width: int) -> list[int]:
    return values + [-1] * (width - len(values))


def brute_window(batch: Batch) -> tuple[list[list[int]], list[int]]:
    rows, lens = [], []
    for req, pos in batch.positions():
        window = range(max(0, pos - WINDOW + 1), pos + 1)
        slots = [slot(batch.swa_block_table, req, p, SWA_BLOCK) for p in window]
        rows.append(padded(slots, WINDOW))
        lens.append(len(slots))
    pad = batch.num_tokens - len(rows)
    return rows + [[-1] * WINDOW] * pad, lens + [0] * pad


def brute_write_slots(batch: Batch, ratio: int) -> list[int]:
    per_block = CACHE_BLOCK // ratio
    out = []
    for req, pos in batch.positions():
        done = (pos + 1) % ratio == 0
        out.append(slot(batch.cache_block_table, req, pos // ratio, per_block) if done else -1)
    return out + [-1] * (batch.num_tokens - len(out))


def brute_visible(batch: Batch, ratio: int, width: int):
    """Each token's visible entries' slots, the first ``width`` of them (a narrower list holds
    no more), padded with -1 to ``width``, and their count."""
    per_block = CACHE_BLOCK // ratio
    rows, lens = [], []
    for req, pos in batch.positions():
        seen = range(min((pos + 1) // ratio, width))
        slots = [slot(batch.cache_block_table, req, i, per_block) for i in seen]
        rows.append(padded(slots, width))
        lens.append(len(slots))
    pad = batch.num_tokens - len(rows)
    return rows + [[-1] * width] * pad, lens + [0] * pad


def random_local_topk(gen: torch.Generator, batch: Batch, k: int) -> torch.Tensor:
    """Indexer-like picks: distinct visible entries (i < (pos + 1) // 4) in random order, -1 holes
    anywhere; padding rows hold garbage that must be ignored."""
    out = torch.randint(-1, 50, (batch.num_tokens, k), generator=gen, dtype=torch.int32)
    for t, (_, pos) in enumerate(batch.positions()):
        visible = (pos + 1) // 4
        picks = torch.randperm(visible, generator=gen)[:k].to(torch.int32) if visible else None
        row = torch.full((k,), -1, dtype=torch.int32)
        if picks is not None:
            row[: len(picks)] = picks
        out[t] = row[torch.randperm(k, generator=gen)]
    return out


def brute_local(batch: Batch, local: torch.Tensor):
    per_block = CACHE_BLOCK // 4
    rows, lens = [], []
    for t, (req, _) in enumerate(batch.positions()):
        entries = local[t].tolist()
        rows.append(
            [slot(batch.cache_block_table, req, e, per_block) if e >= 0 else -1 for e in entries]
        )
        used = [j for j, e in enumerate(entries) if e >= 0]
        lens.append(used[-1] + 1 if used else 0)
    pad = batch.num_tokens - len(rows)
    return rows + [[-1] * local.shape[1]] * pad, lens + [0] * pad


# ----------------------------------------------------------------------------------------------
# Spawn round trip (the target must be importable by the child: it lives here, not in a test)
# ----------------------------------------------------------------------------------------------


def spawn_child(config, results) -> None:
    """Runs in a fresh interpreter started with ``spawn``: ``config`` was unpickled before any
    vLLM plugin could load. Reports what it found and sends the config back."""
    import sys

    import vllm.plugins

    backend = config.attention_config.backend
    results.put(
        {
            "backend": backend.name,
            "class_path": backend.get_path(),
            "plugins_loaded": vllm.plugins.plugins_loaded,
            "plugin_module": "dsv4_attn.plugin" in sys.modules,
            "config": config,
        }
    )


def vllm_triton_kernel(kernel_class: type):
    """The Triton body of one of vLLM's kernel classes (``kernel_class.kernel``), jitted with
    Triton itself: on a host without a GPU driver vLLM binds its modules to a Triton
    placeholder (whose ``jit`` is a no-op). Run it with ``TRITON_INTERPRET=1`` set before Triton
    is imported (a child process)."""
    return vllm_triton_kernel_fn(kernel_class.__dict__["kernel"].__func__)


def vllm_triton_kernel_fn(function):
    """:func:`vllm_triton_kernel` of a module-level Triton function of vLLM's."""
    import types

    import triton
    import triton.language as tl

    body = getattr(function, "fn", function)
    rebound = types.FunctionType(
        body.__code__,
        {**body.__globals__, "tl": tl, "triton": triton},
        body.__name__,
        body.__defaults__,
        body.__closure__,
    )
    return triton.jit(rebound)


def run_in_triton_interpreter(call: str) -> str:
    """Run the Python statement ``call`` from the repository root in a child process with
    Triton's CPU interpreter on (``TRITON_INTERPRET`` must be set before Triton is imported) and
    vLLM on its CPU platform; its stdout. The child's failure fails the caller, with its
    output."""
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", call],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout
