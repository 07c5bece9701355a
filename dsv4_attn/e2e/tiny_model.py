"""A tiny random-weight DeepSeek-V4 built with HuggingFace transformers' own implementation.

The model is ``transformers.DeepseekV4ForCausalLM`` (transformers >= 5.10.1; earlier releases
have attention bugs), configured small enough for a 2-core CPU but keeping every attention
feature of the real model (research/dsv4_arch.md §7):

* head_dim 512 (448 nope + 64 RoPE), one KV head, sliding window 128, per-head sinks;
* four layers of all three kinds: CSA (ratio 4, Lightning-Indexer top-k 16, 16 indexer heads),
  HCA (ratio 128), sliding-only, HCA;
* YaRN on the compressed layers' RoPE with ``original_max_position_embeddings=256`` so the
  YaRN ramp is actually exercised.

HF initialises the sinks and the compressor/indexer position biases to zero; they are
randomised here (seeded) so the sink term and the compressor softmax matter.

Two choices keep the model from amplifying rounding noise through discrete decisions that are
not under test (measured: the teacher-forced logit error of a bf16 KV path against the fp32
oracle drops from ~3e-2 to ~4e-3):

* the CSA layer comes first, so its indexer sees the token embeddings only and picks the same
  top-k entries in every run over the same tokens (a CSA layer after other layers flips picks
  at near-ties whenever the earlier layers' outputs differ in the last bit);
* every routed expert is active (top-4 of 4), so MoE routing has no near-tie flips either.

The DeepSeek-V4.1 variant (:func:`write_v41_checkpoint`, ``family="v41"`` of
:func:`save_vllm_checkpoint`) has no transformers implementation: its weights are drawn here,
name by name, with the same sizes, seed and initialisation, on V4.1's layers (ratios 0, 2 and 1,
compressed caches and indexers shared from source layers), with an Engram and the tokenizer
vLLM's V4.1 reads.
"""

from __future__ import annotations

import json
import re
import string
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = [
    "DRAFTABLE_SPEC",
    "FAMILIES",
    "LAYER_TYPES",
    "V4_FIXED",
    "V41_ENGRAM",
    "V41_ENGRAM_LAYERS",
    "V41_INDEX_SOURCES",
    "V41_KV_SOURCES",
    "V41_MAX_VOCAB",
    "V41_RATIOS",
    "V41_SPECIAL_TOKENS",
    "VLLM_SPEC",
    "TinySpec",
    "bigram_table",
    "build_model",
    "build_tiny_model",
    "compressed_rope",
    "load_or_build",
    "load_tiny_model",
    "save_vllm_checkpoint",
    "tiny_config",
    "tiny_v41_config",
    "v41_bigram_table",
    "v41_config",
    "v41_text",
    "v41_weight_shapes",
    "write_v41_checkpoint",
    "write_v41_tokenizer",
    "write_v41_weights",
    "write_vllm_checkpoint",
]

#: every kind of layer; CSA first (see the module docstring)
LAYER_TYPES = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
    "heavily_compressed_attention",
)
_SPEC_FILE = "dsv4_attn_tiny_spec.json"
#: the model families :func:`save_vllm_checkpoint` writes: DeepSeek-V4 and DeepSeek-V4.1
FAMILIES = ("v4", "v41")


