"""Load a HF-format safetensors checkpoint (Qwen3-Next or Qwen3.5 layout) into the model."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from refengine.model.config import ModelConfig
from refengine.model.qwen3_next import Qwen3NextForCausalLM
from refengine.model.weights_check import check_finite

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

WRAPPER_PREFIX = "model.language_model."  # Qwen3.5 multimodal wrapper
IGNORED_PREFIXES = ("model.visual.", "visual.")
GDN_RE = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)(in_proj_qkvz|in_proj_ba|conv1d)\.weight$")
MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
# Routed experts on disk: per expert (as transformers writes them) or fused (as it holds them).
EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # [E, 2Ie, H] (rows [gate | up]), [E, H, Ie]


# Checkpoint dtype names (config.json "dtype" / "torch_dtype") the engines run in.
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class CheckpointError(ValueError):
    """The checkpoint on disk does not match what the model needs."""


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A checkpoint folder: ``name_or_path`` itself when it is a folder, else a hub id
    (``owner/name``) looked up in the local Hugging Face cache only; nothing is ever downloaded.

    Anything else comes back unchanged, for ``load_model`` to name what is missing.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir() or not HUB_ID_RE.match(str(name_or_path)):
        return str(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(str(name_or_path), local_files_only=True)
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"{name_or_path!r} is neither a local folder nor in the local Hugging Face cache ({HF_HUB_CACHE}); "
            f"models are never downloaded here: fetch it first (e.g. `hf download {name_or_path}`) or pass a folder"
        ) from exc


def resolve_dtype(requested: str, path: str | os.PathLike) -> str:
    """``requested`` itself, or for ``"auto"`` the checkpoint's dtype: config.json's ``dtype`` /
    ``torch_dtype`` (top level, then ``text_config``), else that of its first floating-point tensor."""
    if requested != "auto":
        return requested
    root = Path(path)
    raw = {}
    if (root / CONFIG_NAME).is_file():
        try:
            raw = json.loads((root / CONFIG_NAME).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"invalid JSON in {root / CONFIG_NAME}: {exc}") from exc
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    name = next((d.get(k) for d in (raw, text) for k in ("dtype", "torch_dtype") if d.get(k)), None)
    if name is None:
        name = _first_float_dtype(root)
    if name not in DTYPE_NAMES:
        raise CheckpointError(f"dtype='auto': the checkpoint's dtype {name!r} is not one of {sorted(DTYPE_NAMES)}")
    return name


def _first_float_dtype(root: Path) -> str | None:
    """The dtype name of the first floating-point tensor in the checkpoint's (first) weight file."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    for file in _weight_files(root):
        with safe_open(str(file), framework="pt") as reader:
            for key in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                name = names.get(reader.get_slice(key).get_dtype())
                if name is not None:
                    return name
    return None


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    allow_non_finite: bool = False,
) -> tuple[Qwen3NextForCausalLM, ModelConfig]:
    """Build the model from ``path/config.json`` and its safetensors weights (single file or sharded)."""
    root = Path(path)
    cfg = read_config(root)
    tensors = _read_tensors(root)
    cfg.num_mtp_layers = _count_mtp_layers(tensors)

    with torch.device("meta"):
        model = Qwen3NextForCausalLM(cfg)
    expected = expected_checkpoint_shapes(model, cfg, set(tensors))
    _check_names_and_shapes(tensors, expected, cfg)

    state = {}
    for name, tensor in _to_model_layout(tensors, cfg).items():
        state[name] = tensor.to(device=device, dtype=dtype)
    check_finite(state, allow_non_finite)  # NaN/Inf weights make every output meaningless
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"missing tensor {leftover[0]} after loading")
    model.requires_grad_(False)
    return model.eval(), cfg


def read_config(root: Path) -> ModelConfig:
    """Parse ``config.json`` into a ModelConfig; CheckpointError names the file when it is unusable."""
    file = root / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"missing {CONFIG_NAME} in {root}")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"invalid JSON in {file}: {exc}") from exc
    try:
        return ModelConfig.from_hf_config(raw)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"invalid {file}: {exc}") from exc


