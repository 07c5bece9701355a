"""The tiny checkpoint's draft weights (:mod:`dsv4_attn.e2e.draft_weights`) load through vLLM
0.33's own draft models as written: MTP layers through ``DeepSeekV4MTP``, the DSpark draft
through ``DSparkDeepseekV4ForCausalLM`` (V4's, and V4.1's of ``vllm.models.deepseek_v41``); and
the drafts built to predict the bigram do."""

from __future__ import annotations

import functools
import json
import os
import shutil
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests import vllm_glue_testing as vt
from tests.temp_dirs import temp_dir

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file

from dsv4_attn.e2e.draft_weights import (
    DEFAULT_MARKOV_RANK,
    DSPARK_FILE,
    DSPARK_LAYERS,
    DSPARK_TARGET_LAYER_IDS,
    MARKOV_BIGRAM_BIAS,
    add_dspark_layers,
    add_mtp_layers,
    v41_dspark_target_layer_ids,
)
from dsv4_attn.e2e.tiny_model import V41_RATIOS, VLLM_SPEC, TinySpec, save_vllm_checkpoint
from dsv4_attn.vllm_glue.support import check_supported
from tests.test_tiny_model import SPEC
from tests.test_tiny_model import checkpoint as mtp_checkpoint

NUM_SPECULATIVE_TOKENS = 4
# vLLM runs DSpark on its V2 model runner only, which it picks by itself where Triton is
# installed (GPU machines); on a CPU without Triton it falls back to V1, which refuses DSpark.
_V2_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


@functools.cache
def checkpoint() -> str:
    """The tiny vLLM checkpoint (8 query heads) with the DSpark draft (no MTP layers)."""
    path = temp_dir("dsv4_dspark_ckpt_")
    return str(save_vllm_checkpoint(path, SPEC, mtp_layers=0, dspark=True))


def checkpoint_weights(path: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (default: the DSpark one)."""
    weights = {}
    for file in sorted(Path(path or checkpoint()).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def engine_config(attention_backend: str | None, path: str | None = None):
    dspark = {"method": "dspark", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    args = vt.engine_args(
        model=path or checkpoint(),
        load_format="auto",
        max_num_seqs=4,
        attention_backend=attention_backend,
        speculative_config=dspark,
    )
    with mock.patch.dict(os.environ, _V2_RUNNER):
        return args.create_engine_config()


@functools.cache
def dspark_model():
    return load_dspark_with_vllm(checkpoint())


def load_dspark_with_vllm(path: str):
    """vLLM's DeepSeek-V4 DSpark draft (``DSparkDeepseekV4ForCausalLM``, CUDA model code built
    on the CPU with this package's attention layer) for the checkpoint, filled by its own
    ``load_weights`` from every tensor of the checkpoint. Returns ``(model, loaded names)``.

    Built directly, as vLLM's ``load_dspark_model`` builds it (the target's vLLM config, prefix
    ""): vLLM's registry maps the DSpark architecture to a refusal on the CPU platform, and
    vLLM's own DeepSeek-V4 attention needs a CUDA device at construction. Besides what the MTP
    draft needs (``vt._cpu_events``), the V2 model runner is chosen while it is built (above). The
    DSV4_NVFP4 layers run their build-time support check on the DSpark configuration as they
    do in a server."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    vt._distributed_ready()
    config = engine_config("DSV4_NVFP4", path)
    draft = config.speculative_config.draft_model_config
    assert draft.architectures == ["DSparkDraftModel"]
    with (
        mock.patch.dict(os.environ, _V2_RUNNER),
        set_current_vllm_config(config),
        vt._cpu_events(),
        set_default_torch_dtype(draft.dtype),
    ):
        model = DSparkDeepseekV4ForCausalLM(vllm_config=config, prefix="")
    with set_current_vllm_config(config):
        loaded = model.load_weights(iter(checkpoint_weights(path).items()))
    return model, loaded


