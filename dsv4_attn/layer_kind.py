"""What one attention layer of DeepSeek-V4 or DeepSeek-V4.1 holds and reads, from its config.

Every layer attends, in one softmax with a per-head sink, to its sliding window and, where it has
one, to entries of a compressed cache. The model family and the layer's compress ratio say which:

========  =====  ===================================================================
family    ratio  the layer
========  =====  ===================================================================
V4        0, 1   window only
V4        4      CSA: an overlapping compressor (each entry pools 8 positions), the
                 indexer's top-k of its entries
V4        128    HCA: every entry it has seen (no indexer)
V4.1      0      window only
V4.1      1      a compressed entry per position, the indexer's top-k of them
V4.1      2      an entry per pair of positions (a per-channel softmax gate), top-k
========  =====  ===================================================================

V4.1 also shares: only the layers of ``kv_source_layer_ids`` own a compressor and a compressed
cache, and a compressed layer reads the newest source at or below it; likewise indexers live on
``index_source_layer_ids``. V4.1 drops V4's per-head RMSNorm of q, and its compressed layers of
either ratio RoPE with the compressed theta (V4: only ratios above 1). Layers past the configured
ratios (the draft layers) are window only, as in vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RATIOS", "Family", "LayerKind", "compress_ratios_of", "layer_kinds", "layer_kinds_of"]


class Family(enum.Enum):
    """The model family, by its Hugging Face ``model_type``."""

    V4 = "deepseek_v4"
    V41 = "deepseek_v41"


# The compress ratios each family's layers may have.
RATIOS = {Family.V4: (0, 1, 4, 128), Family.V41: (0, 1, 2)}
_NAMES = {Family.V4: "DeepSeek-V4", Family.V41: "DeepSeek-V4.1"}


@dataclass(frozen=True)
class Compressed:
    """A layer's compressed entries as its query tokens see them.

    Attributes:
        ratio: positions per entry; entry ``e`` is complete at position ``(e + 1) * ratio - 1``.
        top_k: a token attends to the indexer's picks among the entries complete at its
            position (V4's CSA, V4.1's ratios 1 and 2); else to every one of them (V4's HCA).
    """

    ratio: int
    top_k: bool


def compressed_of(family: Family, compress_ratio: int) -> Compressed | None:
    """The compressed entries of a layer of ``family`` and ratio, None for a window-only one."""
    if compress_ratio not in RATIOS[family]:
        raise ValueError(
            f"compress ratio {compress_ratio}; {_NAMES[family]} layers have one of {RATIOS[family]}"
        )
    if compress_ratio <= (1 if family is Family.V4 else 0):
        return None
    return Compressed(compress_ratio, top_k=family is Family.V41 or compress_ratio == 4)


@dataclass(frozen=True)
class LayerKind:
    """One attention layer's kind.

    Attributes:
        family: the model family.
        layer_id: the layer's index (draft layers follow the target's).
        compress_ratio: positions per compressed entry; 0 (and in V4 1) for window only.
        kv_source: the layer whose compressed cache this layer reads (itself in V4 and for a
            V4.1 source); None without a compressed cache.
        index_source: the layer whose indexer picks this layer's top-k (itself in V4); None
            where no indexer picks (window only, V4's HCA).
    """

    family: Family
    layer_id: int
    compress_ratio: int
    kv_source: int | None
    index_source: int | None

    @property
    def compressed(self) -> Compressed | None:
        """The compressed entries the layer attends to besides its window (None: window only)."""
        return compressed_of(self.family, self.compress_ratio)

    @property
    def has_compressed(self) -> bool:
        """Whether the layer attends to compressed entries besides its window."""
        return self.compressed is not None

    @property
    def overlapping(self) -> bool:
        """Whether an entry pools ``2 * ratio`` positions (V4's CSA compressor)."""
        return self.family is Family.V4 and self.compress_ratio == 4

    @property
    def owns_compressed(self) -> bool:
        """Whether the layer's compressor writes a compressed cache of its own."""
        return self.kv_source == self.layer_id

    @property
    def q_norm(self) -> bool:
        """Whether q gets a per-head, weight-free RMSNorm before RoPE (V4 only)."""
        return self.family is Family.V4

    @property
    def compressed_rope(self) -> bool:
        """Whether the layer's RoPE (q, window, entries) uses the compressed layers' theta and
        scaling rather than the main ones."""
        return self.has_compressed


def layer_kinds(
    family: Family,
    compress_ratios: Sequence[int],
    num_layers: int,
    kv_source_layer_ids: Sequence[int] = (),
    index_source_layer_ids: Sequence[int] = (),
) -> list[LayerKind]:
    """The kind of each of ``num_layers`` layers (target and draft layers alike).

    Args:
        family: the model family.
        compress_ratios: per layer; layers past it are window only.
        num_layers: how many kinds to return.
        kv_source_layer_ids, index_source_layer_ids: V4.1's source layers (ignored for V4).

    Raises:
        ValueError: naming the layer and the value, for a ratio the family does not have, or a
            V4.1 compressed layer with no source at or below it.
    """
    kinds = []
    for layer in range(num_layers):
        ratio = int(compress_ratios[layer]) if layer < len(compress_ratios) else 0
        try:
            entries = compressed_of(family, ratio)
        except ValueError as exc:
            raise ValueError(f"layer {layer} has {exc}") from None
        kv = index = None
        if entries is not None and family is Family.V4:  # every V4 layer is its own source
            kv, index = layer, (layer if entries.top_k else None)
        elif entries is not None:
            kv = _newest_at_or_below(layer, kv_source_layer_ids, "kv_source_layer_ids")
            index = _newest_at_or_below(layer, index_source_layer_ids, "index_source_layer_ids")
            if layer in index_source_layer_ids and kv not in index_source_layer_ids:
                # Its indexer keeps its keys in the indexer cache of its KV source.
                raise ValueError(
                    f"layer {layer} is an index source whose KV source, layer {kv}, is not one: "
                    f"index_source_layer_ids = {list(index_source_layer_ids)} must hold every "
                    f"KV source an index source reads"
                )
        kinds.append(LayerKind(family, layer, ratio, kv, index))
    return kinds


def layer_kinds_of(config: Any, num_layers: int | None = None) -> list[LayerKind]:
    """:func:`layer_kinds` from a Hugging Face config of either family (``model_type``,
    ``compress_ratios``, ``kv_source_layer_ids``, ``index_source_layer_ids``); ``num_layers``
    defaults to ``num_hidden_layers``."""
    model_type = getattr(config, "model_type", None)
    families = {f.value: f for f in Family}
    if model_type not in families:
        raise ValueError(f"model_type must be one of {sorted(families)}, got {model_type!r}")
    return layer_kinds(
        families[model_type],
        compress_ratios_of(config),
        config.num_hidden_layers if num_layers is None else num_layers,
        getattr(config, "kv_source_layer_ids", None) or (),
        getattr(config, "index_source_layer_ids", None) or (),
    )


def compress_ratios_of(config: Any) -> list[int]:
    """Per-layer compress ratios of a config, draft layers included: its ``compress_ratios``
    list, or (the upstream ``DeepseekV4Config``) ``compress_rates`` per entry of
    ``layer_types`` followed by a window-only layer per ``num_nextn_predict_layers``."""
    ratios = getattr(config, "compress_ratios", None)
    if ratios is not None:
        return [int(r) for r in ratios]
    rates = getattr(config, "compress_rates", None)
    if rates is None:
        return []
    drafts = getattr(config, "num_nextn_predict_layers", 0) or 0
    return [int(rates.get(t, 0)) for t in config.layer_types] + [0] * drafts


def _newest_at_or_below(layer: int, sources: Sequence[int], name: str) -> int:
    below = [s for s in sources if s <= layer]
    if not below:
        raise ValueError(
            f"layer {layer} has a compressed cache but {name} = {list(sources)} holds no layer "
            f"at or below it"
        )
    return max(below)
