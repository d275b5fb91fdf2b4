"""The Qwen3-Next / Qwen3.5 token mixers by layer type: each declares the cache it needs; ``MIXERS`` maps
the config's layer types to classes.

A mixer is the part of a decoder layer that moves information between tokens. Every mixer class
has the same call, ``mixer(x, positions, ctx, cache_key) -> [T, H]``, and declares:

- ``attr_name``: the attribute (and checkpoint key prefix) it sits under in its decoder layer;
- ``cache_spec(cfg, num_speculative_tokens)``: a ``PagedKV`` (keys and values in blocks, read through
  ``ctx.attn``) or a ``RecurrentState`` (per-slot tensors, read through ``ctx.recurrent``), both
  from ``refengine.model.cache_specs``.

``ModelCaches`` allocates from the declarations alone (through the family's ``cache_specs``). To add a
layer type: one module with its mixer class, and one entry in ``MIXERS``; a recurrent mixer reuses
``RecurrentMetadata``.
"""

from __future__ import annotations

from refengine.model.attention import GatedAttention
from refengine.model.qwen3_next.config import FULL, LINEAR
from refengine.model.qwen3_next.gdn import GatedDeltaNet

MIXERS: dict[str, type] = {
    LINEAR: GatedDeltaNet,
    FULL: GatedAttention,
}


def mixer_class(layer_type: str) -> type:
    try:
        return MIXERS[layer_type]
    except KeyError:
        raise ValueError(
            f"layer_types: unknown layer type {layer_type!r}; known: {', '.join(MIXERS)}"
        ) from None
