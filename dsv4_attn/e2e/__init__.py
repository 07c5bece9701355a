"""End-to-end harness: a tiny HuggingFace DeepSeek-V4 run with attention routed through
:mod:`dsv4_attn.ops`, compared against transformers' own eager attention (the oracle)."""
