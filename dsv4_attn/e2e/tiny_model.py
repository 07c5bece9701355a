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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = [
    "DRAFTABLE_SPEC",
    "LAYER_TYPES",
    "V4_FIXED",
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
    path: str | Path, spec: TinySpec = VLLM_SPEC, mtp_layers: int = 1, dspark: bool = False
) -> Path:
    """Write the tiny model as a checkpoint ``vllm serve PATH --skip-tokenizer-init`` loads as
    it is (:func:`write_vllm_checkpoint`), with ``mtp_layers`` MTP draft layers
    (:func:`~dsv4_attn.e2e.draft_weights.add_mtp_layers`; vLLM reads them only with
    ``--speculative-config`` method ``mtp``), or with ``dspark`` the DSpark draft instead
    (:func:`~dsv4_attn.e2e.draft_weights.add_dspark_layers`, method ``dspark``; both are
    ``mtp.*`` weights, so ``mtp_layers`` must then be 0). With ``spec.layer_output_scale`` < 1
    the drafts predict the bigram (:func:`bigram_table`). transformers cannot read this one
    back (other names); :func:`load_or_build` keeps its own. Returns the directory."""
    from dsv4_attn.e2e.draft_weights import add_dspark_layers, add_mtp_layers

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
