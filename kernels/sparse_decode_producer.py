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
        nope bytes and scales into registers with 16-byte (FP8) or 8-byte (NVFP4) loads,
        dequantizes its 112 nope values into the key's SMEM row and copies 16 of its RoPE
        values there by cp.async. Round 0 of the next tile is loaded while round 1 of this one
        is dequantized; slot ids are loaded two tiles ahead and the next tile's rows prefetched
        into L2 while this tile is staged.
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
        # Key of this lane in round r of tile t: key0 + 64 t + 8 r; its SMEM row row0 + 8 r.
        key0 = key_begin + pwarp * KEYS_PER_PRODUCER_WARP + (lane >> 2)
        row0 = pwarp * KEYS_PER_PRODUCER_WARP + (lane >> 2)
        scope = (*self.id_rows(mIdx, mEIdx, token), n_window, key_end)

        # Slot ids are loaded two tiles ahead (only packed, i.e. waited for, when used), rows
        # prefetched into L2 one tile ahead and loaded into registers one round ahead (``ahead``:
        # round 0 of the next tile); RoPE values are copied into the stage by cp.async.
        raw = self.raw_slots(*scope, key0)
        raw_next = self.raw_slots(*scope, key0 + BLOCK_N)
        ahead = self.load_key(self.pack_slot(raw[0], key0, n_window), part, *bases)
        for tile in cutlass.range(n_tiles, unroll=1):
            stage = tile % NUM_STAGES
            key_t = key0 + tile * BLOCK_N
            packed = [self.pack_slot(raw[r], key_t + r * 8, n_window) for r in range(ROUNDS)]
            packed_next = [
                self.pack_slot(raw_next[r], key_t + BLOCK_N + r * 8, n_window)
                for r in range(ROUNDS)
            ]
            first = ahead
            second = self.load_key(packed[1], part, *bases)
            raw_next2 = self.raw_slots(*scope, key_t + 2 * BLOCK_N)
            for r in cutlass.range_constexpr(ROUNDS):
                self.prefetch_key(packed_next[r], part, *bases)
            if tile >= NUM_STAGES:
                cute.arch.mbarrier_wait(empty_bar + stage, ((tile // NUM_STAGES) + 1) % 2)
            stage_base = sK_base + stage * (BLOCK_N * HEAD_DIM * 2)
            for r in cutlass.range_constexpr(ROUNDS):
                self.copy_rope(packed[r], row0 + r * 8, part, parity, stage_base, *bases)
            self.store_key(first, packed[0] >= 0, row0, lane, stage_base)
            ahead = self.load_key(packed_next[0], part, *bases)
            self.store_key(second, packed[1] >= 0, row0 + 8, lane, stage_base)
            if part == 0:
                for r in cutlass.range_constexpr(ROUNDS):
                    key_bias[row0 + r * 8, stage] = Float32(
                        cutlass.select_(packed[r] >= 0, Float32(0.0), Float32(-math.inf))
                    )
            ptx_ops.cp_async_wait_all()  # this lane's RoPE copies have landed
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(full_bar + stage)
            raw = raw_next
            raw_next = raw_next2

    @cute.jit
    def id_rows(self, mIdx, mEIdx, token):
        """Addresses of the token's window and extra slot-id rows (the window's twice if none)."""
        elem = self.cfg.index_bytes
        window_ids = mIdx.iterator.toint() + Int64(token) * Int64(mIdx.stride[0]) * elem
        extra_ids = window_ids
        if const_expr(self.cfg.has_extra):
            extra_ids = mEIdx.iterator.toint() + Int64(token) * Int64(mEIdx.stride[0]) * elem
        return window_ids, extra_ids

    @cute.jit
    def raw_slots(self, window_ids, extra_ids, n_window, key_end, key) -> tuple:
        """Slot ids of a lane's keys ``key + 8 r`` (one per round), as loaded: -1 past
        ``key_end``; the loads are not waited for until :meth:`pack_slot` reads them."""
        elem = self.cfg.index_bytes
        out = []
        for r in cutlass.range_constexpr(ROUNDS):
            k = key + r * 8
            # (int64 ids: their low word, as every slot id is < 2^30 and -1 stays -1.)
            addr = Int64(
                cutlass.select_(k < n_window, window_ids + Int64(k) * elem,
                                extra_ids + Int64(k - n_window) * elem)
            )  # fmt: skip
            present = Int32(cutlass.select_(k < key_end, Int32(1), Int32(0)))
            out.append(ptx_ops.ld_global_nc_b32_if(addr, present, -1))
        return tuple(out)

    @cute.jit
    def pack_slot(self, raw, key, n_window) -> Int32:
        """``slot * 2 + is_extra`` of key ``key`` from its loaded slot id, or -1 if it has none."""
        is_extra = Int32(cutlass.select_(key >= n_window, Int32(1), Int32(0)))
        if const_expr(not self.cfg.has_extra):
            is_extra = Int32(0)
        return Int32(cutlass.select_(raw >= 0, raw * 2 + is_extra, Int32(-1)))

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

        The lines to touch are the data row's every 128 bytes, its last byte and the scale row
        (at most 8 items); lane ``part`` takes items ``part`` and ``part + 4`` of that list.
        """
        if packed >= 0:
            data_addr, scale_addr = self.row_addresses(
                packed, cache_base, page_stride, ecache_base, epage_stride
            )
            n_lines = len(range(0, self.data_row, 128)) + 1  # every 128 B, and the last byte
            for j in cutlass.range_constexpr(2):
                item = part + 4 * j  # items n_lines.. are the scale row (prefetched again)
                line = cutlass.min(item * 128, self.data_row - 1)
                addr = Int64(cutlass.select_(item < n_lines, data_addr + line, scale_addr))
                ptx_ops.prefetch_l2(addr)

    @cute.jit
    def load_key(self, packed, part, cache_base, page_stride, ecache_base, epage_stride):
        """Registers of lane ``part``'s quarter of a key: ``(nope, rope, scales)``.

        FP8: nope chunk d (d < 7) = bytes 64d + 16 part .. +15 (values 64d + 16 part ..), 4 words;
        NVFP4: bytes 32d + 8 part .. +7 (the same 16 values), 2 words. RoPE: the 16-byte chunks
        ``rope_chunk(part, parity, 0/1)`` of the 128 RoPE bytes. Scales: FP8 the whole scale row
        (2 words), NVFP4 its words 2 part and 2 part + 1 (the key's four lanes hold the row).
        A key without a slot (``packed`` < 0) reads slot 0 of the window cache instead;
        :meth:`store_key` zeroes it.
        """
        data_addr, scale_addr = self.row_addresses(
            cutlass.max(packed, 0), cache_base, page_stride, ecache_base, epage_stride
        )
        if const_expr(self.is_fp8):
            nope = [ptx_ops.ld_global_nc_v4(data_addr + 64 * d + 16 * part) for d in range(7)]
            scales = ptx_ops.ld_global_nc_v2(scale_addr)
        else:
            nope = [ptx_ops.ld_global_nc_v2(data_addr + 32 * d + 8 * part) for d in range(7)]
            # A quarter of the scale row (words 2 part, 2 part + 1); store_key shuffles.
            scales = ptx_ops.ld_global_nc_v2(scale_addr + 8 * part)
        # One flat tuple of words (it is carried from one loop iteration to the next).
        return (*[w for chunk in nope for w in chunk], *scales)

    @staticmethod
    def rope_chunk(part, parity, c):
        """16-byte RoPE chunk (0..7) a lane handles in its ``c``-th copy (load and store).

        Lanes of odd keys (``parity`` 1) take their two chunks in the other order, so each
        8-lane phase of a store (keys 2i and 2i+1) covers 8 distinct 16-byte bank groups.
        """
        return part + 4 * (c ^ parity)

    @cute.jit
    def copy_rope(self, packed, row, part, parity, stage_base, cache_base, page_stride,
                  ecache_base, epage_stride):  # fmt: skip
        """cp.async lane ``part``'s two 16-byte RoPE chunks of a key into its SMEM row (bf16
        values need no conversion); a key without a slot copies 0 bytes, i.e. zeros."""
        data_addr, _ = self.row_addresses(
            cutlass.max(packed, 0), cache_base, page_stride, ecache_base, epage_stride
        )
        rope_at = NOPE_DIM if const_expr(self.is_fp8) else NVFP4_NOPE_BYTES
        size = Int32(cutlass.select_(packed >= 0, Int32(16), Int32(0)))
        for c in cutlass.range_constexpr(2):
            chunk = self.rope_chunk(part, parity, c)
            ptx_ops.cp_async_16(stage_base + swizzled_offset(row, NOPE_DIM + 8 * chunk),
                                data_addr + rope_at + 16 * chunk, size)  # fmt: skip

    @cute.jit
    def store_key(self, loaded, valid, row, lane, stage_base):
        """Dequantize a lane's quarter of one key into K/V stage row ``row`` (zeros if invalid)."""
        n_nope = 4 if const_expr(self.is_fp8) else 2  # words per nope chunk
        nope = [loaded[n_nope * d : n_nope * (d + 1)] for d in range(7)]
        scales = loaded[7 * n_nope :]
        part = lane & 3
        zero = Uint32(0)
        if const_expr(not self.is_fp8):
            quad = lane & ~3

            def scale_word(w):  # word w of the key's NVFP4 scale row, held by lane w // 2
                return Uint32(cute.arch.shuffle_sync(scales[w % 2], quad | (w // 2)))

            token_scale2 = Uint32(
                cutlass.select_(valid, nvfp4_token_scale_bf16x2(scale_word(7) & 0xFF), zero)
            )
        for d in cutlass.range_constexpr(7):
            col = 64 * d + 16 * part
            if const_expr(self.is_fp8):
                e = (scales[d // 4] >> (8 * (d % 4))) & 0xFF
                scale2 = Uint32(cutlass.select_(valid, fp8_block_scale_bf16x2(e), zero))
                deq = dequant_fp8_16(nope[d], scale2)
            else:
                block_scale2 = nvfp4_block_scale_bf16x2((scale_word(d) >> (part * 8)) & 0xFF)
                deq = dequant_nvfp4_16(nope[d], block_scale2, token_scale2)
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col), *deq[:4])
            ptx_ops.st_shared_v4(stage_base + swizzled_offset(row, col + 8), *deq[4:])
