"""vLLM 0.33.0 glue for the DSV4_NVFP4 attention backend (DeepSeek-V4).

One role per module:

* :mod:`.compat` — the vLLM version this glue targets and a cheap check of the installed one.
* :mod:`.model_hook` — makes DeepSeek-V4's decoder build :class:`.attention.DSV4NVFP4Attention`
  when ``--attention-backend DSV4_NVFP4`` is given.
* :mod:`.backend` — the backend classes vLLM groups layers and builds metadata by.
* :mod:`.metadata` — per-step metadata builders (vectorized torch, CPU or CUDA).
* :mod:`.kv_spec` — ``--kv-cache-dtype`` resolution, KV-cache specs and page views.
* :mod:`.writers` — NVFP4 writers for the SWA insert and the compressor output.
* :mod:`.attention` — the DeepSeek-V4 attention layer subclass (``forward_mqa``).

Importing this package is cheap: it holds names only. The modules that import vLLM's model code
(backend, metadata, attention, writers) are imported by vLLM when it builds the model.
"""

BACKEND_NAME = "DSV4_NVFP4"
"""The ``--attention-backend`` value, and the ``AttentionBackendEnum`` member name."""

SWA_BACKEND_NAME = f"{BACKEND_NAME}_SWA"
"""The name of the backend of this backend's sliding-window caches (vLLM groups layers by it)."""

BACKEND_CLASS_PATH = "dsv4_attn.vllm_glue.backend.DSV4NVFP4Backend"
"""Fully qualified class registered for :data:`BACKEND_NAME`."""
