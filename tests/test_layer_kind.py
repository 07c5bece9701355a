"""Tests of ``dsv4_attn.layer_kind``: each layer's kind for DeepSeek-V4 and V4.1 configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsv4_attn.layer_kind import Family, LayerKind, compress_ratios_of, layer_kinds, layer_kinds_of

# V4.1-Flash's published schedule: 40 layers, two window-only, 18 of ratio 2, 20 of ratio 1,
# three window-only draft layers; compressed caches on layers 2, 8, 14 and 20.
V41_FLASH_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
V41_FLASH_KV_SOURCES = [2, 8, 14, 20]


def test_v41_flash_layers_read_the_newest_source_at_or_below_them():
    index_sources = [2, 5, 8, 14, 20, 24, 28, 32]
    kinds = layer_kinds(Family.V41, V41_FLASH_RATIOS, 43, V41_FLASH_KV_SOURCES, index_sources)
    assert [k.layer_id for k in kinds] == list(range(43))
    # Written out by hand from the rule, layer by layer.
    kv_by_hand = [None, None] + [2] * 6 + [8] * 6 + [14] * 6 + [20] * 20 + [None] * 3
    index_by_hand = (
        [None, None]
        + [2] * 3
        + [5] * 3
        + [8] * 6
        + [14] * 6
        + [20] * 4
        + [24] * 4
        + [28] * 4
        + [32] * 8
        + [None] * 3
    )
    assert [k.kv_source for k in kinds] == kv_by_hand
    assert [k.index_source for k in kinds] == index_by_hand
    assert [k.layer_id for k in kinds if k.owns_compressed] == V41_FLASH_KV_SOURCES
    assert [k.has_compressed for k in kinds] == [r > 0 for r in V41_FLASH_RATIOS]
    # Every V4.1 layer: no q norm; ratio 1 and 2 alike RoPE with the compressed theta.
    assert not any(k.q_norm or k.overlapping for k in kinds)
    assert [k.compressed_rope for k in kinds] == [r > 0 for r in V41_FLASH_RATIOS]


def test_v4_layers_own_their_caches():
    ratios = [0, 1, 4, 128, 4]
    kinds = layer_kinds(Family.V4, ratios, 6)
    assert kinds == [
        LayerKind(Family.V4, 0, 0, None, None),
        LayerKind(Family.V4, 1, 1, None, None),  # V4's ratio 1: window only
        LayerKind(Family.V4, 2, 4, 2, 2),
        LayerKind(Family.V4, 3, 128, 3, None),  # HCA: every entry, no indexer
        LayerKind(Family.V4, 4, 4, 4, 4),
        LayerKind(Family.V4, 5, 0, None, None),  # past the list: a draft layer
    ]
    assert [k.overlapping for k in kinds] == [False, False, True, False, True, False]
    assert all(k.q_norm for k in kinds)
    assert [k.compressed_rope for k in kinds] == [False, False, True, True, True, False]


@pytest.mark.parametrize(
    ("family", "ratios", "sources", "message"),
    [
        (
            Family.V41,
            [0, 4],
            [1],
            r"layer 1 has compress ratio 4; DeepSeek-V4\.1 layers have one of",
        ),
        (Family.V41, [0, 3], [1], r"ratio 3; DeepSeek-V4\.1 layers have one of \(0, 1, 2\)"),
        (
            Family.V4,
            [0, 2],
            [],
            r"layer 1 has compress ratio 2; DeepSeek-V4 layers have one of \(0, 1, 4, 128\)",
        ),
        (
            Family.V41,
            [0, 2, 2],
            [2],
            r"layer 1 has a compressed cache but kv_source_layer_ids = \[2\] holds no layer",
        ),
        (Family.V41, [1], [], r"kv_source_layer_ids = \[\] holds no layer at or below"),
    ],
)
def test_a_config_the_family_cannot_have_is_refused_by_name(family, ratios, sources, message):
    with pytest.raises(ValueError, match=message):
        layer_kinds(family, ratios, len(ratios), sources, sources)


def test_v41_index_sources_are_checked_apart_from_kv_sources():
    with pytest.raises(ValueError, match=r"index_source_layer_ids = \[3\] holds no layer at or"):
        layer_kinds(Family.V41, [0, 0, 1, 1], 4, [2], [3])
    # An index source that is no KV source keeps its keys in its KV source's indexer cache.
    with pytest.raises(ValueError, match=r"layer 3 is an index source whose KV source, layer 2,"):
        layer_kinds(Family.V41, [0, 0, 1, 1], 4, [2], [0, 3])


def test_kinds_of_a_v41_config():
    config = SimpleNamespace(
        model_type="deepseek_v41",
        num_hidden_layers=40,
        compress_ratios=V41_FLASH_RATIOS,
        kv_source_layer_ids=V41_FLASH_KV_SOURCES,
        index_source_layer_ids=V41_FLASH_KV_SOURCES,
    )
    kinds = layer_kinds_of(config)
    assert len(kinds) == 40 and kinds[39].kv_source == 20 and kinds[1].kv_source is None
    assert len(layer_kinds_of(config, 43)) == 43
    with pytest.raises(ValueError, match=r"model_type must be one of .* got 'llama'"):
        layer_kinds_of(SimpleNamespace(model_type="llama"))


def test_compress_ratios_read_as_vllm_reads_them():
    """Both config forms (a ``compress_ratios`` list; the upstream ``compress_rates`` per layer
    type plus the draft layers) give what vLLM's own reader gives."""
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios

    upstream = SimpleNamespace(
        compress_rates={"csa": 4, "hca": 128},
        layer_types=["sliding_attention", "csa", "hca", "csa", "sliding_attention"],
        num_nextn_predict_layers=1,
    )
    listed = SimpleNamespace(compress_ratios=V41_FLASH_RATIOS)
    neither = SimpleNamespace()
    for config in (upstream, listed, neither):
        assert compress_ratios_of(config) == list(get_compress_ratios(config))
    assert compress_ratios_of(upstream) == [0, 4, 128, 4, 0, 0]


def test_kinds_are_the_ones_vllms_own_v41_layers_take():
    """vLLM's DeepSeek-V4.1 attention layers, built on the CPU from a tiny V4.1 config (each
    reading its ratio, cache source and indexer source as vLLM does): the same kind per layer."""
    pytest.importorskip("vllm")
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tests import vllm_glue_testing as vt

    Layer = vt.v41_base_layer()
    vt._distributed_ready()
    config = vt.engine_args(model=vt.tiny_v41_checkpoint()).create_engine_config()
    hf_config = config.model_config.hf_config
    kinds = layer_kinds_of(hf_config)
    assert [k.compress_ratio for k in kinds] == list(vt.V41_RATIOS)
    tokens = config.scheduler_config.max_num_batched_tokens
    topk = torch.full((tokens, hf_config.index_topk), -1, dtype=torch.int32)
    with (
        set_current_vllm_config(config),
        vt._cpu_events(),
        set_default_torch_dtype(torch.bfloat16),
        torch.device("cpu"),
    ):
        for kind in kinds:
            layer = Layer(
                config, prefix=f"model.layers.{kind.layer_id}.attn", topk_indices_buffer=topk
            )
            assert layer.compress_ratio == kind.compress_ratio
            assert layer.kv_source_layer_id == kind.kv_source, kind
            assert layer.index_source_layer_id == kind.index_source, kind
            assert layer.is_kv_source == kind.owns_compressed, kind
    # The index sources are not the KV sources: some layer reads one of each kind of source.
    assert any(k.kv_source is not None and k.kv_source != k.index_source for k in kinds)
