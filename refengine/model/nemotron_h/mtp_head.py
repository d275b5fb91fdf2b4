"""The Nemotron-H MTP head ``refengine add-mtp-head`` writes (see ``refengine.tools.mtp_head``).

Named as vLLM loads it: ``mtp.layers.{i}`` one block per entry of the config's MTP block kinds
(attention then MoE by default), ``enorm`` / ``hnorm`` / ``eh_proj`` on the first, ``final_layernorm`` on
the last. Initialised from the model's own layers, not trained:

- each MTP block takes the norm and mixer of the model's last block of its kind; a kind the model
  lacks (the MoE of a model without 'E' blocks) gets seeded random weights (matrices N(0, 1/fan_in),
  router bias zeros, norm weights ones);
- ``eh_proj`` = ``[0 | I]`` over ``[enorm(embedding) | hnorm(hidden)]``: the step starts from the
  normalised hidden state; ``enorm`` ones; ``hnorm`` and ``final_layernorm``: the model's ``norm_f``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from refengine.model.family import NewMTPHead
from refengine.model.nemotron_h.config import NemotronHConfig
from refengine.model.nemotron_h.weights import NemotronHWeights, mtp_head_shapes
from refengine.model.weights_check import CheckpointError

SEED = 0  # of the weights made for a block kind the model lacks


def nemotron_mtp_head(read: Callable[[str], torch.Tensor], files: dict[str, str], cfg: NemotronHConfig,
                      ) -> NewMTPHead:
    """``read(name) -> tensor`` reads a SRC tensor. The ``mtp.*`` tensors (disk layout: experts per
    expert, as the model's own layers are saved), per tensor where it came from, and the layer count's
    field (``num_nextn_predict_layers``, as vLLM reads it)."""
    prefix = "backbone." if any(n.startswith("backbone.") for n in files) else "model."
    shapes = mtp_head_shapes(cfg, set())  # experts per expert, as the model's own layers are saved
    final_norm = f"{prefix}norm_f.weight"
    dtype = read(final_norm).dtype
    head: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for i, kind in enumerate(cfg.mtp_block_kinds):
        here = f"mtp.layers.{i}."
        sources = [j for j, k in enumerate(cfg.block_kinds) if k == kind]
        if sources:
            there = f"{prefix}layers.{sources[-1]}."
            for name in [n for n in shapes if n.startswith((here + "norm.", here + "mixer."))]:
                src = there + name[len(here):]
                if src not in files:
                    raise CheckpointError(f"missing tensor {src} (the MTP head is initialised from it)")
                head[name], origin[name] = read(src).clone(), src
    gen = torch.Generator().manual_seed(SEED)
    h = cfg.hidden_size
    made = {
        "mtp.layers.0.eh_proj.weight": (torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1),
                                        "[0 | I]: the normalised hidden state"),
        "mtp.layers.0.enorm.weight": (torch.ones(h), "ones (unit scale)"),
        "mtp.layers.0.hnorm.weight": (read(final_norm), final_norm),
        f"mtp.layers.{len(cfg.mtp_block_kinds) - 1}.final_layernorm.weight": (read(final_norm), final_norm),
    }
    for name, (tensor, where) in made.items():
        head[name], origin[name] = tensor.clone(), where
    for name, shape in shapes.items():
        if name in head:
            continue
        if len(shape) == 1:
            fill = torch.zeros(shape) if name.endswith("e_score_correction_bias") else torch.ones(shape)
            head[name], origin[name] = fill, "ones (norm) / zeros (router bias)"
        else:
            head[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            origin[name] = f"seeded random (seed {SEED}): the model has no such block"
    for name, tensor in head.items():
        keep = NemotronHWeights.keep_fp32(name)
        head[name] = tensor.to(torch.float32 if keep else dtype).contiguous()
    return NewMTPHead(head, origin, "num_nextn_predict_layers")

