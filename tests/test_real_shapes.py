"""The V4-Flash-shaped checkpoint: V4-Flash's attention as its config.json has it, a config vLLM
accepts for DSV4_NVFP4, weights vLLM's loader takes from sharded files, a tokenizer vLLM reads."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

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


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4.1-Flash (--v41)
# ----------------------------------------------------------------------------------------------

# V4.1-Flash's published geometry, written out here (not read from the module under test).
_V41_FLASH_RATIOS = [0, 0] + [2] * 18 + [1] * 20
_V41_FLASH_KV_SOURCES = [2, 8, 14, 20]
_V41_FLASH_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]


@functools.cache
def _v41_flash_dir() -> str:
    """A folder with the V4.1-Flash checkpoint's tokenizer and config.json (no weights)."""
    path = temp_dir("dsv41_flash_cfg_")
    real_shapes.write_v41_flash_config(path)
    return str(path)


def _v41_text() -> dict:
    return json.loads(Path(_v41_flash_dir(), "config.json").read_text())["text_config"]


@functools.cache
def _v41_flash_on_meta():
    return vt.v41_vllm_model(_v41_flash_dir(), "meta", load=False)


def test_v41_flash_config_reads_back_through_vllm_as_published():
    """vLLM's own config path (EngineArgs, DeepseekV41Config, 1M context, DSV4_NVFP4 with fp8
    caches) reads V4.1-Flash's published attention geometry and the documented overrides back
    from the written config.json and tokenizer, and this backend's model-build checks take it."""
    from dsv4_attn.vllm_glue.support import check_supported

    config = vt.engine_args(
        model=_v41_flash_dir(),
        skip_tokenizer_init=False,
        language_model_only=True,
        max_model_len=1048576,
        attention_backend="DSV4_NVFP4",
        kv_cache_dtype="fp8",
    ).create_engine_config()
    hf = config.model_config.hf_config
    assert hf.model_type == "deepseek_v41" and hf.vision_n_layers == 0
    published = {
        "num_hidden_layers": 40,
        "hidden_size": 5120,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1280,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 512,
        "rms_norm_eps": 1e-20,
        "hc_mult": 4,
        "max_position_embeddings": 1048576,
        "compress_ratios": _V41_FLASH_RATIOS,
        "kv_source_layer_ids": _V41_FLASH_KV_SOURCES,
        "index_source_layer_ids": _V41_FLASH_INDEX_SOURCES,
        "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
    }
    assert {k: getattr(hf, k) for k in published} == published
    overrides = {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "num_nextn_predict_layers": 0,
        "vocab_size": 4224,
        "engram_vocab_size": 16384,
    }
    assert {k: getattr(hf, k) for k in overrides} == overrides
    assert config.model_config.max_model_len == 1048576
    assert config.model_config.get_num_attention_heads(config.parallel_config) == 64
    check_supported(config)


def test_v41_flash_layers_read_sources_of_their_own_ratio():
    """From vLLM's config (layer_kinds_of) and vLLM's built model alike: every compressed layer
    reads a KV source of its own ratio and top-k picks made over that same source's cache; the
    indexers after layer 20 (which keeps the candidate blocks) read layer 20's cache; the last KV
    source, where vLLM's decoder replay cuts, has ratio 1 (vLLM asserts it when the replay is
    on) with every Engram layer before it, so vLLM keeps the replay."""
    from dsv4_attn.layer_kind import layer_kinds_of

    config, model = _v41_flash_on_meta()
    hf = config.model_config.hf_config
    kinds = layer_kinds_of(hf)
    assert [k.compress_ratio for k in kinds] == _V41_FLASH_RATIOS
    compressed = [k for k in kinds if k.has_compressed]
    assert len(compressed) == 38
    for k in compressed:
        assert kinds[k.kv_source].compress_ratio == k.compress_ratio, k
        assert kinds[k.index_source].kv_source == k.kv_source, k
    candidate_source = hf.candidate_source_layer_id
    after = [k for k in kinds if k.index_source == k.layer_id and k.layer_id > candidate_source]
    assert after and all(k.kv_source == kinds[candidate_source].kv_source for k in after)
    cut = max(hf.kv_source_layer_ids)
    assert kinds[cut].compress_ratio == 1
    assert all(i < cut for i in hf.engram_layer_ids)
    layers = model.language_model.model.layers
    built = [
        (a.compress_ratio, a.kv_source_layer_id, a.index_source_layer_id)
        for a in (layer.attn for layer in layers)
    ]
    assert built == [(k.compress_ratio, k.kv_source, k.index_source) for k in kinds]
    assert [i for i, layer in enumerate(layers) if layer.engram is not None] == [1, 14]
    assert model.language_model.model._decoder_replay_supported(config, cut)


