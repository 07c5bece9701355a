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


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4.1
# ----------------------------------------------------------------------------------------------


@functools.cache
def v41_checkpoint() -> str:
    return str(save_vllm_checkpoint(temp_dir("dsv41_vllm_ckpt_"), SPEC, family="v41"))


def _v41_config() -> dict:
    return json.loads(Path(v41_checkpoint(), "config.json").read_text())


@functools.cache
def v41_vllm():
    """``(config, model)``: vLLM's DeepseekV41ForCausalLM created and filled by vLLM's default
    model loader from :func:`v41_checkpoint` on the CPU, as ``vllm serve DIR
    --language-model-only`` would (:func:`tests.vllm_glue_testing.v41_vllm_model`)."""
    return vt.v41_vllm_model(v41_checkpoint(), "cpu", load=True)


def _checkpoint_names_of(params: dict[str, torch.Tensor], hf_config) -> dict:
    """``{checkpoint name: (shape, dtype)}`` of vLLM's V4.1 parameters ``params``, by undoing
    the loader's mapping (``vl_model._make_deepseek_v4_vl_weights_mapper`` and the fused
    parameters of ``DeepseekV4Model.load_weights``), written out from vLLM's sources: DeepSeek's
    names (no ``language_model.model.`` prefix, ``embed``, ``head``, ``gate.bias``, Engram
    ``embed.scale``), fused projections split into the checkpoint's parts, the stacked routed
    experts into one tensor per expert, the sinks of the real heads only (vLLM pads them to the
    kernel's head count with -inf)."""
    q_lora, head_dim = hf_config.q_lora_rank, hf_config.head_dim
    out = {}
    for name, param in params.items():
        shape, dtype = tuple(param.shape), param.dtype
        name = name.removeprefix("language_model.").removeprefix("model.")
        name = {"lm_head.weight": "head.weight", "embed_tokens.weight": "embed.weight"}.get(
            name, name
        )
        name = name.replace("engram.embed_tokens.weight_scale_inv", "engram.embed.scale")
        name = name.replace("engram.embed_tokens.weight", "engram.embed.weight")
        name = name.replace("gate.e_score_correction_bias", "gate.bias")
        head, _, leaf = name.rpartition(".")
        if dtype == torch.uint8:  # E8M0 scales: vLLM stores the raw exponent bytes
            dtype = torch.float8_e8m0fnu
        if name.endswith("attn.fused_wqa_wkv.weight"):
            stem = name.removesuffix("fused_wqa_wkv.weight")
            out[stem + "wq_a.weight"] = ((q_lora, shape[1]), dtype)
            out[stem + "wkv.weight"] = ((shape[0] - q_lora, shape[1]), dtype)
        elif name.endswith("compressor.fused_wkv_wgate.weight"):
            stem = name.removesuffix("fused_wkv_wgate.weight")
            parts = ["wkv", "wgate"][: shape[0] // head_dim]
            for part in parts:
                out[f"{stem}{part}.weight"] = ((head_dim, shape[1]), dtype)
        elif name.endswith("shared_experts.gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            for part in ("w1", "w3"):
                out[f"{stem}{part}.weight"] = ((shape[0] // 2, shape[1]), dtype)
        elif name.endswith("shared_experts.down_proj.weight"):
            out[name.replace("down_proj", "w2")] = (shape, dtype)
        elif leaf == "attn_sink":
            out[name] = ((hf_config.num_attention_heads,), dtype)
        elif head.endswith("experts.routed_experts"):
            stem = head.removesuffix("routed_experts")
            for e in range(shape[0]):
                if leaf == "w13_weight":
                    for part in ("w1", "w3"):
                        out[f"{stem}{e}.{part}.weight"] = ((shape[1] // 2, shape[2]), dtype)
                else:
                    assert leaf == "w2_weight", name
                    out[f"{stem}{e}.w2.weight"] = (shape[1:], dtype)
        else:
            out[name] = (shape, dtype)
    return out


def test_v41_checkpoint_holds_exactly_what_vllms_v41_model_asks_for():
    """Every parameter of vLLM's DeepseekV41ForCausalLM (built from the written config) is in the
    checkpoint under its checkpoint name, with its shape and dtype, and the checkpoint holds
    nothing else (vLLM's mapper drops some names silently, e.g. ``mtp.*``, ``vision.*``)."""
    config, model = v41_vllm()
    hf = config.model_config.hf_config
    expected = _checkpoint_names_of(dict(model.named_parameters()), hf)
    weights = load_file(f"{v41_checkpoint()}/model.safetensors")
    written = {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}
    assert sorted(set(written) - set(expected)) == [], "not asked for by vLLM"
    assert sorted(set(expected) - set(written)) == [], "missing"
    wrong = {k: (written[k], expected[k]) for k in expected if written[k] != expected[k]}
    assert wrong == {}
    # the only other state vLLM's model holds is derived: RoPE tables, Engram hash constants
    for name, _ in model.named_buffers():
        assert name.endswith("rotary_emb.cos_sin_cache") or ".engram_hash." in name, name


def test_v41_vllm_loader_puts_the_checkpoints_tensors_in_place():
    """The tensors vLLM loaded are the checkpoint's, fused ones concatenated in vLLM's order."""
    _, model = v41_vllm()
    weights = load_file(f"{v41_checkpoint()}/model.safetensors")
    params = dict(model.named_parameters())
    lm = "language_model.model."
    fused = {
        "language_model.lm_head.weight": ["head.weight"],
        lm + "embed_tokens.weight": ["embed.weight"],
        lm + "layers.1.attn.fused_wqa_wkv.weight": [
            "layers.1.attn.wq_a.weight",
            "layers.1.attn.wkv.weight",
        ],
        lm + "layers.1.attn.compressor.fused_wkv_wgate.weight": [
            "layers.1.attn.compressor.wkv.weight",
            "layers.1.attn.compressor.wgate.weight",
        ],
        lm + "layers.3.attn.compressor.fused_wkv_wgate.weight": [
            "layers.3.attn.compressor.wkv.weight"
        ],
        lm + "layers.2.ffn.gate.e_score_correction_bias": ["layers.2.ffn.gate.bias"],
        lm + "layers.1.engram.wkv.weight": ["layers.1.engram.wkv.weight"],
    }
    for param_name, parts in fused.items():
        want = torch.cat([weights[p].float() for p in parts])
        torch.testing.assert_close(params[param_name].float(), want, rtol=0, atol=0)
    sink = params[lm + "layers.4.attn.attn_sink"]
    heads = SPEC.num_heads
    assert torch.equal(sink[:heads], weights["layers.4.attn.attn_sink"])
    assert torch.isneginf(sink[heads:]).all()
    for layer in (1, 2):  # Engram tables: FP8 rows and E8M0 scales, byte for byte
        table = params[f"{lm}layers.{layer}.engram.embed_tokens.weight"]
        scales = params[f"{lm}layers.{layer}.engram.embed_tokens.weight_scale_inv"]
        rows = weights[f"layers.{layer}.engram.embed.weight"]
        assert torch.equal(table.view(torch.uint8), rows.view(torch.uint8))
        assert torch.equal(scales, weights[f"layers.{layer}.engram.embed.scale"].view(torch.uint8))


def test_v41_engram_is_on_and_keeps_the_decoder_replay():
    """Engram layers in the config, built by vLLM on exactly those layers with its n-gram hash
    (whose compressed vocabulary vLLM checks against the tokenizer's), all before the last KV
    source, so that vLLM's decoder replay stays allowed (its own rule says so)."""
    config, model = v41_vllm()
    text = _v41_config()["text_config"]
    engram_layers = text["engram_layer_ids"]
    assert engram_layers
    backbone = model.language_model.model
    built = [i for i, layer in enumerate(backbone.layers) if layer.engram is not None]
    assert built == engram_layers
    assert backbone.engram_hash is not None
    assert len(backbone.engram_hash.token_map) == text["vocab_size"]
    cut = max(text["kv_source_layer_ids"])
    assert backbone._decoder_replay_supported(config, cut)


def test_v41_layers_read_compressed_caches_of_their_own_ratio():
    """Each compressed layer of vLLM's built model reads the compressed cache (and page size) of
    a KV source of its own ratio, and the last KV source, where vLLM's decoder replay cuts, has
    ratio 1 (vLLM asserts that whenever the replay is on, as on a GPU)."""
    _, model = v41_vllm()
    attn = [layer.attn for layer in model.language_model.model.layers]
    compressed = [a for a in attn if a.compress_ratio > 0]
    assert {a.compress_ratio for a in compressed} == {1, 2}
    for a in compressed:
        assert attn[a.kv_source_layer_id].compress_ratio == a.compress_ratio, a.prefix
    assert attn[max(_v41_config()["text_config"]["kv_source_layer_ids"])].compress_ratio == 1
    # some layer reads the compressed cache of one source and the picks of another
    assert any(a.kv_source_layer_id != a.index_source_layer_id for a in compressed)


def test_v41_tokenizer_loads_offline_and_spells_the_chat_encoding(monkeypatch):
    """``AutoTokenizer.from_pretrained(DIR)`` offline: the config's vocabulary size; every marker
    of vLLM's V4.1 chat encoding is one token; vLLM's V4.1 tokenizer (``--tokenizer-mode
    deepseek_v41``, the default for the architecture) encodes a chat and decodes it back."""
    from transformers import AutoTokenizer
    from vllm.tokenizers import deepseek_v41_encoding as enc
    from vllm.tokenizers.deepseek_v41 import DeepseekV41Tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    vocab_size = _v41_config()["text_config"]["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(v41_checkpoint())
    assert len(tokenizer) == vocab_size
    markers = [
        enc.bos_token,
        enc.eos_token,
        enc.thinking_start_token,
        enc.thinking_end_token,
        enc.dsml_token,
        enc.USER_SP_TOKEN,
        enc.ASSISTANT_SP_TOKEN,
        enc.SYSTEM_SP_TOKEN,
        enc.LATEST_REMINDER_SP_TOKEN,
        enc.IMAGE_PLACEHOLDER,
        *enc.DS_TASK_SP_TOKENS.values(),
    ]
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in markers]
    assert all(len(i) == 1 for i in ids), dict(zip(markers, ids, strict=True))
    assert len({i[0] for i in ids}) == len(markers)
    chat = DeepseekV41Tokenizer.from_pretrained(v41_checkpoint())
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo, wörld! 1 + 2 = ?"},
        {"role": "assistant", "content": "3", "reasoning_content": "add"},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    prompt = chat.apply_chat_template(messages, tokenize=False)
    token_ids = chat.apply_chat_template(messages)
    assert prompt.startswith(enc.bos_token) and enc.thinking_start_token in prompt
    assert max(token_ids) < vocab_size
    assert chat.decode(token_ids, skip_special_tokens=False) == prompt


def test_v41_checkpoint_takes_no_mtp_layers(tmp_path):
    for kwargs in ({"mtp_layers": 1}, {"mtp_layers": 1, "dspark": True}):
        with pytest.raises(ValueError, match=r"DeepSeek-V4\.1 has no MTP layers"):
            save_vllm_checkpoint(tmp_path, SPEC, family="v41", **kwargs)
    with pytest.raises(ValueError, match="family must be one of"):
        save_vllm_checkpoint(tmp_path, SPEC, family="v5")
    assert list(tmp_path.iterdir()) == []


def test_serve_check_cli_writes_the_v41_checkpoint(monkeypatch):
    """``serve_check checkpoint DIR --v41`` asks for the V4.1 family without MTP layers (with
    ``--dspark`` its DSpark draft, with ``--draftable`` too the draftable spec), and refuses MTP
    layers and ``--draftable`` without ``--dspark``; without it, the V4 default of one MTP
    layer stays."""
    from dsv4_attn.e2e import serve_check, tiny_model

    calls = []
    monkeypatch.setattr(
        tiny_model, "save_vllm_checkpoint", lambda *a, **k: calls.append((a, k)) or a[0]
    )
    serve_check.main(["checkpoint", "D", "--v41"])
    serve_check.main(["checkpoint", "D", "--v41", "--dspark"])
    serve_check.main(["checkpoint", "D", "--v41", "--dspark", "--draftable"])
    serve_check.main(["checkpoint", "D"])
    assert [(a[1], a[2], k) for a, k in calls] == [
        (tiny_model.VLLM_SPEC, 0, {"dspark": False, "family": "v41"}),
        (tiny_model.VLLM_SPEC, 0, {"dspark": True, "family": "v41"}),
        (tiny_model.DRAFTABLE_SPEC, 0, {"dspark": True, "family": "v41"}),
        (tiny_model.VLLM_SPEC, 1, {"dspark": False, "family": "v4"}),
    ]
    for flag in ("--draftable", "--mtp-layers=1"):
        with pytest.raises(SystemExit, match="--draftable only with --dspark"):
            serve_check.main(["checkpoint", "D", "--v41", flag])


def test_the_bigram_rule_is_what_transformers_computes_with_zeroed_layers():
    """The rule :func:`v41_bigram_table` applies (a stream of equal embedding copies, collapsed
    with positive weights, then RMSNorm and the head: ``argmax head @ (norm * e / rms(e))``),
    checked on V4, where transformers runs the whole model with every layer's output zeroed
    (:func:`bigram_table`), its learned hyper-connection head included."""
    from dsv4_attn.e2e.tiny_model import DRAFTABLE_SPEC, _bigram_of, bigram_table, build_tiny_model

    model = build_tiny_model(DRAFTABLE_SPEC)
    inner = model.model
    rule = _bigram_of(
        inner.embed_tokens.weight.detach(),
        inner.norm.weight.detach(),
        model.lm_head.weight.detach(),
        model.config.rms_norm_eps,
        row_dtype=torch.float32,
    )
    assert torch.equal(rule, bigram_table(model))
    assert len(rule.unique()) > 100  # a table of many tokens, not a constant


def test_a_draftable_v41_scales_exactly_each_layers_outputs(tmp_path):
    """``layer_output_scale`` multiplies attention's output projection, the routed and shared
    experts' down projections and the Engram's wkv of every layer, and changes no other tensor
    (the same seed draws the rest alike)."""
    from dsv4_attn.e2e.tiny_model import write_v41_checkpoint

    scale = 0.02
    plain = load_file(
        str(write_v41_checkpoint(tmp_path / "plain", VLLM_SPEC) / "model.safetensors")
    )
    spec = TinySpec(num_heads=64, index_heads=64, layer_output_scale=scale)
    scaled = load_file(str(write_v41_checkpoint(tmp_path / "scaled", spec) / "model.safetensors"))
    assert plain.keys() == scaled.keys()
    outputs = (".attn.wo_b.weight", ".shared_experts.w2.weight", ".engram.wkv.weight")
    expected_scaled = {
        name
        for name in plain
        if name.endswith(outputs) or (".ffn.experts." in name and name.endswith(".w2.weight"))
    }
    assert any(".engram." in n for n in expected_scaled) and len(expected_scaled) > 6 * 3
    for name, tensor in plain.items():
        if name in expected_scaled:
            assert torch.equal(scaled[name], (tensor.float() * scale).to(tensor.dtype)), name
        else:
            assert torch.equal(scaled[name], tensor), name


def test_a_draftable_v41_dspark_head_drafts_its_bigram(tmp_path):
    """``save_vllm_checkpoint(..., family="v41", dspark=True)`` with the draftable spec: the
    draft's Markov bias (vLLM's ``w2 @ w1[t]``, V4.1's ``head @ embed[t]``) peaks at the
    checkpoint's own bigram for every token; with the plain spec the head is of low rank."""
    from safetensors import safe_open

    from dsv4_attn.e2e.tiny_model import DRAFTABLE_SPEC, v41_bigram_table

    path = save_vllm_checkpoint(tmp_path / "d", DRAFTABLE_SPEC, 0, dspark=True, family="v41")
    bigram = v41_bigram_table(path)
    with safe_open(str(path / "dspark.safetensors"), framework="pt") as handle:
        w1 = handle.get_tensor("mtp.2.markov_head.embed.weight").float()
        w2 = handle.get_tensor("mtp.2.markov_head.head.weight").float()
    bias = w1 @ w2.T  # [previous token, next token]: w2 @ w1[t] for each t, as rows
    assert torch.equal(bias.argmax(-1), bigram)
    assert len(bigram.unique()) > 100
    plain = save_vllm_checkpoint(tmp_path / "p", VLLM_SPEC, 0, dspark=True, family="v41")
    config = json.loads((plain / "config.json").read_text())
    assert config["text_config"]["dspark_markov_rank"] == 64
