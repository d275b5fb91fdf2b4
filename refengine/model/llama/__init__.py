"""The dense attention family: Llama (``llama``, Llama-3.x RoPE scaling included) and Qwen3 dense
(``qwen3``), one registry entry (``FAMILY``).

``config.py`` the config view, ``model.py`` the model and its cache specs, ``weights.py`` the checkpoint
layout, ``tiny.py`` the weights of ``tiny:llama`` and ``tiny:qwen3``.
"""

from refengine.model.family import ModelFamily
from refengine.model.llama.config import MODEL_TYPES, LlamaConfig
from refengine.model.llama.model import LlamaForCausalLM, cache_specs
from refengine.model.llama.tiny import write_tiny_llama, write_tiny_qwen3
from refengine.model.llama.weights import LlamaWeights

FAMILY = ModelFamily(
    name="llama",
    model_types=MODEL_TYPES,
    config_from_dict=LlamaConfig.from_hf_config,
    model_class=LlamaForCausalLM,
    weights=LlamaWeights(),
    cache_specs=cache_specs,
    tiny_checkpoints=(("llama", write_tiny_llama), ("qwen3", write_tiny_qwen3)),
    test_checkpoints=(("llama", "tiny:llama"),),
)

__all__ = ["FAMILY", "LlamaConfig", "LlamaForCausalLM"]
