"""A KV scope: one candidate list of a sparse attention call, read straight from a paged cache.

DeepSeek-V4 attention gives every query token two candidate lists that share one softmax (and the
attention sink): its sliding window in the SWA cache, and its compressed entries (the CSA top-k or
all visible HCA entries) in the compressed cache. Each list is a :class:`KVScope`: which cache, in
which format, how many rows a page holds, and per token the slot ids and how many of them count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dsv4_attn.kv_cache import KVFormat

__all__ = ["KVScope"]


@dataclass(frozen=True)
class KVScope:
    """Per query token, up to ``K`` rows of one paged KV cache.

    Attributes:
        cache: ``uint8 [num_blocks, >= page_bytes]`` pages in format ``fmt`` (row stride may exceed
            the page, as in vLLM's packed pages; :mod:`dsv4_attn.kv_cache` has the byte layout).
        fmt: the cache's row format.
        block_size: rows (tokens or compressed entries) per page.
        indices: ``int32/int64 [T, K]`` slot ids, ``block * block_size + row``; -1 is a hole.
        lens: ``int32/int64 [T]``; only the first ``lens[t]`` entries of ``indices[t]`` count.
    """

    cache: torch.Tensor
    fmt: KVFormat
    block_size: int
    indices: torch.Tensor
    lens: torch.Tensor

    @property
    def capacity(self) -> int:
        """The widest list a token can have (``K``)."""
        return self.indices.shape[1]

    def tokens(self, start: int, stop: int) -> KVScope:
        """The same scope for query tokens ``start .. stop - 1`` only."""
        return replace(self, indices=self.indices[start:stop], lens=self.lens[start:stop])
