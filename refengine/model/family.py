"""What a model family tells the rest of refengine: one ``ModelFamily`` per package under
``refengine/model/<family>/`` (its ``FAMILY``), listed in ``registry.FAMILIES``.

- ``config_from_dict``: config.json (parsed) -> the family's config view. Every view has
  ``model_type``, ``vocab_size``, ``eos_token_ids``, ``max_position_embeddings`` and
  ``tie_word_embeddings``; ValueError / TypeError name a bad field;
- ``config_fields``: the config.json fields the family reads itself beside those of transformers'
  configuration class (the loader warns about any other field, ``refengine.model.config_fields``);
- ``model_class``: built from the view; ``forward(input_ids, positions, ForwardContext)`` -> hidden,
  ``compute_logits(hidden)``, ``tie_weights()``, and ``mtp`` (the draft head, or None);
- ``weights``: the weight-name mapping between the checkpoint and the model (see ``FamilyWeights``);
- ``cache_specs``: (view, K, drafter_kv) -> cache key -> ``PagedKV`` | ``RecurrentState``, one entry per
  layer that has a cache (layers without one are absent), plus the drafter's KV cache under
  ``MTP_CACHE_KEY`` when asked;
- ``mtp_head``: the MTP head ``refengine add-mtp-head`` gives a checkpoint saved without one (None: the
  family has no MTP head);
- ``tiny_checkpoint``: writes the family's ``tiny:<name>`` checkpoint into a folder (None: the family
  has none; the embedded default model is a Qwen3-Next);
- ``test_checkpoints``: the tiny checkpoints the fake-CUDA test tier runs the family on, as
  (case name, preset): a preset of tests/helpers/checkpoints.py, ``tiny:<name>``, or None for the
  embedded default model.

This module imports no family, so every family package can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from refengine.model.cache_specs import PagedKV, RecurrentState

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
class NewMTPHead:
    """An MTP head made for a checkpoint that has none (``refengine add-mtp-head``)."""

    tensors: dict[str, torch.Tensor]  # ``mtp.*`` name -> tensor, in the checkpoint's layout on disk
    origin: dict[str, str]  # ``mtp.*`` name -> where it came from (a checkpoint tensor, or how it was made)
    count_field: str  # the config.json field that records the MTP layer count (as vLLM reads it)


# (read(name) -> a checkpoint tensor, tensor name -> weight file, config view) -> the head
MTPHeadMaker = Callable[[Callable[[str], torch.Tensor], dict[str, str], Any], NewMTPHead]


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the package name under refengine/model/, and the ``tiny:<name>`` preset's
    model_types: tuple[str, ...]  # config.json model_type values
    config_from_dict: Callable[[dict], Any]
    model_class: Callable[[Any], torch.nn.Module]
    weights: FamilyWeights
    cache_specs: Callable[[Any, int, bool], dict[int | str, CacheSpec]]
    config_fields: frozenset[str] = frozenset()
    mtp_head: MTPHeadMaker | None = None
    tiny_checkpoint: Callable[[Path], None] | None = None
    test_checkpoints: tuple[tuple[str, str | None], ...] = ()
