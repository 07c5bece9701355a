"""dsv4-attn: the DSV4_NVFP4 attention backend for DeepSeek-V4 in vLLM.

Importing this package is cheap: it loads neither vLLM nor CUDA. See ``dsv4_attn.ops`` for the
attention entry points and ``dsv4_attn.kv_cache`` for the cache formats.
"""

__version__ = "0.1.0"
