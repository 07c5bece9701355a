"""The producer warpgroup of the Hopper sparse-decode kernel: gather, dequantize, stage.

A mixin of :class:`dsv4_attn.kernels.sparse_decode_sm90.SparseDecodeSm90` (its ``cfg``,
``is_fp8``, ``data_row`` and ``scale_row``): each 32-key tile's rows are copied, still quantized,
from the paged cache (FP8 or NVFP4, ``dsv4_attn.kv_cache``) into a ring of raw slots in SMEM by
cp.async, ``RAW_STAGES`` tiles ahead; staging a tile reads them back, dequantizes them to bf16
with the bit recipes of :mod:`dsv4_attn.kernels.dequant` and stores them, RoPE values included,
into the K/V stage the MMA warpgroups read (swizzled as
:func:`~dsv4_attn.kernels.sparse_decode_config.swizzled_offset` says); the ``full``/``empty``
mbarriers hand stages over. The slot ids travel the same way, through a ring of their own one
ring further ahead, so no register of the loop ever waits on a global load.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from dsv4_attn.kernels import ptx_ops
from dsv4_attn.kernels.dequant import (
    FP8_FOLDED_MAX_EXP,
    dequant_fp8_16,
    dequant_nvfp4_16,
    fp8_block_scale_bf16x2,
    fp8_folded_scale_bf16x2,
    nvfp4_block_scale_bf16x2,
    nvfp4_token_scale_bf16x2,
)
from dsv4_attn.kernels.sparse_decode_config import (
    BAR_ITEM,
    BLOCK_N,
    CTA_THREADS,
    HEAD_DIM,
    ID_BYTES,
    ID_SLOT_BYTES,
    ID_STAGES,
    KEYS_PER_PRODUCER_WARP,
    NOPE_DIM,
    NUM_STAGES,
    NVFP4_NOPE_BYTES,
    RAW_SLOT_BYTES,
    RAW_STAGES,
    ROUNDS,
    swizzled_offset,
)

RAW_CHUNK_STRIDE = 128 * 16  # bytes between chunk c and c + 1 of one producer thread
RAW_ROPE_CHUNK = 7  # chunks 7, 8: the lane's two 16-byte RoPE chunks
RAW_SCALE_CHUNK = 9  # chunks 9 (10): the key's scale row (FP8 8 bytes, NVFP4 32 bytes)

assert ROUNDS == 1, "the raw ring stages one key per producer lane group per tile"

__all__ = ["SparseDecodeProducer"]


class SparseDecodeProducer:
    """The producer warpgroup's methods (WG2 of the kernel)."""

    @cute.jit
    def producer(
        self,
        mCache: cute.Tensor,
        mIdx: cute.Tensor,
        mECache: cute.Tensor | None,
        mEIdx: cute.Tensor | None,
        sK: cute.Tensor,
        sRaw: cute.Tensor,
        sIds: cute.Tensor,
        key_bias: cute.Tensor,
        full_bar,
        empty_bar,
        token: Int32,
        n_window: Int32,
        key_begin: Int32,
        key_end: Int32,
        n_tiles: Int32,
        ptid: Int32,
        g0: Int32,
        done: Int32,
    ):
        """Copy, dequantize and stage one 32-key tile per iteration.

        ``g0``: tiles staged for earlier items of this CTA (the K/V stage and the mbarrier
        phase follow the running count); ``done``: those items. With the balanced schedule, an
        item after the first starts its copies into the raw ring (which the epilogue leaves
        alone), then waits at ``BAR_ITEM`` until the last item's output has left the K/V
        stages it was staged in.

        Warp w stages keys 8w..8w+7 of a tile; the four lanes ``4k..4k+3`` share key k
        (``part`` = lane % 4): each copies a quarter of the key's nope bytes, its scales and 16
        RoPE values into its own column of a raw slot by cp.async (:meth:`copy_key`), one
        cp.async group per tile, ``RAW_STAGES`` tiles ahead. Staging tile t waits for its group
        (the oldest), reads the lane's bytes back (:meth:`store_key`), dequantizes the nope
        values into the key's row of the K/V stage, stores the RoPE values beside them, and
        refills the slot with tile t + ``RAW_STAGES``. The slot ids ride in the same groups one
        ring further ahead (``ID_STAGES``): tile t + 2 ``RAW_STAGES``'s ids land with tile t's
        rows. A slot id past the list or outside its cache is a hole (:meth:`read_packed`).
        A lane only reads bytes it copied, so its own cp.async groups order both rings.
        """
        pwarp = cute.arch.make_warp_uniform(ptid // 32)
        lane = ptid & 31
        part = lane & 3
        parity = (lane >> 2) & 1
        sK_base = sK.iterator.toint()
        unit0 = sRaw.iterator.toint() + ptid * 16  # this thread's chunk 0 in raw slot 0
        id0 = sIds.iterator.toint() + ptid * 4  # this thread's id in id slot 0
        bases = [mCache.iterator.toint(), Int64(mCache.stride[0])]
        if const_expr(self.cfg.has_extra):
            bases += [mECache.iterator.toint(), Int64(mECache.stride[0])]
        else:
            bases += bases
        # Key of this lane in tile t: key0 + 32 t; its row of the stage: row.
        key0 = key_begin + pwarp * KEYS_PER_PRODUCER_WARP + (lane >> 2)
        row = pwarp * KEYS_PER_PRODUCER_WARP + (lane >> 2)
        scope = (*self.id_rows(mIdx, mEIdx, token), n_window, key_end)
        # A slot id outside its cache (not a row of a page) is a hole, like -1: the kernel
        # never reads outside the caches, whatever the metadata holds.
        limits = (n_window, key_end, *self.slot_limits(mCache, mECache))

        # Prologue: the ids of tiles 0 .. RAW_STAGES - 1 (one wait), then the copies of those
        # tiles' rows, each group with the ids of the tile RAW_STAGES further on.
        for s in cutlass.range_constexpr(RAW_STAGES):
            self.copy_id(*scope, key0 + s * BLOCK_N, self.id_slot(id0, s))
        ptx_ops.cp_async_commit()
        ptx_ops.cp_async_wait_group(0)
        for s in cutlass.range_constexpr(RAW_STAGES):
            packed = self.read_packed(self.id_slot(id0, s), key0 + s * BLOCK_N, *limits)
            self.copy_key(packed, part, parity, unit0 + s * RAW_SLOT_BYTES, *bases)
            self.copy_id(
                *scope, key0 + (s + RAW_STAGES) * BLOCK_N, self.id_slot(id0, s + RAW_STAGES)
            )
            ptx_ops.cp_async_commit()
        if const_expr(self.cfg.balanced):  # noqa: SIM102 (a compile-time, then a runtime test)
            if done > 0:
                cute.arch.barrier(barrier_id=BAR_ITEM, number_of_threads=CTA_THREADS)
        for tile in cutlass.range(n_tiles, unroll=1):
            g = g0 + tile
            stage = g % NUM_STAGES
            unit = unit0 + (tile % RAW_STAGES) * RAW_SLOT_BYTES
            key = key0 + tile * BLOCK_N
            ptx_ops.cp_async_wait_group(RAW_STAGES - 1)  # this tile's group has landed
            if g >= NUM_STAGES:
                cute.arch.mbarrier_wait(empty_bar + stage, ((g // NUM_STAGES) + 1) % 2)
            stage_base = sK_base + stage * (BLOCK_N * HEAD_DIM * 2)
            packed = self.read_packed(self.id_slot(id0, tile), key, *limits)
            self.store_key(unit, packed >= 0, row, lane, parity, stage_base)
            if part == 0:
                key_bias[row, stage] = Float32(
                    cutlass.select_(packed >= 0, Float32(0.0), Float32(-math.inf))
                )
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(full_bar + stage)
            # The raw slot just read takes tile + RAW_STAGES (its ids landed with this tile's
            # rows); the id slot just read takes tile + 2 RAW_STAGES.
            key_new = key + RAW_STAGES * BLOCK_N
            packed_new = self.read_packed(self.id_slot(id0, tile + RAW_STAGES), key_new, *limits)
            self.copy_key(packed_new, part, parity, unit, *bases)
            # (tile + 2 RAW_STAGES shares tile's id slot.)
            self.copy_id(*scope, key + 2 * RAW_STAGES * BLOCK_N, self.id_slot(id0, tile))
            ptx_ops.cp_async_commit()
        ptx_ops.cp_async_wait_all()  # do not retire with copies in flight

    @staticmethod
    def id_slot(id0, tile):
        """This thread's word of the id-ring slot holding tile ``tile``'s ids (``id0``: slot 0)."""
        return id0 + (tile % ID_STAGES) * ID_SLOT_BYTES

    @cute.jit
    def id_rows(self, mIdx, mEIdx, token):
        """Addresses of the token's window and extra slot-id rows (the window's twice if none)."""
        elem = ID_BYTES
        window_ids = mIdx.iterator.toint() + Int64(token) * Int64(mIdx.stride[0]) * elem
        extra_ids = window_ids
        if const_expr(self.cfg.has_extra):
            extra_ids = mEIdx.iterator.toint() + Int64(token) * Int64(mEIdx.stride[0]) * elem
        return window_ids, extra_ids

    @cute.jit
    def copy_id(self, window_ids, extra_ids, n_window, key_end, key, dst):
        """cp.async the (int32) slot id of key ``key`` to ``dst``; nothing (zeros) past
        ``key_end``."""
        elem = ID_BYTES
        addr = Int64(
            cutlass.select_(
                key < n_window,
                window_ids + Int64(key) * elem,
                extra_ids + Int64(key - n_window) * elem,
            )
        )
        present = Int32(cutlass.select_(key < key_end, Int32(4), Int32(0)))
        ptx_ops.cp_async_4(dst, Int64(cutlass.select_(key < key_end, addr, window_ids)), present)

    @cute.jit
    def slot_limits(self, mCache, mECache):
        """Slots of the window and extra caches (pages x rows per page; < 2^30, checked on the
        host), the bound of a slot id that is a row of its cache."""
        window_slots = Int32(mCache.shape[0]) * self.cfg.block_size
        extra_slots = window_slots
        if const_expr(self.cfg.has_extra):
            extra_slots = Int32(mECache.shape[0]) * self.cfg.extra_block_size
        return window_slots, extra_slots

    @cute.jit
    def read_packed(self, src, key, n_window, key_end, window_slots, extra_slots) -> Int32:
        """``slot * 2 + is_extra`` of key ``key`` from the id :meth:`copy_id` put at ``src``,
        or -1 if it has none (past ``key_end``, or an id outside ``0 .. slots`` of its cache:
        -1 and every other)."""
        raw = ptx_ops.ld_shared_b32(src)
        raw = Int32(cutlass.select_(key < key_end, raw, Int32(-1)))
        return self.pack_slot(raw, key, n_window, window_slots, extra_slots)

    @cute.jit
    def pack_slot(self, raw, key, n_window, window_slots, extra_slots) -> Int32:
        """``slot * 2 + is_extra`` of key ``key`` from its loaded slot id, or -1 if the id is
        not a slot of its scope's cache."""
        is_extra = Int32(cutlass.select_(key >= n_window, Int32(1), Int32(0)))
        limit = window_slots
        if const_expr(not self.cfg.has_extra):
            is_extra = Int32(0)
        else:
            limit = Int32(cutlass.select_(key >= n_window, extra_slots, window_slots))
        return ptx_ops.packed_slot_or_hole(raw, limit, is_extra)

    @cute.jit
    def row_addresses(self, packed, cache_base, page_stride, ecache_base, epage_stride):
        """(data row address, scale row address) of a packed slot (>= 0)."""
        slot = packed >> 1
        bs, ebs = self.cfg.block_size, self.cfg.extra_block_size
        data_addr = Int64(0)
        scale_addr = Int64(0)
        if const_expr(not self.cfg.has_extra):
            page = slot // bs
            pos = slot - page * bs
            page_base = cache_base + Int64(page) * page_stride
            data_addr = page_base + pos * self.data_row
            scale_addr = page_base + (bs * self.data_row) + pos * self.scale_row
        elif const_expr(bs & (bs - 1) == 0 and ebs & (ebs - 1) == 0):
            # Both page sizes powers of two: select per scope, no branch.
            is_extra = (packed & 1) == 1
            shift = Int32(
                cutlass.select_(is_extra, Int32(ebs.bit_length() - 1), Int32(bs.bit_length() - 1))
            )
            mask = Int32(cutlass.select_(is_extra, Int32(ebs - 1), Int32(bs - 1)))
            base = Int64(cutlass.select_(is_extra, ecache_base, cache_base))
            stride = Int64(cutlass.select_(is_extra, epage_stride, page_stride))
            scales_at = Int32(
                cutlass.select_(is_extra, Int32(ebs * self.data_row), Int32(bs * self.data_row))
            )
            pos = slot & mask
            page_base = base + Int64(slot >> shift) * stride
            data_addr = page_base + pos * self.data_row
            scale_addr = page_base + scales_at + pos * self.scale_row
        else:
            if (packed & 1) == 0:
                page = slot // bs
                pos = slot - page * bs
                page_base = cache_base + Int64(page) * page_stride
                data_addr = page_base + pos * self.data_row
                scale_addr = page_base + (bs * self.data_row) + pos * self.scale_row
            else:
                page = slot // ebs
                pos = slot - page * ebs
                page_base = ecache_base + Int64(page) * epage_stride
                data_addr = page_base + pos * self.data_row
                scale_addr = page_base + (ebs * self.data_row) + pos * self.scale_row
        return data_addr, scale_addr

    @cute.jit
    def copy_key(
        self, packed, part, parity, unit, cache_base, page_stride, ecache_base, epage_stride
    ):
        """cp.async lane ``part``'s quarter of a key into its raw-slot column at ``unit``.

        Chunk d < 7: nope bytes 64d + 16 part .. +15 (FP8) or 32d + 8 part .. +7 (NVFP4, 8
        bytes), i.e. values 64d + 16 part ..; chunks 7, 8: the 16-byte RoPE chunks
        ``rope_chunk(part, parity, 0/1)``; chunks 9 (and 10): the whole scale row (FP8 8 bytes,
        NVFP4 32 bytes). A key without a slot (``packed`` < 0) copies 0 bytes (zeros) from slot
        0's address.
        """
        data_addr, scale_addr = self.row_addresses(
            cutlass.max(packed, 0), cache_base, page_stride, ecache_base, epage_stride
        )
        size16 = Int32(cutlass.select_(packed >= 0, Int32(16), Int32(0)))
        size8 = Int32(cutlass.select_(packed >= 0, Int32(8), Int32(0)))
        for d in cutlass.range_constexpr(7):
            if const_expr(self.is_fp8):
                ptx_ops.cp_async_16(
                    unit + d * RAW_CHUNK_STRIDE, data_addr + 64 * d + 16 * part, size16
                )
            else:
                ptx_ops.cp_async_8(
                    unit + d * RAW_CHUNK_STRIDE, data_addr + 32 * d + 8 * part, size8
                )
        rope_at = NOPE_DIM if const_expr(self.is_fp8) else NVFP4_NOPE_BYTES
        for c in cutlass.range_constexpr(2):
            ptx_ops.cp_async_16(
                unit + (RAW_ROPE_CHUNK + c) * RAW_CHUNK_STRIDE,
                data_addr + rope_at + 16 * self.rope_chunk(part, parity, c),
                size16,
            )
        if const_expr(self.is_fp8):
            ptx_ops.cp_async_8(unit + RAW_SCALE_CHUNK * RAW_CHUNK_STRIDE, scale_addr, size8)
        else:
            for c in cutlass.range_constexpr(2):
                ptx_ops.cp_async_16(
                    unit + (RAW_SCALE_CHUNK + c) * RAW_CHUNK_STRIDE, scale_addr + 16 * c, size16
                )

    @cute.jit
    def read_nope(self, unit, d):
        """Nope chunk ``d`` of this lane's raw-slot column (FP8 4 words, NVFP4 2)."""
        if const_expr(self.is_fp8):
            return ptx_ops.ld_shared_v4(unit + d * RAW_CHUNK_STRIDE)
        return ptx_ops.ld_shared_v2(unit + d * RAW_CHUNK_STRIDE)

    @cute.jit
    def read_scales_rope(self, unit) -> tuple:
        """The scale row and RoPE words :meth:`copy_key` put in this lane's column."""
        scale_at = unit + RAW_SCALE_CHUNK * RAW_CHUNK_STRIDE
        if const_expr(self.is_fp8):
            scales = ptx_ops.ld_shared_v2(scale_at)
        else:
            scales = (
                *ptx_ops.ld_shared_v4(scale_at),
                *ptx_ops.ld_shared_v4(scale_at + RAW_CHUNK_STRIDE),
            )
        rope = [
            ptx_ops.ld_shared_v4(unit + (RAW_ROPE_CHUNK + c) * RAW_CHUNK_STRIDE) for c in range(2)
        ]
        return (*scales, *rope[0], *rope[1])

    @staticmethod
    def rope_chunk(part, parity, c):
        """16-byte RoPE chunk (0..7) a lane handles in its ``c``-th copy (load and store).

        Lanes of odd keys (``parity`` 1) take their two chunks in the other order, so each
        8-lane phase of a store (keys 2i and 2i+1) covers 8 distinct 16-byte bank groups.
        """
        return part + 4 * (c ^ parity)

    @cute.jit
    def store_key(self, unit, valid, row, lane, parity, stage_base):
        """Dequantize a lane's quarter of one key from its raw-slot column at ``unit`` into K/V
        stage row ``row`` (:meth:`store_nope`) and store its RoPE values beside them (zeros if
        not ``valid``)."""
        words = self.read_scales_rope(unit)
        n_scales = 2 if const_expr(self.is_fp8) else 8  # words of the scale row
        scales = words[:n_scales]
        rope = words[n_scales:]
        part = lane & 3
        zero = Uint32(0)
        for c in cutlass.range_constexpr(2):
            rope_words = [Uint32(cutlass.select_(valid, w, zero)) for w in rope[4 * c : 4 * c + 4]]
            col = NOPE_DIM + 8 * self.rope_chunk(part, parity, c)
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col, BLOCK_N), *rope_words)
        if const_expr(self.is_fp8):
            # One multiply per pair when every block scale of the warp's keys allows folding the
            # 2^120 into it (scales up to 2^7: all real rows); else the two-multiply recipe.
            e_max = Uint32(0)
            for d in cutlass.range_constexpr(7):
                e_max = cutlass.max(e_max, self.fp8_block_exp(scales, d))
            if cute.arch.vote_all_sync(e_max <= FP8_FOLDED_MAX_EXP):
                self.store_nope(unit, valid, row, part, stage_base, scales, None, True)
            else:
                self.store_nope(unit, valid, row, part, stage_base, scales, None, False)
        else:
            token_scale2 = Uint32(
                cutlass.select_(valid, nvfp4_token_scale_bf16x2(scales[7] & 0xFF), zero)
            )
            self.store_nope(unit, valid, row, part, stage_base, scales, token_scale2, False)

    @staticmethod
    def fp8_block_exp(scales, d: int) -> Uint32:
        """UE8M0 exponent byte of FP8 nope block ``d`` (0..6) from the scale row's words."""
        return (scales[d // 4] >> (8 * (d % 4))) & 0xFF

    @cute.jit
    def store_nope(
        self,
        unit,
        valid,
        row,
        part,
        stage_base,
        scales,
        token_scale2,
        folded: cutlass.Constexpr[bool],
    ):
        """Dequantize the lane's seven nope chunks into K/V stage row ``row`` (zeros if not
        ``valid``); FP8 ``folded``: one multiply per pair (:func:`fp8_folded_scale_bf16x2`).

        Chunks are read one ahead of their dequantization: enough to cover the shared load's
        latency, while ptxas keeps at most two chunks' registers live.
        """
        zero = Uint32(0)
        chunk = self.read_nope(unit, 0)
        for d in cutlass.range_constexpr(7):
            chunk_next = chunk
            if const_expr(d < 6):
                chunk_next = self.read_nope(unit, d + 1)
            col = 64 * d + 16 * part
            if const_expr(self.is_fp8):
                e = self.fp8_block_exp(scales, d)
                if const_expr(folded):
                    scale2 = Uint32(cutlass.select_(valid, fp8_folded_scale_bf16x2(e), zero))
                else:
                    scale2 = Uint32(cutlass.select_(valid, fp8_block_scale_bf16x2(e), zero))
                deq = dequant_fp8_16(chunk, scale2, folded)
            else:
                block_scale2 = nvfp4_block_scale_bf16x2((scales[d] >> (part * 8)) & 0xFF)
                deq = dequant_nvfp4_16(chunk, block_scale2, token_scale2)
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col, BLOCK_N), *deq[:4])
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col + 8, BLOCK_N), *deq[4:])
            chunk = chunk_next
