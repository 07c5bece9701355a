"""Prefill tokens of a DeepSeek-V4 layer through the gathered FMHA kernel.

Decode tokens (vLLM puts them first) read the paged caches directly in the sparse-decode kernel.
Prefill tokens come many per request, and neighbours share most of their keys, so each chunk of
prefill requests is handled as vLLM's FlashMLA layer does:

1. **gather** — dequantize each request's visible rows once into a bf16 workspace
   ``[C, M, 512]``: its compressed entries ``0 .. seq_len // ratio`` at rows ``0 .. N`` and its
   window rows (positions ``seq_len - gather_len .. seq_len``, ``gather_len = query_len +
   min(prefix, window - 1)``) at rows ``N .. M``. FP8 uses vLLM's own gather-dequant op on CUDA,
   NVFP4 :func:`dsv4_attn.fused.kv_gather.gather_nvfp4_rows`; elsewhere :func:`dsv4_attn.kv_cache.
   read_unchecked`.
2. **index** — each token's list of workspace rows: its compressed entries (top-k layers, V4's
   CSA and V4.1's compressed layers: the indexer's picks, -1 holes kept and picks the token does
   not see yet, ``>= (pos + 1) // ratio``, made holes, as in decode; V4's HCA: every entry it
   sees, ``(pos + 1) // ratio``) then its window
   (``max(0, pos - window + 1) .. pos``), the same rows the decode path would read.
3. **attend** — :func:`dsv4_attn.fmha_ops.sparse_prefill` with the sink, written into vLLM's
   output rows.

Shapes come from the host copies vLLM keeps (``query_start_loc_cpu`` and the upper bound of
``seq_lens``); the contents from the device tensors: no device-to-host synchronization. The
workspace comes from vLLM's workspace manager; :func:`peak_workspace_shapes` is what the
profiling run reserves, and :func:`plan_chunks` keeps every chunk within it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_attn import fmha_ops, kv_cache
from dsv4_attn.kv_cache import HEAD_DIM, KVFormat
from dsv4_attn.layer_kind import Compressed

__all__ = [
    "PrefillChunk",
    "attend",
    "chunk_workspace_shapes",
    "gather_lens",
    "gather_rows",
    "index_lists",
    "index_width",
    "peak_workspace_shapes",
    "plan_chunks",
    "rows_budget",
    "token_rows_view",
    "warm_gather",
]

_CPU_ROWS_PER_READ = 4096  # rows decoded per torch read (bounds its float32 temporaries)


@dataclass(frozen=True)
class PrefillChunk:
    """Requests ``[first_req, end_req)`` of the step (tokens ``[first_token, end_token)``) whose
    rows share one workspace: ``entries`` compressed rows then ``rows - entries`` window rows per
    request (host upper bounds over the chunk)."""

    first_req: int
    end_req: int
    first_token: int
    end_token: int
    entries: int
    rows: int


def _entries(seq_len: int, compressed: Compressed | None, ceil: bool = False) -> int:
    """Compressed entries of a sequence of ``seq_len`` positions (complete ones, or every
    started one with ``ceil``); 0 for a window-only layer."""
    if compressed is None:
        return 0
    return -(-seq_len // compressed.ratio) if ceil else seq_len // compressed.ratio


def rows_budget(
    max_model_len: int, compressed: Compressed | None, window: int, max_tokens: int
) -> int:
    """Workspace rows a chunk may use: enough for any single request (all its compressed entries
    plus a whole step of query tokens and the window before them)."""
    return _entries(max_model_len, compressed, ceil=True) + window - 1 + max_tokens


def index_width(compressed: Compressed | None, topk: int, entries: int, window: int) -> int:
    """Columns of a token's list: its compressed candidates (top-k, or every entry of the chunk's
    longest request) then the window."""
    if compressed is not None and compressed.top_k:
        return topk + window
    return (entries if compressed is not None else 0) + window


def chunk_workspace_shapes(
    rows: int, tokens: int, width: int, heads: int
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What one chunk takes from the workspace: its gathered ``rows`` (bf16 ``[rows, 512]``),
    each of its ``tokens`` tokens' index list (int32 ``[tokens, width]``) and length (int32
    ``[tokens]``), and the attention's log-sum-exp (fp32 ``[tokens, heads]``)."""
    return [
        ((rows, HEAD_DIM), torch.bfloat16),
        ((tokens, width), torch.int32),
        ((tokens,), torch.int32),
        ((tokens, heads), torch.float32),
    ]


