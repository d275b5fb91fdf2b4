"""The models: one package per family (``qwen3_next/``: Qwen3-Next / Qwen3.5, ``nemotron_h/``), found by
config.json's ``model_type`` in ``registry.py``, and what the families share (layers, attention, the
cache declarations, the checkpoint loader)."""

from refengine.model.cache_specs import MTP_CACHE_KEY
from refengine.model.loader import CheckpointError, load_model

__all__ = [
    "MTP_CACHE_KEY",
    "CheckpointError",
    "load_model",
]