def _weight_files(root: Path) -> list[Path]:
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"invalid shard index {index}: {exc}") from exc
        files = []
        for shard in sorted(set(weight_map.values())):
            if not str(shard).endswith(".safetensors"):
                raise CheckpointError(f"shard {shard} in {index} is not a .safetensors file")
            if not (root / shard).is_file():
                raise CheckpointError(f"missing shard file {shard} (listed in {index})")
            files.append(root / shard)
        return files
    if (root / SINGLE_NAME).is_file():
        return [root / SINGLE_NAME]
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES) if root.is_dir() else []
    if pickles:
        raise CheckpointError(f"only .bin/pickle weights found; convert to safetensors (only safetensors "
                              f"checkpoints are supported, found {pickles[0]} in {root})")
    raise CheckpointError(f"no {SINGLE_NAME} or {INDEX_NAME} in {root}")


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """All tensors, names normalised (wrapper prefix stripped, vision tower dropped)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for key in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if key.startswith(IGNORED_PREFIXES):
                        continue
                    name = "model." + key[len(WRAPPER_PREFIX):] if key.startswith(WRAPPER_PREFIX) else key
                    if name in tensors:
                        raise CheckpointError(f"tensor {key} appears twice (again in {file.name})")
                    tensors[name] = reader.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return tensors


def _count_mtp_layers(tensors: dict[str, torch.Tensor]) -> int:
    """1 + the highest mtp.layers.{n} index; 1 when only mtp.* non-layer tensors exist (reported missing)."""
    indices = [int(m.group(1)) for m in map(MTP_LAYER_RE.match, tensors) if m]
    if indices:
        return max(indices) + 1
    return 1 if any(name.startswith("mtp.") for name in tensors) else 0


def expected_checkpoint_shapes(
    model: Qwen3NextForCausalLM, cfg: ModelConfig, names: set[str] | None = None
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


def _check_names_and_shapes(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], cfg: ModelConfig
) -> None:
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some tied checkpoints still store the head; accept it only if it is the embedding.
        head = tensors.pop("lm_head.weight")
        embed = tensors.get("model.embed_tokens.weight")
        if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
            raise CheckpointError("unexpected tensor lm_head.weight: tie_word_embeddings is true")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}" + _more(missing))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]}" + _more(unexpected))
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        conv_2d = name.endswith("conv1d.weight") and got == (shape[0], shape[2])
        if got != shape and not conv_2d:
            raise CheckpointError(f"tensor {name} has shape {list(got)}, expected {list(shape)}")
        if not tensors[name].is_floating_point():
            raise CheckpointError(f"tensor {name} has dtype {tensors[name].dtype}, expected a float type")


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more: {', '.join(names[1:6])})" if len(names) > 1 else ""


def _to_model_layout(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
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


def split_qkvz(weight: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_qkvz [Hk*(2Dk+2rDv), H] (per key-head group: q, k, v_g, z_g)
    -> in_proj_qkv [2HkDk+HvDv, H] (rows [all q | all k | all v]) and in_proj_z [HvDv, H]."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    grouped = weight.reshape(hk, 2 * dk + 2 * r * dv, weight.shape[-1])
    q, k, v, z = torch.split(grouped, [dk, dk, r * dv, r * dv], dim=1)
    flat = [t.reshape(-1, weight.shape[-1]) for t in (q, k, v, z)]
    return torch.cat(flat[:3], dim=0).contiguous(), flat[3].contiguous()


def split_ba(weight: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_ba [2Hv, H] (per key-head group: b_g (r), a_g (r)) -> in_proj_b, in_proj_a [Hv, H]."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    grouped = weight.reshape(hk, 2 * r, weight.shape[-1])
    b, a = torch.split(grouped, [r, r], dim=1)
    return b.reshape(-1, weight.shape[-1]).contiguous(), a.reshape(-1, weight.shape[-1]).contiguous()


def merge_qkvz(qkv: torch.Tensor, z: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of split_qkvz: Qwen3.5 in_proj_qkv / in_proj_z -> Qwen3-Next in_proj_qkvz."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r, hidden = cfg.linear_num_value_heads // hk, qkv.shape[-1]
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hk * r * dv], dim=0)
    parts = [q.reshape(hk, dk, hidden), k.reshape(hk, dk, hidden),
             v.reshape(hk, r * dv, hidden), z.reshape(hk, r * dv, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden).contiguous()


def merge_ba(b: torch.Tensor, a: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of split_ba: in_proj_b / in_proj_a [Hv, H] -> Qwen3-Next in_proj_ba [2Hv, H]."""
    hk, hidden = cfg.linear_num_key_heads, b.shape[-1]
    r = cfg.linear_num_value_heads // hk
    return torch.cat([b.reshape(hk, r, hidden), a.reshape(hk, r, hidden)], dim=1).reshape(-1, hidden).contiguous()
