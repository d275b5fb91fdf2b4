"""Tiny Llama and Qwen3 dense checkpoints written by transformers itself (``LlamaForCausalLM`` /
``Qwen3ForCausalLM.save_pretrained``).

The weights are seeded and "stressed" (matrices scaled up, every RMSNorm weight randomised) so greedy
logit margins are not flat.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tests.helpers.checkpoints import _transformers, as_oracle

MODEL_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
# Llama-3.1's scaling, its original context shrunk so short prompts reach the scaled and smoothed bands
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class DenseSpec:
    model_type: str = "llama"  # a key of MODEL_CLASSES
    num_hidden_layers: int = 3
    hidden_size: int = 64
    vocab_size: int = 256
    num_attention_heads: int = 4  # Hq
    num_key_value_heads: int = 2  # Hkv
    head_dim: int = 16  # D
    intermediate_size: int = 96
    rope_theta: float = 10000.0
    llama3_scaling: bool = True
    tied: bool = False
    seed: int = 0
    stress: float = 4.0  # matrix scale factor; 0 keeps transformers' default init


PRESETS: dict[str, DenseSpec] = {
    "llama3": DenseSpec(),  # llama3 RoPE scaling, untied, GQA 4:2
    "llama-plain-tied": DenseSpec(llama3_scaling=False, tied=True, num_key_value_heads=4, seed=1),
    # odd sizes: head_dim not hidden / heads, GQA 6:2, odd vocab
    "llama3-odd": DenseSpec(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                            vocab_size=199, intermediate_size=80, rope_theta=500000.0, tied=True, seed=2),
    "qwen3": DenseSpec(model_type="qwen3", llama3_scaling=False, tied=True, seed=3),
    "qwen3-untied-gqa4": DenseSpec(model_type="qwen3", llama3_scaling=False, num_attention_heads=8,
                                   head_dim=8, seed=4),
}


def get_spec(spec: DenseSpec | str) -> DenseSpec:
    return PRESETS[spec] if isinstance(spec, str) else spec


def hf_config_dict(spec: DenseSpec) -> dict:
    rope = dict(LLAMA3) if spec.llama3_scaling else {"rope_type": "default"}
    return {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size, "max_position_embeddings": 1024,
        "rope_parameters": {**rope, "rope_theta": spec.rope_theta}, "tie_word_embeddings": spec.tied,
        "eos_token_id": 2, "bos_token_id": 1,
    }


def build_hf_model(spec: DenseSpec | str):
    """A transformers model (fp32, eval) with the spec's seeded, stressed weights."""
    spec = get_spec(spec)
    tf = _transformers()
    config_name, model_name = MODEL_CLASSES[spec.model_type]
    config = getattr(tf, config_name)(**hf_config_dict(spec))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = getattr(tf, model_name)(config).float().eval()
    if spec.stress:
        gen = torch.Generator().manual_seed(1000 + spec.seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name == "lm_head.weight" and spec.tied:
                    continue
                if p.dim() >= 2:
                    p.mul_(spec.stress)
                else:  # RMSNorm weights, plain (used as-is)
                    p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
    return model


def write_checkpoint(directory: str | Path, spec: DenseSpec | str) -> Path:
    """save_pretrained a tiny model into ``directory`` (created)."""
    spec = get_spec(spec)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_hf_model(spec).save_pretrained(directory)
    (directory / "tiny_spec.json").write_text(json.dumps(asdict(spec)))
    return directory


def load_hf_model(directory: str | Path, dtype: torch.dtype = torch.float32):
    """The transformers oracle for a checkpoint directory (eval)."""
    tf = _transformers()
    model_type = json.loads((Path(directory) / "config.json").read_text())["model_type"]
    return as_oracle(getattr(tf, MODEL_CLASSES[model_type][1]).from_pretrained(directory, dtype=dtype).eval())
