"""Route HuggingFace DeepSeek-V4's core attention through :func:`dsv4_attn.ops.sparse_attention`.

The hook point is transformers' attention-function registry: ``DeepseekV4Attention.forward``
computes q, the window KV, the compressed KV (compressor) and the indexer's picks itself and then
calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)`` with
``(module, q [B,H,S,512], kv, kv, mask, scaling=512**-0.5, sliding_window, s_aux=sinks)``, where
``kv = [window keys | compressed entries]``. We register our own implementation under
:data:`OPS_ATTENTION` and switch the model to it with ``set_attn_implementation``. Nothing of the
model (projections, RoPE, compressor, indexer, mHC, MoE) is reimplemented.

The registry call does not carry the query positions, the number of compressed entries or the
indexer's top-k, so three forward hooks *observe* them (they change nothing): a pre-hook on the
attention module (``position_ids``), a hook on the compressor (its output's entry count) and one
on the indexer (its ``[B, S, k]`` picks, -1 = invalid). With them, each call:

1. writes the new tokens' window rows (the last S window keys) into a paged cache of 64-token
   pages in the chosen :class:`~dsv4_attn.kv_cache.KVFormat`, and the newly emitted compressed
   entries into a second paged cache (the extra scope);
2. builds per query token t: window slots for positions ``max(0, t-127)..t`` and lens
   ``min(t+1, 128)``; extra slots for the HCA entries ``i < (t+1) // 128`` or for the CSA
   indexer's valid picks;
3. calls ``ops.sparse_attention`` (kernel on Hopper, fallback elsewhere), reading every KV row
   from the paged caches, never from HF's tensors;
4. releases (poisons, recycles) window pages no later query can see.

HF's own mask is never used for the result; with ``check_mask=True`` each call also checks that
the candidate sets we built equal the ones HF's mask allows (a structural cross-check).

:func:`simulate_kv_format` is the quantized oracle: HF's own eager attention with every key/value
row (window and compressed) passed through the format's encode/decode first, which is how the
official DeepSeek-V4 inference code simulates its FP8 KV cache.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dsv4_attn import kv_cache, ops
from dsv4_attn.e2e.paged_rows import PagedRows
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.scope import KVScope

__all__ = [
    "KV_SIM_ATTENTION",
    "OPS_ATTENTION",
    "AttentionRoute",
    "RouteStats",
    "route_attention",
    "simulate_kv_format",
]

OPS_ATTENTION = "dsv4_attn_ops"
KV_SIM_ATTENTION = "dsv4_attn_kv_sim"
WINDOW_BLOCK_SIZE = 64  # vLLM's SWA page size for DeepSeek-V4
# Compressed pages hold 256 source tokens in vLLM: 64 CSA entries, 2 HCA entries.
COMPRESSED_SOURCE_TOKENS_PER_BLOCK = 256
EXTRA_INDEX_ALIGN = 64  # extra-scope index rows are padded with -1 to a multiple of this
_ROUTE_ATTR = "_dsv4_attn_route"
_SIM_ATTR = "_dsv4_attn_kv_sim_format"


def _hf_modules():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return modeling_deepseek_v4


def _register_functions() -> None:
    """Register our attention functions (and HF's eager mask for them) once per process."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    eager_mask = ALL_MASK_ATTENTION_FUNCTIONS["eager"]
    for name, fn in ((OPS_ATTENTION, _ops_attention), (KV_SIM_ATTENTION, _kv_sim_attention)):
        AttentionInterface.register(name, fn)
        # The same mask eager attention gets: unused by _ops_attention except for check_mask.
        AttentionMaskInterface.register(name, eager_mask)


@dataclass
class RouteStats:
    """What ran: attention calls by (phase, backend), query tokens, fallback reasons."""

    calls: Counter = field(default_factory=Counter)  # (phase, backend) -> calls
    query_tokens: Counter = field(default_factory=Counter)  # phase -> query tokens
    fallback_reasons: Counter = field(default_factory=Counter)  # reason -> calls
    ops_seconds: float = 0.0
    released_pages: int = 0
    max_extra_rows: Counter = field(default_factory=Counter)  # layer type -> max extra lens
    mask_checks: int = 0

    def backends(self) -> set[str]:
        return {backend for _, backend in self.calls}


@dataclass
class _LayerState:
    """Per-layer routing state for one sequence (batch size 1)."""

    layer_type: str
    window: PagedRows
    compressed: PagedRows | None
    ratio: int
    positions: torch.Tensor | None = None  # [S] int64 of the current call
    num_entries: int = 0  # compressed entries the compressor returned in the current call
    picks: torch.Tensor | None = None  # [S, k] indexer picks of the current call

    def reset(self) -> None:
        self.window.reset()
        if self.compressed is not None:
            self.compressed.reset()


class AttentionRoute:
    """The installed route: configuration, per-layer state and :class:`RouteStats`."""

    def __init__(
        self,
        fmt: KVFormat,
        backend: str,
        q_dtype: torch.dtype | None,
        check_mask: bool,
        seed: int,
    ) -> None:
        if backend not in ops.BACKENDS:
            raise ValueError(f"backend must be one of {ops.BACKENDS}, got {backend!r}")
        if q_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"q_dtype must be None, bfloat16, float16 or float32, got {q_dtype}")
        self.fmt = fmt
        self.backend = backend
        self.q_dtype = q_dtype
        self.check_mask = check_mask
        self.seed = seed
        self.stats = RouteStats()
        self.layers: dict[int, _LayerState] = {}

    def _state(self, module) -> _LayerState:
        state = self.layers.get(module.layer_idx)
        if state is None:
            device = module.q_b_proj.weight.device
            seed = self.seed * 1000 + 2 * module.layer_idx
            window = PagedRows(self.fmt, WINDOW_BLOCK_SIZE, device, seed=seed)
            compressed, ratio = None, 0
            if module.compressor is not None:
                ratio = module.compressor.compress_rate
                block = max(1, COMPRESSED_SOURCE_TOKENS_PER_BLOCK // ratio)
                compressed = PagedRows(self.fmt, block, device, seed=seed + 1)
            state = _LayerState(module.layer_type, window, compressed, ratio)
            self.layers[module.layer_idx] = state
        return state


# ------------------------------------------------------------------------------ observers
def _capture_positions(module, args, kwargs) -> None:
    route: AttentionRoute = getattr(module, _ROUTE_ATTR)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError("DeepseekV4Attention was called without position_ids")
    if position_ids.shape[0] != 1:
        raise ValueError(f"the ops route supports batch size 1, got {position_ids.shape[0]}")
    state = route._state(module)
    state.positions = position_ids[0].to(torch.int64)
    state.num_entries, state.picks = 0, None


def _capture_entries(route: AttentionRoute, layer_idx: int):
    def hook(module, args, output) -> None:
        route.layers[layer_idx].num_entries = int(output[0].shape[2])

    return hook


def _capture_picks(route: AttentionRoute, layer_idx: int):
    def hook(module, args, output) -> None:  # output: the [B, S, k] picks, -1 = invalid
        route.layers[layer_idx].picks = output[0]

    return hook


# ------------------------------------------------------------------------------ index building
def _window_rows(positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions ``[S, window]`` (oldest first, -1 padded) and lens ``[S]``."""
    lens = torch.clamp(positions + 1, max=window)
    offs = torch.arange(window, device=positions.device)
    rows = positions[:, None] - lens[:, None] + 1 + offs[None, :]
    return torch.where(offs[None, :] < lens[:, None], rows, torch.full_like(rows, -1)), lens


def _pad_columns(rows: torch.Tensor, align: int) -> torch.Tensor:
    k = rows.shape[1]
    k_padded = max(align, -(-k // align) * align)
    if k_padded == k:
        return rows
    pad = torch.full((rows.shape[0], k_padded - k), -1, dtype=rows.dtype, device=rows.device)
    return torch.cat([rows, pad], dim=1)


def _extra_rows(state: _LayerState) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed-entry numbers ``[S, K]`` (valid first, -1 padded) and lens ``[S]``."""
    positions = state.positions
    visible = (positions + 1) // state.ratio  # entry i is complete once token (i+1)*r-1 is seen
    if state.layer_type == "heavily_compressed_attention":
        k = max(1, int(visible.max()))
        offs = torch.arange(k, device=positions.device)
        rows = torch.where(offs[None, :] < visible[:, None], offs[None, :], -1)
        return _pad_columns(rows, EXTRA_INDEX_ALIGN), visible
    # CSA: the indexer's picks for this query token; -1 marks an invalid pick.
    if state.picks is None:
        raise RuntimeError("the CSA indexer did not run before attention")
    picks = state.picks.to(torch.int64)
    if bool((picks >= visible[:, None]).any()):
        raise RuntimeError("the indexer picked a compressed entry that is not complete yet")
    valid = picks >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid picks first
    rows = torch.where(valid, picks, -1).gather(1, order)
    return _pad_columns(rows, EXTRA_INDEX_ALIGN), valid.sum(dim=1)


def _check_against_mask(
    mask: torch.Tensor | None,
    positions: torch.Tensor,
    window_rows: torch.Tensor,
    extra_rows: torch.Tensor | None,
    num_window_keys: int,
    num_entries: int,
) -> None:
    """Raise if the candidate sets differ from what HF's mask lets each query see.

    HF's keys are ``[window keys | compressed entries]``; window key column j holds the token at
    position ``positions[-1] - num_window_keys + 1 + j`` and compressed column j entry j.
    """
    S = positions.shape[0]
    total = num_window_keys + num_entries
    device = positions.device
    if mask is None:
        hf = torch.ones(S, total, dtype=torch.bool, device=device)
    else:
        hf = mask[0, 0] > torch.finfo(mask.dtype).min  # 0 = visible, -inf/min = masked
        if hf.shape != (S, total):
            raise RuntimeError(f"HF mask has shape {tuple(hf.shape)}, expected {(S, total)}")
    key_positions = int(positions[-1]) - num_window_keys + 1 + torch.arange(num_window_keys)
    hits = window_rows[:, :, None] == key_positions.to(device)[None, None, :]
    if not torch.equal(hits.sum(dim=(1, 2)), (window_rows >= 0).sum(dim=1)):
        raise RuntimeError("our window reaches a position HF does not hold")
    ours = hits.any(dim=1)
    if num_entries:
        entries = torch.arange(num_entries, device=device)
        picked = (extra_rows[:, :, None] == entries[None, None, :]).any(dim=1)
        ours = torch.cat([ours, picked], dim=1)
    if not torch.equal(ours, hf):
        query, column = (ours != hf).nonzero()[0].tolist()
        raise RuntimeError(
            f"candidate set differs from HF's mask at query {query} key column {column} "
            f"(ours {bool(ours[query, column])}, HF {bool(hf[query, column])})"
        )


# ------------------------------------------------------------------------------ attention fns
def _ops_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Registered attention function: ``query [1, H, S, 512]`` -> ``([1, S, H, 512], None)``."""
    route: AttentionRoute | None = getattr(module, _ROUTE_ATTR, None)
    if route is None:
        raise RuntimeError(f"{OPS_ATTENTION} is set but no route is installed on this model")
    state = route.layers[module.layer_idx]
    B, _, S, D = query.shape
    if B != 1:
        raise ValueError(f"the ops route supports batch size 1, got {B}")
    if D != HEAD_DIM or key.shape[1] != 1:
        raise ValueError(
            f"expected head_dim {HEAD_DIM} and one KV head, got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}"
        )
    if state.positions is None or state.positions.shape[0] != S:
        raise RuntimeError("query positions were not captured for this call")
    positions = state.positions
    if int(positions[0]) == 0:  # a new sequence starts: drop the previous one's pages
        state.reset()
    num_entries = state.num_entries if state.compressed is not None else 0
    num_window_keys = key.shape[2] - num_entries
    rows = key[0, 0].to(torch.bfloat16)
    state.window.write(positions, rows[num_window_keys - S : num_window_keys])
    if state.compressed is not None and num_entries > state.compressed.rows_written:
        new = torch.arange(state.compressed.rows_written, num_entries, device=positions.device)
        state.compressed.write(new, rows[num_window_keys + new])

    window = module.sliding_window
    window_rows, lens = _window_rows(positions, window)
    indices = state.window.slots(window_rows)
    extra = None
    extra_rows = None
    if state.compressed is not None:
        extra_rows, extra_lens = _extra_rows(state)
        extra = KVScope(
            state.compressed.cache,
            route.fmt,
            state.compressed.block_size,
            state.compressed.slots(extra_rows),
            extra_lens,
        )
        stats_key = state.layer_type
        route.stats.max_extra_rows[stats_key] = max(
            route.stats.max_extra_rows[stats_key], int(extra_lens.max())
        )
    if route.check_mask:
        _check_against_mask(
            attention_mask, positions, window_rows, extra_rows, num_window_keys, num_entries
        )
        route.stats.mask_checks += 1

    q = query[0].transpose(0, 1)
    q = (q if route.q_dtype is None else q.to(route.q_dtype)).contiguous()
    sink = module.sinks.detach().to(torch.float32)
    window_scope = KVScope(state.window.cache, route.fmt, state.window.block_size, indices, lens)
    start = time.perf_counter()
    out, _ = ops.sparse_attention(
        q, window_scope, sink, float(scaling), extra, backend=route.backend
    )
    backend, reason = ops.last_dispatch()
    if reason is not None:
        route.stats.fallback_reasons[reason] += 1
    phase = "prefill" if S > 1 else "decode"
    route.stats.calls[(phase, backend)] += 1
    route.stats.query_tokens[phase] += S
    route.stats.ops_seconds += time.perf_counter() - start

    # Window rows no later query can see (t' > t sees positions >= t' - window + 1).
    route.stats.released_pages += state.window.release_below(int(positions.max()) - window + 2)
    return out.to(query.dtype).unsqueeze(0), None


def _kv_sim_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's eager attention on the operands ``ops.sparse_attention`` would get: key/value rows
    round-tripped through the cache format, q cast to the route's q dtype, output rounded to
    bf16 (the dtype ops returns). The math itself is HF's, in the model's dtype."""
    sim: _Simulation = getattr(module, _SIM_ATTR)
    shape = key.shape
    rows = key.reshape(-1, HEAD_DIM).to(torch.bfloat16)
    rows = kv_cache.decode_rows(*kv_cache.encode_rows(rows, sim.fmt), sim.fmt)
    rows = rows.to(key.dtype).reshape(shape)
    if sim.q_dtype is not None:
        query = query.to(sim.q_dtype).to(key.dtype)
    eager = _hf_modules().eager_attention_forward
    out, weights = eager(module, query, rows, rows, attention_mask, scaling, dropout, **kwargs)
    if sim.round_output:
        out = out.to(torch.bfloat16).to(query.dtype)
    return out, weights


@dataclass(frozen=True)
class _Simulation:
    fmt: KVFormat
    q_dtype: torch.dtype | None
    round_output: bool


# ------------------------------------------------------------------------------ installers
def _attention_modules(model) -> list:
    cls = _hf_modules().DeepseekV4Attention
    found = [m for m in model.modules() if isinstance(m, cls)]
    if not found:
        raise ValueError("the model has no transformers DeepseekV4Attention modules")
    return found


@contextlib.contextmanager
def _attn_implementation(model, name: str) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def route_attention(
    model,
    fmt: KVFormat | str = KVFormat.BF16,
    backend: str = "auto",
    q_dtype: torch.dtype | None = torch.bfloat16,
    check_mask: bool = False,
    seed: int = 0,
) -> Iterator[AttentionRoute]:
    """Within the block, ``model`` (a transformers ``DeepseekV4ForCausalLM``) computes attention
    with :func:`dsv4_attn.ops.sparse_attention` over paged caches in format ``fmt``.

    ``backend`` is passed to ``ops.sparse_attention``. ``q_dtype`` is the dtype q is cast to
    before the call (bf16, as vLLM feeds the kernels; None keeps the model's dtype).
    ``check_mask`` cross-checks every call's candidate sets against HF's own mask. ``seed``
    seeds the page order of the block tables. Yields the :class:`AttentionRoute`, whose
    ``stats`` say which backend ran. Batch size 1 only.
    """
    route = AttentionRoute(KVFormat.parse(fmt), backend, q_dtype, check_mask, seed)
    _register_functions()
    handles = []
    modules = _attention_modules(model)
    try:
        for module in modules:
            setattr(module, _ROUTE_ATTR, route)
            handles.append(module.register_forward_pre_hook(_capture_positions, with_kwargs=True))
            if module.compressor is not None:
                handles.append(
                    module.compressor.register_forward_hook(
                        _capture_entries(route, module.layer_idx)
                    )
                )
                indexer = getattr(module.compressor, "indexer", None)
                if indexer is not None:
                    handles.append(
                        indexer.register_forward_hook(_capture_picks(route, module.layer_idx))
                    )
        with _attn_implementation(model, OPS_ATTENTION):
            yield route
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            if hasattr(module, _ROUTE_ATTR):
                delattr(module, _ROUTE_ATTR)


@contextlib.contextmanager
def simulate_kv_format(
    model,
    fmt: KVFormat | str,
    q_dtype: torch.dtype | None = torch.bfloat16,
    round_output: bool = True,
) -> Iterator[None]:
    """Within the block, ``model`` runs HF's eager attention on KV rows round-tripped through
    ``fmt`` (nope part quantized, RoPE part bf16): the storage-matched oracle.

    With the defaults it also casts q to bf16 and rounds the attention output to bf16, so its
    operands are exactly those :func:`route_attention` (default ``q_dtype``) hands to
    ``ops.sparse_attention``; ``q_dtype=None, round_output=False`` simulates the rows only.
    """
    simulation = _Simulation(KVFormat.parse(fmt), q_dtype, round_output)
    _register_functions()
    modules = _attention_modules(model)
    try:
        for module in modules:
            setattr(module, _SIM_ATTR, simulation)
        with _attn_implementation(model, KV_SIM_ATTENTION):
            yield
    finally:
        for module in modules:
            if hasattr(module, _SIM_ATTR):
                delattr(module, _SIM_ATTR)
