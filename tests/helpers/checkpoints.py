"""Tiny Qwen3-Next / Qwen3.5 checkpoints written by transformers itself, for tests.

The weights are seeded and "stressed" (matrices scaled up, every 1-D parameter randomised) so
greedy logit margins are not flat; random ``mtp.*`` tensors are added to the safetensors file
afterwards (transformers has no MTP module and ignores them on load).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

LIN, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class TinySpec:
    layout: str = "next"  # "next": Qwen3NextForCausalLM (in_proj_qkvz/ba); "qwen35": Qwen3_5ForCausalLM (split)
    hidden_size: int = 64
    layer_types: tuple[str, ...] = (LIN, FULL, LIN, FULL)
    num_attention_heads: int = 4  # Hq
    num_key_value_heads: int = 2  # Hkv
    head_dim: int = 16  # D
    linear_num_key_heads: int = 2  # Hk
    linear_num_value_heads: int = 4  # Hv
    linear_key_head_dim: int = 16  # Dk
    linear_value_head_dim: int = 16  # Dv
    conv_width: int = 4  # W
    vocab_size: int = 256
    intermediate_size: int = 128
    tied: bool = True
    with_mtp: bool = True
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    seed: int = 0
    stress: float = 4.0  # matrix scale factor; 0 keeps transformers' default init


PRESETS: dict[str, TinySpec] = {
    "next-tiny": TinySpec(),
    "next-gqa4-untied": TinySpec(
        num_attention_heads=8, num_key_value_heads=2, layer_types=(FULL, LIN, LIN, FULL), tied=False, seed=1
    ),
    "qwen35-tiny": TinySpec(layout="qwen35", seed=2),
    # Head dims that are not powers of two, r = Hv/Hk = 3, conv width 3, odd vocab.
    "next-odd-dims": TinySpec(
        hidden_size=48, layer_types=(FULL, LIN, LIN, FULL, LIN), num_attention_heads=3, num_key_value_heads=1,
        head_dim=12, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=20, linear_value_head_dim=12, conv_width=3, vocab_size=199, intermediate_size=80,
        tied=False, seed=3,
    ),
}


def get_spec(spec: TinySpec | str) -> TinySpec:
    return PRESETS[spec] if isinstance(spec, str) else spec


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def build_hf_model(spec: TinySpec | str):
    """A transformers model (fp32, eval) with the spec's seeded, stressed weights."""
    spec = get_spec(spec)
    tf = _transformers()
    common = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": len(spec.layer_types),
        "layer_types": list(spec.layer_types),
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.conv_width,
        "tie_word_embeddings": spec.tied,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "partial_rotary_factor": spec.partial_rotary_factor,
        },
    }
    if spec.layout == "next":
        n = len(spec.layer_types)
        config, cls = tf.Qwen3NextConfig(**common, num_experts=0, mlp_only_layers=list(range(n))), tf.Qwen3NextForCausalLM
    elif spec.layout == "qwen35":
        config, cls = tf.Qwen3_5TextConfig(**common), tf.Qwen3_5ForCausalLM
    else:
        raise ValueError(f"unknown layout {spec.layout!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = cls(config).float().eval()
    if spec.stress:
        _stress(model, spec)
    return model


def _stress(model: torch.nn.Module, spec: TinySpec) -> None:
    gen = torch.Generator().manual_seed(1000 + spec.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name == "lm_head.weight" and spec.tied:
                continue
            if p.dim() >= 2:
                p.mul_(spec.stress)
            elif name.endswith("linear_attn.norm.weight"):  # gated norm, used as-is
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.1, 4.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen))
            else:  # zero-centred RMSNorm weights
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen))


def mtp_tensors(spec: TinySpec | str) -> dict[str, torch.Tensor]:
    """The 15 dense MTP tensors (one full-attention decoder layer), seeded."""
    spec = get_spec(spec)
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    std = 0.02 * (spec.stress or 1.0)
    gen = torch.Generator().manual_seed(2000 + spec.seed)
    matrices = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * hq * d, h),
        "mtp.layers.0.self_attn.k_proj.weight": (hkv * d, h),
        "mtp.layers.0.self_attn.v_proj.weight": (hkv * d, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, hq * d),
        "mtp.layers.0.mlp.gate_proj.weight": (i, h),
        "mtp.layers.0.mlp.up_proj.weight": (i, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, i),
    }
    norms = {
        "mtp.pre_fc_norm_embedding.weight": h,
        "mtp.pre_fc_norm_hidden.weight": h,
        "mtp.norm.weight": h,
        "mtp.layers.0.input_layernorm.weight": h,
        "mtp.layers.0.post_attention_layernorm.weight": h,
        "mtp.layers.0.self_attn.q_norm.weight": d,
        "mtp.layers.0.self_attn.k_norm.weight": d,
    }
    out = {name: torch.randn(shape, generator=gen) * std for name, shape in matrices.items()}
    out.update({name: torch.empty(n).uniform_(-0.5, 0.5, generator=gen) for name, n in norms.items()})
    return out


def write_checkpoint(directory: str | Path, spec: TinySpec | str) -> Path:
    """save_pretrained a tiny model into ``directory`` (created), plus mtp.* tensors when asked."""
    spec = get_spec(spec)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_hf_model(spec).save_pretrained(directory)
    if spec.with_mtp:
        file = directory / "model.safetensors"
        tensors = load_file(file)
        tensors.update(mtp_tensors(spec))
        save_file(tensors, file, metadata={"format": "pt"})
    (directory / "tiny_spec.json").write_text(json.dumps(asdict(spec)))
    return directory


def load_hf_model(directory: str | Path):
    """The transformers oracle for a checkpoint directory (fp32, eval)."""
    tf = _transformers()
    model_type = json.loads((Path(directory) / "config.json").read_text())["model_type"]
    cls = tf.Qwen3NextForCausalLM if model_type == "qwen3_next" else tf.Qwen3_5ForCausalLM
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(directory) / "model.safetensors")


def reshard(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """Copy a single-file checkpoint into ``num_shards`` shards plus model.safetensors.index.json."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = read_tensors(src)
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        save_file(part, dst / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


def write_variant(src: str | Path, dst: str | Path, tensors: dict[str, torch.Tensor] | None = None,
                  config: dict | None = None) -> Path:
    """A copy of ``src`` with replaced tensors and/or config (for loader error tests)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text()) if config is None else config
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(read_tensors(src) if tensors is None else tensors, dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst


def tensor_names(directory: str | Path) -> list[str]:
    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


__all__ = [
    "FULL", "LIN", "PRESETS", "TinySpec", "build_hf_model", "get_spec", "load_hf_model", "mtp_tensors",
    "read_tensors", "replace", "reshard", "tensor_names", "write_checkpoint", "write_variant",
]
