"""The backend classes of DSV4_NVFP4, as vLLM 0.33.0 sees them.

DeepSeek-V4 layers do not go through vLLM's generic backend selector: the layer class carries its
backend (``backend_cls``), and vLLM uses it to group layers, pick a block size and build metadata.
There are two, like vLLM's FlashMLA path: :class:`DSV4NVFP4Backend` for the attention layers'
compressed caches (CSA, HCA) and :class:`DSV4NVFP4SWABackend` for every layer's SWA cache.

Neither has an impl class: attention runs in
:meth:`dsv4_attn.vllm_glue.attention.DSV4NVFP4Attention.forward_mqa`. The capability flags are
stated honestly in case a generic layer ever validates against them: MLA, sparse, sink, head size
512, bf16 queries, the ``--kv-cache-dtype`` values of :mod:`.kv_spec`, any compute capability
(the SDPA fallback runs anywhere; the CuTeDSL kernels need 9.x, see
:meth:`DSV4NVFP4Backend.kernels_support`).
"""

from __future__ import annotations

from typing import ClassVar

from vllm.config.cache import CacheDType
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

from dsv4_attn.vllm_glue import BACKEND_NAME, SWA_BACKEND_NAME
from dsv4_attn.vllm_glue.kv_spec import KV_CACHE_DTYPES
from dsv4_attn.vllm_glue.metadata import DSV4CompressedMetadataBuilder, DSV4SWAMetadataBuilder

__all__ = ["DSV4NVFP4Backend", "DSV4NVFP4SWABackend"]


class DSV4NVFP4Backend(DeepseekV4SparseMLABackend):
    """Backend of DSV4_NVFP4 attention layers and their compressed (CSA/HCA) caches."""

    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(KV_CACHE_DTYPES)  # type: ignore[assignment]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[DSV4CompressedMetadataBuilder]:
        return DSV4CompressedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # 256 tokens per block, as vLLM's DeepSeek-V4 indexer backend requires (one block size
        # must suit every backend of the model).
        return [256]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return True  # the SDPA fallback runs anywhere

    @classmethod
    def kernels_support(cls, capability: DeviceCapability | None) -> bool:
        """Whether this package's CuTeDSL kernels target ``capability`` (Hopper, 9.x)."""
        return capability is not None and capability.major == 9


class DSV4NVFP4SWABackend(DeepseekSparseSWABackend):
    """Backend of the SWA caches of DSV4_NVFP4 layers (64-token pages)."""

    @staticmethod
    def get_name() -> str:
        return SWA_BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[DSV4SWAMetadataBuilder]:
        return DSV4SWAMetadataBuilder
