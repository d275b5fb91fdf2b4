"""config.json fields nobody reads: a misspelt ``eos_token_id`` (``eos_token_ids``) is ignored by transformers
and by the engine alike, and generation then runs past EOS. ``unknown_fields`` finds them and the loader
warns about each by name (``UnknownConfigFieldWarning``).

Known are: the fields transformers' own configuration class for the file's ``model_type`` defines (its
dataclass fields and ``attribute_map``, ``text_config`` checked against its text class), the standard and
legacy ``PretrainedConfig`` attributes transformers accepts (``torch_dtype``, ``rope_theta``, generation
defaults, ...), and the fields the family reads itself as vLLM does (its ``ModelFamily.config_fields``)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any


class UnknownConfigFieldWarning(UserWarning):
    """A config.json field that neither transformers' configuration class nor the engine reads."""


# Accepted by every PretrainedConfig (popped, standardised or kept as legacy attributes).
STANDARD_FIELDS = frozenset({
    "model_type", "torch_dtype", "dtype", "_name_or_path", "name_or_path", "_commit_hash", "auto_map",
    "output_attentions", "attn_implementation", "experts_implementation", "per_layer_config",
    "quantization_config", "rope_scaling", "rope_theta", "partial_rotary_factor", "rope_parameters",
    "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "num_labels", "use_bfloat16", "torchscript", "tie_encoder_decoder",
    "tie_word_embeddings", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "prefix",
    "finetuning_task", "task_specific_params", "pruned_heads", "tf_legacy_loss", "use_cache",
    "initializer_range", "transformers_version", "architectures",
})
def _class_fields(config_class: Any) -> set[str]:
    names = set()
    if dataclasses.is_dataclass(config_class):
        names = {f.name for f in dataclasses.fields(config_class)}
    names |= set(getattr(config_class, "attribute_map", {}) or {})
    names |= set(getattr(config_class, "sub_configs", {}) or {})
    return names


def _generation_fields() -> set[str]:
    try:
        from transformers import GenerationConfig

        return set(GenerationConfig._get_default_generation_params())
    except (ImportError, AttributeError):
        return set()


def unknown_fields(raw: dict, family_fields: frozenset[str]) -> list[tuple[str, str | None]]:
    """(field, the known field it is closest to or None) for each field of config.json ``raw`` that nothing
    reads, ``family_fields`` being those the family reads itself; ``text_config``'s fields are named
    ``text_config.<field>``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return []
    config_class = CONFIG_MAPPING[model_type]
    common = STANDARD_FIELDS | family_fields | _generation_fields()
    found = []

    def check(d: dict, known: set[str], prefix: str) -> None:
        for key in d:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
                found.append((prefix + key, prefix + close[0] if close else None))

    check(raw, _class_fields(config_class) | common, "")
    text_class = (getattr(config_class, "sub_configs", {}) or {}).get("text_config")
    if isinstance(raw.get("text_config"), dict) and text_class is not None:
        check(raw["text_config"], _class_fields(text_class) | common, "text_config.")
    return found
