"""The kernels the benchmarks compare against (``--against flashmla``), and how this project's
inputs map onto them.

FlashMLA (the ``flash_mla`` package, when installed) is a measuring stick, never a dependency:
:func:`import_flash_mla` returns its module when importable, else says so and returns None, and the
benchmark times ours only. The rest maps a :class:`dsv4_attn.testing.DecodeCase` over ``fp8_ds_mla``
caches onto FlashMLA's sparse decode (``flash_mla_with_kvcache``, DeepSeek-V4 "MODEL1" layout) on
the same bytes, as vLLM 0.33 calls it on Hopper:

* q: bf16 ``[b, s_q, h_q, 512]`` with ``h_q`` 64 or 128; fewer heads are zero-padded to 64 (vLLM's
  ``get_padded_num_q_heads``), the sink padded with -inf (no effect), the output sliced back.
* k caches: a float8_e4m3fn ``[num_blocks, block_size, 1, 584]`` view of each uint8 cache with
  ``stride(1) == 584`` (checked by FlashMLA). Its sm90 kernel takes only the block stride and the
  block size from the view and addresses, exactly as an ``fp8_ds_mla`` page is laid out, slot row
  ``r``'s 576-byte data row at ``r * 576`` of its page and its 8-byte scale row at
  ``block_size * 576 + r * 8`` (``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``). The view's own
  element ``[block, r]`` (at ``r * 584``) is not the row: nothing may read the view as rows.
* indices: int32 ``[b, s_q, K]`` global slot ids (``block * block_size + row``, -1 = none), ``K`` a
  multiple of 64 (the kernel's tile of keys).
* topk_length / extra_topk_length: int32 ``[b]`` (one length per request) or None when every
  entry counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.scope import KVScope
from dsv4_attn.testing import DecodeCase

__all__ = [
    "FLASHMLA_HEADS",
    "FLASHMLA_ROW_BYTES",
    "FLASHMLA_TOPK_TILE",
    "flashmla_heads",
    "flashmla_indices",
    "flashmla_kv_view",
    "flashmla_lengths",
    "flashmla_refusal",
    "flashmla_sparse_decode",
    "import_flash_mla",
    "pad_heads",
    "pad_sink",
    "unpad_heads",
]

FLASHMLA_HEADS = (64, 128)  # query head counts its sparse decode runs
FLASHMLA_ROW_BYTES = kv_cache.bytes_per_token(KVFormat.FP8_DS_MLA)  # 584: data row + scale row
FLASHMLA_TOPK_TILE = 64  # keys per tile of its sm90 kernel: index widths must be multiples


def import_flash_mla() -> ModuleType | None:
    """FlashMLA's module when importable (the anchor), else None after
    printing one line saying so."""
    try:
        import flash_mla
    except ImportError as exc:
        print(f"flash_mla is not importable ({exc}): timing ours only", flush=True)
        return None
    return flash_mla


def flashmla_heads(num_heads: int) -> int:
    """The query head count FlashMLA runs for ``num_heads`` heads (64 up to 64, else 128), as
    vLLM pads them; ValueError beyond 128."""
    if not 0 < num_heads <= FLASHMLA_HEADS[-1]:
        raise ValueError(f"FlashMLA's sparse decode runs 1 to 128 query heads, got {num_heads}")
    return next(h for h in FLASHMLA_HEADS if num_heads <= h)


def pad_heads(q: torch.Tensor, heads: int) -> torch.Tensor:
    """``q [..., H, D]`` zero-padded to ``[..., heads, D]`` (contiguous; ``q`` itself when
    ``H == heads`` and contiguous)."""
    H = q.shape[-2]
    if heads < H:
        raise ValueError(f"cannot pad {H} heads down to {heads}")
    if heads == H:
        return q.contiguous()
    return torch.nn.functional.pad(q, (0, 0, 0, heads - H), value=0.0)


def pad_sink(sink: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """fp32 ``sink [H]`` padded to ``[heads]`` with -inf (a sink of -inf has no effect)."""
    if sink is None:
        return None
    tail = sink.new_full((heads - sink.shape[0],), float("-inf"))
    return torch.cat([sink.float(), tail.float()]).contiguous()


def unpad_heads(out: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The first ``num_heads`` heads of ``out [..., heads, D]`` (a view)."""
    return out[..., :num_heads, :]


