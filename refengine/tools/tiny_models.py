"""Tiny checkpoints of the other registered families, made on first use, so every command that takes a
model runs every family without a download: ``--model tiny:nemotron_h`` (``refengine generate / report /
bench``, every ``conformance`` command, and a mutant that declares that model), ``tiny:llama`` and
``tiny:qwen3``. The engine takes folders: ``LLM(tiny_model_path("tiny:nemotron_h"))`` (``resolve_tiny``
passes any other name through; the loader refuses a tiny name with that advice).

``tiny:<preset>`` exists for each preset of a registered family's ``tiny_checkpoints`` (model/family.py):
its weights, written by transformers' own ``save_pretrained`` (``tiny:nemotron_h``: a Nemotron-H of every
block kind, ``refengine/model/nemotron_h/tiny.py``), then given an MTP head by ``refengine add-mtp-head``
where the family has one, and the embedded default model's byte-level tokenizer (ids 0..255 are the UTF-8
bytes; its special tokens, past the tiny vocabulary, are left out), so text prompts work. It is written
once per version (of this file, the family's weights writer and head maker, and transformers) into the
temp folder and reused; a half-written folder is never picked up (written beside, then renamed). The
first use in a process says which folder it is (stderr, once).

``tiny:eagle3`` is not a family but a preset: the embedded default model with an EAGLE-3 head in its
folder's ``eagle3-head`` (``refengine.tools.eagle_training.make_tiny_eagle3``: aux ids (1, 2, 3), a draft
vocabulary of the 128 ids most frequent in the model's greedy text, trained on that text);
``tiny_head_path("tiny:eagle3")`` is the head (``--draft-model tiny:eagle3`` on the command lines):
``LLM(tiny_model_path("tiny:eagle3"), drafter="eagle3", draft_model=tiny_head_path("tiny:eagle3"),
num_speculative_tokens=3)``. It takes a minute or so to write on first use. ``draw_model`` draws among
the families only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refengine.model.family import ModelFamily

from refengine.tools.folders import write_once

TINY_PREFIX = "tiny:"


def makers() -> dict[str, tuple[ModelFamily, Callable[[Path], None]]]:
    """Preset name -> (its family, the writer of its weights), over every registered family's presets."""
    from refengine.model.registry import FAMILIES

    return {preset: (f, writer) for f in FAMILIES for preset, writer in f.tiny_checkpoints}


def head_presets() -> dict[str, Callable[[Path], None]]:
    """Preset name -> the writer of its checkpoint folder (into work/out): tiny models that are no family."""
    return {"eagle3": _make_eagle3}


def tiny_names() -> list[str]:
    return [TINY_PREFIX + name for name in (*makers(), *head_presets())]


def family_names() -> list[str]:
    return [TINY_PREFIX + name for name in makers()]


def draw_model(seed: int) -> str | None:
    """The model ``conformance fuzz --draw-family`` runs for ``seed``: None (the embedded default model)
    or one of the tiny models, each family equally likely, the same for the same seed."""
    import random

    return random.Random(f"family-{seed}").choice([None, *family_names()])


def tiny_model_path(name: str) -> str:
    """The folder of tiny model ``tiny:<preset>``, written on first use; ValueError for an unknown one."""
    preset = name[len(TINY_PREFIX):]
    if preset not in makers() and preset not in head_presets():
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(tiny_names())}")
    version = _preset_version() if preset in head_presets() else _version(preset)
    root = Path(tempfile.gettempdir()) / f"conformance-tiny-{preset}-{version}-uid{os.getuid()}"
    make = head_presets()[preset] if preset in head_presets() else partial(_make, preset)
    if not write_once(root, make):
        _announce(name, root, "reused")
        return str(root)
    _announce(name, root, "written now")
    return str(root)


def resolve_tiny(name: str | os.PathLike | None) -> str | os.PathLike | None:
    """``name`` as the engine takes it: a tiny model's name as its folder (written on first use), anything
    else (a folder, a hub id, None) unchanged for ``refengine.LLM`` to resolve."""
    if name is None or not str(name).startswith(TINY_PREFIX):
        return name
    return tiny_model_path(str(name))


