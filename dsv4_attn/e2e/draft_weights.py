"""Draft weights for the tiny vLLM checkpoint: MTP layers (:func:`add_mtp_layers`) or the
DSpark draft (:func:`add_dspark_layers`), named as vLLM 0.33's loaders read them.

Both speculators of DeepSeek-V4 ship their weights inside the target checkpoint under
``mtp.{i}.*``, so one checkpoint holds one draft or the other (:func:`add_dspark_layers` says
why). Each draft's tensors start from the main model's own, moved by seeded noise (no tensor
equals one the main model has: a loader that reads the wrong one is caught), except where a
draft is asked to *draft well*: for a model whose layers barely move the residual stream
(``tiny_model.DRAFTABLE_SPEC``), the next token is mostly the one the current token's embedding
alone gives (the bigram), and the draft is built to predict exactly that, so that speculation
is measured with drafts that are accepted about as often as trained ones.

DeepSeek-V4.1 checkpoints (``model_type`` ``deepseek_v41``, text fields under ``text_config``)
carry no MTP layers, only the DSpark draft (:func:`add_dspark_layers` writes it in V4.1's
layout: :data:`V41_DSPARK_BLOCK_SIZE`, :func:`v41_dspark_target_layer_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_MARKOV_RANK",
    "DSPARK_FILE",
    "DSPARK_LAYERS",
    "DSPARK_TARGET_LAYER_IDS",
    "MARKOV_BIGRAM_BIAS",
    "V41_DSPARK_BLOCK_SIZE",
    "add_dspark_layers",
    "add_mtp_layers",
    "is_v41",
    "v41_dspark_target_layer_ids",
]

#: the draft's decoder layers (vLLM's default when ``n_mtp_layers`` is absent, written anyway)
DSPARK_LAYERS = 3
#: the main-model layers after which the draft reads the hidden stream: the CSA layer, the
#: sliding-only layer and the last layer of the tiny model's four (vLLM captures after layer
#: ``i`` for ``i`` in ``0..num_hidden_layers - 1``)
DSPARK_TARGET_LAYER_IDS = (0, 2, 3)
DEFAULT_MARKOV_RANK = 64
DSPARK_FILE = "dspark.safetensors"
#: the logit bias a bigram Markov head adds to the bigram token: far above the tiny model's
#: logits (standard deviation ~0.3), so the draft samples the bigram
MARKOV_BIGRAM_BIAS = 32.0
#: the V4.1 draft's block, V4.1-Flash's ``dspark_block_size``: the tokens drafted in parallel,
#: vLLM's ``num_speculative_tokens`` when the speculative config leaves it out
V41_DSPARK_BLOCK_SIZE = 5
#: the main layers whose attention input the V4.1 draft reads: the last ones, as V4.1-Flash
#: (``[37, 38, 39]`` of 40 layers)
_V41_TARGET_LAYERS = 3
#: V4.1's main weights are named as DeepSeek names them (no ``model.`` prefix)
_V41_NORM, _V41_LAYERS = "norm.weight", "layers."
#: the parts of a V4.1 main layer a draft layer has none of (vLLM builds the draft's layers
#: without an Engram, and window only: no compressor, no indexer)
_V41_NOT_IN_DRAFT = (".engram.", ".compressor.", ".indexer.")


def is_v41(config: dict) -> bool:
    """Whether ``config`` (a ``config.json``) is a DeepSeek-V4.1 one: V4.1's ``model_type``, or
    its text fields nested under ``text_config``."""
    return config.get("model_type") == "deepseek_v41" or "text_config" in config


def v41_dspark_target_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The ``dspark_target_layer_ids`` of a V4.1 model of ``num_layers`` layers: the last
    :data:`_V41_TARGET_LAYERS` layers, ``(3, 4, 5)`` for the tiny V4.1's six.

    vLLM's V4.1 reads id ``L`` as the stream entering layer ``L`` (the one layer ``L - 1``
    leaves; ``num_layers``: the last layer's output), captured inside layer ``L``'s fused
    hyper-connection pre-mix; layer 0 takes the bare embedding and captures nothing, so the
    ids lie in ``[1, num_layers]``. (V4's ids are ``L``'s output instead.)"""
    if num_layers <= _V41_TARGET_LAYERS:
        raise ValueError(
            f"the V4.1 draft reads the inputs of the last {_V41_TARGET_LAYERS} layers past "
            f"layer 0, which needs more than {_V41_TARGET_LAYERS} layers, got {num_layers}"
        )
    return tuple(range(num_layers - _V41_TARGET_LAYERS, num_layers))


