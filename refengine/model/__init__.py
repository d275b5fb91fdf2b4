"""The model families (registry.py: Qwen3-Next / Qwen3.5, Nemotron-H), their configurations and the
checkpoint loader."""

from refengine.model.loader import CheckpointError, load_model
from refengine.model.qwen3_next.config import ModelConfig
from refengine.model.qwen3_next.model import MTP_CACHE_KEY, MTPHead, Qwen3NextForCausalLM

__all__ = [
    "MTP_CACHE_KEY",
    "CheckpointError",
    "MTPHead",
    "ModelConfig",
    "Qwen3NextForCausalLM",
    "load_model",
]
