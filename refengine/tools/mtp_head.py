"""``refengine add-mtp-head SRC DST``: a copy of a checkpoint, with an MTP head it was saved without.

refengine finds the MTP head from the checkpoint's ``mtp.*`` tensors (for Qwen the loader counts
``mtp.layers.{i}`` and config fields play no part; a Nemotron-H head is one step, and config.json's
``num_nextn_predict_layers`` must then be 1, or 0 where it was never recorded). transformers has no MTP
module, so a checkpoint it saves (``save_pretrained``) holds none: ``drafter="mtp"`` refuses it and the
conformance suite skips its MTP scenarios. This command writes DST: every file of SRC, the head's tensors in
``mtp.safetensors``, a ``model.safetensors.index.json`` mapping every tensor (SRC's weights are not
rewritten), and the MTP layer count in config.json where vLLM reads it (``num_nextn_predict_layers`` for
Qwen3-Next and Nemotron-H, ``mtp_num_hidden_layers`` for Qwen3.5). The head is the checkpoint's family's
(``ModelFamily.mtp_head``: ``refengine/model/qwen3_next/mtp_head.py``,
``refengine/model/nemotron_h/mtp_head.py``), initialised from the model's own layers, not trained.

Its drafts are valid ids from the model's own head, so every MTP code path runs and the
conformance checks apply in full; few drafts are accepted until the head is trained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from refengine.model.loader import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, CheckpointError, read_config
from refengine.model.registry import family_for

HEAD_FILE = "mtp.safetensors"
MTP_PREFIX = "mtp."


def add_mtp_head(src: str | Path, dst: str | Path) -> dict[str, str]:
    """Write DST (a new folder): SRC plus an MTP head initialised from SRC's layers. Returns each
    head tensor's name -> where it came from (a SRC tensor, or how it was made)."""
    src, dst = Path(src), Path(dst)
    cfg = read_config(src)  # CheckpointError when SRC is not a checkpoint folder
    family = family_for(cfg.model_type)
    if family.mtp_head is None:
        raise CheckpointError(f"add-mtp-head: the {family.name} family has no MTP head; {src} is a "
                              f"{cfg.model_type} checkpoint")
    files = weight_map(src)
    if any(name.startswith(MTP_PREFIX) for name in files):
        raise CheckpointError(f"{src} already has an MTP head (mtp.* tensors); nothing to add")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; add-mtp-head writes a new folder")
    head = family.mtp_head(lambda name: _read(src, files, name), files, cfg)
    shutil.copytree(src, dst)
    save_file(head.tensors, str(dst / HEAD_FILE), metadata={"format": "pt"})
    _write_index(dst, {**files, **dict.fromkeys(head.tensors, HEAD_FILE)})
    _record_mtp_layers(dst / CONFIG_NAME, head.count_field, num_layers=1)
    return head.origin


def weight_map(root: Path) -> dict[str, str]:
    """Tensor name -> weight file name (relative to ``root``), from the index or the single file."""
    index = root / INDEX_NAME
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    if not (root / SINGLE_NAME).is_file():
        raise CheckpointError(f"no {SINGLE_NAME} or {INDEX_NAME} in {root}")
    with safe_open(str(root / SINGLE_NAME), framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_NAME)


def _read(root: Path, files: dict[str, str], name: str) -> torch.Tensor:
    if name not in files:
        raise CheckpointError(f"missing tensor {name} (the MTP head is initialised from it)")
    with safe_open(str(root / files[name]), framework="pt") as f:
        return f.get_tensor(name)


def _write_index(root: Path, files: dict[str, str]) -> None:
    total = sum(_tensor_bytes(root / file) for file in set(files.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(files.items()))}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _tensor_bytes(file: Path) -> int:
    """Bytes of tensor data in a safetensors file, from its header (8-byte length, then JSON)."""
    with file.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(
        end - begin
        for key, v in header.items()
        if key != "__metadata__"
        for begin, end in [v["data_offsets"]]
    )


def _record_mtp_layers(path: Path, field: str, num_layers: int) -> None:
    """The MTP layer count in config.json's ``field`` (inside ``text_config`` for a multimodal wrapper)."""
    config = json.loads(path.read_text())
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    text[field] = num_layers
    path.write_text(json.dumps(config, indent=2) + "\n")