@pytest.mark.parametrize("attention_backend", [None, "DSV4_NVFP4"])
def test_vllm_takes_the_dspark_config(attention_backend):
    """vLLM resolves method "dspark" on the checkpoint to its DeepSeek-V4 DSpark draft, with
    the layers, ranks and target layers config.json gives."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    on_disk = json.loads(Path(checkpoint(), "config.json").read_text())
    assert on_disk["dspark_target_layer_ids"] == list(DSPARK_TARGET_LAYER_IDS)
    assert on_disk["n_mtp_layers"] == DSPARK_LAYERS
    assert on_disk["dspark_markov_rank"] == DEFAULT_MARKOV_RANK
    assert on_disk["enable_confidence_head"] is True
    assert on_disk["num_nextn_predict_layers"] == 0
    assert on_disk["dspark_noise_token_id"] == on_disk["vocab_size"] - 1

    config = engine_config(attention_backend)
    check_supported(config)  # served as it is, by either backend
    spec = config.speculative_config
    assert spec.method == "dspark" and spec.num_speculative_tokens == NUM_SPECULATIVE_TOKENS
    hf = spec.draft_model_config.hf_config
    assert spec.draft_model_config.architectures == ["DSparkDraftModel"]
    assert hf.model_type == "deepseek_v4"
    assert list(hf.dspark_target_layer_ids) == list(DSPARK_TARGET_LAYER_IDS)
    assert hf.n_mtp_layers == DSPARK_LAYERS and hf.dspark_markov_rank == DEFAULT_MARKOV_RANK
    # vLLM's GPU speculator refuses a draft block without a token for its undrafted slots.
    assert get_parallel_drafting_token_id(hf) == on_disk["vocab_size"] - 1
    # The target hands the draft the stream after each target layer (vLLM's ids are 1-based):
    # every one of them a layer the tiny model has.
    aux = get_eagle3_aux_layers_from_config(spec)
    assert aux == tuple(i + 1 for i in DSPARK_TARGET_LAYER_IDS)
    assert max(aux) <= on_disk["num_hidden_layers"]


def test_checkpoint_has_the_dspark_layers():
    config = json.loads(Path(checkpoint(), "config.json").read_text())
    names = load_file(str(Path(checkpoint(), DSPARK_FILE)))
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    last = f"mtp.{DSPARK_LAYERS - 1}"
    assert names["mtp.0.main_proj.weight"].shape == (hidden, hidden * len(DSPARK_TARGET_LAYER_IDS))
    assert names[f"{last}.markov_head.markov_w1.weight"].shape == (vocab, DEFAULT_MARKOV_RANK)
    assert names[f"{last}.markov_head.markov_w2.weight"].shape == (vocab, DEFAULT_MARKOV_RANK)
    assert names[f"{last}.confidence_head.proj.weight"].shape == (1, hidden + DEFAULT_MARKOV_RANK)
    for i in range(DSPARK_LAYERS):
        assert f"mtp.{i}.attn.wkv.weight" in names and f"mtp.{i}.ffn.gate.bias" in names
    assert not any(k.startswith(f"mtp.{DSPARK_LAYERS}.") for k in names)
    assert not any(".compressor." in k for k in names)  # sliding-window layers
    # No MTP-only tensor, and neither the embedding nor the head: vLLM aliases the target's.
    for part in ("e_proj", "h_proj", "enorm", "hnorm", "head.weight", "emb.tok_emb"):
        assert not any(f".{part}" in k for k in names), part
    index = Path(checkpoint(), "model.safetensors.index.json")
    if index.exists():
        assert json.loads(index.read_text())["weight_map"]["mtp.0.main_proj.weight"] == DSPARK_FILE


def test_vllm_dspark_loader_takes_every_draft_weight():
    """Every parameter of vLLM's DSpark draft comes from the checkpoint (its loader raises on a
    name it cannot place) but the token embedding and the head, which vLLM's
    ``load_dspark_model`` aliases from the target (``has_own_embed_tokens`` and
    ``has_own_lm_head`` are False), and holds the checkpoint's tensor, none of the main
    model's."""
    model, loaded = dspark_model()
    params = dict(model.named_parameters())
    aliased = {"model.embed_tokens.weight", "lm_head.weight"}
    assert set(loaded) == set(params) - aliased
    # Kept: the loader drops the confidence head when the checkpoint has none.
    assert model.model.confidence_head is not None

    weights = checkpoint_weights()
    last = f"mtp.{DSPARK_LAYERS - 1}"
    checks = {
        "mtp.0.main_proj.weight": "model.main_proj.weight",
        "mtp.0.main_norm.weight": "model.main_norm.weight",
        "mtp.1.attn.wq_b.weight": "model.layers.1.attn.wq_b.weight",
        "mtp.2.attn.attn_sink": "model.layers.2.attn.attn_sink",
        "mtp.0.hc_attn_fn": "model.layers.0.hc_attn_fn",
        "mtp.1.ffn.gate.bias": "model.layers.1.ffn.gate.e_score_correction_bias",
        f"{last}.norm.weight": "model.norm.weight",
        f"{last}.hc_head_fn": "model.hc_head_fn",
        f"{last}.markov_head.markov_w1.weight": "model.markov_head.markov_w1.weight",
        f"{last}.markov_head.markov_w2.weight": "model.markov_head.markov_w2.weight",
        f"{last}.confidence_head.proj.weight": "model.confidence_head.proj.weight",
    }
    for ckpt_name, param_name in checks.items():
        torch.testing.assert_close(params[param_name].float(), weights[ckpt_name].float())
    # Stacked on load: each layer's wq_a and wkv, every layer's wkv in the context projection,
    # the routed experts.
    fused = torch.cat([weights["mtp.1.attn.wq_a.weight"], weights["mtp.1.attn.wkv.weight"]])
    torch.testing.assert_close(params["model.layers.1.attn.fused_wqa_wkv.weight"], fused)
    context = torch.cat([weights[f"mtp.{i}.attn.wkv.weight"] for i in range(DSPARK_LAYERS)])
    torch.testing.assert_close(params["model.context_wkv_proj.weight"], context)
    torch.testing.assert_close(
        params["model.layers.2.ffn.experts.routed_experts.w2_weight"][1],
        weights["mtp.2.ffn.experts.1.w2.weight"],
    )

    # The main model's tensors of the same role differ: a loader reading those is caught.
    config = json.loads(Path(checkpoint(), "config.json").read_text())
    sliding = f"model.layers.{config['layer_types'].index('sliding_attention')}"
    main = {
        "mtp.0.main_norm.weight": "model.norm.weight",
        "mtp.1.attn.wq_b.weight": f"{sliding}.attn.wq_b.weight",
        "mtp.2.attn.attn_sink": f"{sliding}.attn.attn_sink",
        f"{last}.norm.weight": "model.norm.weight",
        f"{last}.hc_head_fn": "model.hc_head_fn",
    }
    for draft_name, main_name in main.items():
        assert not torch.equal(weights[draft_name], weights[main_name]), draft_name
    # and so do the draft layers' own: a loader reading one stage for all is caught too.
    assert not torch.equal(weights["mtp.0.attn.wq_b.weight"], weights["mtp.1.attn.wq_b.weight"])


