"""The Qwen3-Next / Qwen3.5 MTP head ``refengine add-mtp-head`` writes (see ``refengine.tools.mtp_head``).

Initialised from the model's own layers, not trained:

- ``mtp.layers.0``: the attention and both layer norms of the model's last full-attention layer, and
  the MLP of layer 0 (an MTP layer is dense or sparse by the model's rule on its own index, 0, as
  layer 0 is);
- ``mtp.fc`` = ``[0 | I]`` over ``[norm(embedding) | norm(hidden)]``: the layer starts from the
  normalised hidden state;
- ``mtp.pre_fc_norm_hidden`` and ``mtp.norm``: the model's final norm; ``mtp.pre_fc_norm_embedding``:
  zeros (unit scale: the norms are zero-centred).

The layer count goes where vLLM reads it: ``num_nextn_predict_layers`` for Qwen3-Next,
``mtp_num_hidden_layers`` for Qwen3.5.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from refengine.model.family import NewMTPHead
from refengine.model.qwen3_next.config import Qwen3NextConfig
from refengine.model.qwen3_next.weights import WRAPPER_PREFIX
from refengine.model.weights_check import CheckpointError


def qwen_mtp_head(read: Callable[[str], torch.Tensor], files: dict[str, str], cfg: Qwen3NextConfig,
                  ) -> NewMTPHead:
    """``read(name) -> tensor`` reads a SRC tensor; ``files`` names them all. The ``mtp.*`` tensors (see
    the module docstring) and, per tensor, where it came from."""
    if not cfg.full_layer_ids:
        raise CheckpointError("the model has no full-attention layer to initialise the MTP layer from")
    prefix = WRAPPER_PREFIX if any(n.startswith(WRAPPER_PREFIX) for n in files) else "model."
    attention = f"{prefix}layers.{cfg.full_layer_ids[-1]}."
    parts = (
        f"{attention}self_attn.",
        f"{attention}input_layernorm.",
        f"{attention}post_attention_layernorm.",
    )
    copied = {f"mtp.layers.0.{n[len(attention):]}": n for n in files if n.startswith(parts)}
    mlp = f"{prefix}layers.0.mlp."
    copied.update({f"mtp.layers.0.mlp.{n[len(mlp):]}": n for n in files if n.startswith(mlp)})
    final_norm = f"{prefix}norm.weight"
    copied.update({"mtp.norm.weight": final_norm, "mtp.pre_fc_norm_hidden.weight": final_norm})
    head = {name: read(source).clone() for name, source in copied.items()}
    norm = head["mtp.norm.weight"]
    h = cfg.hidden_size
    head["mtp.pre_fc_norm_embedding.weight"] = torch.zeros_like(norm)
    head["mtp.fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1).to(norm.dtype)
    origin = {**copied, "mtp.pre_fc_norm_embedding.weight": "zeros (unit scale)",
              "mtp.fc.weight": "[0 | I]: the normalised hidden state"}
    count = "num_nextn_predict_layers" if cfg.model_type == "qwen3_next" else "mtp_num_hidden_layers"
    return NewMTPHead(head, origin, count)
