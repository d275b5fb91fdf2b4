"""``refengine make-draft-model SRC DST --layers N``: a draft model cut from a checkpoint.

DST keeps SRC's embedding, final norm and lm_head, and the decoder layers named by ``--layers`` (the
first N, a comma list of indices such as ``0,3``, or ``all``), renumbered from 0; the MTP head is dropped. The
result is a checkpoint of SRC's family with SRC's vocabulary, so it drafts for SRC with
``drafter="draft_model"`` (``SpeculativeConfig(draft_model=DST)``) and its drafts are the continuation of a
shallower copy of the target: acceptance is meaningful without training. config.json's layer count and
per-layer lists (``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``, ``mlp_only_layers``)
follow the kept layers. Tokenizer and other files are copied as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from refengine.model.loader import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, CheckpointError
from refengine.tools.folders import write_once

LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)\.")
PER_LAYER_LISTS = ("layer_types", "layers_block_type")
MTP_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def parse_layers(text: str, num_layers: int) -> list[int]:
    """``"N"`` -> the first N layers; ``"i,j,..."`` -> those (ascending, distinct, each < num_layers);
    ``"all"`` -> every layer (the target itself as its drafter: every draft is accepted)."""
    if text == "all":
        return list(range(num_layers))
    try:
        if "," not in text:
            n = int(text)
            if not 1 <= n <= num_layers:
                raise ValueError
            return list(range(n))
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise CheckpointError(f"--layers {text!r}: give a count 1..{num_layers} or ascending layer indices "
                              f"below {num_layers}, such as 0,3") from None
    if layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= num_layers:
        raise CheckpointError(f"--layers {text!r}: indices must ascend, without repeats, in "
                              f"0..{num_layers - 1}")
    return layers


def _num_layers(config: dict) -> int:
    if "num_hidden_layers" in config:
        return int(config["num_hidden_layers"])
    for key in PER_LAYER_LISTS + ("hybrid_override_pattern",):
        if isinstance(config.get(key), list | str):
            return len(config[key])
    raise CheckpointError(f"config.json: no layer count (num_hidden_layers, {', '.join(PER_LAYER_LISTS)})")


def make_draft_model(src: str | Path, dst: str | Path, layers: str | int | list[int]) -> Path:
    """Write DST (a new folder): SRC cut to ``layers`` (see the module doc). Returns DST."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / CONFIG_NAME).read_text())
    total = _num_layers(config)
    keep = layers if isinstance(layers, list) else parse_layers(str(layers), total)
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists; give a new folder")
    new_index = {old: new for new, old in enumerate(keep)}
    tensors = {}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if name.startswith("mtp.") or ".mtp." in name:
                    continue
                m = LAYER_RE.search(name)
                if m is not None:
                    old = int(m.group(2))
                    if old not in new_index:
                        continue
                    name_out = name[: m.start(2)] + str(new_index[old]) + name[m.end(2):]
                else:
                    name_out = name
                tensors[name_out] = f.get_tensor(name).contiguous()
    if "num_hidden_layers" in config:
        config["num_hidden_layers"] = len(keep)
    for key in PER_LAYER_LISTS:
        if isinstance(config.get(key), list):
            config[key] = [config[key][i] for i in keep]
    if isinstance(config.get("hybrid_override_pattern"), str):
        config["hybrid_override_pattern"] = "".join(config["hybrid_override_pattern"][i] for i in keep)
    if isinstance(config.get("mlp_only_layers"), list):
        config["mlp_only_layers"] = [new_index[i] for i in config["mlp_only_layers"] if i in new_index]
    for key in MTP_COUNTS:
        if key in config:
            config[key] = 0
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (CONFIG_NAME, INDEX_NAME):
            shutil.copy2(path, dst / path.name)
    save_file(tensors, str(dst / SINGLE_NAME))
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return dst


CUT_PREFIX = "cut:"  # a draft model named by the layers it keeps of the target ("cut:0,3", "cut:2")


def cut_draft_model(src: str | Path, layers: str) -> str:
    """The folder of ``src`` cut to ``layers`` (``make_draft_model``), written once per source and
    layers under the temporary directory (a source's files' sizes and times name it) and reused."""
    src = Path(src).resolve()
    stamp = hashlib.blake2b(digest_size=8)
    for path in sorted(src.iterdir()):
        if path.is_file():
            st = path.stat()
            stamp.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    stamp.update(f"{src}|{layers}".encode())
    root = Path(tempfile.gettempdir()) / f"refengine-draft-{stamp.hexdigest()}-uid{os.getuid()}"
    write_once(root, lambda work: make_draft_model(src, work / "out", layers))
    return str(root)
