"""``refengine add-eagle-head SRC DST [--method eagle|eagle3]``: an EAGLE head for any checkpoint, in vLLM
0.33's layout (``config.json`` + ``model.safetensors``), to serve with ``drafter="eagle" | "eagle3"`` and
``draft_model=DST``.

The head is one Llama decoder layer as wide as the target (heads of 16..32 dims), initialised from the
target so its drafts are the target's own guesses, then perturbed by seeded noise so every weight matters:

- EAGLE-1: ``fc`` = [0 | I] (the layer starts from the target's final hidden state); drafts through the
  target's lm_head;
- EAGLE-3: ``fc`` averages the auxiliary states, ``norm`` is the target's final norm, ``lm_head`` the
  target's rows of the draft vocabulary (``--draft-vocab-size``: the first ids of the vocabulary in a seeded
  order, ``d2t`` their offsets; the whole vocabulary, and no ``d2t``, by default). The aux ids are named in
  ``eagle_aux_hidden_state_layer_ids`` (``--aux-ids``; by default (1, L//2, L-1) of the target's L layers),
  since vLLM's default (2, L//2, L-3) collapses on targets of fewer than 7 layers.

Untrained, few drafts are accepted; ``refengine.tools.eagle_training`` trains one on the target's own
greedy text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from refengine.model.eagle import EAGLE1, EAGLE3, METHODS
from refengine.model.loader import load_model, resolve_model_path

NOISE = 0.05  # std of the seeded perturbation, relative to 1/sqrt(fan-in)


def _final_norm(net) -> torch.Tensor:
    """[H] the target's final norm as a plain weight (a zero-centred one is 1 + w)."""
    inner = net.model
    norm = getattr(inner, "norm", None) or inner.norm_f
    w = norm.weight.detach().float()
    return w + 1 if getattr(norm, "zero_centered", False) else w


def default_head_aux_ids(num_layers: int) -> list[int]:
    return sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1})


def eagle_head_tensors(net, method: str, aux_ids: list[int], draft_vocab: int, seed: int,
                       draft_ids: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The head's tensors (vLLM's names) and its config.json, from target ``net``; ``draft_ids`` [Vd]: the
    target ids of the draft vocabulary (default: a seeded choice)."""
    gen = torch.Generator().manual_seed(seed)
    lm_head = net.lm_head.weight.detach().float()  # [V, H]
    vocab, h = lm_head.shape
    head_dim = 32 if h % 32 == 0 and h >= 128 else 16
    heads = max(h // head_dim, 1)
    kv_heads = max(heads // 2, 1)
    inter = 2 * h
    in_width = 2 * h if method == EAGLE3 else h

    def noise(out: int, fan_in: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) * (scale / fan_in**0.5)

    prefix = "midlayer." if method == EAGLE3 else "layers.0."
    t = {
        f"{prefix}self_attn.q_proj.weight": noise(heads * head_dim, in_width),
        f"{prefix}self_attn.k_proj.weight": noise(kv_heads * head_dim, in_width),
        f"{prefix}self_attn.v_proj.weight": noise(kv_heads * head_dim, in_width),
        f"{prefix}self_attn.o_proj.weight": noise(h, heads * head_dim, NOISE),
        f"{prefix}mlp.gate_proj.weight": noise(inter, h),
        f"{prefix}mlp.up_proj.weight": noise(inter, h),
        f"{prefix}mlp.down_proj.weight": noise(h, inter, NOISE),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if method == EAGLE3 else "EagleLlamaForCausalLM"],
        "model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab, "hidden_act": "silu",
        "max_position_embeddings": net.config.max_position_embeddings, "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    if method == EAGLE1:
        t["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1) + noise(h, 2 * h, NOISE)
        return t, config
    n = len(aux_ids)
    t[f"{prefix}input_layernorm.weight"] = torch.ones(h)
    t[f"{prefix}hidden_norm.weight"] = torch.ones(h)
    t["fc.weight"] = torch.cat([torch.eye(h) / n] * n, dim=1) + noise(h, n * h, NOISE)
    t["norm.weight"] = _final_norm(net)
    if draft_vocab < vocab:
        order = torch.randperm(vocab, generator=gen)[:draft_vocab] if draft_ids is None else draft_ids
        order = order.sort().values  # draft id -> target id
        t["lm_head.weight"] = lm_head[order].clone()
        t["d2t"] = order - torch.arange(draft_vocab)
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, order, True)
    else:
        t["lm_head.weight"] = lm_head.clone()
    config.update({"draft_vocab_size": draft_vocab, "target_hidden_size": h,
                   "eagle_aux_hidden_state_layer_ids": list(aux_ids), "norm_before_residual": False})
    return t, config


def write_eagle_head(dst: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def add_eagle_head(src: str | Path, dst: str | Path, method: str = EAGLE3, *,
                   aux_ids: list[int] | None = None, draft_vocab_size: int | None = None,
                   seed: int = 0) -> dict:
    """Write the head folder DST for checkpoint SRC; returns its config.json."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; add-eagle-head writes a new folder")
    net, _ = load_model(resolve_model_path(src), dtype=torch.float32, device="cpu")
    num_layers = len(net.model.layers)
    ids = sorted(set(aux_ids)) if aux_ids else default_head_aux_ids(num_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--aux-ids {bad}: a target of {num_layers} layers has ids 0..{num_layers - 1}")
    vocab = net.lm_head.weight.shape[0]
    draft_vocab = vocab if draft_vocab_size is None else draft_vocab_size
    if not 1 <= draft_vocab <= vocab:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab}, got {draft_vocab}")
    tensors, config = eagle_head_tensors(net, method, ids, draft_vocab, seed)
    write_eagle_head(dst, tensors, config)
    return config