def tiny_head_path(name: str) -> str:
    """The EAGLE head folder inside tiny model ``name`` (``tiny:eagle3``'s ``eagle3-head``)."""
    from refengine.tools.eagle_training import TINY_HEAD

    head = Path(tiny_model_path(name)) / TINY_HEAD
    if not head.is_dir():
        raise ValueError(f"draft_model={name!r}: that tiny model has no EAGLE head ({TINY_HEAD}/)")
    return str(head)


def resolve_draft(drafter: str | None, draft_model: str | os.PathLike | None) -> str | os.PathLike | None:
    """``draft_model`` as the engine takes it for ``drafter``: a tiny model's name as its EAGLE head's folder
    (drafter eagle or eagle3) or as its checkpoint folder (draft_model); anything else unchanged."""
    if draft_model is None or not str(draft_model).startswith(TINY_PREFIX):
        return draft_model
    name = str(draft_model)
    return tiny_head_path(name) if drafter in ("eagle", "eagle3") else tiny_model_path(name)


def resolve_model(name: str | os.PathLike) -> str:
    """A checkpoint folder for the tools that read one: a tiny model's folder, else what the loader's
    ``resolve_model_path`` makes of ``name`` (a folder, or a hub id in the local cache)."""
    from refengine.model.loader import resolve_model_path

    return resolve_model_path(resolve_tiny(name))


_ANNOUNCED: set[str] = set()


def _announce(name: str, root: Path, how: str) -> None:
    """Say once per process where a tiny model's folder is (a replay or a bug report can name it)."""
    if name not in _ANNOUNCED:
        _ANNOUNCED.add(name)
        print(f"{name}: checkpoint folder {root} ({how})", file=sys.stderr, flush=True)


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """The embedded default model's byte-level tokenizer, without the special tokens past ``vocab_size``."""
    from importlib.resources import files

    src = files("refengine") / "data" / "default_model"
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok.get("added_tokens", []) if t["id"] < vocab_size]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["eos_token"] = None  # the model's own EOS id is config.json's; no special token names it here
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _version(preset: str) -> str:
    """What the written checkpoint depends on: this file, the preset's weights writer, its family's MTP
    head maker, the MTP head tool, the tokenizer and transformers' version."""
    import inspect

    import transformers

    from refengine.tools import mtp_head

    entry, writer = makers()[preset]
    digest = hashlib.sha256(transformers.__version__.encode())
    tokenizer = Path(__file__).parents[1] / "data" / "default_model" / "tokenizer.json"
    writers = [inspect.getsourcefile(f) for f in (writer, entry.mtp_head) if f is not None]
    for source in (__file__, *writers, mtp_head.__file__, tokenizer):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


def _make(preset: str, work: Path) -> None:
    """The preset's weights (transformers' save_pretrained) under work/src; the checkpoint, with an MTP
    head where its family has one and the byte-level tokenizer, in work/out."""
    from refengine.model.loader import read_config
    from refengine.tools.mtp_head import add_mtp_head

    entry, writer = makers()[preset]
    writer(work / "src")
    if entry.mtp_head is not None:
        add_mtp_head(work / "src", work / "out")
    else:
        shutil.copytree(work / "src", work / "out")
    _write_tokenizer(work / "out", read_config(work / "out").vocab_size)


def _preset_version() -> str:
    """What a preset depends on: this file, the EAGLE head maker and trainer, the embedded default model."""
    from refengine.tools import eagle_head, eagle_training

    digest = hashlib.sha256()
    data = Path(__file__).parents[1] / "data" / "default_model"
    for source in (__file__, eagle_head.__file__, eagle_training.__file__, data / "config.json",
                   data / "tokenizer.json"):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


def _make_eagle3(work: Path) -> None:
    """``tiny:eagle3``: the embedded default model with a trained EAGLE-3 head in ``eagle3-head``."""
    from refengine.tools.eagle_training import make_tiny_eagle3

    make_tiny_eagle3(work / "out")
