"""How Qwen3-Next / Qwen3.5 checkpoints name and lay out their tensors, and how the model holds them.

On disk: the Qwen3-Next fused GDN projections (``in_proj_qkvz``, ``in_proj_ba``) or the Qwen3.5 split
ones, the conv weight as [C, 1, W], routed experts per expert or fused, the multimodal wrapper's
``model.language_model.`` prefix (its vision tower is skipped), and ``mtp.*`` draft-head tensors.
"""

from __future__ import annotations

import re

import torch

from refengine.model.qwen3_next.config import FULL, LINEAR, Qwen3NextConfig, layer_types_given

WRAPPER_PREFIX = "model.language_model."  # Qwen3.5 multimodal wrapper
IGNORED_PREFIXES = ("model.visual.", "visual.")
GDN_RE = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)(in_proj_qkvz|in_proj_ba|conv1d)\.weight$")
MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
LAYER_ATTENTION_RE = re.compile(r"^model\.layers\.(\d+)\.(linear_attn|self_attn)\.")
# Routed experts on disk: per expert (as transformers writes them) or fused (as it holds them).
EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # [E, 2Ie, H] (rows [gate | up]), [E, H, Ie]


class QwenWeights:
    """The weight-name mapping of the Qwen3-Next / Qwen3.5 family (see ``refengine.model.registry``)."""

    embed_name = "model.embed_tokens.weight"

    @staticmethod
    def model_name(key: str) -> str | None:
        """A file's tensor name as the model names it (None: not the language model's)."""
        if key.startswith(IGNORED_PREFIXES):
            return None
        return _model_name(key)

    @staticmethod
    def as_in_file(names: list[str], file_names: dict[str, str]) -> list[str]:
        return _as_in_file(names, file_names)

    @staticmethod
    def prepare(cfg: Qwen3NextConfig, tensors: dict[str, torch.Tensor]) -> None:
        cfg.num_mtp_layers = _count_mtp_layers(tensors)

    @staticmethod
    def expected_shapes(model, cfg: Qwen3NextConfig, names: set[str]) -> dict[str, tuple[int, ...]]:
        return expected_checkpoint_shapes(model, cfg, names)

    @staticmethod
    def mismatch_note(raw: dict, tensors: dict[str, torch.Tensor], cfg: Qwen3NextConfig) -> str:
        return "" if layer_types_given(raw) else _derived_layer_types_note(tensors, cfg)

    @staticmethod
    def to_model_layout(tensors: dict[str, torch.Tensor], cfg: Qwen3NextConfig) -> dict[str, torch.Tensor]:
        return _to_model_layout(tensors, cfg)

    @staticmethod
    def keep_fp32(name: str) -> bool:
        return False


def _model_name(key: str) -> str:
    """A file's tensor name as the model names it: a Qwen3.5 wrapper's ``model.language_model.`` ->
    ``model.``."""
    return "model." + key[len(WRAPPER_PREFIX):] if key.startswith(WRAPPER_PREFIX) else key



def _as_in_file(names: list[str], file_names: dict[str, str]) -> list[str]:
    """Model tensor names as the file names them: its own key where it holds the tensor, else in the
    file's convention (wrapped when any of its tensors is)."""
    wrapped = any(key.startswith(WRAPPER_PREFIX) for key in file_names.values())

    def as_in_file(name: str) -> str:
        if name in file_names:
            return file_names[name]
        return WRAPPER_PREFIX + name[len("model."):] if wrapped and name.startswith("model.") else name

    return [as_in_file(name) for name in names]



def _count_mtp_layers(tensors: dict[str, torch.Tensor]) -> int:
    """1 + the highest mtp.layers.{n} index; 1 when only mtp.* non-layer tensors exist (reported missing)."""
    indices = [int(m.group(1)) for m in map(MTP_LAYER_RE.match, tensors) if m]
    if indices:
        return max(indices) + 1
    return 1 if any(name.startswith("mtp.") for name in tensors) else 0



