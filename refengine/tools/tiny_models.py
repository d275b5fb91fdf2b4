"""Tiny checkpoints of the other registered families, made on first use, so every command that takes a
model runs every family without a download: ``--model tiny:nemotron_h`` (``refengine generate / report /
bench``, every ``conformance`` command, ``LLM("tiny:nemotron_h")``, and a mutant that declares that model).

``tiny:nemotron_h`` is a Nemotron-H of every block kind (Mamba2, attention, MLP, MoE; pattern
``M*ME``) written by transformers' own ``save_pretrained`` from seeded, stressed random weights (so
greedy margins are not flat), then given an MTP head by ``refengine add-mtp-head`` and the embedded default
model's byte-level tokenizer (ids 0..255 are the UTF-8 bytes; its special tokens, past the tiny
vocabulary, are left out), so text prompts work. It is written once per version (of this file, the head
maker and transformers) into the temp folder and reused; a half-written folder is never picked up
(written beside, then renamed). The first use in a process says which folder it is (stderr, once).

``tiny:eagle3`` is not a family but a preset: the embedded default model with an EAGLE-3 head in its folder's
``eagle3-head`` (``refengine.tools.eagle_training.make_tiny_eagle3``: aux ids (1, 2, 3), a draft vocabulary of
the 128 ids most frequent in the model's greedy text, trained on that text); ``draft_model="tiny:eagle3"``
names the head: ``LLM("tiny:eagle3", drafter="eagle3", draft_model="tiny:eagle3", num_speculative_tokens=3)``.
It takes a minute or two to write on first use. ``draw_model`` draws among the families only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

TINY_PREFIX = "tiny:"
NEMOTRON_H_CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 96, "mamba_num_heads": 8, "mamba_head_dim": 8,
    "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 1024, "eos_token_id": 2, "tie_word_embeddings": False,
    "layers_block_type": ["mamba", "attention", "mamba", "moe"],
}
SEED = 0
STRESS = 4.0  # matrix scale: wider logit margins than transformers' default init


def tiny_names() -> list[str]:
    return [TINY_PREFIX + name for name in MAKERS]


def family_names() -> list[str]:
    """The tiny models of the other families (what ``draw_model`` draws from; presets such as ``tiny:eagle3``
    are not families)."""
    return [TINY_PREFIX + name for name in FAMILY_MAKERS]


def draw_model(seed: int) -> str | None:
    """The model ``conformance fuzz --draw-family`` runs for ``seed``: None (the embedded default model)
    or one of the tiny models, each family equally likely, the same for the same seed."""
    import random

    return random.Random(f"family-{seed}").choice([None, *family_names()])


def tiny_model_path(name: str) -> str:
    """The folder of tiny model ``tiny:<family>``, written on first use; ValueError for an unknown one."""
    family = name[len(TINY_PREFIX):]
    if family not in MAKERS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(tiny_names())}")
    root = Path(tempfile.gettempdir()) / f"conformance-tiny-{family}-{_version()}-uid{os.getuid()}"
    if (root / "config.json").is_file():
        _announce(name, root, "reused")
        return str(root)
    work = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=root.parent))
    try:
        MAKERS[family](work)
        try:
            os.rename(work / "out", root)
        except OSError:  # another process finished first: use its copy
            if not (root / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _announce(name, root, "written now")
    return str(root)


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


def _version() -> str:
    """What the written checkpoint depends on: this file, the MTP head maker, transformers' version."""
    import transformers

    import refengine.tools.nemotron_mtp_head as head
    from refengine.tools import eagle_head, eagle_training

    digest = hashlib.sha256(transformers.__version__.encode())
    data = Path(__file__).parents[1] / "data" / "default_model"
    for source in (__file__, head.__file__, eagle_head.__file__, eagle_training.__file__,
                   data / "tokenizer.json", data / "config.json"):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


def _make_nemotron_h(work: Path) -> None:
    """SRC (transformers' save_pretrained) under work/src, the checkpoint with its MTP head in work/out."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from refengine.tools.mtp_head import add_mtp_head

    config = transformers.NemotronHConfig(**NEMOTRON_H_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = transformers.NemotronHForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(1000 + SEED)

    def uniform(shape, low, high):
        return torch.empty(shape).uniform_(low, high, generator=gen)

    ranges = {"A_log": None, "dt_bias": (-8.0, 1.0), ".D": (-1.0, 1.0), "conv1d.bias": (-0.5, 0.5)}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.mul_(STRESS)
            elif name.endswith("A_log"):
                p.copy_(uniform(p.shape, 0.5, 4.0).log())
            else:
                bounds = next((r for key, r in ranges.items() if r and name.endswith(key)), (0.5, 1.5))
                p.copy_(uniform(p.shape, *bounds))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(uniform(b.shape, -0.05, 0.05))
    model.save_pretrained(work / "src")
    add_mtp_head(work / "src", work / "out")
    _write_tokenizer(work / "out", NEMOTRON_H_CONFIG["vocab_size"])


def _make_eagle3(work: Path) -> None:
    """The embedded default model with a trained EAGLE-3 head in ``eagle3-head`` (work/out)."""
    from refengine.tools.eagle_training import make_tiny_eagle3

    make_tiny_eagle3(work / "out")


FAMILY_MAKERS = {"nemotron_h": _make_nemotron_h}
# ``tiny:eagle3``: the embedded default model (Qwen3-Next hybrid, 4 layers) with a trained EAGLE-3 head
# (``draft_model="tiny:eagle3"`` names the head)
MAKERS = {**FAMILY_MAKERS, "eagle3": _make_eagle3}
