"""Triton kernels for the per-step work around the attention kernel (CUDA, any GPU Triton runs on).

* :mod:`.nvfp4` — NVFP4 row encoding as Triton device functions, bit-exact with
  :func:`dsv4_attn.kv_cache.encode_rows`;
* :mod:`.kv_writers` — the fused SWA insert (q RMSNorm + RoPE, KV RoPE + NVFP4 encode + paged
  store) and the store of the compressor's staged rows;
* :mod:`.step_metadata` — the metadata builders' and the CSA layers' slot lists.

Each public function launches one kernel on the current stream, with no host synchronisation, so it
can sit inside a CUDA graph. The torch code they replace stays the reference (and the CPU path).
"""
