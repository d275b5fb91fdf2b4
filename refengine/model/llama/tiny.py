"""The weights of ``tiny:llama`` and ``tiny:qwen3``: dense decoders of 8 layers (so EAGLE-3's default
auxiliary layers (2, L/2, L-3) exist) written by transformers' own ``save_pretrained`` from seeded random
weights, matrices scaled by ``STRESS`` and RMSNorm weights drawn from ``NORMS``. At a smaller scale a random
dense decoder falls into repeating one or two tokens (no stop set or grammar lands mid-output); much wider
(norms in [1, 3]) no request repeats itself, so penalties change nothing: either way the suite's triggers
go unmet."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Llama-3.1's RoPE scaling with its original context shrunk to 64 tokens, so short prompts reach the scaled
# and the smoothed frequency bands
LLAMA_CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": False,
}
# Qwen3 dense: per-head q/k norms, head_dim not hidden / heads, tied embeddings
QWEN3_CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "eos_token_id": 2,
    "tie_word_embeddings": True,
}
SEED = 0
STRESS, NORMS = 6.0, (0.5, 1.5)


def write_seeded(out: Path, config_name: str, model_name: str, config: dict) -> None:
    """transformers' ``save_pretrained`` of ``model_name(config_name(**config))``, seeded and stressed:
    matrices x STRESS, one-dimensional parameters drawn from NORMS, a tied lm_head left alone."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    hf_config = getattr(transformers, config_name)(**config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = getattr(transformers, model_name)(hf_config).float().eval()
    gen = torch.Generator().manual_seed(1000 + SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name == "lm_head.weight" and config["tie_word_embeddings"]:
                continue
            if p.dim() >= 2:
                p.mul_(STRESS)
            else:
                p.copy_(torch.empty(p.shape).uniform_(*NORMS, generator=gen))
    model.save_pretrained(out)


def write_tiny_llama(out: Path) -> None:
    """transformers' ``save_pretrained`` of tiny:llama into ``out`` (config.json and weights)."""
    write_seeded(out, "LlamaConfig", "LlamaForCausalLM", LLAMA_CONFIG)


def write_tiny_qwen3(out: Path) -> None:
    """transformers' ``save_pretrained`` of tiny:qwen3 into ``out`` (config.json and weights)."""
    write_seeded(out, "Qwen3Config", "Qwen3ForCausalLM", QWEN3_CONFIG)
