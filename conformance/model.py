"""What the suite needs to know about a checkpoint before running anything on it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFacts:
    path: str  # resolved checkpoint folder
    label: str  # how reports name it: the path, or "embedded default model"
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_mtp: bool
    has_tokenizer: bool
    family: str = ""  # the model family (refengine.model.registry), named in reports
    num_layers: int = 0  # decoder layers (what a "cut:<layers>" draft model can keep; 0: not known)


def resolve_model(model: str | None) -> tuple[str, str]:
    """(folder, label); ``None`` is the embedded default model (FileNotFoundError until it exists)."""
    if model is None:
        from refengine.llm import default_model_path

        return default_model_path(), "embedded default model"
    from conformance.tiny_models import TINY_PREFIX, tiny_model_path

    if model.startswith(TINY_PREFIX):
        try:
            return tiny_model_path(model), model
        except ValueError as exc:
            raise FileNotFoundError(str(exc)) from exc
    from refengine.model.loader import CheckpointError, resolve_model_path

    try:
        path = Path(resolve_model_path(model))  # a folder, or a hub id in the local cache
    except CheckpointError as exc:
        raise FileNotFoundError(str(exc)) from exc
    if not path.exists():
        raise FileNotFoundError(f"checkpoint folder {model} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {model!r} (expected a folder with config.json)")
    return str(path.resolve()), str(path.resolve())


class UnusableSetup(ValueError):
    """The checkpoint or the device cannot run at all: reported once, before any scenario runs."""


def preflight(model: str | None, device: str = "cpu", dtype: str = "float32") -> ModelFacts:
    """Describe the checkpoint and prove it loads on ``device`` in ``dtype`` (weights, config,
    tokenizer), so a broken checkpoint or an unusable device is one clear error instead of a failure
    per scenario."""
    from refengine.config import DTYPES, check_device

    check_device("device", device)
    facts = describe_model(model)
    try:
        from refengine.model.loader import load_model
        from refengine.tokenizer import load_tokenizer

        load_model(facts.path, dtype=DTYPES[run_dtype(dtype, facts)], device=device)
        load_tokenizer(facts.path)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise UnusableSetup(f"checkpoint {_where(model)} cannot be used: {type(e).__name__}: {e}") from e
    return facts


def run_dtype(requested: str, facts: ModelFacts) -> str:
    """The dtype both engines run in: ``requested``, or for "auto" the checkpoint's own dtype
    (UnusableSetup when that is not one the engines run in, e.g. float64)."""
    from refengine.config import DTYPE_CHOICES
    from refengine.model.loader import resolve_dtype

    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    try:
        return resolve_dtype(requested, facts.path)
    except ValueError as e:  # CheckpointError: the checkpoint's dtype is not one the engines run in
        raise UnusableSetup(f"checkpoint {facts.label}: {e}") from e


def _where(model: str | None) -> str:
    return "the embedded default model" if model is None else repr(model)


def describe_model(model: str | None) -> ModelFacts:
    """The checkpoint's facts from its config and weight index, without loading any weight
    (FileNotFoundError: no checkpoint there; UnusableSetup: one that cannot be read)."""
    from refengine.model.loader import read_config
    from refengine.model.registry import family_for
    from refengine.tokenizer import TOKENIZER_FILES

    folder, label = resolve_model(model)
    root = Path(folder)
    try:
        cfg = read_config(root)
        names = _tensor_names(root)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise UnusableSetup(f"checkpoint {_where(model)} cannot be used: {type(e).__name__}: {e}") from e
    family = family_for(cfg.model_type).name
    return ModelFacts(
        folder,
        f"{label} ({family})",
        cfg.vocab_size,
        tuple(cfg.eos_token_ids),
        any(n.startswith("mtp.") for n in names),
        any((root / f).is_file() for f in TOKENIZER_FILES),
        family,
        int(getattr(cfg, "num_hidden_layers", 0) or 0),
    )


def cut_refused(draft_model: str | None, facts: ModelFacts) -> str | None:
    """Why a ``cut:<layers>`` draft model cannot be cut from this checkpoint (it keeps a layer the model
    does not have, e.g. "cut:0,3" of a model of 3 layers), or None (another draft model, or the layer
    count is not known)."""
    from refengine.model.loader import CheckpointError
    from refengine.tools.draft_model import CUT_PREFIX, parse_layers

    if not (draft_model or "").startswith(CUT_PREFIX) or not facts.num_layers:
        return None
    try:
        parse_layers(draft_model[len(CUT_PREFIX):], facts.num_layers)
    except CheckpointError:
        n = facts.num_layers
        return (f"its draft model {draft_model} keeps layers a model of {n} layer{'s' if n != 1 else ''} "
                "does not have")
    return None


def _tensor_names(root: Path) -> set[str]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(root / "model.safetensors"), framework="pt") as f:
        return set(f.keys())
