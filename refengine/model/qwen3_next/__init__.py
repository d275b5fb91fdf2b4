"""The Qwen3-Next / Qwen3.5 family (dense and MoE, plain and multimodal-wrapped checkpoints): gated
DeltaNet and gated attention layers, dense or sparse MLPs, an MTP draft head.

``config.py`` the config view, ``model.py`` the model and its cache specs, ``weights.py`` the checkpoint
layouts, ``gdn.py`` / ``moe.py`` / ``mixers.py`` its layers, ``mtp_head.py`` the head ``add-mtp-head``
writes. ``FAMILY`` is its registry entry.
"""

from refengine.model.family import ModelFamily
from refengine.model.qwen3_next.config import FULL, GDN_LAYOUTS, LINEAR, Qwen3NextConfig
from refengine.model.qwen3_next.model import Qwen3NextForCausalLM, Qwen3NextMTPHead, cache_specs
from refengine.model.qwen3_next.mtp_head import qwen_mtp_head
from refengine.model.qwen3_next.weights import QwenWeights

FAMILY = ModelFamily(
    name="qwen3_next",
    model_types=tuple(GDN_LAYOUTS),
    config_from_dict=Qwen3NextConfig.from_hf_config,
    model_class=Qwen3NextForCausalLM,
    weights=QwenWeights(),
    cache_specs=cache_specs,
    # read as vLLM does, beside transformers' configuration classes
    config_fields=frozenset({"num_nextn_predict_layers", "mtp_num_hidden_layers",
                             "mtp_use_dedicated_embeddings", "full_attention_interval", "attn_output_gate",
                             "use_sliding_window", "sliding_window", "max_window_layers"}),
    mtp_head=qwen_mtp_head,
    tiny_checkpoint=None,  # the embedded default model is a Qwen3-Next
    test_checkpoints=(("qwen3-next-default", None), ("qwen3-next-moe", "next-moe"),
                      ("qwen3.5-moe", "qwen35-moe")),
)

__all__ = ["FAMILY", "FULL", "LINEAR", "Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextMTPHead"]
