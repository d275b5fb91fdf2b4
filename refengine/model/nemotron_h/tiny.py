"""The weights of ``tiny:nemotron_h`` (``refengine.tools.tiny_models`` adds the MTP head and tokenizer):
a Nemotron-H of every block kind (Mamba2, attention, MLP, MoE; pattern ``M*ME``) written by
transformers' own ``save_pretrained`` from seeded, stressed random weights, so greedy margins are not
flat."""

from __future__ import annotations

import os
from pathlib import Path

import torch

TINY_CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 96, "mamba_num_heads": 8, "mamba_head_dim": 8,
    "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 1024, "eos_token_id": 2, "tie_word_embeddings": False,
    "layers_block_type": ["mamba", "attention", "mamba", "moe"],
}
SEED = 0
STRESS = 4.0  # matrix scale: wider logit margins than transformers' default init


def write_tiny_checkpoint(out: Path, config: dict | None = None) -> None:
    """transformers' ``save_pretrained`` of the tiny model into ``out`` (config.json and weights);
    ``config``: other NemotronHConfig fields than ``TINY_CONFIG`` (another geometry, seeded alike)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config = transformers.NemotronHConfig(**(TINY_CONFIG if config is None else config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = transformers.NemotronHForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(1000 + SEED)

    def uniform(shape, low, high):
        return torch.empty(shape).uniform_(low, high, generator=gen)

    ranges = {"A_log": None, "dt_bias": (-8.0, 1.0), ".D": (-1.0, 1.0), "conv1d.bias": (-0.5, 0.5)}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.mul_(STRESS)
            elif name.endswith("A_log"):
                p.copy_(uniform(p.shape, 0.5, 4.0).log())
            else:
                bounds = next((r for key, r in ranges.items() if r and name.endswith(key)), (0.5, 1.5))
                p.copy_(uniform(p.shape, *bounds))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(uniform(b.shape, -0.05, 0.05))
    model.save_pretrained(out)