def test_vllm_dspark_loader_cannot_take_mtp_weights():
    """Why :func:`add_dspark_layers` refuses a checkpoint with MTP layers: vLLM's DSpark loader
    maps an ``mtp.{i}.*`` name it does not know as a head to its decoder layer ``i``, where
    MTP's own tensors have no parameter."""
    model, _ = dspark_model()
    with pytest.raises(KeyError, match=r"model\.layers\.0\.e_proj\.weight"):
        model.load_weights([("mtp.0.e_proj.weight", torch.zeros(256, 256))])


def _config_only(tmp_path: Path) -> Path:
    shutil.copy(Path(checkpoint(), "config.json"), tmp_path / "config.json")
    return tmp_path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"markov_rank": 0}, r"markov_rank must be an int in \[1, vocab_size=1024\], got 0"),
        ({"markov_rank": -3}, r"markov_rank must be an int in \[1, vocab_size=1024\], got -3"),
        ({"markov_rank": 1025}, r"\[1, vocab_size=1024\], got 1025"),
        ({"markov_rank": 1.5}, r"markov_rank must be an int, got 1\.5"),
        ({"markov_rank": True}, r"markov_rank must be an int, got True"),
        ({"seed": -1}, r"seed must be a non-negative int \(>= 0\), got -1"),
        ({"seed": "0"}, r"seed must be an int, got '0'"),
    ],
)
def test_add_dspark_layers_refuses_bad_arguments(tmp_path, kwargs, message):
    path = _config_only(tmp_path)
    before = (path / "config.json").read_text()
    with pytest.raises(ValueError, match=message):
        add_dspark_layers(path, **kwargs)
    assert (path / "config.json").read_text() == before and not (path / DSPARK_FILE).exists()


