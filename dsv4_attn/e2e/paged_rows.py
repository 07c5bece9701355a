"""A paged KV cache for one sequence: a pool of pages, a block table, eviction with poisoning.

This is the harness's stand-in for vLLM's block manager. Rows are stored in a
:mod:`dsv4_attn.kv_cache` page format; logical row ``p`` (a token position, or a compressed-entry
number) lives in logical block ``p // block_size``, which the block table maps to a physical
page drawn in a seeded random order, so a block table is never the identity and index mistakes
show up. Released pages are overwritten with 0xFF bytes (NaN in bf16, e4m3 and the NVFP4 scales)
and reused: a kernel that reads an evicted row poisons the output instead of silently using a
stale one.
"""

from __future__ import annotations

import torch

from dsv4_attn import kv_cache
from dsv4_attn.kv_cache import KVFormat

__all__ = ["POISON_BYTE", "PagedRows"]

POISON_BYTE = 0xFF


class PagedRows:
    """Paged storage for the rows of one sequence in one cache scope.

    Args:
        fmt: page format of the cache.
        block_size: rows per page.
        device: where the pages live.
        seed: seeds the order in which free pages are handed out.
        initial_blocks: pages allocated up front; the pool doubles when it runs out.
    """

    def __init__(
        self,
        fmt: KVFormat | str,
        block_size: int,
        device: torch.device | str,
        seed: int = 0,
        initial_blocks: int = 4,
    ) -> None:
        self.fmt = KVFormat.parse(fmt)
        self.block_size = block_size
        self.device = torch.device(device)
        self._rng = torch.Generator().manual_seed(seed)
        self.cache = kv_cache.allocate(initial_blocks, block_size, self.fmt, self.device)
        self.cache.fill_(POISON_BYTE)
        self._free: list[int] = self._shuffled(range(initial_blocks))
        self._table: list[int] = []  # logical block -> physical page, -1 once released
        self._table_tensor: torch.Tensor | None = None
        self.rows_written = 0  # one past the highest logical row written so far

    # ---------------------------------------------------------------- pool management
    def _shuffled(self, ids) -> list[int]:
        ids = list(ids)
        order = torch.randperm(len(ids), generator=self._rng).tolist()
        return [ids[i] for i in order]

    def _grow(self) -> None:
        old = self.cache.shape[0]
        extra = torch.full_like(self.cache, POISON_BYTE)
        self.cache = torch.cat([self.cache, extra], dim=0)
        self._free.extend(self._shuffled(range(old, 2 * old)))

    def _ensure_blocks(self, num_logical_blocks: int) -> None:
        while len(self._table) < num_logical_blocks:
            if not self._free:
                self._grow()
            self._table.append(self._free.pop())
            self._table_tensor = None

    def block_table(self) -> torch.Tensor:
        """int64 ``[num_logical_blocks]`` physical page per logical block (-1: released)."""
        if self._table_tensor is None:
            self._table_tensor = torch.tensor(self._table, dtype=torch.int64, device=self.device)
        return self._table_tensor

    @property
    def live_blocks(self) -> int:
        """Pages currently held by this sequence."""
        return sum(1 for b in self._table if b >= 0)

    def reset(self) -> None:
        """Release every page (poisoning it) and forget the sequence."""
        self.release_below(len(self._table) * self.block_size)
        self._table = []
        self._table_tensor = None
        self.rows_written = 0

    # ---------------------------------------------------------------- rows
    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache slot ids (int64, same shape as ``rows``) of logical rows ``rows``; -1 stays -1.

        Raises RuntimeError if a row lies in a released or never-allocated block: the caller
        asked for a row that no longer exists, which is a bug in the caller's index building.
        """
        rows = rows.to(device=self.device, dtype=torch.int64)
        used = rows[rows >= 0]
        if used.numel():
            hi = int(used.max())
            table = self.block_table()
            if hi // self.block_size >= len(self._table) or bool(
                (table[used // self.block_size] < 0).any()
            ):
                raise RuntimeError(
                    f"row indices reach a released or unallocated block (max row {hi}, "
                    f"{len(self._table)} logical blocks, block_size {self.block_size})"
                )
        safe = rows.clamp(min=0)
        table = self.block_table() if self._table else torch.zeros(1, dtype=torch.int64)
        slot = table.to(self.device)[safe // self.block_size] * self.block_size
        slot = slot + safe % self.block_size
        return torch.where(rows >= 0, slot, torch.full_like(slot, -1))

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` (bf16 ``[N, 512]``) as logical rows ``rows`` (int ``[N]``)."""
        if rows.numel() == 0:
            return
        self._ensure_blocks(int(rows.max()) // self.block_size + 1)
        kv_cache.write(self.cache, self.slots(rows), values, self.fmt, self.block_size)
        self.rows_written = max(self.rows_written, int(rows.max()) + 1)

    def release_below(self, row: int) -> int:
        """Poison and free every page whose rows all lie below ``row``; returns how many."""
        released = 0
        for logical in range(min(len(self._table), max(0, row) // self.block_size)):
            page = self._table[logical]
            if page >= 0:
                self.cache[page].fill_(POISON_BYTE)
                self._free.append(page)
                self._table[logical] = -1
                released += 1
        if released:
            self._table_tensor = None
        return released