def test_v41_flash_table_is_what_vllms_v41_model_asks_for():
    """The V4.1 writer's name/shape table on V4.1-Flash's config is exactly the parameter set
    vLLM's DeepseekV41ForCausalLM builds from it (all 40 layers at their real widths, built on
    the meta device), checked as tests/test_tiny_model.py checks the tiny V4.1."""
    from dsv4_attn.e2e.tiny_model import v41_weight_shapes
    from tests.test_tiny_model import _checkpoint_names_of

    config, model = _v41_flash_on_meta()
    expected = _checkpoint_names_of(dict(model.named_parameters()), config.model_config.hf_config)
    table = v41_weight_shapes(_v41_text())
    assert sorted(set(table) - set(expected)) == [], "not asked for by vLLM"
    assert sorted(set(expected) - set(table)) == [], "missing"
    assert {k: (table[k], expected[k]) for k in expected if table[k] != expected[k]} == {}
    for name, _ in model.named_buffers():
        assert name.endswith("rotary_emb.cos_sin_cache") or ".engram_hash." in name, name


def _primes_above(start: int, count: int) -> list[int]:
    found, n = [], start
    while len(found) < count:
        n += 1
        if all(n % d for d in range(2, int(n**0.5) + 1)):
            found.append(n)
    return found