def test_add_dspark_layers_refuses_mtp_checkpoints(tmp_path):
    """MTP and DSpark weights are both ``mtp.{i}.*``: a checkpoint holds one draft or the
    other, whether config.json or the weights say it has MTP layers."""
    path = _config_only(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"already has MTP draft layers \(num_nextn_predict"):
        add_dspark_layers(path)
    (path / "config.json").write_text(json.dumps(config))
    save_file({"mtp.0.e_proj.weight": torch.zeros(2, 2)}, str(path / "mtp.safetensors"))
    with pytest.raises(ValueError, match=r"mtp\.\* weights in \['mtp\.safetensors'\]"):
        add_dspark_layers(path)
    assert not (path / DSPARK_FILE).exists()


# MTP ----------------------------------------------------------------------------------------


@functools.cache
def mtp_model():
    return load_mtp_with_vllm(mtp_checkpoint())


def load_mtp_with_vllm(path: str):
    """vLLM's DeepSeek-V4 MTP draft (``DeepSeekV4MTP``, CUDA model code built on the CPU with
    this package's attention layer) for the checkpoint at ``path`` with its MTP layer, filled by
    its own ``load_weights`` from every tensor of the checkpoint (vLLM's registry maps the MTP
    architecture to a refusal on the CPU platform, so it is built directly)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.nvidia.mtp import DeepSeekV4MTP
    from vllm.utils.torch_utils import set_default_torch_dtype

    vt._distributed_ready()
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    args = vt.engine_args(
        model=path,
        load_format="auto",
        max_num_seqs=4,
        attention_backend="DSV4_NVFP4",
        speculative_config=mtp,
    )
    config = args.create_engine_config()
    draft = config.speculative_config.draft_model_config
    assert draft.architectures == ["DeepSeekV4MTPModel"]

    class _NoStream:  # the predictor makes aux CUDA streams in __init__
        def __init__(self, *args, **kwargs) -> None:
            pass

    saved = torch.cuda.Stream
    torch.cuda.Stream = _NoStream  # type: ignore[misc]
    try:
        with (
            set_current_vllm_config(config),
            vt._cpu_events(),
            set_default_torch_dtype(draft.dtype),
        ):
            model = DeepSeekV4MTP(vllm_config=config, prefix="model")
    finally:
        torch.cuda.Stream = saved  # type: ignore[misc]
    with set_current_vllm_config(config):
        loaded = model.load_weights(iter(checkpoint_weights(path).items()))
    return model, loaded


def test_checkpoint_has_one_mtp_layer_by_default():
    config = json.loads(Path(mtp_checkpoint(), "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    index = Path(mtp_checkpoint(), "model.safetensors.index.json")
    names = checkpoint_weights(mtp_checkpoint())
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
    weights = checkpoint_weights(mtp_checkpoint())
    config = json.loads(Path(mtp_checkpoint(), "config.json").read_text())
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
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_layers must be a positive int"):
            add_mtp_layers(tmp_path, bad)


def test_a_bigram_mtp_layer_reads_the_main_models_embedding_and_head(tmp_path):
    """The draftable checkpoint's MTP layer: the embedding passes straight into the decoder
    block (e_proj the identity, h_proj zero, enorm ones) and leaves through the main model's
    own hyper-connection head, norm and head; vLLM's MTP loader places every tensor."""
    spec = TinySpec(num_heads=8, index_heads=VLLM_SPEC.index_heads, layer_output_scale=0.02)
    path = str(save_vllm_checkpoint(tmp_path / "ckpt", spec))
    weights = checkpoint_weights(path)
    hidden = weights["mtp.0.e_proj.weight"].shape[0]
    assert torch.equal(weights["mtp.0.e_proj.weight"].float(), torch.eye(hidden))
    assert not weights["mtp.0.h_proj.weight"].any()
    assert torch.equal(weights["mtp.0.enorm.weight"], torch.ones_like(weights["model.norm.weight"]))
    same = {
        "mtp.0.emb.tok_emb.weight": "model.embed_tokens.weight",
        "mtp.0.head.weight": "head.weight",
        "mtp.0.norm.weight": "model.norm.weight",
        "mtp.0.hc_head_fn": "model.hc_head_fn",
        "mtp.0.hc_head_base": "model.hc_head_base",
        "mtp.0.hc_head_scale": "model.hc_head_scale",
    }
    for draft, main in same.items():
        assert torch.equal(weights[draft], weights[main]), draft
    config = json.loads(Path(path, "config.json").read_text())
    sliding = config["layer_types"].index("sliding_attention")
    main_sink = weights[f"model.layers.{sliding}.attn.attn_sink"]
    assert not torch.equal(weights["mtp.0.attn.attn_sink"], main_sink)  # a block of its own
    model, loaded = load_mtp_with_vllm(path)
    params = dict(model.named_parameters())
    assert set(loaded) == set(params)
    layer = f"model.layers.{config['num_hidden_layers']}"
    torch.testing.assert_close(params[f"{layer}.e_proj.weight"].float(), torch.eye(hidden))


