"""DeepSeek-V4-Flash's attention at its real shapes, the rest shrunk: a checkpoint to serve.

    python -m dsv4_attn.e2e.real_shapes DIR [--experts 8] [--layers 43] [--seed 0]

writes a random-weight checkpoint that ``vllm serve DIR`` loads as it is, with a word-level
tokenizer (``tokenizer.json``: token ``i`` is the word ``w<i>``) so that ``vllm bench serve``
and prompts in text work offline. 8.6B parameters, 16 GiB of bf16 weights (5.1B of them
attention): write it where it is served.

As V4-Flash's ``config.json`` (transformers' ``DeepseekV4Config`` fields): hidden size 4096, 64
query heads of 512 (64 RoPE dims), one KV head, q LoRA 1024, 8 output groups of LoRA 1024, a
128-token window, CSA (ratio 4) with a 64-head, 128-dim Lightning Indexer picking 512 entries,
HCA (ratio 128), 43 layers (two window-only, then CSA and HCA alternating: 21 CSA, 20 HCA), RoPE
theta 10000 and, in the compressed layers, 160000 with YaRN (factor 16 over 65536 positions,
beta 32 / 1), 1M positions, hyper-connections of 4, a 129280-token vocabulary.

What differs, so that one GPU holds the model with room for a long KV cache (:data:`OVERRIDES`):
8 routed experts of 512 (V4-Flash: 256 of 2048) with 2 active per token (6), learned routing in
every layer (V4-Flash hash-routes its first three), no MTP layer, and bf16 weights (V4-Flash:
FP8 attention projections, MXFP4 experts). The attention, its caches and its kernels are
exactly those of V4-Flash.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsv4_attn.e2e.tiny_model import (
    V4_FIXED,
    _import_transformers,
    build_model,
    compressed_rope,
    write_vllm_checkpoint,
)

__all__ = ["FLASH_LAYER_TYPES", "OVERRIDES", "flash_config", "main", "write_word_tokenizer"]

FLASH_LAYER_TYPES = ["sliding_attention"] * 2 + [
    "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
    for i in range(2, 43)
]
"""V4-Flash's 43 layers: window-only 0-1, CSA at even layers 2-42, HCA at odd layers 3-41."""

OVERRIDES = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "mlp_layer_types": ["moe"] * 43,
    "num_nextn_predict_layers": 0,
}
"""Where this model is not V4-Flash (the MoE and the MTP layer; see the module docstring)."""


def flash_config(
    experts: int = OVERRIDES["n_routed_experts"], layers: int = len(FLASH_LAYER_TYPES), **overrides
):
    """The ``DeepseekV4Config`` of V4-Flash's attention with :data:`OVERRIDES` (``experts``
    routed experts; the first ``layers`` of its schedule; ``overrides`` replace any field, for
    tests)."""
    if not 1 <= layers <= len(FLASH_LAYER_TYPES):
        raise ValueError(
            f"layers must be 1 to {len(FLASH_LAYER_TYPES)} (V4-Flash's schedule), got {layers}"
        )
    DeepseekV4Config, _ = _import_transformers()
    fields = dict(
        V4_FIXED,
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        layer_types=FLASH_LAYER_TYPES[:layers],
        index_n_heads=64,
        index_topk=512,
        rope_parameters=compressed_rope(65536),
        max_position_embeddings=1048576,
        **{**OVERRIDES, "n_routed_experts": experts, "mlp_layer_types": ["moe"] * layers},
    )
    fields.update(overrides)
    return DeepseekV4Config(**fields)


_SEPARATOR = "\u2581"  # SentencePiece's word boundary, a space in the text


def write_word_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens (``▁w0``, ``▁w1``, ...: text ``w0 w1``;
    unknown words to ``▁w0``) in ``path``: ``tokenizer.json`` and its config, which
    transformers' ``AutoTokenizer`` and vLLM read offline. Any token ids decode to text that
    encodes back to the same ids.

    Each token carries its separator (``▁``, a space in the text), as a real tokenizer's do:
    vLLM refuses, before tokenizing, a prompt of more characters than its token budget times
    the longest token's length, and text of separate words would exceed that bound by one
    space per token (a 129,024-token prompt: 921,341 characters against 903,168).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    unknown = f"{_SEPARATOR}w0"
    vocab = {f"{_SEPARATOR}w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(_SEPARATOR, prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(_SEPARATOR, prepend_scheme="always")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": unknown,
        "bos_token": unknown,
        "pad_token": unknown,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4_attn.e2e.real_shapes")
    parser.add_argument("directory")
    parser.add_argument("--experts", type=int, default=OVERRIDES["n_routed_experts"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layers",
        type=int,
        default=len(FLASH_LAYER_TYPES),
        help="the first N layers of V4-Flash's schedule (window, window, CSA, HCA, ...): a "
        "shallow model with the same layers, whose outputs depth has not amplified",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the weights are drawn (cuda: seconds instead of minutes; other weights "
        "than a CPU build of the same seed)",
    )
    args = parser.parse_args(argv)
    if args.experts < OVERRIDES["num_experts_per_tok"]:
        raise SystemExit(
            f"--experts must be at least {OVERRIDES['num_experts_per_tok']} (the "
            f"experts each token uses), got {args.experts}"
        )
    try:
        config = flash_config(args.experts, args.layers)
    except ValueError as error:
        raise SystemExit(f"--{error}") from None
    # built in bf16: half the memory of fp32
    model = build_model(config, args.seed, args.device, dtype=torch.bfloat16)
    path = write_vllm_checkpoint(args.directory, model, max_shard_size="2GB")
    write_word_tokenizer(path, config.vocab_size)
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
