"""Load a HF-format safetensors checkpoint (Qwen3-Next or Qwen3.5 layout) into the model."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from refengine.model.config import FULL, LINEAR, ModelConfig, layer_types_given
from refengine.model.qwen3_next import Qwen3NextForCausalLM
from refengine.model.weights_check import CheckpointError, check_finite

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

WRAPPER_PREFIX = "model.language_model."  # Qwen3.5 multimodal wrapper
IGNORED_PREFIXES = ("model.visual.", "visual.")
GDN_RE = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)(in_proj_qkvz|in_proj_ba|conv1d)\.weight$")
MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
LAYER_ATTENTION_RE = re.compile(r"^model\.layers\.(\d+)\.(linear_attn|self_attn)\.")
# Routed experts on disk: per expert (as transformers writes them) or fused (as it holds them).
EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # [E, 2Ie, H] (rows [gate | up]), [E, H, Ie]


# Checkpoint dtype names (config.json "dtype" / "torch_dtype") the engines run in.
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


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
            f"{name_or_path!r} is neither a local folder nor in the local Hugging Face cache "
            f"({HF_HUB_CACHE}); models are never downloaded here: fetch it first "
            f"(e.g. `hf download {name_or_path}`) or pass a folder"
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
        raise CheckpointError(
            f"dtype='auto': the checkpoint's dtype {name!r} is not one of {sorted(DTYPE_NAMES)}"
        )
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
    """Build the model from ``path/config.json`` and its safetensors weights (single file or sharded).

    Every error names tensors as the file does (a Qwen3.5 wrapper's ``model.language_model.`` prefix
    included) and the weights are checked for NaN/Inf as read, before any fusing or dtype conversion.
    """
    root = Path(path)
    raw = read_config_json(root)
    cfg = parse_config(raw, root / CONFIG_NAME)
    tensors, file_names = _read_tensors(root)
    cfg.num_mtp_layers = _count_mtp_layers(tensors)

    with torch.device("meta"):
        model = Qwen3NextForCausalLM(cfg)
    expected = expected_checkpoint_shapes(model, cfg, set(tensors))
    layer_types_note = "" if layer_types_given(raw) else _derived_layer_types_note(tensors, cfg)
    _check_names_and_shapes(tensors, expected, cfg, file_names, layer_types_note)
    # NaN/Inf weights make every output meaningless; checked by the file's names and dtypes.
    check_finite({file_names[name]: t for name, t in tensors.items()}, dtype, allow_non_finite)

    state = {}
    for name, tensor in _to_model_layout(tensors, cfg).items():
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"missing tensor {leftover[0]} after loading")
    model.requires_grad_(False)
    return model.eval(), cfg


def read_config(root: Path) -> ModelConfig:
    """Parse ``config.json`` into a ModelConfig; CheckpointError names the folder or file when it is
    unusable."""
    return parse_config(read_config_json(root), root / CONFIG_NAME)


def read_config_json(root: Path) -> dict:
    """``root/config.json`` as parsed JSON; CheckpointError says which of folder, file or JSON is wrong."""
    if not root.exists():
        raise CheckpointError(f"checkpoint folder {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint path {root} is not a folder (expected a folder holding {CONFIG_NAME} "
            f"and the safetensors weights)"
        )
    file = root / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"missing {CONFIG_NAME} in {root}")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"invalid JSON in {file}: {exc}") from exc


def parse_config(raw: dict, file: Path) -> ModelConfig:
    """A ModelConfig from config.json's contents; CheckpointError names ``file`` when they are unusable."""
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


def _read_tensors(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors as read, by model name (wrapper prefix stripped, vision tower dropped), and each
    model name's tensor name in the file (for error messages)."""
    tensors: dict[str, torch.Tensor] = {}
    file_names: dict[str, str] = {}
    for file in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for key in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if key.startswith(IGNORED_PREFIXES):
                        continue
                    name = _model_name(key)
                    if name in tensors:
                        raise CheckpointError(f"tensor {key} appears twice (again in {file.name})")
                    tensors[name], file_names[name] = reader.get_tensor(key), key
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return tensors, file_names


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
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], cfg: ModelConfig,
    file_names: dict[str, str], layer_types_note: str = "",
) -> None:
    """Refuse missing, unexpected, misshaped and non-float tensors, naming them as the file does;
    ``layer_types_note`` is added to missing / unexpected tensor errors."""
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some tied checkpoints still store the head; accept it only if it is the embedding.
        head = tensors.pop("lm_head.weight")
        embed = tensors.get("model.embed_tokens.weight")
        if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
            raise CheckpointError("unexpected tensor lm_head.weight: tie_word_embeddings is true")
    missing = _as_in_file(sorted(set(expected) - set(tensors)), file_names)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}" + _more(missing) + layer_types_note)
    unexpected = _as_in_file(sorted(set(tensors) - set(expected)), file_names)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]}" + _more(unexpected) + layer_types_note)
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        conv_2d = name.endswith("conv1d.weight") and got == (shape[0], shape[2])
        if got != shape and not conv_2d:
            raise CheckpointError(f"tensor {file_names[name]} has shape {list(got)}, expected {list(shape)}")
        if not tensors[name].is_floating_point():
            raise CheckpointError(
                f"tensor {file_names[name]} has dtype {tensors[name].dtype}, expected a float type"
            )


def _derived_layer_types_note(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> str:
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
    """Qwen3-Next in_proj_ba [2Hv, H] (per key-head group: b_g (r), a_g (r)) -> in_proj_b,
    in_proj_a [Hv, H]."""
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
    return (
        torch.cat([b.reshape(hk, r, hidden), a.reshape(hk, r, hidden)], dim=1)
        .reshape(-1, hidden)
        .contiguous()
    )
