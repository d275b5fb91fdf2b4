"""The dense attention family: Llama (``llama``, Llama-3.x RoPE scaling included) and Qwen3 dense
(``qwen3``), one registry entry (``FAMILY``)."""

from __future__ import annotations

from refengine.model.llama.config import MODEL_TYPES, LlamaConfig
from refengine.model.llama.model import LlamaForCausalLM, cache_specs
from refengine.model.llama.weights import LlamaWeights

LAYER = "attention"  # every layer is one: layer_pattern's name for it


def __getattr__(name: str):
    """``FAMILY``, built on first use: ``ModelFamily`` lives in the registry, which imports this package to
    list the family, so the package cannot import the registry while it is itself being imported."""
    if name != "FAMILY":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from refengine.model.registry import ModelFamily

    family = globals().get("FAMILY")  # importing the registry (which asks for it) may have built it
    if family is None:
        family = globals()["FAMILY"] = ModelFamily(
            name="llama",
            model_types=MODEL_TYPES,
            config_from_dict=LlamaConfig.from_hf_config,
            model_class=LlamaForCausalLM,
            weights=LlamaWeights(),
            layer_pattern=lambda cfg: [LAYER] * cfg.num_hidden_layers,
            cache_specs=cache_specs,
        )
    return family


__all__ = ["FAMILY", "LlamaConfig", "LlamaForCausalLM"]