def test_v41_flash_parameter_count_and_size_are_the_docstrings():
    """The table's parameter count and bytes equal a count from V4.1-Flash's geometry by hand,
    and the module docstring states them (8.57B, 15.8 GiB, 5.13B of attention)."""
    import torch

    from dsv4_attn.e2e.tiny_model import v41_weight_shapes

    table = v41_weight_shapes(_v41_text())
    count = sum(torch.Size(shape).numel() for shape, _ in table.values())
    size = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in table.values())
    attention = sum(torch.Size(s).numel() for name, (s, _) in table.items() if ".attn." in name)

    h, heads, q_lora, vocab, experts, inter = 5120, 64, 1280, 4224, 8, 512
    mix = (2 + 4) * 4  # hyper-connections of 4: pre, post and the 4 x 4 residual mix
    hc = 2 * (mix * 4 * h + mix + 3)  # attention's and the FFN's
    norms = 2 * h
    attn = (
        heads  # sinks
        + q_lora * h
        + q_lora  # wq_a, q_norm
        + heads * 512 * q_lora  # wq_b
        + 512 * h
        + 512  # wkv, kv_norm
        + 8 * 1024 * heads * 512 // 8  # wo_a: 8 groups of 1024
        + h * 8 * 1024  # wo_b
    )
    ffn = experts * h + experts + (experts + 1) * 3 * inter * h  # gate, routed + shared
    compressors = 3 * (2 * 512 * h + 512) + (512 * h + 512)  # ratio 2 (wkv, wgate), ratio 1
    indexers = 8 * (32 * 128 * q_lora + 32 * h) + 4 * (128 * 512 + 128)  # keys on KV sources
    primes = _primes_above(16383, 48)  # 3 n-gram sizes x 8 heads a layer, never reused
    rows = [sum(primes[:24]), sum(primes[24:])]
    engram_dense = 2 * (h * 5 * 3 * 8 * 256 + 2 * 4 * h)  # wkv (4 keys + value), q and k mixes
    engram_tables = sum(rows) * (256 + 256 // 32)  # FP8 rows, an E8M0 scale per 32
    top = 2 * vocab * h + h + 3 * h  # embed, head, norm, image delimiters
    want = 40 * (hc + norms + attn + ffn) + compressors + indexers + top
    assert count == want + engram_dense + engram_tables
    assert attention == 40 * attn + compressors + indexers
    fp32 = 40 * (hc + heads + experts) + 3 * h
    assert size == 2 * (want - fp32) + 4 * fp32 + 2 * engram_dense + engram_tables
    doc = real_shapes.__doc__
    assert f"{count / 1e9:.2f}B parameters, {size / 2**30:.1f} GiB" in doc, (count, size)
    assert f"{attention / 1e9:.2f}B of them attention" in doc


def test_v41_tokenizer_makes_bench_serves_random_prompts(monkeypatch):
    """``vllm bench serve --dataset-name random`` on the V4.1-Flash checkpoint's tokenizer (read
    offline, as vLLM's server reads it for this architecture): prompts of 8K tokens decode to
    text that encodes back to their length within a token and passes vLLM's character bound;
    a chat in V4.1's encoding fits the vocabulary."""
    from vllm.benchmarks.datasets.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = get_tokenizer(_v41_flash_dir(), tokenizer_mode="deepseek_v41")
    assert len(tokenizer) == _v41_text()["vocab_size"]
    assert tokenizer.model_max_length >= 1048576
    requests = RandomDataset(random_seed=3).sample(
        tokenizer, num_requests=3, input_len=8192, output_len=16
    )
    for request in requests:
        ids = tokenizer.encode(request.prompt, add_special_tokens=False)
        assert abs(len(ids) - 8192) <= 1 and len(ids) == request.prompt_len
        assert len(request.prompt) <= len(ids) * tokenizer.max_chars_per_token
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Héllo, 1 + 2?"}])
    assert 0 < max(chat) < len(tokenizer)


def test_sharded_v41_weights_load_through_vllms_loader(tmp_path):
    """The V4.1 writer in shards (as for V4.1-Flash, here 1 MB on the tiny V4.1): every name in
    exactly one shard and the index, the same tensors as one file holds, and vLLM's loader
    takes every weight from the shards."""
    import torch
    from safetensors.torch import load_file

    from dsv4_attn.e2e.tiny_model import (
        _v41_engram_fields,
        tiny_v41_config,
        write_v41_tokenizer,
        write_v41_weights,
    )

    spec = TinySpec(num_heads=8, index_heads=VLLM_SPEC.index_heads)
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    for path in (sharded, whole):
        path.mkdir()
        write_v41_tokenizer(path, spec.vocab_size)
        config = tiny_v41_config(spec, _v41_engram_fields(path))
        (path / "config.json").write_text(json.dumps(config))
    text = config["text_config"]
    table = write_v41_weights(sharded, text, seed=5, max_shard_bytes=2**20)
    write_v41_weights(whole, text, seed=5)
    shards = sorted(sharded.glob("*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    loaded = {}
    for shard in shards:
        tensors = load_file(str(shard))
        assert not set(tensors) & set(loaded)
        assert {index["weight_map"][k] for k in tensors} == {shard.name}
        loaded.update(tensors)
    assert set(loaded) == set(table) == set(index["weight_map"])
    reference = load_file(str(whole / "model.safetensors"))
    for name, tensor in reference.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
    _, model = vt.v41_vllm_model(str(sharded), "cpu", load=True)
    params = dict(model.named_parameters())
    embed = params["language_model.model.embed_tokens.weight"]
    assert torch.equal(embed, loaded["embed.weight"])


def test_cli_writes_the_v41_flash_checkpoint_with_v41(monkeypatch, tmp_path):
    """``--v41`` writes V4.1-Flash (experts, seed, device passed on) and refuses ``--layers``;
    without it, the V4 default (V4-Flash's 43 layers) stays."""
    calls = []
    monkeypatch.setattr(
        real_shapes,
        "write_v41_flash_checkpoint",
        lambda *args: calls.append(args) or (Path(args[0]), {}),
    )

    class Built(Exception):
        pass

    def build(config, *args, **kwargs):
        calls.append(config.num_hidden_layers)
        raise Built

    monkeypatch.setattr(real_shapes, "build_model", build)
    real_shapes.main([str(tmp_path), "--v41", "--experts", "4", "--seed", "3"])
    with pytest.raises(Built):
        real_shapes.main([str(tmp_path)])
    assert calls == [(str(tmp_path), 4, 3, "cpu"), 43]
    with pytest.raises(SystemExit, match="--v41 writes all 40 layers"):
        real_shapes.main([str(tmp_path), "--v41", "--layers", "4"])