# DSpark drafting the bigram -------------------------------------------------------------------


def test_a_bigram_markov_head_biases_exactly_the_bigram(tmp_path):
    """A draftable DSpark checkpoint: the Markov head adds the bias to the previous token's
    bigram (the main model's :func:`bigram_table` of the weights as written) and nothing else,
    in vLLM's own head (w2 @ w1[token]); vLLM's loader places every draft tensor."""
    from dsv4_attn.e2e.tiny_model import bigram_table, build_tiny_model

    spec = TinySpec(num_heads=8, index_heads=VLLM_SPEC.index_heads, layer_output_scale=0.02)
    path = save_vllm_checkpoint(tmp_path / "ckpt", spec, mtp_layers=0, dspark=True)
    config = json.loads(Path(path, "config.json").read_text())
    vocab = config["vocab_size"]
    assert config["dspark_markov_rank"] == vocab
    weights = checkpoint_weights(str(path))
    last = f"mtp.{DSPARK_LAYERS - 1}.markov_head"
    w1 = weights[f"{last}.markov_w1.weight"].float()
    w2 = weights[f"{last}.markov_w2.weight"].float()
    bias = w1 @ w2.T  # row t: the bias after token t
    table = bias.argmax(-1)
    assert (bias.amax(-1) == MARKOV_BIGRAM_BIAS).all() and (
        bias.sum(-1) == MARKOV_BIGRAM_BIAS
    ).all()
    # The bigram the main model gives, recomputed here from a fresh build of the same spec
    # (bf16 weights, as written and served).
    model = build_tiny_model(spec).to(torch.bfloat16).float()
    assert torch.equal(table, bigram_table(model))
    assert len(set(table.tolist())) > vocab // 4  # a map of tokens, not a constant
    draft, loaded = load_dspark_with_vllm(str(path))
    params = dict(draft.named_parameters())
    assert set(loaded) == set(params) - {"model.embed_tokens.weight", "lm_head.weight"}
    torch.testing.assert_close(params["model.markov_head.markov_w2.weight"].float(), w2)