@dataclass(frozen=True)
class TinySpec:
    """What distinguishes one tiny model from another (everything else is fixed).

    ``num_heads`` is the query head count (8 keeps the CPU test fast; 64 is V4-Flash's count,
    the one the Hopper kernels are built for). ``seed`` seeds every random weight.
    ``index_heads``: the Lightning Indexer's heads (16 for the harness: with fewer, exact ties at
    the top-k cut appear; vLLM's DeepGEMM indexer kernel takes 32 or 64 only).
    ``layer_output_scale`` multiplies every layer's output projections (attention and experts):
    below 1 the residual stream stays close to the token's embedding, so the next token depends
    mostly on the current one and a draft layer can predict it (:data:`DRAFTABLE_SPEC`).
    """

    seed: int = 0
    num_heads: int = 8
    vocab_size: int = 1024
    hidden_size: int = 256
    index_topk: int = 16
    index_heads: int = 16
    layer_output_scale: float = 1.0

    def __post_init__(self) -> None:
        scale = self.layer_output_scale
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale <= 1:
            raise ValueError(f"layer_output_scale must be in (0, 1], got {scale!r}")
        for name in ("seed", "num_heads", "vocab_size", "hidden_size", "index_topk", "index_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.num_heads < 1 or self.num_heads % 2:
            raise ValueError(f"num_heads must be a positive even int, got {self.num_heads}")
        if self.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {self.index_topk}")


def _import_transformers():
    try:
        import transformers
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as exc:  # older transformers has no DeepSeek-V4
        raise ImportError(
            "the end-to-end harness needs transformers >= 5.10.1 with DeepSeek-V4 "
            f"(transformers.DeepseekV4ForCausalLM): {exc}"
        ) from exc
    version = tuple(int(p) for p in transformers.__version__.split(".")[:3] if p.isdigit())
    if version < (5, 10, 1):
        raise ImportError(
            f"transformers {transformers.__version__} has known DeepSeek-V4 attention bugs; "
            "use >= 5.10.1"
        )
    return DeepseekV4Config, DeepseekV4ForCausalLM


V4_FIXED = dict(
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    sliding_window=128,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    index_head_dim=128,
    n_shared_experts=1,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    initializer_range=0.02,
    num_nextn_predict_layers=0,
    # No early stop: every run generates exactly the requested number of tokens.
    eos_token_id=None,
    bos_token_id=0,
    pad_token_id=0,
)
"""``DeepseekV4Config`` fields every model of this package shares with V4-Flash (one KV head of
512 with 64 RoPE dims, a 128-token window, ratios 4 and 128, 128-dim indexer heads,
hyper-connections of 4, RoPE thetas), plus no end-of-sequence token and no MTP layer in the
transformers model (the vLLM checkpoint gets its draft layers from
:mod:`dsv4_attn.e2e.draft_weights`)."""


def compressed_rope(original_max_positions: int) -> dict:
    """``rope_parameters`` of DeepSeek-V4's compressed layers: YaRN, factor 16 over
    ``original_max_positions`` (V4-Flash: 65536), beta 32 / 1."""
    return {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": original_max_positions,
        "beta_fast": 32,
        "beta_slow": 1,
    }


def tiny_config(spec: TinySpec):
    """The ``DeepseekV4Config`` of the tiny model described by ``spec``."""
    DeepseekV4Config, _ = _import_transformers()
    heads = spec.num_heads
    return DeepseekV4Config(
        **V4_FIXED,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=heads,
        q_lora_rank=128,
        # The real models group 8 heads per output group; keep at least 2 groups.
        o_groups=max(2, heads // 8),
        o_lora_rank=64,
        layer_types=list(LAYER_TYPES),
        index_n_heads=spec.index_heads,
        index_topk=spec.index_topk,
        n_routed_experts=4,
        num_experts_per_tok=4,  # all experts active: no routing flips at near-ties
        moe_intermediate_size=64,
        mlp_layer_types=["moe"] * len(LAYER_TYPES),
        # original_max_position_embeddings 256 so that the YaRN ramp is exercised
        rope_parameters=compressed_rope(256),
        max_position_embeddings=4096,
    )


def build_tiny_model(spec: TinySpec = TinySpec()):
    """A fresh, seeded, random-weight ``DeepseekV4ForCausalLM`` in float32 eval mode (CPU)."""
    model = build_model(tiny_config(spec), spec.seed).float()
    if spec.layer_output_scale != 1:
        with torch.no_grad():
            for weight in _layer_outputs(model):
                weight.mul_(spec.layer_output_scale)
    return model


def _layer_outputs(model) -> list[torch.Tensor]:
    """The projections through which every layer writes into the residual stream: attention's
    output projection and the routed and shared experts' down projections."""
    return [
        weight
        for layer in model.model.layers
        for weight in (
            layer.self_attn.o_b_proj.weight,
            layer.mlp.experts.down_proj,
            layer.mlp.shared_experts.down_proj.weight,
        )
    ]


@contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Torch's default dtype set to ``dtype`` within (unchanged when None)."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config, seed: int, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
):
    """A seeded random-weight ``DeepseekV4ForCausalLM`` of ``config`` (eval mode, on ``device``,
    drawn in ``dtype``, torch's default dtype when None): transformers' own initialisation, then
    random sinks and compressor position biases (transformers zeroes them; random, the sink term
    and the compressor softmax matter). The weights depend on the device's random generator: a
    CUDA build (seconds for V4-Flash's 8.6 B parameters, where the CPU takes minutes) differs
    from a CPU build of the same seed."""
    _, DeepseekV4ForCausalLM = _import_transformers()
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        # transformers builds every weight in torch's default dtype
        with _default_dtype(dtype), torch.device(device):
            model = DeepseekV4ForCausalLM(config)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                attn.sinks.copy_(torch.randn(attn.sinks.shape, generator=gen))
                compressor = attn.compressor
                if compressor is None:
                    continue
                biases = [compressor.position_bias]
                indexer = getattr(compressor, "indexer", None)
                if indexer is not None:
                    biases.append(indexer.position_bias)
                for bias in biases:
                    bias.copy_(0.5 * torch.randn(bias.shape, generator=gen))
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def bigram_table(model) -> torch.Tensor:
    """``[V]`` int64: the greedy next token after each token when every layer's output is zero
    (the residual stream is the token's embedding alone): the token that ``model`` predicts
    from the current token only. For a model with ``layer_output_scale`` < 1 it is the
    model's own greedy choice at most positions."""
    import copy

    bare = copy.deepcopy(model)
    with torch.no_grad():
        for weight in _layer_outputs(bare):
            weight.zero_()
        # Each position sees only its own token once the layers add nothing.
        tokens = torch.arange(model.config.vocab_size)[None]
        return bare(tokens).logits[0].argmax(-1)


def load_tiny_model(path: str | Path):
    """Load a tiny model saved by :func:`load_or_build` (float32, eval, CPU)."""
    _, DeepseekV4ForCausalLM = _import_transformers()
    model = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def load_or_build(path: str | Path | None, spec: TinySpec = TinySpec()):
    """Load the checkpoint at ``path`` if it holds ``spec``'s model, else build and save it.

    With ``path=None`` the model is built in memory only. The checkpoint is written with
    ``save_pretrained`` (safetensors + config.json) for transformers; the one vLLM serves is
    :func:`save_vllm_checkpoint`'s. Returns ``(model, loaded)`` where ``loaded`` says whether
    it came from disk.
    """
    if path is None:
        return build_tiny_model(spec), False
    path = Path(path)
    spec_file = path / _SPEC_FILE
    if spec_file.is_file() and json.loads(spec_file.read_text()) == asdict(spec):
        return load_tiny_model(path), True
    model = build_tiny_model(spec)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    spec_file.write_text(json.dumps(asdict(spec), indent=1) + "\n")
    return model, False


VLLM_SPEC = TinySpec(num_heads=64, index_heads=64)
"""The tiny model ``vllm serve`` runs: V4-Flash's 64 query heads, 64 indexer heads (DeepGEMM)."""

DRAFTABLE_SPEC = TinySpec(num_heads=64, index_heads=64, layer_output_scale=0.02)
""":data:`VLLM_SPEC` with its layers' outputs scaled by 0.02: the greedy next token equals the
one the embedding alone gives ("the bigram") at about 2 of 3 positions, so a draft layer
that predicts the bigram is accepted about as often as a trained MTP layer is. For measuring
speculative decoding (acceptance, losslessness with accepted drafts); the attention still
moves the logits, less than in :data:`VLLM_SPEC`."""

# transformers' save_pretrained names -> the names vLLM 0.33's DeepSeek-V4 loader expects.
_VLLM_KEY_RENAMES = (
    (re.compile(r"^model\.hc_head\.hc_"), "model.hc_head_"),
    (re.compile(r"\.attn\.norm\.weight$"), ".attn.kv_norm.weight"),
)


def save_vllm_checkpoint(
    path: str | Path,
    spec: TinySpec = VLLM_SPEC,
    mtp_layers: int | None = None,
    dspark: bool = False,
    family: str = "v4",
) -> Path:
    """Write the tiny model of ``family`` as a checkpoint vLLM loads as it is. Returns the
    directory.

    ``"v4"``: ``vllm serve PATH --skip-tokenizer-init`` (:func:`write_vllm_checkpoint`), with
    ``mtp_layers`` (default 1) MTP draft layers
    (:func:`~dsv4_attn.e2e.draft_weights.add_mtp_layers`; vLLM reads them only with
    ``--speculative-config`` method ``mtp``), or with ``dspark`` the DSpark draft instead
    (:func:`~dsv4_attn.e2e.draft_weights.add_dspark_layers`, method ``dspark``; both are
    ``mtp.*`` weights, so ``mtp_layers`` must then be 0). With ``spec.layer_output_scale`` < 1
    the drafts predict the bigram (:func:`bigram_table`). transformers cannot read this one
    back (other names); :func:`load_or_build` keeps its own.

    ``"v41"``: the DeepSeek-V4.1 variant (:func:`write_v41_checkpoint`), served with
    ``vllm serve PATH --language-model-only``. V4.1 has no MTP, so ``mtp_layers`` must be 0 or
    None; ``dspark`` adds its DSpark draft (:func:`~dsv4_attn.e2e.draft_weights.add_dspark_layers`,
    seeded by the spec), which with ``spec.layer_output_scale`` < 1 drafts the bigram
    (:func:`v41_bigram_table`).
    """
    from dsv4_attn.e2e.draft_weights import add_dspark_layers, add_mtp_layers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if family == "v41":
        if mtp_layers:
            raise ValueError(
                "DeepSeek-V4.1 has no MTP layers (its only draft is DSpark: dspark=True); got "
                f"mtp_layers={mtp_layers}"
            )
        path = write_v41_checkpoint(path, spec)
        if dspark:
            draftable = spec.layer_output_scale < 1
            bigram = v41_bigram_table(path) if draftable else None
            add_dspark_layers(path, spec.seed, bigram=bigram)
        (path / _SPEC_FILE).write_text(json.dumps(asdict(spec), indent=1) + "\n")
        return path
    if mtp_layers is None:
        mtp_layers = 1
    if dspark and mtp_layers:
        raise ValueError(
            f"a checkpoint holds MTP layers or the DSpark draft, not both (both are mtp.* "
            f"weights): with dspark, mtp_layers must be 0, got {mtp_layers}"
        )
    model = build_tiny_model(spec)
    path = write_vllm_checkpoint(path, model)
    draftable = spec.layer_output_scale < 1
    if dspark:
        # The bigram of the weights as written (bf16), as vLLM computes with them.
        bigram = bigram_table(model.float()) if draftable else None
        add_dspark_layers(path, spec.seed, bigram=bigram)
    elif mtp_layers:
        add_mtp_layers(path, mtp_layers, spec.seed, drafts_bigram=draftable)
    (path / _SPEC_FILE).write_text(json.dumps(asdict(spec), indent=1) + "\n")
    return path


def _vllm_name(key: str) -> str:
    for pattern, replacement in _VLLM_KEY_RENAMES:
        key = pattern.sub(replacement, key)
    return key


def write_vllm_checkpoint(path: str | Path, model, max_shard_size: str = "5GB") -> Path:
    """Write ``model`` (a ``DeepseekV4ForCausalLM``) as a checkpoint vLLM 0.33 loads as it is:
    bf16 safetensors (sharded above ``max_shard_size``, with their index) under vLLM's weight
    names, and ``"topk_method": "noaux_tc"`` in config.json (so vLLM creates the MoE gate's
    correction bias the checkpoint carries). Returns the directory."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(path), max_shard_size=max_shard_size)
    for weights_file in sorted(path.glob("*.safetensors")):
        weights = load_file(str(weights_file))
        renamed = {_vllm_name(key): tensor for key, tensor in weights.items()}
        save_file(renamed, str(weights_file), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        index["weight_map"] = {_vllm_name(k): v for k, v in index["weight_map"].items()}
        index_file.write_text(json.dumps(index, indent=1) + "\n")
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["topk_method"] = "noaux_tc"
    config_file.write_text(json.dumps(config, indent=1) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4.1: the same tiny sizes, V4.1's layers, an Engram and a tokenizer
# ----------------------------------------------------------------------------------------------

V41_RATIOS = (0, 2, 2, 1, 1, 1)
"""Compress ratio of each layer of the tiny V4.1: window only, two ratio-2 layers reading the
compressed cache of layer 1, three ratio-1 layers reading that of layer 3. As in V4.1-Flash
(``[0, 0] + [2] * 18 + [1] * 20``), every layer reads a source of its own ratio."""
V41_KV_SOURCES = (1, 3)
"""The layers owning a compressor and a compressed cache. vLLM's decoder replay cuts at the last
one, which must be of ratio 1 (vLLM asserts it when the replay is on, as on a GPU)."""
V41_INDEX_SOURCES = (1, 3, 4)
"""The layers owning an indexer: every KV source (an index source that is none keeps its keys in
its KV source's indexer cache) and layer 4, so that layer 5 reads the compressed cache of one
source (3) and the top-k picks of another (4)."""
V41_ENGRAM_LAYERS = (1, 2)
"""The layers with an Engram: both before the last KV source (vLLM turns its decoder replay off
for an Engram at or after it)."""
V41_ENGRAM = dict(
    engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=64, engram_vocab_size=64
)
"""Engram sizes: 2- and 3-grams with two hash heads each (four prime-sized table ranges per
layer, from 67 up) of 64-wide FP8 rows (one E8M0 scale per 32)."""
V41_SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",  # id 0: bos
    "<｜end▁of▁sentence｜>",  # closes each assistant turn of the chat encoding
    "<｜▁pad▁｜>",  # pad, also the Engram's n-gram pad
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "<｜deepseek_image｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
)
"""The tokenizer's special tokens, ids 0 up: the markers vLLM's DeepSeek-V4.1 chat encoding
writes (``vllm/tokenizers/deepseek_v41_encoding.py``)."""
_V41_TEXT_TOKENS = ("<think>", "</think>", "｜DSML｜")
"""Tokens of the chat encoding that stay in decoded text (reasoning and tool-call markup)."""
_V41_MERGED = ("Ġ", *string.ascii_lowercase, *string.ascii_uppercase, *string.digits)  # Ġ: " "
V41_MAX_VOCAB = len(V41_SPECIAL_TOKENS) + len(_V41_TEXT_TOKENS) + 256 + len(_V41_MERGED) ** 2
"""The largest vocabulary :func:`write_v41_tokenizer` writes (4242): its special and text tokens,
the 256 byte-level tokens and a merge of every pair of space, ASCII letter and digit."""
_V41_PAD_ID = V41_SPECIAL_TOKENS.index("<｜▁pad▁｜>")
_ENGRAM_SCALE_BLOCK = 32  # values per E8M0 scale in vLLM's Engram tables
_E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)  # older torch: the raw exponent bytes
# V4-only keys of a text config: V4.1 describes its layers with compress_ratios and sources
_V4_ONLY_KEYS = ("architectures", "model_type", "layer_types", "compress_rates")


def v41_config(
    text: dict,
    ratios: tuple[int, ...],
    kv_sources: tuple[int, ...],
    index_sources: tuple[int, ...],
) -> dict:
    """The DeepSeek-V4.1 ``config.json`` of a V4 text config ``text`` (HF format): its fields
    nested under ``text_config`` with V4's layer description (``layer_types``,
    ``compress_rates``) replaced by V4.1's per-layer ``compress_ratios`` (0, 1 or 2) and the
    layers owning compressed caches and indexers, and a vision tower of no layers."""
    text = {key: value for key, value in text.items() if key not in _V4_ONLY_KEYS}
    text.update(
        num_hidden_layers=len(ratios),
        compress_ratios=list(ratios),
        kv_source_layer_ids=list(kv_sources),
        index_source_layer_ids=list(index_sources),
    )
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": {"num_hidden_layers": 0},
        "torch_dtype": "bfloat16",
    }


def v41_text(v4_config, num_layers: int) -> dict:
    """The fields of a V4.1 ``text_config`` that a ``DeepseekV4Config`` ``v4_config`` gives
    (sizes, RoPE, MoE; for :func:`v41_config`): its own fields without the bookkeeping every HF
    config carries, one MoE on each of ``num_layers`` layers, the MoE gate's correction bias on
    (``noaux_tc``) and the pad token of :func:`write_v41_tokenizer`."""
    from transformers import PreTrainedConfig

    generic = set(PreTrainedConfig().to_dict())
    text = {k: v for k, v in v4_config.to_dict().items() if k not in generic}
    text.update(
        mlp_layer_types=["moe"] * num_layers, topk_method="noaux_tc", pad_token_id=_V41_PAD_ID
    )
    return text


def tiny_v41_config(spec: TinySpec, engram: dict) -> dict:
    """The tiny V4.1's ``config.json``: :func:`tiny_config`'s V4 fields (:func:`v41_text`) on
    :data:`V41_RATIOS` layers and the Engram fields ``engram`` (:func:`_v41_engram_fields`)."""
    text = v41_text(tiny_config(spec), len(V41_RATIOS))
    text.update(engram)
    return v41_config(text, V41_RATIOS, V41_KV_SOURCES, V41_INDEX_SOURCES)


def write_v41_tokenizer(path: str | Path, vocab_size: int, max_length: int = 4096) -> None:
    """Write a tokenizer of exactly ``vocab_size`` ids to ``path`` (``tokenizer.json`` and
    ``tokenizer_config.json``, what ``AutoTokenizer.from_pretrained`` reads offline):
    :data:`V41_SPECIAL_TOKENS` from id 0, the chat encoding's text tokens, the 256 byte-level
    tokens (any text encodes), then byte-level BPE merges of ASCII letter, digit and space
    pairs up to ``vocab_size``. No end-of-sequence token is declared: as the V4 model, every
    run generates exactly the tokens asked for."""
    import itertools

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    added = (*V41_SPECIAL_TOKENS, *_V41_TEXT_TOKENS)
    vocab = {token: i for i, token in enumerate(added)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    merges = []
    for first, second in itertools.product(_V41_MERGED, repeat=2):
        if len(vocab) >= vocab_size:
            break
        merges.append((first, second))
        vocab[first + second] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(
            f"the V4.1 tokenizer holds {len(added) + 256} to {V41_MAX_VOCAB} tokens, got "
            f"vocab_size={vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in V41_SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in _V41_TEXT_TOKENS])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": V41_SPECIAL_TOKENS[0],
        "eos_token": None,
        "pad_token": V41_SPECIAL_TOKENS[_V41_PAD_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")


def _v41_engram_fields(
    tokenizer_dir: Path,
    layers: tuple[int, ...] = V41_ENGRAM_LAYERS,
    sizes: dict = V41_ENGRAM,
) -> dict:
    """The config's Engram fields for the tokenizer in ``tokenizer_dir``: ``sizes`` (the fields
    of :data:`V41_ENGRAM`) on ``layers``, the size of the compressed vocabulary vLLM builds from
    the tokenizer (it refuses any other: its hash multipliers derive from it) and each layer's
    table size, the sum of its prime-sized hash ranges, both as vLLM's Engram computes them."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from vllm.models.deepseek_v41.common.engram import EngramLayout, build_compressed_token_map

    _, compressed = build_compressed_token_map(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    fields = {
        "engram_layer_ids": list(layers),
        **sizes,
        "engram_compressed_vocab_size": compressed,
        "engram_pad_token_id": _V41_PAD_ID,
    }
    sizes_unknown = [0] * len(layers)
    layout = EngramLayout(SimpleNamespace(**fields, engram_num_embeddings=sizes_unknown))
    fields["engram_num_embeddings"] = [sum(map(sum, ranges)) for ranges in layout.primes]
    return fields


def v41_weight_shapes(text: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a V4.1 checkpoint of text config ``text`` (a ``text_config``) under the
    name vLLM 0.33's V4.1 loader reads (DeepSeek's own: ``embed``, ``layers.{i}``, ``head``),
    with its shape and dtype: float32 where vLLM keeps the parameter in float32 (hyper-connection
    mixes, sinks, the gate's correction bias), FP8 E4M3 rows and E8M0 scales for the Engram
    tables, bfloat16 elsewhere (no ``quantization_config``: every linear layer is bfloat16)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    hidden, hc, vocab = text["hidden_size"], text["hc_mult"], text["vocab_size"]
    mix = (2 + hc) * hc  # pre, post and the hc x hc residual mix
    heads, head_dim, q_lora = text["num_attention_heads"], text["head_dim"], text["q_lora_rank"]
    groups, o_lora = text["o_groups"], text["o_lora_rank"]
    index_heads, index_dim = text["index_n_heads"], text["index_head_dim"]
    experts, inter = text["n_routed_experts"], text["moe_intermediate_size"]
    shared = inter * text["n_shared_experts"]
    kv_sources, index_sources = text["kv_source_layer_ids"], text["index_source_layer_ids"]
    engram_layers = list(text.get("engram_layer_ids") or ())
    shapes = {
        "embed.weight": ((vocab, hidden), bf16),
        "norm.weight": ((hidden,), bf16),
        "head.weight": ((vocab, hidden), bf16),
    }
    # The vision wrapper's image-span delimiters: with its tower off they are never used (vLLM
    # keeps them on the meta device), but its loader still asks for them.
    for name in ("image_start", "image_end", "image_newline"):
        shapes[name] = ((hidden,), fp32)
    for i, ratio in enumerate(text["compress_ratios"]):
        layer = f"layers.{i}."
        for part in ("attn", "ffn"):
            shapes[f"{layer}hc_{part}_fn"] = ((mix, hc * hidden), fp32)
            shapes[f"{layer}hc_{part}_base"] = ((mix,), fp32)
            shapes[f"{layer}hc_{part}_scale"] = ((3,), fp32)
            shapes[f"{layer}{part}_norm.weight"] = ((hidden,), bf16)
        attn = layer + "attn."
        shapes.update(
            {
                attn + "attn_sink": ((heads,), fp32),
                attn + "wq_a.weight": ((q_lora, hidden), bf16),
                attn + "q_norm.weight": ((q_lora,), bf16),
                attn + "wq_b.weight": ((heads * head_dim, q_lora), bf16),
                attn + "wkv.weight": ((head_dim, hidden), bf16),
                attn + "kv_norm.weight": ((head_dim,), bf16),
                attn + "wo_a.weight": ((groups * o_lora, heads * head_dim // groups), bf16),
                attn + "wo_b.weight": ((hidden, groups * o_lora), bf16),
            }
        )
        if i in kv_sources:
            shapes[attn + "compressor.wkv.weight"] = ((head_dim, hidden), bf16)
            if ratio == 2:  # pairs pool with a per-channel softmax over scores
                shapes[attn + "compressor.wgate.weight"] = ((head_dim, hidden), bf16)
            shapes[attn + "compressor.norm.weight"] = ((head_dim,), bf16)
        if i in index_sources:
            shapes[attn + "indexer.wq_b.weight"] = ((index_heads * index_dim, q_lora), bf16)
            shapes[attn + "indexer.weights_proj.weight"] = ((index_heads, hidden), bf16)
            if i in kv_sources:  # the index keys: of the compressed latent of a KV source only
                shapes[attn + "indexer.wk.weight"] = ((index_dim, head_dim), bf16)
                shapes[attn + "indexer.k_norm.weight"] = ((index_dim,), bf16)
        ffn = layer + "ffn."
        shapes[ffn + "gate.weight"] = ((experts, hidden), bf16)
        shapes[ffn + "gate.bias"] = ((experts,), fp32)
        for expert in [*(f"experts.{e}." for e in range(experts)), "shared_experts."]:
            width = shared if expert == "shared_experts." else inter
            shapes[f"{ffn}{expert}w1.weight"] = ((width, hidden), bf16)
            shapes[f"{ffn}{expert}w2.weight"] = ((hidden, width), bf16)
            shapes[f"{ffn}{expert}w3.weight"] = ((width, hidden), bf16)
        if i in engram_layers:
            rows = text["engram_num_embeddings"][engram_layers.index(i)]
            dim = text["engram_head_dim"]
            hashes = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
            engram = layer + "engram."
            shapes[engram + "embed.weight"] = ((rows, dim), torch.float8_e4m3fn)
            shapes[engram + "embed.scale"] = ((rows, dim // _ENGRAM_SCALE_BLOCK), _E8M0)
            # one key per hyper-connection copy and a shared value
            shapes[engram + "wkv.weight"] = ((hidden * (hc + 1), hashes * dim), bf16)
            shapes[engram + "q_weight"] = ((hc, hidden), bf16)
            shapes[engram + "k_weight"] = ((hc, hidden), bf16)
    return shapes


def _v41_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    std: float,
    seed: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """The tensor ``name`` of a V4.1 checkpoint, initialised as transformers initialises V4
    (:func:`build_model`): norms and mix scales 1, mix biases and the gate's correction bias 0,
    sinks standard normal, everything else normal of ``std``; Engram tables standard normal in
    FP8 with scales 1 (E8M0 byte 127). Seeded by ``seed`` and the name, so no tensor depends on
    which others are written; drawn by ``device``'s generator (CUDA: other values than the CPU's
    for the same seed), returned on the CPU."""
    gen = torch.Generator(device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("engram.embed.scale"):
        ones = torch.ones(shape)
        return ones.to(dtype) if dtype != torch.uint8 else torch.full(shape, 127, dtype=dtype)
    if name.endswith("engram.embed.weight"):
        return torch.randn(shape, generator=gen, device=device).to(dtype).cpu()
    if name.endswith("norm.weight") or leaf in ("q_weight", "k_weight") or "_scale" in leaf:
        return torch.ones(shape, dtype=dtype)
    if leaf.endswith("_base") or name.endswith("gate.bias"):
        return torch.zeros(shape, dtype=dtype)
    if leaf == "attn_sink":
        return torch.randn(shape, generator=gen, device=device).to(dtype).cpu()
    return (std * torch.randn(shape, generator=gen, device=device)).to(dtype).cpu()


#: The tensors through which a V4.1 layer writes into the residual stream: attention's output
#: projection, the routed and shared experts' down projections, and the Engram's ``wkv``, whose
#: value rows its output is made of (its key rows are RMS-normalized before the gate, so a scale
#: leaves the gate as it is).
_V41_LAYER_OUTPUTS = re.compile(
    r"\.(attn\.wo_b|ffn\.experts\.\d+\.w2|ffn\.shared_experts\.w2|engram\.wkv)\.weight$"
)


def write_v41_weights(
    path: str | Path,
    text: dict,
    seed: int,
    max_shard_bytes: int | None = None,
    device: str | torch.device = "cpu",
    layer_output_scale: float = 1.0,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Draw every tensor of :func:`v41_weight_shapes` of ``text`` (:func:`_v41_tensor`, drawn by
    ``device``) and save it in ``path``: ``model.safetensors``, or with ``max_shard_bytes`` shards
    of at most that many bytes (a larger tensor alone in one) and their index, as vLLM's loader
    reads them. One shard is held in host memory at a time. ``layer_output_scale`` multiplies
    the tensors through which each layer writes into the residual stream
    (:data:`_V41_LAYER_OUTPUTS`), as :class:`TinySpec`'s does for V4. Returns the table it
    wrote."""
    from safetensors.torch import save_file

    path = Path(path)
    shapes = v41_weight_shapes(text)
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, (shape, dtype) in shapes.items():
        size = dtype.itemsize * int(torch.Size(shape).numel())
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    std = text["initializer_range"]

    def tensor(name: str) -> torch.Tensor:
        drawn = _v41_tensor(name, *shapes[name], std, seed, device)
        if layer_output_scale != 1 and _V41_LAYER_OUTPUTS.search(name):
            drawn = (drawn.float() * layer_output_scale).to(drawn.dtype)
        return drawn

    for file, names in zip(files, shards, strict=True):
        weights = {name: tensor(name) for name in names}
        save_file(weights, str(path / file), metadata={"format": "pt"})
        del weights
    if len(shards) > 1:
        total = sum(dtype.itemsize * torch.Size(shape).numel() for shape, dtype in shapes.values())
        weight_map = {
            name: file for file, names in zip(files, shards, strict=True) for name in names
        }
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return shapes


def write_v41_checkpoint(path: str | Path, spec: TinySpec = VLLM_SPEC) -> Path:
    """Write the tiny DeepSeek-V4.1 of ``spec``'s sizes and seed as a checkpoint vLLM 0.33 loads
    as it is: ``config.json`` (:func:`tiny_v41_config`, Engram on), the tokenizer vLLM's V4.1
    needs (:func:`write_v41_tokenizer`: its multimodal processor and its Engram's n-gram hash
    read it) and bf16 safetensors under vLLM's V4.1 weight names (:func:`v41_weight_shapes`).
    Serve it with ``--language-model-only`` (no vision tower: vLLM's processor would otherwise
    want the image token at id 129264 of a full-size vocabulary). ``spec.layer_output_scale``
    < 1 scales each layer's outputs (:func:`write_v41_weights`), for a DSpark draft that drafts
    the bigram (:func:`v41_bigram_table`). Returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_v41_tokenizer(path, spec.vocab_size)
    config = tiny_v41_config(spec, _v41_engram_fields(path))
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_v41_weights(
        path, config["text_config"], spec.seed, layer_output_scale=spec.layer_output_scale
    )
    return path


def v41_bigram_table(path: str | Path) -> torch.Tensor:
    """``[V]`` int64: the greedy next token after each token of the V4.1 checkpoint at ``path``
    when every layer's output is zero, as vLLM computes it from the weights as written (bf16).

    With nothing added, the residual stream is ``hc_mult`` equal copies of the token's
    embedding ``e``: each layer's residual mix (Sinkhorn-balanced, rows summing to 1) keeps them
    equal, and the final collapse (the last layer's pre-mix, positive weights) gives ``c * e``,
    ``c > 0``, which the final RMSNorm takes back to ``e``'s: the logits are
    ``head @ (norm.weight * e / rms(e))``, the normalized row rounded to bf16 before the
    head, as vLLM's RMSNorm hands it on. V4.1 has no learned hyper-connection head, so nothing
    else enters. For a checkpoint written with ``layer_output_scale`` < 1 it is the model's own
    greedy choice at most positions (:func:`bigram_table` is V4's, through transformers)."""
    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    eps = config["text_config"]["rms_norm_eps"]
    wanted = {"embed.weight": None, "norm.weight": None, "head.weight": None}
    for weights_file in sorted(path.glob("model*.safetensors")):
        with safe_open(str(weights_file), framework="pt") as handle:
            for name in wanted.keys() & set(handle.keys()):
                wanted[name] = handle.get_tensor(name)
    missing = [name for name, tensor in wanted.items() if tensor is None]
    if missing:
        raise ValueError(f"{path}: no {missing} in its model*.safetensors")
    return _bigram_of(wanted["embed.weight"], wanted["norm.weight"], wanted["head.weight"], eps)


def _bigram_of(
    embed: torch.Tensor,
    norm_weight: torch.Tensor,
    head: torch.Tensor,
    eps: float,
    row_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``argmax(head @ (norm_weight * e / rms(e)))`` for every embedding row ``e`` (``embed``
    ``[V, H]``, ``head`` ``[V, H]``), the normalized rows rounded to ``row_dtype`` first:
    ``[V]`` int64. Computed in float32."""
    embed = embed.float()
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * norm_weight.float()).to(row_dtype).float()
    return (normed @ head.float().T).argmax(-1)
