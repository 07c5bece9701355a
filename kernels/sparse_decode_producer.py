"""The producer warpgroup of the Hopper sparse-decode kernel: gather, dequantize, stage.

A mixin of :class:`dsv4_attn.kernels.sparse_decode_sm90.SparseDecodeSm90` (its ``cfg``,
``is_fp8``, ``data_row`` and ``scale_row``): per 64-key tile, each key's rows are read from the
paged cache (FP8 or NVFP4, ``dsv4_attn.kv_cache``), dequantized to bf16 with the bit recipes of
:mod:`dsv4_attn.kernels.dequant` and stored, RoPE values included, into the K/V stage the MMA
warpgroups read (swizzled as :func:`~dsv4_attn.kernels.sparse_decode_config.swizzled_offset`
says); the ``full``/``empty`` mbarriers hand stages over.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from dsv4_attn.kernels import ptx_ops
from dsv4_attn.kernels.dequant import (
    dequant_fp8_16,
    dequant_nvfp4_16,
    fp8_block_scale_bf16x2,
    nvfp4_block_scale_bf16x2,
    nvfp4_token_scale_bf16x2,
)
from dsv4_attn.kernels.sparse_decode_config import (
    BLOCK_N,
    HEAD_DIM,
    KEYS_PER_PRODUCER_WARP,
    NOPE_DIM,
    NUM_STAGES,
    NVFP4_NOPE_BYTES,
    ROUNDS,
    swizzled_offset,
)

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
        key_bias: cute.Tensor,
        full_bar,
        empty_bar,
        token: Int32,
        n_window: Int32,
        key_begin: Int32,
        key_end: Int32,
        n_tiles: Int32,
        ptid: Int32,
    ):
        """Gather, dequantize and stage one 64-key tile per iteration.

        Warp w stages keys 16w..16w+15 of a tile in two rounds of 8 keys; in a round, the four
        lanes ``4k..4k+3`` share key k (``part`` = lane % 4): each loads a quarter of the key's
        rows into registers with 16-byte (FP8) or 8-byte (NVFP4) loads, dequantizes its 112
        nope values and stores them, with its 16 RoPE values, into the key's SMEM row. Both
        rounds' loads are issued before the first dequantization; slot ids are loaded two tiles
        ahead and the next tile's rows prefetched into L2 while this tile is staged.
        """
        pwarp = cute.arch.make_warp_uniform(ptid // 32)
        lane = ptid & 31
        part = lane & 3
        parity = (lane >> 2) & 1  # of the lane's keys (rows row0 + 8 r)
        sK_base = sK.iterator.toint()
        bases = [mCache.iterator.toint(), Int64(mCache.stride[0])]
        if const_expr(self.cfg.has_extra):
            bases += [mECache.iterator.toint(), Int64(mECache.stride[0])]
        else:
            bases += bases
        # Key of this lane in round r of tile t: key0 + 64 t + 8 r.
        key0 = key_begin + pwarp * KEYS_PER_PRODUCER_WARP + (lane >> 2)
        row0 = pwarp * KEYS_PER_PRODUCER_WARP + (lane >> 2)

        slots = self.round_slots(mIdx, mEIdx, token, n_window, key0, key_end)
        slots_next = self.round_slots(mIdx, mEIdx, token, n_window, key0 + BLOCK_N, key_end)
        for r in cutlass.range_constexpr(ROUNDS):
            self.prefetch_key(slots[r], part, *bases)
        for tile in cutlass.range(n_tiles, unroll=1):
            stage = tile % NUM_STAGES
            loaded = [self.load_key(slots[r], part, parity, *bases) for r in range(ROUNDS)]
            slots_next2 = self.round_slots(
                mIdx, mEIdx, token, n_window, key0 + (tile + 2) * BLOCK_N, key_end
            )
            for r in cutlass.range_constexpr(ROUNDS):
                self.prefetch_key(slots_next[r], part, *bases)
            if tile >= NUM_STAGES:
                cute.arch.mbarrier_wait(empty_bar + stage, ((tile // NUM_STAGES) + 1) % 2)
            stage_base = sK_base + stage * (BLOCK_N * HEAD_DIM * 2)
            for r in cutlass.range_constexpr(ROUNDS):
                self.store_key(loaded[r], slots[r] >= 0, row0 + r * 8, part, parity, stage_base)
                if part == 0:
                    key_bias[row0 + r * 8, stage] = Float32(
                        cutlass.select_(slots[r] >= 0, Float32(0.0), Float32(-math.inf))
                    )
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(full_bar + stage)
            slots = slots_next
            slots_next = slots_next2

    @cute.jit
    def round_slots(self, mIdx, mEIdx, token, n_window, key, key_end) -> tuple:
        """Packed slots of a lane's keys in the rounds of one tile (``key``, ``key + 8``)."""
        return tuple(
            self.load_slot(mIdx, mEIdx, token, n_window, key + r * 8, key_end)
            for r in range(ROUNDS)
        )

    @cute.jit
    def load_slot(self, mIdx, mEIdx, token, n_window, key, key_end) -> Int32:
        """``slot * 2 + is_extra`` of key ``key`` of the token, or -1 if it has none."""
        packed = Int32(-1)
        if key < key_end:
            if key < n_window:
                slot = Int32(mIdx[token, key])
                if slot >= 0:
                    packed = slot * 2
            else:
                if const_expr(self.cfg.has_extra):
                    slot = Int32(mEIdx[token, key - n_window])
                    if slot >= 0:
                        packed = slot * 2 + 1
        return packed

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
            shift = Int32(cutlass.select_(is_extra, Int32(ebs.bit_length() - 1),
                                          Int32(bs.bit_length() - 1)))  # fmt: skip
            mask = Int32(cutlass.select_(is_extra, Int32(ebs - 1), Int32(bs - 1)))
            base = Int64(cutlass.select_(is_extra, ecache_base, cache_base))
            stride = Int64(cutlass.select_(is_extra, epage_stride, page_stride))
            scales_at = Int32(cutlass.select_(is_extra, Int32(ebs * self.data_row),
                                              Int32(bs * self.data_row)))  # fmt: skip
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
    def prefetch_key(self, packed, part, cache_base, page_stride, ecache_base, epage_stride):
        """Prefetch into L2 the lines of a key's data and scale rows, shared by its 4 lanes.

        The lines to touch are the data row's every 128 bytes, its last byte and the scale row;
        lane ``part`` takes items ``part`` and ``part + 4`` of that list.
        """
        if packed >= 0:
            data_addr, scale_addr = self.row_addresses(
                packed, cache_base, page_stride, ecache_base, epage_stride
            )
            offsets = [*range(0, self.data_row, 128), self.data_row - 1]
            n_items = len(offsets) + 1  # + the scale row
            for j in cutlass.range_constexpr(2):
                item = part + 4 * j
                if item < n_items:
                    line = cutlass.min(item * 128, self.data_row - 1)
                    addr = Int64(cutlass.select_(item < n_items - 1, data_addr + line, scale_addr))
                    ptx_ops.prefetch_l2(addr)

    @cute.jit
    def load_key(self, packed, part, parity, cache_base, page_stride, ecache_base, epage_stride):
        """Registers of lane ``part``'s quarter of a key: ``(nope, rope, scales)``.

        FP8: nope chunk d (d < 7) = bytes 64d + 16 part .. +15 (values 64d + 16 part ..), 4 words;
        NVFP4: bytes 32d + 8 part .. +7 (the same 16 values), 2 words. RoPE: the 16-byte chunks
        ``rope_chunk(part, parity, 0/1)`` of the 128 RoPE bytes. Scales: the whole scale row (FP8 2
        words, NVFP4 8). A key without a slot (``packed`` < 0) reads slot 0 of the window
        cache instead; :meth:`store_key` zeroes it.
        """
        data_addr, scale_addr = self.row_addresses(
            cutlass.max(packed, 0), cache_base, page_stride, ecache_base, epage_stride
        )
        rope_at = NOPE_DIM if const_expr(self.is_fp8) else NVFP4_NOPE_BYTES
        if const_expr(self.is_fp8):
            nope = [ptx_ops.ld_global_nc_v4(data_addr + 64 * d + 16 * part) for d in range(7)]
            scales = ptx_ops.ld_global_nc_v2(scale_addr)
        else:
            nope = [ptx_ops.ld_global_nc_v2(data_addr + 32 * d + 8 * part) for d in range(7)]
            scales = (
                *ptx_ops.ld_global_nc_v4(scale_addr),
                *ptx_ops.ld_global_nc_v4(scale_addr + 16),
            )
        rope = [
            ptx_ops.ld_global_nc_v4(data_addr + rope_at + 16 * self.rope_chunk(part, parity, c))
            for c in range(2)
        ]
        return nope, rope, scales

    @staticmethod
    def rope_chunk(part, parity, c):
        """16-byte RoPE chunk (0..7) a lane handles in its ``c``-th copy (load and store).

        Lanes of odd keys (``parity`` 1) take their two chunks in the other order, so each
        8-lane phase of a store (keys 2i and 2i+1) covers 8 distinct 16-byte bank groups.
        """
        return part + 4 * (c ^ parity)

    @cute.jit
    def store_key(self, loaded, valid, row, part, parity, stage_base):
        """Dequantize a lane's quarter of one key into K/V stage row ``row`` (zeros if invalid)."""
        nope, rope, scales = loaded
        zero = Uint32(0)
        if const_expr(not self.is_fp8):
            token_scale2 = Uint32(
                cutlass.select_(valid, nvfp4_token_scale_bf16x2(scales[7] & 0xFF), zero)
            )
        for d in cutlass.range_constexpr(7):
            col = 64 * d + 16 * part
            if const_expr(self.is_fp8):
                e = (scales[d // 4] >> (8 * (d % 4))) & 0xFF
                scale2 = Uint32(cutlass.select_(valid, fp8_block_scale_bf16x2(e), zero))
                deq = dequant_fp8_16(nope[d], scale2)
            else:
                block_scale2 = nvfp4_block_scale_bf16x2((scales[d] >> (part * 8)) & 0xFF)
                deq = dequant_nvfp4_16(nope[d], block_scale2, token_scale2)
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col), *deq[:4])
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col + 8), *deq[4:])
        for c in cutlass.range_constexpr(2):
            words = [Uint32(cutlass.select_(valid, w, zero)) for w in rope[c]]
            col = NOPE_DIM + 8 * self.rope_chunk(part, parity, c)
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col), *words)
