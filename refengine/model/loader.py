"""Load a HF-format safetensors checkpoint (single file or sharded) into its family's model.

The family (``refengine.model.registry``) is found from config.json's ``model_type``; it supplies the
config view, the model class and the weight-name mapping. Everything else here (files, shards,
missing / unexpected / misshapen / non-finite tensors) is the same for every family.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from refengine.model.weights_check import CheckpointError, check_finite

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# Checkpoint dtype names (config.json "dtype" / "torch_dtype") the engines run in.
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
TINY_NAME_PREFIX = "tiny:"  # a tiny model's name (refengine.tools.tiny_models), never a folder


def tiny_name_message(what: str, name: str, resolver: str) -> str:
    """The one line that refuses tiny model ``name`` given as ``what`` where a folder is needed."""
    return (f"{what}={name!r} is a tiny model's name, not a folder: pass "
            f"refengine.tools.tiny_models.{resolver}({name!r}), which writes it on first use (the command "
            f"lines take {name} as it is)")


def resolve_model_path(name_or_path: str | os.PathLike, what: str = "model") -> str:
    """A checkpoint folder: ``name_or_path`` itself when it is a folder, else a hub id
    (``owner/name``) looked up in the local Hugging Face cache only; nothing is ever downloaded.
    Anything else comes back unchanged, for ``load_model`` to name what is missing.

    A tiny model's name (``tiny:<preset>``) is refused, as the setting ``what``: the tools make those
    folders (``refengine.tools.tiny_models.tiny_model_path``; the command lines take the names), the engine
    takes the folder.
    """
    if str(name_or_path).startswith(TINY_NAME_PREFIX):
        raise CheckpointError(tiny_name_message(what, str(name_or_path), "tiny_model_path"))
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
    allow_non_finite: bool = False, config: ConfigFile | None = None,
) -> tuple[torch.nn.Module, object]:
    """Build the model of ``path/config.json``'s family from its safetensors weights (single file or
    sharded). Returns (model, config view). ``config``: that file as ``read_config_file`` read it, when
    the caller has already read it.

    Every error names tensors as the file does (a Qwen3.5 wrapper's ``model.language_model.`` or a
    Nemotron-H ``backbone.`` prefix included) and the weights are checked for NaN/Inf as read, before
    any fusing or dtype conversion.
    """
    from refengine.model.registry import family_for

    root = Path(path)
    raw, cfg = config or read_config_file(root)
    weights = family_for(cfg.model_type).weights
    tensors, file_names = _read_tensors(root, weights.model_name)
    weights.prepare(cfg, tensors)

    with torch.device("meta"):
        model = family_for(cfg.model_type).model_class(cfg)
    expected = weights.expected_shapes(model, cfg, set(tensors))
    note = weights.mismatch_note(raw, tensors, cfg)
    _check_names_and_shapes(tensors, expected, cfg, file_names, weights, note)
    # NaN/Inf weights make every output meaningless; checked by the file's names and dtypes.
    check_finite({file_names[name]: t for name, t in tensors.items()}, dtype, allow_non_finite)

    state = {}
    for name, tensor in weights.to_model_layout(tensors, cfg).items():
        state[name] = tensor.to(device=device, dtype=torch.float32 if weights.keep_fp32(name) else dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"missing tensor {leftover[0]} after loading")
    model.requires_grad_(False)
    return model.eval(), cfg


class ConfigFile(NamedTuple):
    """A checkpoint's config.json: as parsed JSON (``raw``) and as its family's config view."""

    raw: dict
    view: Any


def read_config_file(root: Path) -> ConfigFile:
    """``config.json`` as JSON and as its family's config view; CheckpointError names the folder or file
    when it is unusable."""
    raw = read_config_json(root)
    return ConfigFile(raw, parse_config(raw, root / CONFIG_NAME))


def read_config(root: Path):
    """Parse ``config.json`` into its family's config view; CheckpointError names the folder or file
    when it is unusable."""
    return read_config_file(root).view


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


def parse_config(raw: dict, file: Path):
    """The config view of config.json's family; CheckpointError names ``file`` when it is unusable."""
    from refengine.model.registry import family_for

    try:
        if not isinstance(raw, dict):
            raise TypeError(f"config: expected a JSON object, got {type(raw).__name__}")
        family = family_for(raw.get("model_type"))
        cfg = family.config_from_dict(raw)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"invalid {file}: {exc}") from exc
    _warn_unknown_fields(raw, family.config_fields, file)
    return cfg


def _warn_unknown_fields(raw: dict, family_fields: frozenset[str], file: Path) -> None:
    """Warn about each config.json field nothing reads (refengine.model.config_fields), by name."""
    import warnings

    from refengine.model.config_fields import UnknownConfigFieldWarning, unknown_fields

    for field, close in unknown_fields(raw, family_fields):
        hint = f"; did you mean {close!r}?" if close else ""
        warnings.warn(UnknownConfigFieldWarning(
            f"{file}: unknown field {field!r}, ignored (neither transformers' configuration class for "
            f"{raw.get('model_type')!r} nor refengine reads it){hint}"))  # once per file and field


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


def _read_tensors(root: Path, model_name) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors as read, by model name (``model_name(key)``; None skips the tensor), and each
    model name's tensor name in the file (for error messages)."""
    tensors: dict[str, torch.Tensor] = {}
    file_names: dict[str, str] = {}
    for file in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for key in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    name = model_name(key)
                    if name is None:
                        continue
                    if name in tensors:
                        raise CheckpointError(f"tensor {key} appears twice (again in {file.name})")
                    tensors[name], file_names[name] = reader.get_tensor(key), key
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return tensors, file_names


def _check_names_and_shapes(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], cfg,
    file_names: dict[str, str], weights, layer_types_note: str = "",
) -> None:
    """Refuse missing, unexpected, misshaped and non-float tensors, naming them as the file does;
    ``layer_types_note`` is added to missing / unexpected tensor errors."""
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some tied checkpoints still store the head; accept it only if it is the embedding.
        head = tensors.pop("lm_head.weight")
        embed = tensors.get(weights.embed_name)
        if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
            raise CheckpointError("unexpected tensor lm_head.weight: tie_word_embeddings is true")
    missing = weights.as_in_file(sorted(set(expected) - set(tensors)), file_names)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}" + _more(missing) + layer_types_note)
    unexpected = weights.as_in_file(sorted(set(tensors) - set(expected)), file_names)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]}" + _more(unexpected) + layer_types_note)
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        conv_2d = name.endswith("conv1d.weight") and len(shape) == 3 and got == (shape[0], shape[2])
        if got != shape and not conv_2d:
            raise CheckpointError(f"tensor {file_names[name]} has shape {list(got)}, expected {list(shape)}")
        if not tensors[name].is_floating_point():
            raise CheckpointError(
                f"tensor {file_names[name]} has dtype {tensors[name].dtype}, expected a float type"
            )


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more: {', '.join(names[1:6])})" if len(names) > 1 else ""