def flashmla_kv_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """float8_e4m3fn ``[num_blocks, block_size, 1, 584]`` view of an ``fp8_ds_mla`` cache (uint8
    ``[num_blocks, >= page_bytes]``, any row stride) as FlashMLA's sparse decode takes it; no
    copy. See the module docstring for which bytes FlashMLA reads through it."""
    layout = kv_cache.page_layout(KVFormat.FP8_DS_MLA, block_size)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.stride(1) != 1:
        got = f"{cache.dtype} {tuple(cache.shape)} strides {cache.stride()}"
        raise ValueError(f"cache must be uint8 [num_blocks, page_bytes], rows contiguous: {got}")
    if cache.shape[1] < layout.page_bytes:
        raise ValueError(
            f"cache rows of {cache.shape[1]} B are shorter than an fp8_ds_mla page of "
            f"{block_size} rows ({layout.page_bytes} B)"
        )
    shape = (cache.shape[0], block_size, 1, FLASHMLA_ROW_BYTES)
    strides = (cache.stride(0), FLASHMLA_ROW_BYTES, FLASHMLA_ROW_BYTES, 1)
    return cache.view(torch.float8_e4m3fn).as_strided(shape, strides)


def flashmla_indices(indices: torch.Tensor, b: int, s_q: int) -> torch.Tensor:
    """Our slot lists ``[T = b * s_q, K]`` as FlashMLA's int32 ``[b, s_q, K]`` (same ids)."""
    tokens, width = indices.shape
    if tokens != b * s_q:
        raise ValueError(f"{tokens} tokens are not {b} requests of {s_q} tokens")
    return indices.to(torch.int32).contiguous().view(b, s_q, width)


def flashmla_lengths(lens: torch.Tensor, width: int, b: int, s_q: int) -> torch.Tensor | None:
    """FlashMLA's ``topk_length`` for our per-token ``lens [b * s_q]``: None when every entry
    counts (all lens reach ``width``), else int32 ``[b]``; ValueError when the tokens of one
    request count different lengths (FlashMLA takes one per request). Syncs with the device."""
    if bool((lens >= width).all()):
        return None
    per_request = lens.view(b, s_q)
    if not bool((per_request == per_request[:, :1]).all()):
        raise ValueError("FlashMLA takes one list length per request; tokens of a request differ")
    return per_request[:, 0].to(torch.int32).contiguous()


def flashmla_refusal(num_heads: int, widths: Sequence[int]) -> str | None:
    """Why FlashMLA's sm90 sparse decode would refuse (or assert on) ``num_heads`` query heads
    and index lists of these widths, or None."""
    if not 0 < num_heads <= FLASHMLA_HEADS[-1]:
        return f"{num_heads} query heads: FlashMLA runs h_q in {FLASHMLA_HEADS} (padded up to them)"
    tile = FLASHMLA_TOPK_TILE
    for width in widths:
        if width <= 0 or width % tile:
            return f"index width {width}: FlashMLA needs a positive multiple of {tile} keys"
    return None


def flashmla_sparse_decode(
    flash_mla: ModuleType, case: DecodeCase, s_q: int
) -> Callable[[], torch.Tensor]:
    """A call of FlashMLA's sparse decode on ``case`` (``fp8_ds_mla`` caches; ``T = b * s_q``
    tokens as ``b`` requests of ``s_q``): same bytes, slot ids, q, sink and softmax scale. q and
    the sink are padded once here (vLLM pads q in the kernel that produces it); the call returns
    bf16 ``[T, H, 512]``, a view of FlashMLA's padded output. Its tile-scheduler plan is made on
    the first call and reused (vLLM plans once per step and layer kind)."""
    if case.fmt is not KVFormat.FP8_DS_MLA:
        raise ValueError(f"FlashMLA reads fp8_ds_mla caches, not {case.fmt.value}")
    T, H, D = case.q.shape
    if T % s_q:
        raise ValueError(f"{T} tokens are not whole requests of s_q = {s_q}")
    b, heads = T // s_q, flashmla_heads(H)
    q = pad_heads(case.q.view(b, s_q, H, D), heads)
    sink = pad_sink(case.sink, heads)

    def scope_args(scope: KVScope | None) -> tuple:
        if scope is None:
            return None, None, None
        return (
            flashmla_kv_view(scope.cache, scope.block_size),
            flashmla_indices(scope.indices, b, s_q),
            flashmla_lengths(scope.lens, scope.capacity, b, s_q),
        )

    kv, indices, lengths = scope_args(case.window)
    extra_kv, extra_indices, extra_lengths = scope_args(case.extra)
    meta, _ = flash_mla.get_mla_metadata()

    def call() -> torch.Tensor:
        out, _ = flash_mla.flash_mla_with_kvcache(
            q,
            kv,
            None,
            None,
            HEAD_DIM,
            meta,
            None,
            case.scale,
            False,
            True,
            indices,
            sink,
            extra_kv,
            extra_indices,
            lengths,
            extra_lengths,
        )
        return unpad_heads(out.view(T, heads, HEAD_DIM), H)

    return call
