"""DeepSeek-V4-Flash's (or V4.1-Flash's) attention at its real shapes, the rest shrunk: a
checkpoint to serve.

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

DeepSeek-V4.1-Flash
-------------------

    python -m dsv4_attn.e2e.real_shapes DIR --v41 [--experts 8] [--seed 0] [--device cuda]
    vllm serve DIR --language-model-only --kv-cache-dtype fp8 [--attention-backend DSV4_NVFP4]

writes the same for DeepSeek-V4.1-Flash (:func:`write_v41_flash_checkpoint`: the V4.1 writer of
:mod:`~dsv4_attn.e2e.tiny_model` on :func:`v41_flash_config`), with V4.1's tokenizer
(:func:`~dsv4_attn.e2e.tiny_model.write_v41_tokenizer`: byte-level, so any text and vLLM's V4.1
chat encoding encode, with every chat marker one token; ``vllm bench serve``'s random prompts
decode to text that encodes back to their length, off by a token now and then, which it
tolerates). 8.57B parameters, 15.8 GiB of weights (5.13B of them attention; the Engram's 0.80M
rows of FP8 tables stay in host memory when served).

As V4.1-Flash, each value checked against vLLM 0.33's V4.1 code (its V4.1-Flash decode kernels'
constants, its model's comments and checks): hidden size 5120, 64 query heads of 512 (64 RoPE
dims), one KV head, q LoRA 1280, 8 output groups of LoRA 1024, a 128-token window, top-512 of a
32-head, 128-dim indexer, RMSNorm eps 1e-20, hyper-connections of 4 (20 Sinkhorn iterations,
eps 1e-6), routed scale 1.5, SwiGLU limit 10; indexers on layers 2, 8, 14, 20, 24, 28, 32 and 36;
layer 20's indexer keeping each token's 2048 best blocks of 8 positions for those after it;
Engram on layers 1 and 14; learned routing in every layer; compress ratios 0, 1 and 2 only.

As the published config.json has them (public projects copy it; vLLM's code does not hold
them, but agrees where it speaks: layer 20 and the indexers after it are of ratio 1): 40 layers
of ratios [0, 0] + [2] * 18 + [1] * 20 (:data:`V41_FLASH_RATIOS`), compressed caches on layers
2, 8, 14 (ratio 2) and 20 (ratio 1), so that every layer reads a source of its own ratio and
layer 20, where vLLM's decoder replay cuts, has ratio 1 as vLLM asserts, with both Engram layers
before it; Engram n-grams of 2 to 4 with 8 hash heads of 256. Not in vLLM's code and taken from
V4-Flash's shape above (the published config agrees): RoPE theta 10000, 160000 with YaRN in the
compressed layers (factor 16 over 65536 positions, beta 32 / 1), 1M positions.

What differs from V4.1-Flash (:data:`V41_OVERRIDES`): 8 routed experts of 512 (V4.1-Flash: 384
of 2304) with 2 active per token (6); no DSpark draft (V4.1-Flash: three stages after the 40
layers, with ratios of 0); bf16 weights (V4.1-Flash: FP8 in 32 x 32 blocks, FP4 experts); a
4224-token vocabulary (129280: a multiple of 64 too, so vLLM pads neither); Engram tables of
16384 rows per n-gram and hash head (V4.1-Flash: 16M, 384M rows a layer); no vision tower (0
layers: serve the text model, ``--language-model-only``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsv4_attn.e2e.tiny_model import (
    V4_FIXED,
    V41_MAX_VOCAB,
    _import_transformers,
    _v41_engram_fields,
    build_model,
    compressed_rope,
    v41_config,
    v41_text,
    write_v41_tokenizer,
    write_v41_weights,
    write_vllm_checkpoint,
)

__all__ = [
    "FLASH_LAYER_TYPES",
    "OVERRIDES",
    "V41_FLASH_CANDIDATES",
    "V41_FLASH_ENGRAM",
    "V41_FLASH_ENGRAM_LAYERS",
    "V41_FLASH_INDEX_SOURCES",
    "V41_FLASH_KV_SOURCES",
    "V41_FLASH_RATIOS",
    "V41_OVERRIDES",
    "flash_config",
    "main",
    "v41_flash_config",
    "write_v41_flash_checkpoint",
    "write_v41_flash_config",
    "write_word_tokenizer",
]

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


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4.1-Flash
# ----------------------------------------------------------------------------------------------

V41_FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
"""V4.1-Flash's 40 layers: window-only 0-1, ratio 2 (an entry per pair) 2-19, ratio 1 (an entry
per position) 20-39."""
V41_FLASH_KV_SOURCES = (2, 8, 14, 20)
"""The layers owning a compressor and a compressed cache: three of ratio 2, one of ratio 1, each
read by the layers up to the next (every layer reads a source of its own ratio)."""
V41_FLASH_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
"""The layers owning an indexer: every KV source, and every fourth ratio-1 layer after 20 (whose
keys stay in layer 20's indexer cache)."""
V41_FLASH_CANDIDATES = {
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
}
"""Two-level top-k: layer 20's indexer keeps each token's best 2048 blocks of 8 compressed
positions, within which the indexers of layers 24-36 pick their top-k."""
V41_FLASH_ENGRAM_LAYERS = (1, 14)
"""The layers with an Engram, both before layer 20 (where vLLM's decoder replay cuts)."""
V41_FLASH_ENGRAM = dict(
    engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256, engram_vocab_size=16384
)
"""Engram sizes: 2- to 4-grams of 8 hash heads each, 256-wide FP8 rows; 16384 rows per hash head
(V4.1-Flash: 16M, tables of 384M rows a layer)."""
V41_OVERRIDES = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "num_nextn_predict_layers": 0,
    "vocab_size": V41_MAX_VOCAB // 64 * 64,
    "engram_vocab_size": V41_FLASH_ENGRAM["engram_vocab_size"],
}
"""Where the V4.1 model is not V4.1-Flash (the MoE, the drafts, the vocabulary, the Engram
tables; see the module docstring)."""


