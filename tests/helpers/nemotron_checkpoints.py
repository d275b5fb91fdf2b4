"""Tiny Nemotron-H checkpoints written by transformers itself (``NemotronHForCausalLM.save_pretrained``).

The weights are seeded and "stressed" (matrices scaled up, every 1-D parameter randomised) so greedy
logit margins are not flat. ``dt_bias`` reaches far enough below zero that some dt = softplus(dt +
dt_bias) fall under transformers' ``time_step_min``: the oracle must lift its clamp to agree.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tests.helpers.checkpoints import _transformers, as_oracle

LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class NemotronSpec:
    pattern: str = "M*M-"  # one letter per layer: M Mamba2, * attention, - MLP, E MoE
    hidden_size: int = 64
    vocab_size: int = 256
    num_attention_heads: int = 4  # Hq
    num_key_value_heads: int = 2  # Hkv
    head_dim: int = 16  # D
    intermediate_size: int = 96  # '-' MLP width
    mamba_num_heads: int = 8  # Hm
    mamba_head_dim: int = 8  # P
    ssm_state_size: int = 16  # N
    n_groups: int = 2  # G
    conv_kernel: int = 4  # W
    chunk_size: int = 16  # transformers' chunked scan (and ours, opt-in): longer prompts cross chunks
    n_routed_experts: int = 8  # E
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    moe_shared_expert_intermediate_size: int = 48
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    legacy_pattern: bool = False  # write hybrid_override_pattern instead of layers_block_type
    seed: int = 0
    stress: float = 4.0  # matrix scale factor; 0 keeps transformers' default init


PRESETS: dict[str, NemotronSpec] = {
    # Mamba2, attention and MLP blocks; the default-tier case.
    "nemotron-dense": NemotronSpec(),
    # MoE blocks, two expert groups (one kept), the legacy pattern field.
    "nemotron-moe": NemotronSpec(pattern="M*MEME", n_group=2, topk_group=1, num_experts_per_tok=3,
                                 legacy_pattern=True, seed=1),
    # Latent MoE (experts run at width 24), odd head counts, GQA 6:2, conv width 3, no renormalisation.
    "nemotron-latent": NemotronSpec(pattern="ME*E-M", hidden_size=48, vocab_size=199, num_attention_heads=6,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=80,
                                    mamba_num_heads=6, mamba_head_dim=12, ssm_state_size=12, n_groups=3,
                                    conv_kernel=3, n_routed_experts=6, num_experts_per_tok=2,
                                    moe_intermediate_size=20, moe_shared_expert_intermediate_size=28,
                                    moe_latent_size=24, norm_topk_prob=False, routed_scaling_factor=1.5,
                                    seed=2),
}


def get_spec(spec: NemotronSpec | str) -> NemotronSpec:
    return PRESETS[spec] if isinstance(spec, str) else spec


def hf_config_dict(spec: NemotronSpec) -> dict:
    d = {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size,
        "mamba_num_heads": spec.mamba_num_heads, "mamba_head_dim": spec.mamba_head_dim,
        "ssm_state_size": spec.ssm_state_size, "n_groups": spec.n_groups, "conv_kernel": spec.conv_kernel,
        "chunk_size": spec.chunk_size, "n_routed_experts": spec.n_routed_experts,
        "num_experts_per_tok": spec.num_experts_per_tok, "moe_intermediate_size": spec.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": spec.moe_shared_expert_intermediate_size,
        "moe_latent_size": spec.moe_latent_size, "n_group": spec.n_group, "topk_group": spec.topk_group,
        "norm_topk_prob": spec.norm_topk_prob, "routed_scaling_factor": spec.routed_scaling_factor,
        "max_position_embeddings": 1024, "eos_token_id": 2, "tie_word_embeddings": False,
    }
    if spec.legacy_pattern:
        d["hybrid_override_pattern"] = spec.pattern
    else:
        d["layers_block_type"] = [LETTERS[c] for c in spec.pattern]
    return d


def build_hf_model(spec: NemotronSpec | str):
    """A transformers NemotronHForCausalLM (fp32, eval) with the spec's seeded, stressed weights."""
    spec = get_spec(spec)
    tf = _transformers()
    config = tf.NemotronHConfig(**hf_config_dict(spec))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = tf.NemotronHForCausalLM(config).float().eval()
    if spec.stress:
        _stress(model, spec)
    return model


def _stress(model: torch.nn.Module, spec: NemotronSpec) -> None:
    gen = torch.Generator().manual_seed(1000 + spec.seed)

    def uniform(shape, low, high):
        return torch.empty(shape).uniform_(low, high, generator=gen)

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.mul_(spec.stress)
            elif name.endswith("A_log"):
                p.copy_(uniform(p.shape, 0.5, 4.0).log())
            elif name.endswith("dt_bias"):  # dt = softplus(dt + dt_bias): some fall below 1e-3
                p.copy_(uniform(p.shape, -8.0, 1.0))
            elif name.endswith(".D"):
                p.copy_(uniform(p.shape, -1.0, 1.0))
            elif name.endswith("conv1d.bias"):
                p.copy_(uniform(p.shape, -0.5, 0.5))
            else:  # RMSNorm weights, plain (used as-is)
                p.copy_(uniform(p.shape, 0.5, 1.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(uniform(b.shape, -0.05, 0.05))


def write_checkpoint(directory: str | Path, spec: NemotronSpec | str) -> Path:
    """save_pretrained a tiny model into ``directory`` (created): ``backbone.*``, per-expert tensors."""
    spec = get_spec(spec)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_hf_model(spec).save_pretrained(directory)
    (directory / "tiny_spec.json").write_text(json.dumps(asdict(spec)))
    return directory


def load_hf_model(directory: str | Path, dtype: torch.dtype = torch.float32, lift_dt_clamp: bool = True):
    """The transformers oracle for a checkpoint directory (eval). ``lift_dt_clamp``: its Mamba2 mixers
    clamp dt >= time_step_min in the chunked (prefill) path only; served models use (0, inf)."""
    tf = _transformers()
    model = as_oracle(tf.NemotronHForCausalLM.from_pretrained(directory, dtype=dtype).eval())
    if lift_dt_clamp:
        for module in model.modules():
            if hasattr(module, "time_step_limit"):
                module.time_step_limit = (0.0, math.inf)
    return model