def expected_checkpoint_shapes(
    model, cfg: Qwen3NextConfig, names: set[str] | None = None
) -> dict[str, tuple[int, ...]]:
    """Names and shapes the checkpoint must hold, in its on-disk layout.

    Routed experts are expected per expert unless ``names`` (the checkpoint's tensor names) holds
    the fused ``experts.gate_up_proj`` of that layer.
    """
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in [n for n in shapes if n.endswith(".mlp.experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        if names is not None and name in names:
            continue
        num_experts, two_i, hidden = shapes.pop(name)
        del shapes[prefix + "down_proj"]
        for e in range(num_experts):
            shapes[f"{prefix}{e}.gate_proj.weight"] = (two_i // 2, hidden)
            shapes[f"{prefix}{e}.up_proj.weight"] = (two_i // 2, hidden)
            shapes[f"{prefix}{e}.down_proj.weight"] = (hidden, two_i // 2)
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, hidden = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size
    for i in cfg.linear_layer_ids:
        prefix = f"model.layers.{i}.linear_attn."
        shapes[prefix + "conv1d.weight"] = (cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim)
        if cfg.gdn_layout == "qkvz":
            for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                del shapes[prefix + part + ".weight"]
            shapes[prefix + "in_proj_qkvz.weight"] = (2 * hk * dk + 2 * hv * dv, hidden)
            shapes[prefix + "in_proj_ba.weight"] = (2 * hv, hidden)
    return shapes


def _derived_layer_types_note(tensors: dict[str, torch.Tensor], cfg: Qwen3NextConfig) -> str:
    """For a config.json without ``layer_types`` (transformers then derives them from
    ``full_attention_interval``): a note naming the first layer whose tensors say otherwise, "" when
    they agree."""
    held: dict[int, str] = {}
    for match in map(LAYER_ATTENTION_RE.match, tensors):
        if match is not None:
            held[int(match.group(1))] = LINEAR if match.group(2) == "linear_attn" else FULL
    for i, derived in enumerate(cfg.layer_types):
        if held.get(i, derived) != derived:
            return (
                f"; config.json has no layer_types, so transformers derived them from "
                f"full_attention_interval ({derived} for layer {i}), but the tensors make layer {i} "
                f"{held[i]}: add layer_types to config.json"
            )
    return ""



def _to_model_layout(tensors: dict[str, torch.Tensor], cfg: Qwen3NextConfig) -> dict[str, torch.Tensor]:
    """Disk names/layout -> model names/layout (GDN split projections, conv weight [C, W], fused experts)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}  # "...mlp.experts." -> (e, part) -> weight
    for name, tensor in tensors.items():
        m = EXPERT_RE.match(name)
        if m is not None:
            prefix, e, part = m.groups()
            experts.setdefault(prefix, {})[(int(e), part)] = tensor
            continue
        m = GDN_RE.match(name)
        if m is None:
            out[name] = tensor
            continue
        prefix, part = m.groups()
        if part == "conv1d":
            out[name] = tensor.reshape(tensor.shape[0], tensor.shape[-1])
        elif part == "in_proj_qkvz":
            qkv, z = split_qkvz(tensor, cfg)
            out[prefix + "in_proj_qkv.weight"], out[prefix + "in_proj_z.weight"] = qkv, z
        else:
            b, a = split_ba(tensor, cfg)
            out[prefix + "in_proj_b.weight"], out[prefix + "in_proj_a.weight"] = b, a
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0) for e in range(count)]
        out[prefix + "gate_up_proj"] = torch.stack(gate_up)
        out[prefix + "down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    return out



def split_qkvz(weight: torch.Tensor, cfg: Qwen3NextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_qkvz [Hk*(2Dk+2rDv), H] (per key-head group: q, k, v_g, z_g)
    -> in_proj_qkv [2HkDk+HvDv, H] (rows [all q | all k | all v]) and in_proj_z [HvDv, H]."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    grouped = weight.reshape(hk, 2 * dk + 2 * r * dv, weight.shape[-1])
    q, k, v, z = torch.split(grouped, [dk, dk, r * dv, r * dv], dim=1)
    flat = [t.reshape(-1, weight.shape[-1]) for t in (q, k, v, z)]
    return torch.cat(flat[:3], dim=0).contiguous(), flat[3].contiguous()



def split_ba(weight: torch.Tensor, cfg: Qwen3NextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_ba [2Hv, H] (per key-head group: b_g (r), a_g (r)) -> in_proj_b,
    in_proj_a [Hv, H]."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    grouped = weight.reshape(hk, 2 * r, weight.shape[-1])
    b, a = torch.split(grouped, [r, r], dim=1)
    return b.reshape(-1, weight.shape[-1]).contiguous(), a.reshape(-1, weight.shape[-1]).contiguous()



def merge_qkvz(qkv: torch.Tensor, z: torch.Tensor, cfg: Qwen3NextConfig) -> torch.Tensor:
    """Inverse of split_qkvz: Qwen3.5 in_proj_qkv / in_proj_z -> Qwen3-Next in_proj_qkvz."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r, hidden = cfg.linear_num_value_heads // hk, qkv.shape[-1]
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hk * r * dv], dim=0)
    parts = [q.reshape(hk, dk, hidden), k.reshape(hk, dk, hidden),
             v.reshape(hk, r * dv, hidden), z.reshape(hk, r * dv, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden).contiguous()



def merge_ba(b: torch.Tensor, a: torch.Tensor, cfg: Qwen3NextConfig) -> torch.Tensor:
    """Inverse of split_ba: in_proj_b / in_proj_a [Hv, H] -> Qwen3-Next in_proj_ba [2Hv, H]."""
    hk, hidden = cfg.linear_num_key_heads, b.shape[-1]
    r = cfg.linear_num_value_heads // hk
    return (
        torch.cat([b.reshape(hk, r, hidden), a.reshape(hk, r, hidden)], dim=1)
        .reshape(-1, hidden)
        .contiguous()
    )