def v41_flash_config(
    tokenizer_dir: str | Path,
    experts: int = V41_OVERRIDES["n_routed_experts"],
    ratios: tuple[int, ...] = V41_FLASH_RATIOS,
    kv_sources: tuple[int, ...] = V41_FLASH_KV_SOURCES,
    index_sources: tuple[int, ...] = V41_FLASH_INDEX_SOURCES,
    candidates: dict = V41_FLASH_CANDIDATES,
    engram_layers: tuple[int, ...] = V41_FLASH_ENGRAM_LAYERS,
) -> dict:
    """The DeepSeek-V4.1 ``config.json`` of V4.1-Flash's attention with :data:`V41_OVERRIDES`
    (``experts`` routed experts) for the tokenizer in ``tokenizer_dir`` (that of
    :func:`write_v41_flash_checkpoint`; the Engram's fields derive from it). The other arguments
    replace V4.1-Flash's layer schedule, for tests: ``candidates`` empty turns the two-level
    top-k off, ``engram_layers`` empty the Engram."""
    v4 = flash_config(
        experts,
        len(ratios),
        vocab_size=V41_OVERRIDES["vocab_size"],
        hidden_size=5120,
        q_lora_rank=1280,
        index_n_heads=32,
        rms_norm_eps=1e-20,
    )
    text = v41_text(v4, len(ratios))
    text.update(candidates)
    if engram_layers:
        text.update(_v41_engram_fields(Path(tokenizer_dir), engram_layers, V41_FLASH_ENGRAM))
    return v41_config(text, ratios, kv_sources, index_sources)


def write_v41_flash_config(
    path: str | Path, experts: int = V41_OVERRIDES["n_routed_experts"]
) -> dict:
    """Write V4.1's tokenizer (:func:`~dsv4_attn.e2e.tiny_model.write_v41_tokenizer` of
    :data:`V41_OVERRIDES`' vocabulary, 1M positions) and the ``config.json`` of
    :func:`v41_flash_config` in ``path``: all of the checkpoint but its weights. Returns the
    config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_v41_tokenizer(path, V41_OVERRIDES["vocab_size"], max_length=1048576)
    config = v41_flash_config(path, experts)
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return config


def write_v41_flash_checkpoint(
    path: str | Path,
    experts: int = V41_OVERRIDES["n_routed_experts"],
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[Path, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Write the V4.1-Flash-shaped checkpoint in ``path``: :func:`write_v41_flash_config`, then
    bf16 safetensors (FP8 Engram tables) in shards of 2 GB, drawn by ``device``
    (:func:`~dsv4_attn.e2e.tiny_model.write_v41_weights`). Returns the directory and the table
    of the tensors written (name: shape, dtype)."""
    path = Path(path)
    config = write_v41_flash_config(path, experts)
    shapes = write_v41_weights(
        path, config["text_config"], seed, max_shard_bytes=2_000_000_000, device=device
    )
    return path, shapes


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
    parser.add_argument(
        "--v41",
        action="store_true",
        help="the DeepSeek-V4.1-Flash-shaped checkpoint (serve it with --language-model-only)",
    )
    parser.add_argument("--experts", type=int, default=OVERRIDES["n_routed_experts"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the first N layers of V4-Flash's schedule (window, window, CSA, HCA, ...): a "
        "shallow model with the same layers, whose outputs depth has not amplified (V4 only; "
        "default all 43)",
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
    if args.v41:
        if args.layers is not None:
            raise SystemExit("--layers cuts V4-Flash's schedule; --v41 writes all 40 layers")
        path, shapes = write_v41_flash_checkpoint(
            args.directory, args.experts, args.seed, args.device
        )
        count = sum(torch.Size(shape).numel() for shape, _ in shapes.values())
        print(f"{path}: {count / 1e9:.2f}B parameters")
        return
    try:
        config = flash_config(
            args.experts, len(FLASH_LAYER_TYPES) if args.layers is None else args.layers
        )
    except ValueError as error:
        raise SystemExit(f"--{error}") from None
    # built in bf16: half the memory of fp32
    model = build_model(config, args.seed, args.device, dtype=torch.bfloat16)
    path = write_vllm_checkpoint(args.directory, model, max_shard_size="2GB")
    write_word_tokenizer(path, config.vocab_size)
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
