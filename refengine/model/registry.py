"""Model families: one entry per family, found by config.json's ``model_type``.

A family says everything the engines, the loader and the caches need to know about a model:

- ``config_from_dict``: config.json (parsed) -> the family's config view. Every view has
  ``model_type``, ``vocab_size``, ``eos_token_ids``, ``max_position_embeddings`` and
  ``tie_word_embeddings``; ValueError / TypeError name a bad field;
- ``model_class``: built from the view; ``forward(input_ids, positions, ForwardContext)`` -> hidden,
  ``compute_logits(hidden)``, ``tie_weights()``, and ``mtp`` (the draft head, or None);
- ``weights``: the weight-name mapping between the checkpoint and the model (see ``FamilyWeights``);
- ``layer_pattern``: the view -> one name per layer (what each layer is, in the family's terms);
- ``cache_specs``: (view, K, drafter_kv) -> cache key -> ``PagedKV`` | ``RecurrentState``, one entry per
  layer that has a cache (layers without one are absent), plus the drafter's KV cache when asked.

The engines, the scheduler and the prefix cache never name a family or a mixer: they hold the view and
the model, and allocate caches from ``cache_specs``. A new family is one entry in ``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from refengine.model.attention import GatedAttention
from refengine.model.cache_specs import PagedKV, RecurrentState
from refengine.model.config import GDN_LAYOUTS, ModelConfig
from refengine.model.mixers import mixer_class
from refengine.model.nemotron_h import NemotronHForCausalLM
from refengine.model.nemotron_h import cache_specs as nemotron_h_cache_specs
from refengine.model.nemotron_h_config import NemotronHModelConfig
from refengine.model.nemotron_h_weights import NemotronHWeights
from refengine.model.qwen3_next import MTP_CACHE_KEY, Qwen3NextForCausalLM
from refengine.model.qwen3_next_weights import QwenWeights

CacheSpec = PagedKV | RecurrentState


class FamilyWeights(Protocol):
    """How a family's checkpoints name and lay out tensors (the loader's only family-specific part)."""

    embed_name: str  # the model's input embedding (a tied lm_head on disk must equal it)

    def model_name(self, key: str) -> str | None: ...  # file name -> model name; None: skip the tensor

    def as_in_file(self, names: list[str], file_names: dict[str, str]) -> list[str]: ...

    def prepare(self, cfg: Any, tensors: dict[str, torch.Tensor]) -> None: ...  # settle counts read off disk

    def expected_shapes(self, model: Any, cfg: Any, names: set[str]) -> dict[str, tuple[int, ...]]: ...

    def mismatch_note(self, raw: dict, tensors: dict[str, torch.Tensor], cfg: Any) -> str: ...

    def to_model_layout(self, tensors: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]: ...

    def keep_fp32(self, name: str) -> bool: ...  # loaded in float32 whatever the model dtype


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values
    config_from_dict: Callable[[dict], Any]
    model_class: Callable[[Any], torch.nn.Module]
    weights: FamilyWeights
    layer_pattern: Callable[[Any], list[str]]
    cache_specs: Callable[[Any, int, bool], dict[int | str, CacheSpec]]


def _qwen_cache_specs(cfg: ModelConfig, num_speculative_tokens: int,
                      drafter_kv: bool) -> dict[int | str, CacheSpec]:
    specs: dict[int | str, CacheSpec] = {
        i: mixer_class(kind).cache_spec(cfg, num_speculative_tokens) for i, kind in enumerate(cfg.layer_types)
    }
    if drafter_kv:  # the MTP layer is a full-attention layer with its own KV cache
        specs[MTP_CACHE_KEY] = GatedAttention.cache_spec(cfg, num_speculative_tokens)
    return specs


def _nemotron_h_cache_specs(cfg: NemotronHModelConfig, num_speculative_tokens: int,
                            drafter_kv: bool) -> dict[int | str, CacheSpec]:
    return nemotron_h_cache_specs(cfg, num_speculative_tokens, drafter_kv)


QWEN3_NEXT = ModelFamily(
    name="qwen3_next",
    model_types=tuple(GDN_LAYOUTS),
    config_from_dict=ModelConfig.from_hf_config,
    model_class=Qwen3NextForCausalLM,
    weights=QwenWeights(),
    layer_pattern=lambda cfg: list(cfg.layer_types),
    cache_specs=_qwen_cache_specs,
)
NEMOTRON_H = ModelFamily(
    name="nemotron_h",
    model_types=("nemotron_h",),
    config_from_dict=NemotronHModelConfig.from_hf_config,
    model_class=NemotronHForCausalLM,
    weights=NemotronHWeights(),
    layer_pattern=lambda cfg: list(cfg.pattern),
    cache_specs=_nemotron_h_cache_specs,
)
from refengine.model.llama import FAMILY as LLAMA  # below ModelFamily: the package builds it

FAMILIES: tuple[ModelFamily, ...] = (QWEN3_NEXT, NEMOTRON_H, LLAMA)


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_for(model_type: Any) -> ModelFamily:
    """The family of a config.json ``model_type``; ValueError naming the supported ones otherwise."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"model_type: unsupported {model_type!r}, expected one of {supported_model_types()}")


def cache_specs(cfg: Any, num_speculative_tokens: int, drafter_kv: bool) -> dict[int | str, CacheSpec]:
    """What the model of config view ``cfg`` needs cached, by cache key (layer index, or the drafter's)."""
    return family_for(cfg.model_type).cache_specs(cfg, num_speculative_tokens, drafter_kv)