def _main_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the main model's ``model*.safetensors`` files."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for weights_file in sorted(path.glob("model*.safetensors")):
        weights.update(load_file(str(weights_file)))
    return weights


def _mover(gen: torch.Generator, relative: float = 0.0):
    """``moved(tensor)``: the tensor plus seeded noise of half its own scale, plus ``relative``
    times its mean magnitude: what moves a constant tensor (V4.1's norms are all ones, whose
    spread of 0 leaves only the 1e-3 floor, below a bfloat16 step at 1)."""

    def moved(tensor: torch.Tensor) -> torch.Tensor:
        scale = tensor.float().std() if tensor.numel() > 1 else tensor.float().abs().mean()
        std = 0.5 * float(scale) + 1e-3
        if relative:
            std += relative * float(tensor.float().abs().mean())
        noise = torch.randn(tensor.shape, generator=gen) * std
        return (tensor.float() + noise).to(tensor.dtype)

    return moved


def _random(
    gen: torch.Generator, *shape: int, std: float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """A seeded normal tensor of standard deviation ``std`` (the weights a main model lacks)."""
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def _draft_layer(
    weights: dict, config: dict, index: int, moved, prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """Draft decoder layer ``index`` (``mtp.{index}.*``): the main model's layer ``prefix``
    (default: V4's first sliding-window layer; vLLM builds draft layers without a compressor),
    every tensor ``moved``; none of a V4.1 layer's Engram, compressor or indexer."""
    if prefix is None:
        sliding = config["layer_types"].index("sliding_attention")
        prefix = f"model.layers.{sliding}."
    return {
        f"mtp.{index}.{key.removeprefix(prefix)}": moved(tensor)
        for key, tensor in weights.items()
        if key.startswith(prefix) and not any(part in key for part in _V41_NOT_IN_DRAFT)
    }


def _v41_window_layer(text: dict) -> str:
    """The weight prefix of the V4.1 main model's first window-only layer (compress ratio 0)
    without an Engram, KV or index source: the layer vLLM's V4.1 builds each draft layer as
    (its draft layers lie past ``num_hidden_layers``, where ``compress_ratios`` gives 0 and
    no source, and it builds them without an Engram)."""
    taken = {
        *(text.get("engram_layer_ids") or ()),
        *(text.get("kv_source_layer_ids") or ()),
        *(text.get("index_source_layer_ids") or ()),
    }
    ratios = text["compress_ratios"][: text["num_hidden_layers"]]
    for layer, ratio in enumerate(ratios):
        if ratio == 0 and layer not in taken:
            return f"{_V41_LAYERS}{layer}."
    raise ValueError(
        f"the V4.1 draft's layers start from a window-only main layer (compress ratio 0, no "
        f"Engram or source), but this checkpoint has none: compress_ratios={ratios}"
    )


def _save(path: Path, file_name: str, tensors: dict, config: dict, **config_keys) -> None:
    """``tensors`` to ``path/file_name``, listed in the checkpoint's index where it has one;
    ``config_keys`` into config.json."""
    from safetensors.torch import save_file

    save_file(tensors, str(path / file_name), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        index["weight_map"].update(dict.fromkeys(tensors, file_name))
        index_file.write_text(json.dumps(index, indent=1) + "\n")
    (path / "config.json").write_text(json.dumps({**config, **config_keys}, indent=1) + "\n")


def add_mtp_layers(
    path: str | Path, num_layers: int = 1, seed: int = 0, drafts_bigram: bool = False
) -> Path:
    """Give the vLLM checkpoint at ``path`` ``num_layers`` MTP draft layers, named as
    DeepSeek-V4 checkpoints name them (``mtp.{i}.*``, vLLM's ``DeepSeekV4MTP`` loader) and
    written to ``mtp.safetensors``; ``num_nextn_predict_layers`` in config.json says so.

    vLLM builds each MTP layer as a sliding-window decoder layer (no compressor) plus its own
    input norms and projections (``enorm``, ``hnorm``, ``e_proj``, ``h_proj``), hyper-connection
    head (``hc_head_*``), output norm and head, and for the first layer the token embedding.
    The decoder weights start from the checkpoint's first sliding-window layer and the rest
    from the model's own embedding, head and norms, each moved by seeded noise of its own scale.

    ``drafts_bigram``: a layer that predicts the bigram: ``e_proj`` the identity, ``h_proj``
    zero, ``enorm`` ones, and the embedding, hyper-connection head, output norm and head exactly
    the main model's. Its hyper-connection head and output norm do not depend on the stream's
    scale, so the draft's logits are the target's for a stream of the embedding alone. The
    decoder block is still the moved sliding-window layer (its attention runs, and moves the
    draft a little)."""
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights = _main_weights(path)
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    moved = _mover(gen)

    # The main model's own tensor (a bigram draft) or a moved copy of it.
    same = (lambda tensor: tensor.clone()) if drafts_bigram else moved
    norm = weights["model.norm.weight"]
    mtp: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        mtp.update(_draft_layer(weights, config, i, moved))
        mtp[f"mtp.{i}.hnorm.weight"] = moved(norm)
        if drafts_bigram:
            mtp[f"mtp.{i}.enorm.weight"] = torch.ones_like(norm)
            mtp[f"mtp.{i}.e_proj.weight"] = torch.eye(hidden, dtype=torch.bfloat16)
            mtp[f"mtp.{i}.h_proj.weight"] = torch.zeros(hidden, hidden, dtype=torch.bfloat16)
        else:
            mtp[f"mtp.{i}.enorm.weight"] = moved(norm)
            mtp[f"mtp.{i}.e_proj.weight"] = _random(gen, hidden, hidden, std=hidden**-0.5)
            mtp[f"mtp.{i}.h_proj.weight"] = _random(gen, hidden, hidden, std=hidden**-0.5)
        for part in ("fn", "base", "scale"):
            mtp[f"mtp.{i}.hc_head_{part}"] = same(weights[f"model.hc_head_{part}"])
        mtp[f"mtp.{i}.norm.weight"] = same(norm)
        mtp[f"mtp.{i}.head.weight"] = same(weights["head.weight"])
    mtp["mtp.0.emb.tok_emb.weight"] = same(weights["model.embed_tokens.weight"])
    _save(path, "mtp.safetensors", mtp, config, num_nextn_predict_layers=num_layers)
    return path


def add_dspark_layers(
    path: str | Path,
    seed: int = 0,
    markov_rank: int | None = None,
    bigram: torch.Tensor | None = None,
) -> Path:
    """Give the vLLM checkpoint at ``path`` the weights of vLLM's DSpark draft for DeepSeek-V4,
    named as vLLM's loader (``DSparkDeepseekV4ForCausalLM.load_weights``) reads them and written
    to ``dspark.safetensors`` (and into ``model.safetensors.index.json`` where there is one).

    Written, with ``H`` the hidden size, ``V`` the vocabulary, ``r`` ``markov_rank`` and ``T``
    the number of target layers (:data:`DSPARK_TARGET_LAYER_IDS`):

    * ``mtp.0.main_proj.weight`` ``[H, T*H]`` and ``mtp.0.main_norm.weight`` ``[H]``: the
      combiner of the target's hidden states at the target layers;
    * ``mtp.{i}.*`` for ``i < DSPARK_LAYERS``: one sliding-window decoder layer each (vLLM
      builds draft layers past ``num_hidden_layers`` without a compressor), named as the main
      model's layers; vLLM also stacks every ``mtp.{i}.attn.wkv.weight`` into the draft's
      context-KV projection;
    * on the last layer, the head stack: ``norm.weight`` ``[H]``, ``hc_head_fn``
      ``[hc, hc*H]``, ``hc_head_base`` ``[hc]``, ``hc_head_scale`` ``[1]``,
      ``markov_head.markov_w1.weight`` and ``markov_head.markov_w2.weight`` ``[V, r]``,
      ``confidence_head.proj.weight`` ``[1, H + r]`` (float32, as vLLM keeps it).

    No token embedding or output head: vLLM's DSpark aliases the target's. config.json gets
    ``dspark_target_layer_ids``, ``n_mtp_layers``, ``dspark_markov_rank``,
    ``enable_confidence_head`` and ``dspark_noise_token_id``, the keys vLLM's DSpark model and
    its parallel drafting read.

    The decoder weights start from the checkpoint's first sliding-window layer, the norms and
    ``hc_head_*`` from the model's own, each moved by seeded noise of its own scale (no tensor
    equals one the main model has: a loader that reads the wrong one is caught); the
    projections and heads the main model lacks are seeded random. Running it again rewrites the
    same tensors.

    ``markov_rank`` defaults to :data:`DEFAULT_MARKOV_RANK`. ``bigram`` (``[V]`` int64, the
    token the main model's embedding alone predicts after each token): a Markov head of rank
    ``V`` that adds :data:`MARKOV_BIGRAM_BIAS` to the logit of ``bigram[previous token]`` and
    nothing else, so every draft token is the bigram of the one before it (vLLM's dense DSpark
    sampling adds the Markov bias to every draft position's logits).

    A checkpoint with MTP layers (:func:`add_mtp_layers`) is refused:
    both drafts are ``mtp.{i}.*``, one name holds one tensor (``mtp.0.attn.*`` would be both
    drafts' first decoder layer), and vLLM's DSpark loader maps every ``mtp.{i}.*`` it does not
    know as a head to its layer ``i``, so MTP's ``mtp.0.e_proj.weight`` and the like raise a
    KeyError there. Write the DSpark checkpoint to its own directory (``mtp_layers=0``).

    A DeepSeek-V4.1 checkpoint (:func:`is_v41`) gets the draft vLLM's V4.1 DSpark
    (``vllm.models.deepseek_v41.nvidia.dspark.DSparkDeepseekV4ForCausalLM``) reads, which
    differs from V4's in:

    * no ``hc_head_*``: V4.1 has no learned hyper-connection head (vLLM collapses the draft's
      copies with its last layer's FFN pre-mix, and would place ``hc_head_*`` in a decoder
      layer that has no such parameter);
    * the Markov factors named as V4.1 checkpoints name them, ``markov_head.embed.weight``
      (vLLM's ``markov_w1``) and ``markov_head.head.weight`` (``markov_w2``); the same head
      as V4's otherwise, so ``bigram`` works alike;
    * the decoder layers start from the main model's first window-only layer
      (:func:`_v41_window_layer`), its tensors named as V4.1 names them (``layers.{i}.*``),
      the norms from ``norm.weight``, and, as V4.1's norms are all ones, moved by noise of a
      tenth of their magnitude too;
    * the target layers are :func:`v41_dspark_target_layer_ids`, and the config keys go into
      ``text_config`` (vLLM's ``DeepseekV41Config`` lifts its fields onto the config vLLM's
      draft reads), with ``dspark_block_size`` :data:`V41_DSPARK_BLOCK_SIZE` and
      ``compress_ratios`` extended by a 0 for each draft layer, as V4.1-Flash's (vLLM counts
      draft layers in ``compress_ratios`` and takes 0 past its end, so it is not required).
    """
    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    v41 = is_v41(config)
    text = config["text_config"] if v41 else config  # where the model's own fields are
    vocab = text["vocab_size"]
    if markov_rank is None:
        markov_rank = DEFAULT_MARKOV_RANK if bigram is None else vocab
    for name, value in (("seed", seed), ("markov_rank", markov_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative int (>= 0), got {seed}")
    if not 1 <= markov_rank <= vocab:
        # a low-rank V x r transition: a rank above the vocabulary adds nothing
        raise ValueError(
            f"markov_rank must be an int in [1, vocab_size={vocab}], got {markov_rank}"
        )
    if bigram is not None:
        if markov_rank != vocab:
            raise ValueError(
                f"a bigram Markov head has rank vocab_size={vocab}, got markov_rank={markov_rank}"
            )
        if bigram.shape != (vocab,) or bigram.dtype != torch.int64:
            raise ValueError(
                f"bigram must be an int64 tensor of shape ({vocab},), got "
                f"{bigram.dtype} {tuple(bigram.shape)}"
            )
        if bigram.min() < 0 or bigram.max() >= vocab:
            raise ValueError(
                f"bigram tokens must be in [0, {vocab}), got {bigram.min()}..{bigram.max()}"
            )
    num_layers = text["num_hidden_layers"]
    if v41:
        target_layer_ids = v41_dspark_target_layer_ids(num_layers)
        layer_prefix = _v41_window_layer(text)
    else:
        target_layer_ids = DSPARK_TARGET_LAYER_IDS
        layer_prefix = None
        if not all(0 <= i < num_layers for i in DSPARK_TARGET_LAYER_IDS):
            raise ValueError(
                f"DSpark reads the hidden stream after layers {list(DSPARK_TARGET_LAYER_IDS)}, "
                f"but this checkpoint has layers 0..{num_layers - 1} only"
            )
    mtp_files = []
    for weights_file in sorted(path.glob("*.safetensors")):
        if weights_file.name == DSPARK_FILE:  # ours, from an earlier run: rewritten below
            continue
        with safe_open(str(weights_file), framework="pt") as handle:
            # keys() only: the handle is not iterable, and no tensor is read
            if any(key.startswith("mtp.") for key in handle.keys()):  # noqa: SIM118
                mtp_files.append(weights_file.name)
    if mtp_files or text.get("num_nextn_predict_layers", 0):
        raise ValueError(
            f"{path} already has MTP draft layers (num_nextn_predict_layers="
            f"{text.get('num_nextn_predict_layers', 0)}, mtp.* weights in {mtp_files}): "
            "DSpark's weights are mtp.* too, and vLLM's DSpark loader cannot read MTP's "
            "(e_proj, h_proj, enorm, hnorm, head, emb); write the DSpark checkpoint to its own "
            "directory, without MTP layers"
        )

    weights = _main_weights(path)
    hidden = text["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    moved = _mover(gen, relative=0.1 if v41 else 0.0)
    main_norm = weights[_V41_NORM if v41 else "model.norm.weight"]

    dspark: dict[str, torch.Tensor] = {}
    inputs = hidden * len(target_layer_ids)
    # variance-preserving, so main_norm sees activations of the target's scale
    dspark["mtp.0.main_proj.weight"] = _random(gen, hidden, inputs, std=inputs**-0.5)
    dspark["mtp.0.main_norm.weight"] = moved(main_norm)
    for i in range(DSPARK_LAYERS):
        dspark.update(_draft_layer(weights, config, i, moved, layer_prefix))
    last = f"mtp.{DSPARK_LAYERS - 1}"
    dspark[f"{last}.norm.weight"] = moved(main_norm)
    if not v41:  # V4.1 has no learned hyper-connection head
        for part in ("fn", "base", "scale"):
            dspark[f"{last}.hc_head_{part}"] = moved(weights[f"model.hc_head_{part}"])
    markov = f"{last}.markov_head"
    # vLLM's names of the factors (markov_w1 embeds the previous token, markov_w2 projects it
    # to the vocabulary) or V4.1 checkpoints' own, which vLLM's V4.1 loader maps onto them
    w1_name, w2_name = ("embed", "head") if v41 else ("markov_w1", "markov_w2")
    if bigram is None:
        # The Markov bias w2 @ w1[token] has unit-scale entries over the rank: a logit bias of
        # the order of the logits themselves, so a wrong or missing head shows in the drafts.
        dspark[f"{markov}.{w1_name}.weight"] = _random(gen, vocab, markov_rank, std=1.0)
        dspark[f"{markov}.{w2_name}.weight"] = _random(
            gen, vocab, markov_rank, std=markov_rank**-0.5
        )
    else:  # w1[token] = bias * e_token; w2[v, token] = 1 where v is the token's bigram
        w1 = torch.eye(vocab) * MARKOV_BIGRAM_BIAS
        w2 = torch.nn.functional.one_hot(bigram, vocab).T.contiguous()
        dspark[f"{markov}.{w1_name}.weight"] = w1.to(torch.bfloat16)
        dspark[f"{markov}.{w2_name}.weight"] = w2.to(torch.bfloat16)
    width = hidden + markov_rank
    dspark[f"{last}.confidence_head.proj.weight"] = _random(
        gen, 1, width, std=width**-0.5, dtype=torch.float32
    )
    keys = dict(
        dspark_target_layer_ids=list(target_layer_ids),
        n_mtp_layers=DSPARK_LAYERS,
        dspark_markov_rank=markov_rank,
        enable_confidence_head=True,
        # The token vLLM feeds the draft block's not-yet-drafted slots; vLLM refuses parallel
        # drafting without one. The vocabulary's last id (the tiny model's prompts are random).
        dspark_noise_token_id=vocab - 1,
    )
    if v41:
        ratios = [*text["compress_ratios"][:num_layers], *[0] * DSPARK_LAYERS]
        text = {
            **text,
            **keys,
            "dspark_block_size": V41_DSPARK_BLOCK_SIZE,
            "compress_ratios": ratios,
        }
        _save(path, DSPARK_FILE, dspark, {**config, "text_config": text})
    else:
        _save(path, DSPARK_FILE, dspark, config, **keys)
    return path