def test_add_dspark_layers_refuses_a_bad_bigram(tmp_path):
    path = _config_only(tmp_path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    good = torch.zeros(vocab, dtype=torch.int64)
    cases = [
        ({"bigram": good, "markov_rank": 64}, r"rank vocab_size=1024, got markov_rank=64"),
        ({"bigram": good[:-1]}, r"shape \(1024,\), got torch.int64 \(1023,\)"),
        ({"bigram": good.int()}, r"int64 tensor .* got torch.int32"),
        ({"bigram": good + vocab}, r"in \[0, 1024\), got 1024\.\.1024"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            add_dspark_layers(path, **kwargs)
    assert not (path / DSPARK_FILE).exists()


def test_a_checkpoint_holds_one_draft_or_the_other(tmp_path):
    with pytest.raises(ValueError, match=r"with dspark, mtp_layers must be 0, got 1"):
        save_vllm_checkpoint(tmp_path, SPEC, mtp_layers=1, dspark=True)


# DeepSeek-V4.1 --------------------------------------------------------------------------------

# The stream entering each of the tiny V4.1's last three layers (of six), as V4.1-Flash's
# published draft reads layers 37, 38 and 39 of 40; vLLM's V4.1 takes the ids as they are.
V41_TARGET_LAYER_IDS = (3, 4, 5)
# vLLM's V4.1 DSpark leaves these to the target (load_dspark_model aliases them).
ALIASED = {"model.embed_tokens.weight", "lm_head.weight"}


@functools.cache
def v41_checkpoint() -> str:
    """The tiny V4.1 checkpoint with the DSpark draft."""
    path = save_vllm_checkpoint(temp_dir("dsv41_dspark_ckpt_"), SPEC, family="v41")
    return str(add_dspark_layers(path, SPEC.seed))


def v41_engine_config(path: str):
    """The engine config of ``vllm serve PATH --language-model-only`` with this package's
    backend (fp8, the KV format it serves V4.1 with) and method "dspark" on the draft inside
    the checkpoint, its block size left to the checkpoint's ``dspark_block_size``."""
    from vllm.config.engram import EngramConfig

    vt._distributed_ready()
    args = vt.engine_args(
        model=path,
        load_format="auto",
        max_num_seqs=4,
        skip_tokenizer_init=False,
        language_model_only=True,
        engram_config=EngramConfig(cpu_offload=False),
        attention_backend="DSV4_NVFP4",
        kv_cache_dtype="fp8",
        speculative_config={"method": "dspark", "model": path},
    )
    with mock.patch.dict(os.environ, _V2_RUNNER):
        return args.create_engine_config()


def load_v41_dspark_with_vllm(path: str):
    """vLLM's DeepSeek-V4.1 DSpark draft (``vllm.models.deepseek_v41.nvidia.dspark
    .DSparkDeepseekV4ForCausalLM``, CUDA model code built on the CPU with this package's V4.1
    attention layer) for the checkpoint at ``path``, filled by its own ``load_weights`` from
    every tensor of the checkpoint. Returns ``(config, model, loaded names)``.

    Built directly, as vLLM's ``load_dspark_model`` builds it (see
    :func:`load_dspark_with_vllm`), with the CUDA set-up vLLM's V4.1 layers do in
    ``__init__`` stood in as :func:`tests.vllm_glue_testing.v41_vllm_model` stands it in (none
    of it makes parameters)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41.nvidia import flashmla
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = v41_engine_config(path)
    draft = config.speculative_config.draft_model_config
    assert draft.architectures == ["DSparkV41DraftModel"]
    sms = SimpleNamespace(multi_processor_count=4)
    with (
        mock.patch.dict(os.environ, _V2_RUNNER),
        set_current_vllm_config(config),
        vt._cpu_events(),
        set_default_torch_dtype(draft.dtype),
        mock.patch.object(torch.cuda, "Stream", vt._NoStream),
        mock.patch.object(torch.cuda, "get_device_properties", lambda *args: sms),
        mock.patch.object(torch.accelerator, "current_device_index", lambda: 0),
        mock.patch.object(flashmla, "compute_fp8_einsum_recipe", lambda b: ((1, 128, 128), False)),
        mock.patch.object(flashmla, "register_dsv41_o_proj_warmup", lambda layer: None),
    ):
        model = DSparkDeepseekV4ForCausalLM(vllm_config=config, prefix="")
    with set_current_vllm_config(config):
        loaded = model.load_weights(iter(checkpoint_weights(path).items()))
    return config, model, loaded


@functools.cache
def v41_dspark_model():
    return load_v41_dspark_with_vllm(v41_checkpoint())


def _v41_destination(name: str, text: dict) -> tuple[str, tuple]:
    """Where vLLM's V4.1 DSpark keeps the checkpoint tensor ``name``: ``(parameter, index)``
    with the tensor equal to ``parameter[index]``, written out from vLLM's sources
    (``vllm/models/deepseek_v41/nvidia/dspark.py``: ``_remap_dspark_name`` and
    ``load_weights``; the fused projections' and experts' layouts), not from the writer."""
    stage, rest = name.removeprefix("mtp.").split(".", 1)
    if rest in ("main_proj.weight", "main_norm.weight", "norm.weight"):
        return f"model.{rest}", ()
    if rest.startswith("confidence_head."):
        return f"model.{rest}", ()
    if rest == "markov_head.embed.weight":
        return "model.markov_head.markov_w1.weight", ()
    if rest == "markov_head.head.weight":
        return "model.markov_head.markov_w2.weight", ()
    layer = f"model.layers.{stage}."
    q_lora, inter = text["q_lora_rank"], text["moe_intermediate_size"]
    shared = inter * text["n_shared_experts"]
    if rest == "attn.wq_a.weight":  # [wq_a; wkv] stacked along the output
        return layer + "attn.fused_wqa_wkv.weight", (slice(0, q_lora),)
    if rest == "attn.wkv.weight":
        return layer + "attn.fused_wqa_wkv.weight", (slice(q_lora, None),)
    if rest == "attn.attn_sink":  # one per query head, of the padded heads the kernels take
        return layer + rest, (slice(0, text["num_attention_heads"]),)
    if rest == "ffn.gate.bias":
        return layer + "ffn.gate.e_score_correction_bias", ()
    parts = rest.split(".")
    if rest.startswith("ffn.shared_experts."):
        if parts[2] == "w2":
            return layer + "ffn.shared_experts.down_proj.weight", ()
        rows = slice(0, shared) if parts[2] == "w1" else slice(shared, None)
        return layer + "ffn.shared_experts.gate_up_proj.weight", (rows,)
    if rest.startswith("ffn.experts."):  # ffn.experts.{e}.w{1,2,3}.weight: stacked by expert
        expert, proj = int(parts[2]), parts[3]
        if proj == "w2":
            return layer + "ffn.experts.routed_experts.w2_weight", (expert,)
        rows = slice(0, inter) if proj == "w1" else slice(inter, None)
        return layer + "ffn.experts.routed_experts.w13_weight", (expert, rows)
    return layer + rest, ()


def test_vllm_takes_the_v41_dspark_config():
    """vLLM resolves method "dspark" on the V4.1 checkpoint to its V4.1 DSpark draft, reading
    the layers, ranks, target layers and block size from ``text_config``, and hands the draft
    the stream entering layers that the tiny V4.1 has."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    on_disk = json.loads(Path(v41_checkpoint(), "config.json").read_text())
    text = on_disk["text_config"]
    assert on_disk["model_type"] == "deepseek_v41"
    assert text["dspark_target_layer_ids"] == list(V41_TARGET_LAYER_IDS)
    assert text["n_mtp_layers"] == 3 and text["dspark_markov_rank"] == DEFAULT_MARKOV_RANK
    assert text["enable_confidence_head"] is True and text["dspark_block_size"] == 5
    assert text["dspark_noise_token_id"] == text["vocab_size"] - 1
    # one window-only entry per draft layer past the main ones, as V4.1-Flash's config has
    assert text["compress_ratios"] == [*V41_RATIOS, 0, 0, 0]
    assert not any(key.startswith("dspark") or key == "n_mtp_layers" for key in on_disk)

    config = v41_dspark_model()[0]
    check_supported(config)
    spec = config.speculative_config
    assert spec.method == "dspark" and spec.num_speculative_tokens == 5
    hf = spec.draft_model_config.hf_config
    assert hf.model_type == "deepseek_v41"
    assert list(hf.dspark_target_layer_ids) == list(V41_TARGET_LAYER_IDS)
    assert hf.n_mtp_layers == 3 and hf.dspark_markov_rank == DEFAULT_MARKOV_RANK
    assert get_parallel_drafting_token_id(hf) == text["vocab_size"] - 1
    # vLLM's V4.1 captures the stream entering layer L inside layer L's hyper-connection pre-mix
    # (L = num_hidden_layers: the last layer's output); layer 0 captures nothing.
    aux = get_eagle3_aux_layers_from_config(spec)
    assert aux == V41_TARGET_LAYER_IDS
    assert all(1 <= layer <= text["num_hidden_layers"] for layer in aux)


def test_v41_dspark_target_layers_are_the_last_three():
    assert v41_dspark_target_layer_ids(6) == (3, 4, 5)
    assert v41_dspark_target_layer_ids(40) == (37, 38, 39)  # V4.1-Flash's
    assert v41_dspark_target_layer_ids(4) == (1, 2, 3)
    with pytest.raises(ValueError, match=r"more than 3 layers, got 3"):
        v41_dspark_target_layer_ids(3)


def test_v41_checkpoint_has_the_dspark_layers():
    """V4.1's draft: window-only decoder layers from the main model's layer 0 (no Engram,
    compressor or indexer), the Markov factors under V4.1's names, no hyper-connection head."""
    text = json.loads(Path(v41_checkpoint(), "config.json").read_text())["text_config"]
    names = load_file(str(Path(v41_checkpoint(), DSPARK_FILE)))
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    assert names["mtp.0.main_proj.weight"].shape == (hidden, 3 * hidden)
    assert names["mtp.2.markov_head.embed.weight"].shape == (vocab, DEFAULT_MARKOV_RANK)
    assert names["mtp.2.markov_head.head.weight"].shape == (vocab, DEFAULT_MARKOV_RANK)
    assert names["mtp.2.confidence_head.proj.weight"].shape == (1, hidden + DEFAULT_MARKOV_RANK)
    main = load_file(str(Path(v41_checkpoint(), "model.safetensors")))
    layer0 = {k.removeprefix("layers.0.") for k in main if k.startswith("layers.0.")}
    for i in range(3):
        assert {k.removeprefix(f"mtp.{i}.") for k in names if k.startswith(f"mtp.{i}.")} >= layer0
    assert not any(k.startswith("mtp.3.") for k in names)
    for part in (".engram.", ".compressor.", ".indexer.", "hc_head", ".markov_w", ".e_proj"):
        assert not any(part in k for k in names), part


def test_vllm_v41_dspark_loader_takes_every_draft_weight():
    """vLLM's own V4.1 DSpark model takes every tensor of the draft into the parameter
    :func:`_v41_destination` names, equal to it, and has no parameter but the aliased
    embedding and head that the draft does not fill; no tensor equals the main model's."""
    _, model, loaded = v41_dspark_model()
    params = dict(model.named_parameters())
    assert set(loaded) == set(params) - ALIASED
    assert model.model.confidence_head is not None  # kept: the checkpoint has one
    text = json.loads(Path(v41_checkpoint(), "config.json").read_text())["text_config"]
    draft = load_file(str(Path(v41_checkpoint(), DSPARK_FILE)))
    filled = set()
    for name, tensor in draft.items():
        param, index = _v41_destination(name, text)
        torch.testing.assert_close(params[param][index].float(), tensor.float(), msg=name)
        filled.add(param)
    assert filled == set(params) - ALIASED

    # Moved in most entries (V4.1's norms are all ones: noise of their spread alone would
    # move a few by one bfloat16 step), so a loader reading the main model's is caught.
    main = load_file(str(Path(v41_checkpoint(), "model.safetensors")))
    for draft_name, main_name in {
        "mtp.0.main_norm.weight": "norm.weight",  # all ones in the main model
        "mtp.2.norm.weight": "norm.weight",
        "mtp.1.attn_norm.weight": "layers.0.attn_norm.weight",
        "mtp.1.attn.kv_norm.weight": "layers.0.attn.kv_norm.weight",
        "mtp.1.hc_ffn_scale": "layers.0.hc_ffn_scale",
        "mtp.2.attn.attn_sink": "layers.0.attn.attn_sink",
        "mtp.0.attn.wq_b.weight": "layers.0.attn.wq_b.weight",
    }.items():
        moved = (draft[draft_name] != main[main_name]).float().mean()
        assert moved > 0.5, (draft_name, moved)
    assert not torch.equal(draft["mtp.0.attn_norm.weight"], draft["mtp.1.attn_norm.weight"])


def test_vllm_v41_model_loads_the_dspark_checkpoint():
    """The target itself still loads: vLLM's V4.1 model, filled strictly by its default loader
    (unknown names and unfilled parameters raise), drops the draft's ``mtp.*`` tensors."""
    _, model = vt.v41_vllm_model(v41_checkpoint(), "cpu", load=True)
    assert not any("mtp" in name for name, _ in model.named_parameters())


def test_a_v41_bigram_markov_head_biases_exactly_the_bigram(tmp_path):
    """V4.1's DSpark has V4's Markov head (``DSparkMarkovHead``): a bigram head written under
    V4.1's names adds the bias to exactly the given bigram of the previous token in vLLM's own
    head (w2 @ w1[token]), and vLLM's loader takes every draft tensor."""
    path = tmp_path / "ckpt"
    shutil.copytree(v41_checkpoint(), path)
    vocab = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]
    gen = torch.Generator().manual_seed(zlib.crc32(b"v41 bigram"))
    bigram = torch.randint(vocab, (vocab,), generator=gen)
    add_dspark_layers(path, SPEC.seed, bigram=bigram)
    text = json.loads((path / "config.json").read_text())["text_config"]
    assert text["dspark_markov_rank"] == vocab
    assert text["compress_ratios"] == [*V41_RATIOS, 0, 0, 0]  # extended once, not twice
    _, model, loaded = load_v41_dspark_with_vllm(str(path))
    assert set(loaded) == set(dict(model.named_parameters())) - ALIASED
    tokens = torch.arange(vocab)
    head = model.model.markov_head.markov_w2.weight.float()
    bias = model.markov_embed(tokens).float() @ head.T  # row t: the bias after token t
    assert torch.equal(bias.argmax(-1), bigram)
    assert (bias.amax(-1) == MARKOV_BIGRAM_BIAS).all()
    assert (bias.sum(-1) == MARKOV_BIGRAM_BIAS).all()