def peak_workspace_shapes(
    max_model_len: int,
    compressed: Compressed | None,
    window: int,
    topk: int,
    max_tokens: int,
    heads: int,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The largest :func:`chunk_workspace_shapes` any chunk of a step asks for."""
    entries = _entries(max_model_len, compressed, ceil=True)
    width = index_width(compressed, topk, entries, window)
    rows = rows_budget(max_model_len, compressed, window, max_tokens)
    return chunk_workspace_shapes(rows, max_tokens, width, heads)


def plan_chunks(
    query_start_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    first_req: int,
    num_reqs: int,
    compressed: Compressed | None,
    window: int,
    budget: int,
) -> list[PrefillChunk]:
    """Greedy chunks of requests ``first_req ..`` whose ``count x (entries + gather)`` rows fit
    ``budget`` (a request alone always fits: see :func:`rows_budget`). Host tensors only."""
    starts = query_start_cpu.tolist()
    seqs = seq_lens_cpu.tolist()
    chunks: list[PrefillChunk] = []
    r = first_req
    end = first_req + num_reqs
    while r < end:
        entries = gather = 0
        last = r
        while last < end:
            query_len = starts[last + 1] - starts[last]
            seq_len = int(seqs[last])
            e = _entries(seq_len, compressed)
            g = query_len + min(max(seq_len - query_len, 0), window - 1)
            wider = (max(entries, e), max(gather, g))
            if last > r and (last + 1 - r) * (wider[0] + wider[1]) > budget:
                break
            entries, gather = wider
            last += 1
        chunks.append(PrefillChunk(r, last, starts[r], starts[last], entries, entries + gather))
        r = last
    return chunks


def gather_lens(query_lens: torch.Tensor, seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """int32 window rows each request gathers: its query tokens and up to ``window - 1`` before."""
    prefix = (seq_lens - query_lens).clamp(min=0, max=window - 1)
    return (query_lens + prefix).to(torch.int32)


def _read_run(
    out: torch.Tensor,
    cache: torch.Tensor,
    fmt: KVFormat,
    block_size: int,
    block_table: torch.Tensor,
    first: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Torch path: ``out[c, i] = row first[c] + i`` of request ``c`` for ``i < count[c]``
    (zeros past it, and for a row whose block lies outside the block table or whose page lies
    outside the cache: the Triton gather's rule)."""
    C, width = out.shape[:2]
    step = max(1, _CPU_ROWS_PER_READ // max(C, 1))
    for i0 in range(0, width, step):
        i = torch.arange(i0, min(width, i0 + step), device=out.device)
        row = first[:, None] + i[None, :]
        use = (i[None, :] < count[:, None]) & (row >= 0)
        use &= row // block_size < block_table.shape[1]
        row = torch.where(use, row, 0)
        page = block_table.gather(1, row // block_size).long()
        use &= (page >= 0) & (page < cache.shape[0])
        slots = torch.where(use, page * block_size + row % block_size, -1)
        rows = kv_cache.read_unchecked(cache, slots.flatten(), fmt, block_size)
        out[:, i0 : i0 + i.shape[0]] = rows.view(C, i.shape[0], HEAD_DIM)


def gather_rows(
    workspace: torch.Tensor,
    chunk: PrefillChunk,
    fmt: KVFormat,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    window: int,
    swa: tuple[torch.Tensor, torch.Tensor, int],
    compressed: tuple[torch.Tensor, torch.Tensor, int, int] | None,
    vllm_caches: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Fill the chunk's workspace rows; returns them as ``bf16 [C, M, 512]``.

    Args:
        workspace: ``bf16 [>= C * M, 512]``.
        seq_lens, query_lens: ``int32 [C]`` the chunk's requests (device).
        swa: (SWA pages ``uint8 [blocks, page_bytes]``, block table ``int32 [C, *]``, block size).
        compressed: (pages, block table ``[C, *]``, entries per page, compress ratio) or None.
        vllm_caches: the layer's raw fp8 caches (SWA, compressed) for vLLM's fp8 op on CUDA.
    """
    C, N, M = chunk.end_req - chunk.first_req, chunk.entries, chunk.rows
    rows = workspace[: C * M].view(C, M, HEAD_DIM)
    glens = gather_lens(query_lens, seq_lens, window)
    on_cuda = _runs_fused(rows.device)
    swa_pages, swa_table, swa_block = swa
    if on_cuda and fmt is KVFormat.FP8_DS_MLA and vllm_caches is not None:
        from vllm.models.deepseek_v4.common.ops import dequantize_and_gather_k_cache

        swa_cache, compressed_cache = vllm_caches
        if compressed is not None and N:
            _, table, per_page, ratio = compressed
            dequantize_and_gather_k_cache(
                rows,
                compressed_cache,
                seq_lens=seq_lens // ratio,
                gather_lens=None,
                block_table=table,
                block_size=per_page,
                offset=0,
            )
        dequantize_and_gather_k_cache(
            rows,
            swa_cache,
            seq_lens=seq_lens,
            gather_lens=glens,
            block_table=swa_table,
            block_size=swa_block,
            offset=N,
        )
    elif on_cuda and fmt is KVFormat.NVFP4:
        from dsv4_attn.fused.kv_gather import gather_nvfp4_rows

        if compressed is not None and N:
            pages, table, per_page, ratio = compressed
            gather_nvfp4_rows(rows, pages, per_page, seq_lens, table, 0, N, ratio=ratio)
        gather_nvfp4_rows(
            rows, swa_pages, swa_block, seq_lens, swa_table, N, M - N, gather_lens=glens
        )
    else:
        if compressed is not None and N:
            pages, table, per_page, ratio = compressed
            _read_run(
                rows[:, :N],
                pages,
                fmt,
                per_page,
                table,
                torch.zeros_like(seq_lens),
                seq_lens // ratio,
            )
        _read_run(rows[:, N:], swa_pages, fmt, swa_block, swa_table, seq_lens - glens, glens)
    return rows


def _runs_fused(device: torch.device) -> bool:
    """Whether the gather runs the GPU ops (vLLM's fp8 op, the NVFP4 Triton kernel)."""
    return device.type == "cuda"


def token_rows_view(pages: torch.Tensor, fmt: KVFormat, block_size: int) -> torch.Tensor:
    """``uint8 [num_pages, page_bytes]`` pages as ``[num_pages, block_size, row bytes]``, one
    token's bytes per row: the shape vLLM's fp8 gather op takes its cache in."""
    row = kv_cache.bytes_per_token(fmt)
    return pages.as_strided((pages.shape[0], block_size, row), (pages.stride(0), row, 1))


def warm_gather(
    fmt: KVFormat,
    compressed: Compressed | None,
    window: int,
    swa_block: int,
    cache_block: int,
    device: torch.device,
) -> None:
    """Run :func:`gather_rows` once on a one-request chunk over small caches of their own, so
    that every gather variant a layer of this kind launches (window rows; compressed entries,
    where the layer has them) is compiled now and not in a user's first prefill with earlier
    context. vLLM's mixed warm-up batch has none: its prompts start at position 0, so no
    request gathers compressed entries. Called in the profiling run, before the KV caches
    exist; the values written are not used.

    Args:
        compressed: the layer's compressed entries (None: window only).
        swa_block: tokens per window page; cache_block: tokens per compressed block
            (``cache_block // ratio`` entries per page).
    """
    ratio = compressed.ratio if compressed is not None else 1
    seq_len = 2 * ratio + 1  # at least two entries and one window row
    entries = _entries(seq_len, compressed)
    rows = entries + seq_len
    chunk = PrefillChunk(0, 1, 0, seq_len, entries, rows)
    i32 = torch.int32
    lens = torch.tensor([seq_len], dtype=i32, device=device)

    def pages(block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cache of 2 pages more than one request of ``seq_len`` rows spans (the count is
        not specialized), its block table, and the fp8 op's view of it."""
        count = -(-seq_len // block) + 2
        cache = kv_cache.allocate(count, block, fmt, device)
        table = torch.arange(count, dtype=i32, device=device)[None]
        return cache, table, token_rows_view(cache, fmt, block)

    swa_pages, swa_table, swa_view = pages(swa_block)
    extra, extra_view = None, None
    if compressed is not None:
        per_page = cache_block // ratio
        extra_pages, extra_table, extra_view = pages(per_page)
        extra = (extra_pages, extra_table, per_page, ratio)
    vllm_caches = (swa_view, extra_view) if fmt is KVFormat.FP8_DS_MLA else None
    workspace = torch.empty(rows, HEAD_DIM, dtype=torch.bfloat16, device=device)
    gather_rows(
        workspace,
        chunk,
        fmt,
        lens,
        lens,
        window,
        (swa_pages, swa_table, swa_block),
        extra,
        vllm_caches,
    )


def index_lists(
    chunk: PrefillChunk,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    compressed: Compressed | None,
    local_topk: torch.Tensor | None,
    out: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk token's workspace rows (compressed candidates, then its window) and count.

    Args:
        query_start: ``int32 [C + 1]`` the chunk's slice of ``query_start_loc`` (absolute).
        seq_lens: ``int32 [C]``.
        compressed: the layer's compressed entries (None: window only).
        local_topk: top-k layers: ``int32 [T_chunk, K]`` the indexer's request-local entries
            (-1 = none).
        out: ``int32`` buffers ``[>= T_chunk, >= width]`` and ``[>= T_chunk]``.

    Returns:
        ``(indices [T_chunk, width], lens [T_chunk])`` views of ``out``.
    """
    device = seq_lens.device
    N, M = chunk.entries, chunk.rows
    T = chunk.end_token - chunk.first_token
    topk = local_topk.shape[1] if local_topk is not None else 0
    width = index_width(compressed, topk, N, window)
    indices, lens = out[0][:T, :width], out[1][:T]
    if device.type == "cuda":
        from dsv4_attn.fused.prefill_index import fill_prefill_index

        fill_prefill_index(
            query_start,
            seq_lens,
            chunk.first_token,
            T,
            N,
            M,
            compressed,
            window,
            local_topk[:T] if local_topk is not None else None,
            indices,
            lens,
        )
        return indices, lens
    return _index_lists_torch(
        chunk, query_start, seq_lens, window, compressed, local_topk, indices, lens
    )


def _index_lists_torch(chunk, query_start, seq_lens, window, compressed, local_topk, indices, lens):
    """:func:`index_lists` in torch ops (any device; the reference of the Triton kernel)."""
    device = seq_lens.device
    C, N, M = query_start.shape[0] - 1, chunk.entries, chunk.rows
    T = chunk.end_token - chunk.first_token
    topk = local_topk.shape[1] if local_topk is not None else 0
    t = torch.arange(chunk.first_token, chunk.end_token, device=device)
    qs = query_start.long()
    req = torch.searchsorted(qs[1 : C + 1], t, right=True).clamp(max=C - 1)
    seq = seq_lens.long()[req]
    query_len = (qs[1:] - qs[:-1])[req]
    pos = seq - query_len + (t - qs[req])
    base = req * M
    # The window: positions start .. pos, at rows N + (position - gather_start).
    glen = gather_lens(query_len, seq, window).long()
    start = (pos - (window - 1)).clamp(min=0)
    wlen = pos - start + 1
    offsets = torch.arange(window, device=device)
    window_rows = base[:, None] + N + (start - (seq - glen))[:, None] + offsets[None, :]
    window_rows = torch.where(offsets[None, :] < wlen[:, None], window_rows, -1)
    if compressed is not None and compressed.top_k:
        assert local_topk is not None
        entries = local_topk[:T].long()
        usable = (entries >= 0) & (entries < ((pos + 1) // compressed.ratio)[:, None])
        indices[:, :topk] = torch.where(usable, base[:, None] + entries, -1)
        indices[:, topk:] = window_rows
        lens.copy_(topk + wlen)
    elif compressed is not None:
        count = (pos + 1) // compressed.ratio
        e = torch.arange(N + window, device=device)[None, :]
        from_window = e - count[:, None]
        indices.copy_(
            torch.where(
                e < count[:, None],
                base[:, None] + e,
                window_rows.gather(1, from_window.clamp(0, window - 1)),
            )
        )
        indices.masked_fill_(from_window >= wlen[:, None], -1)
        lens.copy_(count + wlen)
    else:
        indices.copy_(window_rows)
        lens.copy_(wlen)
    return indices, lens


def attend(
    q: torch.Tensor,
    rows: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """The chunk's attention, written into ``out`` (vLLM's output rows of its tokens); its
    log-sum-exp goes to ``lse`` (fp32 ``[tokens, heads]``, workspace: nothing reads it)."""
    fmha_ops.sparse_prefill(
        q, rows.view(-1, HEAD_DIM), indices, lens, sink, scale, check_values=False, out=out, lse=lse
    )
