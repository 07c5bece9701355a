"""The tiny checkpoint ``vllm serve`` runs loads through vLLM 0.33's own DeepSeek-V4 weight
loader, as written (names, MoE gate bias, 64 indexer heads)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tests import vllm_glue_testing as vt
from tests.temp_dirs import temp_dir

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from safetensors.torch import load_file

from dsv4_attn.e2e.tiny_model import VLLM_SPEC, TinySpec, save_vllm_checkpoint

# The served spec with 8 query heads: the same layers and names, quicker to build on a CPU.
SPEC = TinySpec(num_heads=8, index_heads=VLLM_SPEC.index_heads)


@functools.cache
def checkpoint() -> str:
    return str(save_vllm_checkpoint(temp_dir("dsv4_vllm_ckpt_"), SPEC))


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
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    vt._distributed_ready()
    config = vt.engine_args(model=path, load_format="auto", max_num_seqs=4).create_engine_config()
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


def test_layer_output_scale_must_be_a_fraction():
    for bad in (0, -0.5, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=r"layer_output_scale must be in \(0, 1\]"):
            TinySpec(layer_output_scale=bad)


def test_the_draftable_model_mostly_predicts_its_bigram():
    """With its layers' outputs scaled down, the served model's greedy next token is its
    bigram (:func:`bigram_table`: the token its embedding alone predicts) at most but not all
    positions of a random sequence: a draft of the bigram is accepted often, and attention
    still matters. The table is what the model with every layer output zeroed predicts at
    each position of the sequence."""
    from dsv4_attn.e2e.tiny_model import (
        DRAFTABLE_SPEC,
        _layer_outputs,
        bigram_table,
        build_tiny_model,
    )

    model = build_tiny_model(DRAFTABLE_SPEC)
    ids = torch.randint(
        1, DRAFTABLE_SPEC.vocab_size, (1, 320), generator=torch.Generator().manual_seed(7)
    )
    table = bigram_table(model)
    assert table.shape == (DRAFTABLE_SPEC.vocab_size,) and table.dtype == torch.int64
    with torch.no_grad():
        greedy = model(ids).logits.argmax(-1)
        for weight in _layer_outputs(model):
            weight.zero_()
        assert torch.equal(model(ids).logits.argmax(-1), table[ids])
    agreement = (greedy == table[ids]).float().mean().item()
    assert 0.45 < agreement < 0.85, agreement
