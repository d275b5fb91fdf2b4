"""How Nemotron-H checkpoints name and lay out their tensors, and how the model holds them.

On disk (the released layout, which transformers' ``save_pretrained`` writes too): ``backbone.*``,
routed experts per expert (``mixer.experts.{e}.up_proj.weight [Ie, Lt]``, ``down_proj.weight [Lt, Ie]``),
the conv weight as [C, 1, W]. Also accepted: ``model.*`` names and experts stacked as transformers
holds them (``mixer.experts.up_proj [E, Ie, Lt]``, ``mixer.experts.down_proj [E, Lt, Ie]``). ``mtp.*``
tensors (the draft head, as vLLM loads it) keep their names; any of them makes the loader build the head,
one MTP step as vLLM builds it (config.json's ``num_nextn_predict_layers`` must then be 1, or 0 where it
was never recorded). An ``mtp.*`` tensor no parameter of the head loads is skipped, as vLLM's MTP
loader skips it (a layer past the step's blocks, the fusion on a later block, an expert id past
``n_routed_experts``, a ``rotary_emb.inv_freq``); a missing or misshapen one is refused.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from refengine.model.nemotron_h.config import NemotronHConfig
from refengine.model.nemotron_h.model import NemotronHMTPHead
from refengine.model.weights_check import CheckpointError

DISK_PREFIX = "backbone."
MODEL_PREFIX = "model."
MTP_PREFIX = "mtp."
EXPERT_RE = re.compile(r"^(.*\.mixer\.experts\.)(\d+)\.(up_proj|down_proj)\.weight$")
STACKED_EXPERTS = ("up_proj", "down_proj")
CONV_RE = re.compile(r"\.mixer\.conv1d\.weight$")
FP32_SUFFIXES = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")  # the router stays float32
MTP_STEPS = (0, 1)  # the num_nextn_predict_layers a checkpoint with an MTP head may record (0: not recorded)


class NemotronHWeights:
    """The weight-name mapping of the Nemotron-H family (see ``refengine.model.registry``)."""

    embed_name = "model.embeddings.weight"

    @staticmethod
    def model_name(key: str) -> str | None:
        return MODEL_PREFIX + key[len(DISK_PREFIX):] if key.startswith(DISK_PREFIX) else key

    @staticmethod
    def as_in_file(names: list[str], file_names: dict[str, str]) -> list[str]:
        """Model names as the file names them: its own key where it holds the tensor, else in the
        file's convention (``backbone.`` when any of its tensors is named so)."""
        released = any(key.startswith(DISK_PREFIX) for key in file_names.values())

        def as_in_file(name: str) -> str:
            if name in file_names:
                return file_names[name]
            if released and name.startswith(MODEL_PREFIX):
                return DISK_PREFIX + name[len(MODEL_PREFIX):]
            return name

        return [as_in_file(name) for name in names]

    @staticmethod
    def prepare(cfg: NemotronHConfig, tensors: dict[str, torch.Tensor]) -> None:
        """The head exists when the checkpoint holds ``mtp.*`` tensors: one MTP step, the one vLLM builds
        (it refuses a ``num_nextn_predict_layers`` other than 1). Drops the ``mtp.*`` tensors no parameter
        of the head loads, as vLLM's loader skips them."""
        head = {name for name in tensors if name.startswith(MTP_PREFIX)}
        cfg.num_mtp_layers = 1 if head else 0
        if not head:
            return
        if cfg.num_nextn_predict_layers not in MTP_STEPS:
            raise CheckpointError(
                f"num_nextn_predict_layers: {cfg.num_nextn_predict_layers!r} MTP layers in config.json, but "
                "a Nemotron-H MTP head (the checkpoint's mtp.* tensors) is one step: vLLM builds it only for "
                "1 and refuses any other count"
            )
        for name in head - set(mtp_head_shapes(cfg, head)):
            del tensors[name]

    @staticmethod
    def expected_shapes(model, cfg: NemotronHConfig, names: set[str]) -> dict[str, tuple[int, ...]]:
        """Names and shapes the checkpoint must hold: routed experts per expert unless the checkpoint
        holds that layer's stacked ``experts.up_proj``; the conv weight as [C, 1, W]."""
        shapes = _as_on_disk({name: tuple(t.shape) for name, t in model.state_dict().items()}, names)
        if cfg.tie_word_embeddings:
            del shapes["lm_head.weight"]
        return shapes

    @staticmethod
    def mismatch_note(raw: dict, tensors: dict[str, torch.Tensor], cfg: NemotronHConfig) -> str:
        return f"; the config's layer pattern is {cfg.pattern!r}"

    @staticmethod
    def to_model_layout(
        tensors: dict[str, torch.Tensor], cfg: NemotronHConfig
    ) -> dict[str, torch.Tensor]:
        """Disk layout -> model layout: conv weight [C, W], per-expert tensors stacked."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}  # "...experts." -> (e, part) -> weight
        for name, tensor in tensors.items():
            m = EXPERT_RE.match(name)
            if m is not None:
                prefix, e, part = m.groups()
                experts.setdefault(prefix, {})[(int(e), part)] = tensor
            elif CONV_RE.search(name):
                out[name] = tensor.reshape(tensor.shape[0], tensor.shape[-1])
            else:
                out[name] = tensor
        for prefix, parts in experts.items():
            count = 1 + max(e for e, _ in parts)
            for part in STACKED_EXPERTS:
                out[prefix + part] = torch.stack([parts[(e, part)] for e in range(count)])
        return out

    @staticmethod
    def keep_fp32(name: str) -> bool:
        return name.endswith(FP32_SUFFIXES)


def mtp_head_shapes(cfg: NemotronHConfig, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Every ``mtp.*`` tensor the head of ``cfg`` loads, with its shape as a checkpoint holds it (routed
    experts per expert unless ``names`` holds that layer's stacked ``experts.up_proj``)."""
    with torch.device("meta"):
        head = NemotronHMTPHead(dataclasses.replace(cfg, num_mtp_layers=1),
                                nn.Embedding(cfg.vocab_size, cfg.hidden_size))
    return _as_on_disk({MTP_PREFIX + name: tuple(t.shape) for name, t in head.state_dict().items()}, names)


def _as_on_disk(shapes: dict[str, tuple[int, ...]], names: set[str]) -> dict[str, tuple[int, ...]]:
    """Model tensor shapes -> as a checkpoint holds them: routed experts per expert unless ``names`` holds
    that layer's stacked ``experts.up_proj``; the conv weight as [C, 1, W]."""
    shapes = dict(shapes)
    for name in [n for n in shapes if n.endswith(".mixer.experts.up_proj")]:
        prefix = name[: -len("up_proj")]
        if name in names:
            continue
        num_experts, inner, width = shapes.pop(name)
        del shapes[prefix + "down_proj"]
        for e in range(num_experts):
            shapes[f"{prefix}{e}.up_proj.weight"] = (inner, width)
            shapes[f"{prefix}{e}.down_proj.weight"] = (width, inner)
    for name in [n for n in shapes if CONV_RE.search(n)]:
        channels, width = shapes[name]
        shapes[name] = (channels, 1, width)
    return shapes
