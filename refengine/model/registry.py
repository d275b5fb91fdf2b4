"""Model families: one ``ModelFamily`` (refengine/model/family.py) per package under refengine/model/, found
by config.json's ``model_type``. A new family is its package (config view, model, weights mapping, cache
specs, its ``FAMILY``) and one line in ``FAMILIES``.

The engines, the scheduler and the prefix cache never name a family or a mixer: they hold the view and
the model, and allocate caches from ``cache_specs``. The loader, ``add-mtp-head``, the ``tiny:`` presets
and the fake-CUDA test tier read what they need of a family from its entry here.
"""

from __future__ import annotations

from typing import Any

from refengine.model import nemotron_h, qwen3_next
from refengine.model.family import CacheSpec, ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    qwen3_next.FAMILY,
    nemotron_h.FAMILY,
)


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_for(model_type: Any) -> ModelFamily:
    """The family of a config.json ``model_type``; ValueError naming the supported ones otherwise."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"model_type: unsupported {model_type!r}, expected one of {supported_model_types()}")


def family_for_name(name: str) -> ModelFamily:
    """The family called ``name`` (``ModelFamily.name``); ValueError naming the registered ones otherwise."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; registered: {', '.join(f.name for f in FAMILIES)}")


def cache_specs(cfg: Any, num_speculative_tokens: int, drafter_kv: bool) -> dict[int | str, CacheSpec]:
    """What the model of config view ``cfg`` needs cached, by cache key (layer index, or the drafter's)."""
    return family_for(cfg.model_type).cache_specs(cfg, num_speculative_tokens, drafter_kv)
