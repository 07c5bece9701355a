"""What the DSV4_NVFP4 backend serves, checked when vLLM builds the model.

* :func:`check_supported` — configurations the backend does not implement (context parallelism,
  micro-batching (dual-batch overlap), the vision variant, more query heads per rank than its
  kernels take) raise a ValueError saying so. Speculative decoding (MTP, DSpark) is served.
* :func:`check_serving_device` — the backend's attention kernels are Hopper (sm_90) CuTeDSL
  kernels. On any other device, or when the kernel stack cannot be imported, serving would run
  the torch fallback, one to two orders of magnitude slower: startup fails with the device or the
  cause and what is supported, unless ``DSV4_ATTN_ALLOW_FALLBACK=1`` opts in (for tests and
  debugging; logged as a warning).
"""

from __future__ import annotations

import os

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger

from dsv4_attn.log import LOGGER_PREFIX
from dsv4_attn.vllm_glue import BACKEND_NAME

__all__ = [
    "ALLOW_FALLBACK_ENV",
    "check_serving_device",
    "check_supported",
    "kernel_stack_error",
    "padded_num_heads",
    "unsupported_device_reason",
]

logger = init_logger(LOGGER_PREFIX + __name__)  # vLLM's, with its *_once methods

ALLOW_FALLBACK_ENV = "DSV4_ATTN_ALLOW_FALLBACK"
"""Set to 1 to serve with the torch fallback where the Hopper kernels cannot run."""

_SUPPORTED = "NVIDIA Hopper GPUs (sm_90: H100, H200)"


def check_supported(vllm_config: VllmConfig) -> None:
    """Raise ValueError for a configuration this backend does not serve (at model build)."""
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} does not support decode or prefill context "
            "parallelism; set both sizes to 1."
        )
    if parallel.use_ubatching:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} does not support micro-batching (dual-batch "
            f"overlap: --enable-dbo is {parallel.enable_dbo}, --ubatch-size "
            f"{parallel.ubatch_size}): its KV-cache writers stage rows in one buffer per GPU, "
            "which two overlapping micro-batches would share. Leave --enable-dbo off and "
            "--ubatch-size at 0 or 1."
        )
    hf_config = vllm_config.model_config.hf_config
    if getattr(hf_config, "vision_n_layers", 0) > 0:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} serves the text model only; this checkpoint "
            "has vision layers, whose bidirectional image windows it does not implement."
        )
    heads = vllm_config.model_config.get_num_attention_heads(parallel)
    most = max(_kernel_head_counts(), default=128)
    if heads > most:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} runs at most {most} query heads per rank (its "
            f"kernels' widest variant); this model has {heads} per rank at "
            f"--tensor-parallel-size {parallel.tensor_parallel_size}. Raise the tensor-parallel "
            "size."
        )


def kernel_stack_error() -> str | None:
    """Why this package's CuTeDSL and Triton kernels cannot load here, or None."""
    try:
        from dsv4_attn.kernels import sparse_decode
    except Exception as exc:  # ImportError, or a broken CUDA/DSL install
        return f"dsv4_attn.kernels cannot be imported ({type(exc).__name__}: {exc})"
    stack_error = sparse_decode.kernel_stack_error()
    if stack_error is not None:
        return stack_error
    try:
        import importlib

        for module in ("dsv4_attn.fused.kv_writers", "dsv4_attn.fused.step_metadata"):
            importlib.import_module(module)
    except Exception as exc:
        return f"the Triton kernels cannot be imported ({type(exc).__name__}: {exc})"
    return None


def unsupported_device_reason(device: torch.device) -> str | None:
    """Why the backend's kernels cannot run on ``device``, or None."""
    if device.type != "cuda":
        return f"this vLLM worker runs on {device.type}, not on a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        name = torch.cuda.get_device_name(device)
        return f"this GPU is {name} (sm_{capability[0]}{capability[1]})"
    return kernel_stack_error()


def check_serving_device(device: torch.device) -> None:
    """Raise RuntimeError unless the backend's kernels can run on ``device`` (or the fallback
    is explicitly allowed by ``DSV4_ATTN_ALLOW_FALLBACK=1``)."""
    reason = unsupported_device_reason(device)
    if reason is None:
        return
    if os.environ.get(ALLOW_FALLBACK_ENV, "0") == "1":
        logger.warning_once(
            "%s runs its torch fallback for attention because %s (%s=1 allows this; it is "
            "for testing, and slow).",
            BACKEND_NAME,
            reason,
            ALLOW_FALLBACK_ENV,
        )
        return
    raise RuntimeError(
        f"--attention-backend {BACKEND_NAME} runs its attention kernels on {_SUPPORTED}, but "
        f"{reason}. Serve DeepSeek-V4 on a Hopper GPU, or leave --attention-backend unset to use "
        f"vLLM's own backend. (Set {ALLOW_FALLBACK_ENV}=1 to run this backend's torch fallback "
        "anyway, for testing: it is slow.)"
    )


def _kernel_head_counts() -> tuple[int, ...]:
    """The head counts the CuTeDSL decode kernel takes (none if it cannot be imported)."""
    try:
        from dsv4_attn.kernels import sparse_decode
    except ImportError:
        return ()
    return tuple(sorted(getattr(sparse_decode, "SUPPORTED_HEAD_COUNTS", ())))


def padded_num_heads(num_heads: int) -> int:
    """Query heads the layer allocates: the smallest head count the CuTeDSL kernel supports
    (``sparse_decode.SUPPORTED_HEAD_COUNTS``) that holds ``num_heads``, so no padding where the
    kernel takes the count as it is; ``num_heads`` itself when the kernel is absent (the SDPA
    fallback takes any count). Counts above the widest are refused at model build
    (:func:`check_supported`)."""
    return next((c for c in _kernel_head_counts() if c >= num_heads), num_heads)
