"""The V4-Flash-shaped checkpoint: V4-Flash's attention as its config.json has it, a config vLLM
accepts for DSV4_NVFP4, weights vLLM's loader takes from sharded files, a tokenizer vLLM reads."""

from __future__ import annotations

import json
import random

import pytest

from tests import vllm_glue_testing as vt
from tests.temp_dirs import temp_dir

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from dsv4_attn.e2e import real_shapes
from dsv4_attn.e2e.tiny_model import VLLM_SPEC, TinySpec, build_tiny_model, write_vllm_checkpoint
from dsv4_attn.vllm_glue.capacity import SCHEDULES


def _config_dir(config) -> str:
    path = temp_dir("dsv4_flash_cfg_")
    config.save_pretrained(str(path))
    real_shapes.write_word_tokenizer(path, config.vocab_size)
    return str(path)


def test_attention_is_v4_flash_as_its_config_states():
    """V4-Flash's published attention fields (hidden 4096, 64 x 512 heads, q LoRA 1024, 8 output
    groups of 1024, window 128, indexer 64 x 128 picking 512, ratios 4 / 128, YaRN 16 over
    65536 at theta 160000, 1M positions) and its 43-layer schedule (the one the capacity
    accounting uses); only the MoE and MTP differ."""
    config = real_shapes.flash_config().to_dict()
    expected = {
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "num_hidden_layers": 43,
        "max_position_embeddings": 1048576,
        "vocab_size": 129280,
        "hc_mult": 4,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["compress_rates"] == {
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 128,
    }
    kinds = {
        "sliding_attention": 1,
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 128,
    }
    assert [kinds[t] for t in config["layer_types"]] == SCHEDULES["V4-Flash"]
    compress = config["rope_parameters"]["compress"]
    assert (compress["rope_type"], compress["factor"]) == ("yarn", 16.0)
    assert compress["rope_theta"] == 160000.0
    assert compress["original_max_position_embeddings"] == 65536
    assert config["rope_parameters"]["main"]["rope_theta"] == 10000.0
    assert {k: config[k] for k in real_shapes.OVERRIDES} == real_shapes.OVERRIDES


def test_a_shallow_model_keeps_the_first_layers_of_the_schedule(tmp_path):
    """--layers N: V4-Flash's first N layers (window, window, CSA, HCA, ...), every other field
    as in the full model, and vLLM takes it; a count outside 1..43 is refused naming it."""
    full = real_shapes.flash_config().to_dict()
    shallow = real_shapes.flash_config(layers=4).to_dict()
    assert (
        shallow["layer_types"]
        == full["layer_types"][:4]
        == [
            "sliding_attention",
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ]
    )
    assert shallow["num_hidden_layers"] == 4 and shallow["mlp_layer_types"] == ["moe"] * 4
    differ = {k for k in full if full[k] != shallow[k]}
    assert differ == {"num_hidden_layers", "layer_types", "mlp_layer_types"}
    config = vt.engine_args(
        model=_config_dir(real_shapes.flash_config(layers=4)),
        skip_tokenizer_init=False,
        max_model_len=131072,
        attention_backend="DSV4_NVFP4",
    ).create_engine_config()
    assert config.model_config.hf_config.num_hidden_layers == 4
    for layers in (0, 44):
        with pytest.raises(ValueError, match=f"layers must be 1 to 43 .*got {layers}"):
            real_shapes.flash_config(layers=layers)
    with pytest.raises(SystemExit, match="--layers must be 1 to 43"):
        real_shapes.main([str(tmp_path / "never_written"), "--layers", "0"])
    assert not (tmp_path / "never_written").exists()


def test_vllm_takes_the_config_for_dsv4_nvfp4():
    """vLLM builds its engine config from the checkpoint's config.json and tokenizer (1M-token
    context, DSV4_NVFP4) and the backend's model-build checks accept it."""
    from dsv4_attn.vllm_glue.support import check_supported

    path = _config_dir(real_shapes.flash_config())
    config = vt.engine_args(
        model=path, skip_tokenizer_init=False, max_model_len=1048576, attention_backend="DSV4_NVFP4"
    ).create_engine_config()
    assert config.model_config.hf_config.num_hidden_layers == 43
    assert config.model_config.get_num_attention_heads(config.parallel_config) == 64
    check_supported(config)


def test_word_tokenizer_round_trips_through_vllms_deepseek_v4_tokenizer(tmp_path):
    from vllm.tokenizers import get_tokenizer

    path = str(tmp_path)
    real_shapes.write_word_tokenizer(path, 129280)
    tokenizer = get_tokenizer(path, tokenizer_mode="deepseek_v4")
    rng = random.Random(1)
    ids = [rng.randrange(129280) for _ in range(300)]
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert len(tokenizer) == 129280


def test_a_prompt_that_fits_the_context_passes_vllms_character_bound(tmp_path):
    """vLLM refuses, before tokenizing, text longer than its token budget times the longest
    token's length: a prompt of exactly the budget's tokens (as set d sends at 128K) must pass."""
    from vllm.tokenizers import get_tokenizer

    real_shapes.write_word_tokenizer(tmp_path, 129280)
    tokenizer = get_tokenizer(str(tmp_path), tokenizer_mode="deepseek_v4")
    rng = random.Random(2)
    ids = [rng.randrange(100000, 129280) for _ in range(4096)]  # the longest words
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert len(text) <= len(ids) * tokenizer.max_chars_per_token


def test_sharded_checkpoint_loads_through_vllms_loader(tmp_path):
    """The writer the V4-Flash checkpoint uses, on the tiny model cut into shards of 1 MB: every
    shard renamed and the index with it; vLLM's own loader takes every weight."""
    from tests.test_tiny_model import load_with_vllm

    spec = TinySpec(num_heads=8, index_heads=VLLM_SPEC.index_heads)
    path = write_vllm_checkpoint(tmp_path, build_tiny_model(spec), max_shard_size="1MB")
    shards = sorted(path.glob("*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert "model.layers.0.attn.kv_norm.weight" in index["weight_map"]
    model = load_with_vllm(str(path))
    assert sum(1 for _ in model.parameters()) > 0


@pytest.mark.gpu
def test_a_cuda_built_checkpoint_has_the_cpu_builds_weights_names_and_shapes(tmp_path):
    """``real_shapes --device cuda`` draws the weights on the GPU: the tiny model built there is
    written with the same tensor names and shapes as a CPU build of the same seed, finite, and
    drawn by the GPU's generator (not the CPU's values)."""
    import torch
    from safetensors.torch import load_file

    from dsv4_attn.e2e.tiny_model import build_model, tiny_config

    config = tiny_config(TinySpec(num_heads=8, index_heads=VLLM_SPEC.index_heads))
    on_gpu = build_model(config, seed=0, device="cuda")
    assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}
    written = {}
    for device, model in (("cuda", on_gpu), ("cpu", build_model(config, seed=0))):
        path = write_vllm_checkpoint(tmp_path / device, model)
        written[device] = {}
        for shard in path.glob("*.safetensors"):
            written[device].update(load_file(str(shard)))
    gpu, cpu = written["cuda"], written["cpu"]
    assert gpu.keys() == cpu.keys()
    assert all(gpu[k].shape == cpu[k].shape and gpu[k].dtype == cpu[k].dtype for k in gpu)
    assert all(torch.isfinite(t.float()).all() for t in gpu.values())
    drawn = [k for k in gpu if cpu[k].float().std() > 0]
    assert drawn and any(not torch.equal(gpu[k], cpu[k]) for k in drawn)
