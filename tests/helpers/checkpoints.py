"""Tiny Qwen3-Next / Qwen3.5 (dense, MoE, multimodal wrapper) checkpoints written by transformers itself.

The weights are seeded and "stressed" (matrices scaled up, every 1-D parameter randomised) so
greedy logit margins are not flat; random ``mtp.*`` tensors are added to the safetensors file
afterwards (transformers has no MTP module and ignores them on load). The MTP layer is an MoE
layer where the model's rule makes layer index 0 sparse (as in Qwen3-Next-80B and Qwen3.5-MoE).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

LIN, FULL = "linear_attention", "full_attention"


# layout -> (transformers config class, model class, wrapped in the multimodal model)
LAYOUTS = {
    "next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", False),  # in_proj_qkvz/ba on disk
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", False),  # split GDN projections
    "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", False),
    "qwen35-mm": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", True),  # model.language_model.*
    "qwen35moe-mm": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", True),
}
MODEL_CLASSES = {  # config.json model_type -> the transformers class that is the oracle
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


@dataclass(frozen=True)
class TinySpec:
    layout: str = "next"  # a key of LAYOUTS
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
    # MoE (num_experts 0: dense). Qwen3.5-MoE makes every layer sparse and always renormalises.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 2  # K
    moe_intermediate_size: int = 32  # Ie
    shared_expert_intermediate_size: int = 48  # Is
    norm_topk_prob: bool = True  # Qwen3-Next only
    decoder_sparse_step: int = 1  # Qwen3-Next only
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-Next only

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        if not self.moe or self.layout.startswith("qwen35moe"):
            return self.moe
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0


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
    # Qwen3-Next-80B-like: every layer (and the MTP layer) sparse, top-k renormalised.
    "next-moe": TinySpec(num_experts=8, num_experts_per_tok=3, tied=False, seed=4),
    # Sparse every second layer, layer 3 forced dense, no renormalisation, odd sizes, dense MTP.
    "next-moe-odd": TinySpec(
        hidden_size=48, layer_types=(FULL, LIN, LIN, FULL, LIN), num_attention_heads=3, num_key_value_heads=1,
        head_dim=12, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=20, linear_value_head_dim=12, conv_width=3, vocab_size=199, intermediate_size=80,
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28,
        norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=(3,), seed=5,
    ),
    "qwen35-moe": TinySpec(layout="qwen35moe", num_experts=6, num_experts_per_tok=2, seed=6),
    "qwen35-moe-no-mtp": TinySpec(layout="qwen35moe", num_experts=7, num_experts_per_tok=3, tied=False,
                                  with_mtp=False, moe_intermediate_size=24, seed=7),
    "qwen35-mm": TinySpec(layout="qwen35-mm", tied=False, seed=8),
    "qwen35-moe-mm": TinySpec(layout="qwen35moe-mm", num_experts=6, num_experts_per_tok=2, seed=9),
}


def get_spec(spec: TinySpec | str) -> TinySpec:
    return PRESETS[spec] if isinstance(spec, str) else spec


# The modeling modules of the oracle's families (transformers.models.<name>.modeling_<name>).
ORACLE_MODELING = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def torch_paths_only(module) -> None:
    """Make an oracle's modeling ``module`` run transformers' plain-torch GDN, conv and Mamba2 functions.

    transformers swaps in another package's kernels for them where one is importable (flash-linear-
    attention, causal-conv1d, mamba-ssm: ``use_kernel_func_from_hub_with_fallback``), and those run on
    CUDA tensors only and round differently; the oracle runs on CPU in float32. Each swapped function in
    the module's namespace (where the layers call it) is replaced by the torch function it wraps.
    Idempotent; it touches only the transformers modules of this test process."""
    for attr, value in list(vars(module).items()):
        code = getattr(value, "__code__", None)
        swapped = code is not None and code.co_filename.endswith("hub_kernels.py")
        if swapped and hasattr(value, "__wrapped__"):
            setattr(module, attr, value.__wrapped__)


def as_oracle(model):
    """``model`` (a transformers model, eval) with its modeling module on the torch paths."""
    torch_paths_only(sys.modules[type(model).__module__])
    return model


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
    if spec.layout not in LAYOUTS:
        raise ValueError(f"unknown layout {spec.layout!r}")
    config_name, model_name, wrapped = LAYOUTS[spec.layout]
    if spec.moe:
        common.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                      moe_intermediate_size=spec.moe_intermediate_size,
                      shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    if spec.layout == "next":
        n = len(spec.layer_types)
        if spec.moe:
            common.update(norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=spec.decoder_sparse_step,
                          mlp_only_layers=list(spec.mlp_only_layers))
        else:
            common.update(num_experts=0, mlp_only_layers=list(range(n)))
    if spec.layout.startswith("qwen35moe"):
        del common["intermediate_size"]
    if wrapped:
        vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                  "out_hidden_size": spec.hidden_size, "patch_size": 4, "num_position_embeddings": 16}
        config = getattr(tf, config_name)(
            text_config=common, vision_config=vision, tie_word_embeddings=spec.tied
        )
    else:
        config = getattr(tf, config_name)(**common)
    cls = getattr(tf, model_name)
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


def mlp_shapes(prefix: str, spec: TinySpec, index: int) -> dict[str, tuple[int, ...]]:
    """On-disk MLP tensors of layer ``index`` under ``prefix`` (``....mlp.``): dense, or MoE per expert."""
    h = spec.hidden_size
    if not spec.is_moe_layer(index):
        i = spec.intermediate_size
        return {f"{prefix}gate_proj.weight": (i, h), f"{prefix}up_proj.weight": (i, h),
                f"{prefix}down_proj.weight": (h, i)}
    ie, shared = spec.moe_intermediate_size, spec.shared_expert_intermediate_size
    out = {
        f"{prefix}gate.weight": (spec.num_experts, h),
        f"{prefix}shared_expert_gate.weight": (1, h),
        f"{prefix}shared_expert.gate_proj.weight": (shared, h),
        f"{prefix}shared_expert.up_proj.weight": (shared, h),
        f"{prefix}shared_expert.down_proj.weight": (h, shared),
    }
    for e in range(spec.num_experts):
        out.update(
            {
                f"{prefix}experts.{e}.gate_proj.weight": (ie, h),
                f"{prefix}experts.{e}.up_proj.weight": (ie, h),
                f"{prefix}experts.{e}.down_proj.weight": (h, ie),
            }
        )
    return out


def mtp_tensors(spec: TinySpec | str) -> dict[str, torch.Tensor]:
    """The MTP tensors (one full-attention decoder layer, dense or MoE MLP), seeded."""
    spec = get_spec(spec)
    h, d = spec.hidden_size, spec.head_dim
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    std = 0.02 * (spec.stress or 1.0)
    gen = torch.Generator().manual_seed(2000 + spec.seed)
    matrices = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * hq * d, h),
        "mtp.layers.0.self_attn.k_proj.weight": (hkv * d, h),
        "mtp.layers.0.self_attn.v_proj.weight": (hkv * d, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, hq * d),
        **mlp_shapes("mtp.layers.0.mlp.", spec, 0),
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


def load_hf_model(directory: str | Path, dtype: torch.dtype = torch.float32):
    """The transformers oracle for a checkpoint directory (eval)."""
    tf = _transformers()
    model_type = json.loads((Path(directory) / "config.json").read_text())["model_type"]
    cls = getattr(tf, MODEL_CLASSES[model_type])
    return as_oracle(cls.from_pretrained(directory, dtype=dtype).eval())


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


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> transformers' fused in-memory layout, written as such."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, part = rest.split(".")[:2]
            experts.setdefault(prefix, {})[(int(e), part)] = t
        else:
            out[name] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    return out


def tensor_names(directory: str | Path) -> list[str]:
    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


# ---- Checkpoints a user brings: other dimensions, layer patterns and seeds than every preset ---------
# Written as a user would make them: transformers' save_pretrained of the family's model (EOS id 2), an MTP
# head from ``refengine add-mtp-head`` where the family has one, and the byte-level tokenizer of the tiny
# presets. name -> (family: "qwen" | "nemotron" | "dense", the spec of that family's helper).
def _foreign_specs() -> dict[str, tuple[str, object]]:
    from tests.helpers.llama_checkpoints import DenseSpec
    from tests.helpers.nemotron_checkpoints import NemotronSpec

    return {
        # Mamba2, attention, MoE and MLP blocks in a pattern no preset has; odd head counts (Hq 5, Hkv 1),
        # Mamba2 heads of 4 over 5 groups, conv width 2, a scan chunk of 8, 5 experts.
        "nemotron-h-m*em-e": ("nemotron", NemotronSpec(
            pattern="M*EM-E", hidden_size=40, vocab_size=300, num_attention_heads=5, num_key_value_heads=1,
            head_dim=8, intermediate_size=72, mamba_num_heads=10, mamba_head_dim=4, ssm_state_size=8,
            n_groups=5, conv_kernel=2, chunk_size=8, n_routed_experts=5, num_experts_per_tok=2,
            moe_intermediate_size=24, moe_shared_expert_intermediate_size=16, seed=11)),
        # Qwen3.5 (split GDN projections): three linear layers around two full ones, GQA 7:1, GDN 3:6 heads
        # of 8 / 12, conv width 2, half the head rotated, untied.
        "qwen35-lllfl": ("qwen", TinySpec(
            layout="qwen35", hidden_size=56, layer_types=(LIN, LIN, FULL, LIN, FULL), num_attention_heads=7,
            num_key_value_heads=1, head_dim=8, linear_num_key_heads=3, linear_num_value_heads=6,
            linear_key_head_dim=8, linear_value_head_dim=12, conv_width=2, vocab_size=320,
            intermediate_size=88, tied=False, with_mtp=False, partial_rotary_factor=0.5, seed=21)),
        # Qwen3 dense (q/k norms), GQA 6:3 with heads of 12, untied.
        "qwen3-dense-6x3": ("dense", DenseSpec(
            model_type="qwen3", num_hidden_layers=4, hidden_size=72, vocab_size=288, num_attention_heads=6,
            num_key_value_heads=3, head_dim=12, intermediate_size=100, llama3_scaling=False, seed=31)),
    }


FOREIGN = ("nemotron-h-m*em-e", "qwen35-lllfl", "qwen3-dense-6x3")  # the keys of _foreign_specs()


def write_foreign_checkpoint(directory: str | Path, name: str) -> Path:
    """The checkpoint ``name`` of ``FOREIGN`` in ``directory`` (a new folder): weights in ``directory/src``,
    the model to run (head and tokenizer added) in ``directory/model``, returned."""
    from refengine.model.loader import read_config
    from refengine.tools.mtp_head import add_mtp_head
    from refengine.tools.tiny_models import _write_tokenizer
    from tests.helpers import llama_checkpoints, nemotron_checkpoints

    family, spec = _foreign_specs()[name]
    builder = {"qwen": build_hf_model, "nemotron": nemotron_checkpoints.build_hf_model,
               "dense": llama_checkpoints.build_hf_model}[family]
    directory = Path(directory)
    model = builder(spec)
    model.config.eos_token_id = 2
    model.save_pretrained(directory / "src")
    out = directory / "model"
    if family == "dense":
        import shutil

        shutil.copytree(directory / "src", out)
    else:
        add_mtp_head(directory / "src", out)
    _write_tokenizer(out, read_config(out).vocab_size)
    (out / "foreign_spec.json").write_text(json.dumps({"name": name, "family": family, **asdict(spec)}))
    return out


__all__ = [
    "FOREIGN",
    "FULL",
    "LAYOUTS",
    "LIN",
    "MODEL_CLASSES",
    "PRESETS",
    "TinySpec",
    "build_hf_model",
    "fuse_experts",
    "get_spec",
    "load_hf_model",
    "mlp_shapes",
    "mtp_tensors",
    "read_tensors",
    "replace",
    "reshard",
    "tensor_names",
    "write_checkpoint",
    "write_foreign_checkpoint",
    "write_variant",
]
