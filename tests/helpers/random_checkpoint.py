"""Random-weight checkpoints at chosen (up to real per-rank) shapes, written straight to safetensors.

The config goes through transformers' configuration class (so config.json is what transformers
writes); the tensors are the model's own parameter list (read off a meta-device model) put in the
on-disk layout: Qwen3-Next GDN projections fused as in_proj_qkvz / in_proj_ba, a [C, 1, W] conv
weight, routed experts fused (``experts.gate_up_proj`` / ``experts.down_proj``) or per expert.
Weights are seeded and scaled 1/sqrt(fan_in) so activations stay O(1) at any width.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

LIN, FULL = "linear_attention", "full_attention"
CONFIG_CLASSES = {"qwen3_next": "Qwen3NextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"}


@dataclass(frozen=True)
class RandomSpec:
    model_type: str  # "qwen3_next" | "qwen3_5_moe_text"
    config: dict = field(default_factory=dict)  # transformers config kwargs (sizes, experts, layer_types)
    with_mtp: bool = True
    fused_experts: bool = True  # on disk: fused 3-D expert tensors, else per expert
    seed: int = 0


# Qwen3-Next-80B-A3B per-rank shapes (hidden 2048, 16/32 GDN heads of 128, 512 experts top-10,
# expert width 512), few layers: layers 1 and 3 sparse, the rest (and the MTP layer) dense.
NEXT_80B_LIKE = RandomSpec(
    "qwen3_next",
    {
        "vocab_size": 32768,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 4,
        "layer_types": [LIN, LIN, LIN, FULL],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
)
# Qwen3.5-MoE per-rank shapes (256 experts top-8), one linear and one full layer, sparse MTP layer.
QWEN35_MOE_LIKE = RandomSpec(
    "qwen3_5_moe_text",
    {
        "vocab_size": 32768,
        "hidden_size": 2048,
        "num_hidden_layers": 2,
        "layer_types": [LIN, FULL],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
    fused_experts=False,
    seed=1,
)

# The same structures, small enough for the CPU default tier.
_SMALL = {
    "vocab_size": 384,
    "hidden_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 24,
    "linear_value_head_dim": 24,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 40,
    "max_position_embeddings": 1024,
}
NEXT_SMALL = RandomSpec("qwen3_next", {**NEXT_80B_LIKE.config, **_SMALL, "intermediate_size": 160,
                                       "num_experts": 24, "num_experts_per_tok": 4}, seed=2)
QWEN35_MOE_SMALL = RandomSpec("qwen3_5_moe_text", {**QWEN35_MOE_LIKE.config, **_SMALL, "num_experts": 16,
                                                   "num_experts_per_tok": 3}, fused_experts=False, seed=3)


def write_random_checkpoint(
    directory: str | Path, spec: RandomSpec, dtype: torch.dtype = torch.float32
) -> Path:
    """config.json + model.safetensors for ``spec`` in ``dtype``; returns the folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from refengine.model.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
    from refengine.model.qwen3_next.weights import merge_ba, merge_qkvz

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = getattr(transformers, CONFIG_CLASSES[spec.model_type])(**spec.config)
    hf_config.dtype = str(dtype).removeprefix("torch.")
    hf_config.save_pretrained(directory)
    cfg = Qwen3NextConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
    cfg.num_mtp_layers = 1 if spec.with_mtp else 0
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen3NextForCausalLM(cfg).state_dict().items()}

    gen = torch.Generator().manual_seed(spec.seed)
    state = {name: _random(name, shape, gen).to(dtype) for name, shape in sorted(shapes.items())}
    for i in cfg.linear_layer_ids:
        p = f"model.layers.{i}.linear_attn."
        state[p + "conv1d.weight"] = state[p + "conv1d.weight"].unsqueeze(1).contiguous()
        if cfg.gdn_layout == "qkvz":
            state[p + "in_proj_qkvz.weight"] = merge_qkvz(state.pop(p + "in_proj_qkv.weight"),
                                                          state.pop(p + "in_proj_z.weight"), cfg)
            state[p + "in_proj_ba.weight"] = merge_ba(state.pop(p + "in_proj_b.weight"),
                                                      state.pop(p + "in_proj_a.weight"), cfg)
    if not spec.fused_experts:
        for name in [n for n in state if n.endswith(".mlp.experts.gate_up_proj")]:
            prefix = name[: -len("gate_up_proj")]
            gate_up, down = state.pop(name), state.pop(prefix + "down_proj")
            half = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                state[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :half].clone()
                state[f"{prefix}{e}.up_proj.weight"] = gate_up[e, half:].clone()
                state[f"{prefix}{e}.down_proj.weight"] = down[e].clone()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return torch.empty(shape).uniform_(-1.0, 1.0, generator=gen)
    if name.endswith("linear_attn.norm.weight"):  # gated norm, used as-is
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if len(shape) == 1:  # zero-centred RMSNorm weights
        return torch.empty(shape).uniform_(-0.3, 0.3, generator=gen)
    if name.endswith("conv1d.weight"):  # [C, W]
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[-1]))  # [.., out, in]
