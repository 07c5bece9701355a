"""The tiny checkpoint ``vllm serve`` runs loads through vLLM 0.33's own DeepSeek-V4 weight
loader, as written (names, MoE gate bias, 64 indexer heads)."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests import vllm_glue_testing as vt

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from safetensors.torch import load_file

from dsv4_attn.e2e.tiny_model import VLLM_SPEC, TinySpec, save_vllm_checkpoint

# The served spec with 8 query heads: the same layers and names, quicker to build on a CPU.
SPEC = TinySpec(num_heads=8, index_heads=VLLM_SPEC.index_heads)


@functools.cache
def checkpoint() -> str:
    return str(save_vllm_checkpoint(tempfile.mkdtemp(prefix="dsv4_vllm_ckpt_"), SPEC))


@functools.cache
def vllm_model():
    return load_with_vllm(checkpoint())


def load_with_vllm(path: str):
    """vLLM's DeepseekV4ForCausalLM created and filled by vLLM's default model loader from the
    checkpoint at ``path`` (CPU). ``load_weights`` is the loader's: the model's own name mapping
    and loading, then the check that every parameter came from the checkpoint. (The platform's
    repacking for its kernels afterwards needs vLLM's compiled CPU ops and is not about the
    checkpoint.)"""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    vt._distributed_ready()
    args = EngineArgs(model=path, skip_tokenizer_init=True, enforce_eager=True,
                      max_model_len=vt.MAX_MODEL_LEN, max_num_seqs=4)  # fmt: skip
    config = args.create_engine_config()
    loader = get_model_loader(config.load_config)
    with (
        set_current_vllm_config(config),
        vt._cpu_events(),
        set_default_torch_dtype(config.model_config.dtype),
    ):
        model = loader.create_model(vllm_config=config, model_config=config.model_config)
        loader.load_weights(model, config.model_config)
    return model


def test_served_spec_is_v4_flash_shaped():
    assert (VLLM_SPEC.num_heads, VLLM_SPEC.index_heads) == (64, 64)


def test_config_carries_what_vllm_needs():
    config = json.loads(Path(checkpoint(), "config.json").read_text())
    assert config["topk_method"] == "noaux_tc"
    assert config["index_n_heads"] == 64 and config["architectures"] == ["DeepseekV4ForCausalLM"]


def test_vllm_loader_takes_every_weight():
    """vLLM's loader refuses names it does not know and parameters the checkpoint misses; the
    tensors it loaded are the checkpoint's."""
    model = vllm_model()
    weights = load_file(f"{checkpoint()}/model.safetensors")
    params = dict(model.named_parameters())
    checks = {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "model.hc_head_base": "model.hc_head_base",
        "model.layers.0.attn.kv_norm.weight": "model.layers.0.attn.kv_norm.weight",
        "model.layers.0.ffn.gate.bias": "model.layers.0.ffn.gate.e_score_correction_bias",
    }
    for ckpt_name, param_name in checks.items():
        assert ckpt_name in weights, sorted(weights)[:20]
        assert param_name in params, f"{param_name} not in vLLM's model"
        torch.testing.assert_close(params[param_name].float(), weights[ckpt_name].float())


@functools.cache
def mtp_model():
    """vLLM's DeepSeek-V4 MTP draft (``DeepSeekV4MTP``, CUDA model code built on the CPU with
    this package's attention layer) for the checkpoint with its MTP layer, filled by its own
    ``load_weights`` from every tensor of the checkpoint (vLLM's registry maps the MTP
    architecture to a refusal on the CPU platform, so it is built directly)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.models.deepseek_v4.nvidia.mtp import DeepSeekV4MTP
    from vllm.utils.torch_utils import set_default_torch_dtype

    vt._distributed_ready()
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    args = EngineArgs(model=checkpoint(), skip_tokenizer_init=True, enforce_eager=True,
                      max_model_len=vt.MAX_MODEL_LEN, max_num_seqs=4,
                      attention_backend="DSV4_NVFP4", speculative_config=mtp)  # fmt: skip
    config = args.create_engine_config()
    draft = config.speculative_config.draft_model_config
    assert draft.architectures == ["DeepSeekV4MTPModel"]

    class _NoStream:  # the predictor makes aux CUDA streams in __init__
        def __init__(self, *args, **kwargs) -> None:
            pass

    saved = torch.cuda.Stream
    torch.cuda.Stream = _NoStream  # type: ignore[misc]
    try:
        with set_current_vllm_config(config), vt._cpu_events(), \
                set_default_torch_dtype(draft.dtype):  # fmt: skip
            model = DeepSeekV4MTP(vllm_config=config, prefix="model")
    finally:
        torch.cuda.Stream = saved  # type: ignore[misc]
    with set_current_vllm_config(config):
        loaded = model.load_weights(iter(checkpoint_weights().items()))
    return model, loaded


def checkpoint_weights() -> dict[str, torch.Tensor]:
    weights = {}
    for path in sorted(Path(checkpoint()).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def test_checkpoint_has_one_mtp_layer_by_default():
    config = json.loads(Path(checkpoint(), "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    index = Path(checkpoint(), "model.safetensors.index.json")
    names = checkpoint_weights()
    assert "mtp.0.e_proj.weight" in names and "mtp.0.attn.wq_a.weight" in names
    assert not any(k.startswith("mtp.1.") for k in names)
    assert not any(".compressor." in k for k in names if k.startswith("mtp."))  # SWA layer
    if index.exists():
        assert json.loads(index.read_text())["weight_map"]["mtp.0.e_proj.weight"] == (
            "mtp.safetensors"
        )


def test_vllm_mtp_loader_takes_every_draft_weight():
    """Every parameter of vLLM's MTP draft comes from the checkpoint (its loader raises on a
    name it cannot place), and holds the checkpoint's tensor, none of the main model's."""
    model, loaded = mtp_model()
    params = dict(model.named_parameters())
    assert set(loaded) == set(params)
    weights = checkpoint_weights()
    config = json.loads(Path(checkpoint(), "config.json").read_text())
    layer = f"model.layers.{config['num_hidden_layers']}"  # the first MTP layer's index
    checks = {
        "mtp.0.e_proj.weight": f"{layer}.e_proj.weight",
        "mtp.0.hnorm.weight": f"{layer}.hnorm.weight",
        "mtp.0.hc_head_fn": f"{layer}.hc_head_fn",
        "mtp.0.norm.weight": f"{layer}.shared_head.norm.weight",
        "mtp.0.head.weight": f"{layer}.shared_head.head.weight",
        "mtp.0.attn.kv_norm.weight": f"{layer}.mtp_block.attn.kv_norm.weight",
        "mtp.0.attn.attn_sink": f"{layer}.mtp_block.attn.attn_sink",
        "mtp.0.emb.tok_emb.weight": "model.embed_tokens.weight",
    }
    for ckpt_name, param_name in checks.items():
        torch.testing.assert_close(params[param_name].float(), weights[ckpt_name].float())
    sliding = config["layer_types"].index("sliding_attention")
    main_sink = weights[f"model.layers.{sliding}.attn.attn_sink"]
    assert not torch.equal(weights["mtp.0.attn.attn_sink"], main_sink)
    assert not torch.equal(weights["mtp.0.head.weight"], weights["head.weight"])


def test_add_mtp_layers_refuses_a_bad_count(tmp_path):
    from dsv4_attn.e2e.tiny_model import add_mtp_layers

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_layers must be a positive int"):
            add_mtp_layers(tmp_path, bad)
