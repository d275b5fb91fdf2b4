"""Load an EAGLE head from its folder (config.json + safetensors) in vLLM 0.33's tensor names.

EAGLE-1 (``llama_eagle.py``): ``fc.weight`` [H, 2H], ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight``,
``layers.{i}.input_layernorm.weight`` for i > 0 only, optionally ``embed_tokens.weight``. A ``norm.weight``
or an ``lm_head.weight`` raises (the head has neither), as does a layer-0 ``input_layernorm``.
EAGLE-3 (``llama_eagle3.py``): ``midlayer.*`` (or ``layers.0.*``) with ``input_layernorm``,
``hidden_norm``, ``post_attention_layernorm``, q/k/v over 2H; ``fc.weight`` [H, n*Ht], ``norm.weight``,
``lm_head.weight`` [Vd, H] (the target's lm_head when absent and Vd is the target's vocabulary), ``d2t``
[Vd] offsets (required when Vd is smaller than the target's vocabulary, refused when not), ``t2d`` skipped,
optionally ``embed_tokens.weight``. A leading ``model.`` is dropped, and so is any ``.bias`` (vLLM's rule).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from refengine.model.eagle.config import EAGLE1, EAGLE3, EagleHeadConfig, EagleHeadError
from refengine.model.eagle.head import make_head

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def read_head_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's safetensors files, names as on disk."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES] if path.is_dir() else []
        hint = f" (found {pickled}: convert them to safetensors)" if pickled else ""
        raise EagleHeadError(f"EAGLE head {path}: no .safetensors weights{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def vllm_names(raw: dict[str, torch.Tensor], method: str) -> dict[str, torch.Tensor]:
    """On-disk names -> the head module's names, as vLLM's ``load_weights`` renames them."""
    out = {}
    for name, t in raw.items():
        name = name.removeprefix("model.")
        if name.endswith(".bias") or (method == EAGLE3 and name == "t2d"):
            continue
        if method == EAGLE3 and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        out[name] = t
    return out


def _target_embedding(target: nn.Module) -> nn.Module:
    inner = getattr(target, "model", None)
    for attr in ("embed_tokens", "embeddings"):
        module = getattr(inner, attr, None)
        if module is not None:
            return module
    raise EagleHeadError(f"an EAGLE head shares the target's embedding; {type(target).__name__} has none "
                         f"that is known (model.embed_tokens / model.embeddings)")


def target_num_layers(target: nn.Module) -> int:
    return len(target.model.layers)


def _check(cfg: EagleHeadConfig, tensors: dict[str, torch.Tensor], target_cfg, num_layers: int,
           where: str) -> tuple[int, ...]:
    """The layout errors named in the module's docstring; returns the aux ids (EAGLE-3; () for EAGLE-1)."""
    if cfg.vocab_size != target_cfg.vocab_size:
        raise EagleHeadError(f"{where}vocab_size {cfg.vocab_size} differs from the target's "
                             f"{target_cfg.vocab_size}")
    if cfg.method == EAGLE1:
        for bad, why in (("norm.weight", "an EAGLE-1 head has no final norm"),
                         ("lm_head.weight", "an EAGLE-1 head uses the target's lm_head"),
                         ("layers.0.input_layernorm.weight",
                          "an EAGLE-1 head's first layer has no input norm")):
            if bad in tensors:
                raise EagleHeadError(f"{where}tensor {bad!r} on disk: {why} (vLLM's llama_eagle.py refuses "
                                     f"it; an EAGLE-3 head is drafter='eagle3')")
        if "d2t" in tensors:
            raise EagleHeadError(f"{where}tensor 'd2t' on disk: an EAGLE-1 head drafts in the target's "
                                 f"vocabulary (an EAGLE-3 head is drafter='eagle3')")
        return ()
    ids = cfg.aux_ids_for(num_layers)
    bad = [i for i in ids if i >= num_layers]
    if bad:
        raise EagleHeadError(f"{where}eagle_aux_hidden_state_layer_ids {list(ids)}: id(s) {bad} at or past "
                             f"the target's {num_layers} layers (id i is the state after i layers)")
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[-1] != len(ids) * cfg.target_hidden_size:
        source = "eagle_aux_hidden_state_layer_ids" if cfg.aux_layer_ids is not None else \
            f"vLLM's default ids for a {num_layers}-layer target"
        raise EagleHeadError(
            f"{where}fc.weight is [{', '.join(map(str, fc.shape))}] but the aux ids {list(ids)} ({source}) "
            f"give "
            f"{len(ids)} x target_hidden_size {cfg.target_hidden_size} = {len(ids) * cfg.target_hidden_size} "
            f"inputs (name the head's ids in config.json's eagle_aux_hidden_state_layer_ids)")
    full = cfg.draft_vocab_size == target_cfg.vocab_size
    if full and "d2t" in tensors:
        raise EagleHeadError(f"{where}tensor 'd2t' on disk with draft_vocab_size {cfg.draft_vocab_size} "
                             f"equal to the target's vocabulary: a full draft vocabulary has no d2t (vLLM "
                             f"refuses it)")
    if not full and "d2t" not in tensors:
        raise EagleHeadError(f"{where}draft_vocab_size {cfg.draft_vocab_size} is smaller than the vocabulary "
                             f"{target_cfg.vocab_size} but the head has no 'd2t' (draft id -> target id "
                             f"offsets)")
    if not full and "lm_head.weight" not in tensors:
        raise EagleHeadError(f"{where}no 'lm_head.weight' for draft_vocab_size {cfg.draft_vocab_size}")
    return ids


def check_d2t(d2t: torch.Tensor, cfg: EagleHeadConfig, where: str) -> None:
    """Every draft id + its offset is a target id (reads the values: a host check at load time)."""
    target_ids = torch.arange(cfg.draft_vocab_size, device=d2t.device) + d2t.long()
    if bool(((target_ids < 0) | (target_ids >= cfg.vocab_size)).any()):
        raise EagleHeadError(f"{where}d2t maps a draft id outside the target vocabulary "
                             f"[0, {cfg.vocab_size})")


def load_eagle_head(path: str | Path, method: str, target: nn.Module, target_cfg) -> tuple[nn.Module, tuple]:
    """The head of folder ``path`` on the target's device and dtype, and the aux layer ids it reads (EAGLE-3;
    () for EAGLE-1). EagleHeadError names whatever does not fit vLLM's layout or the target."""
    path = Path(path)
    where = f"EAGLE head {path}: "
    cfg = EagleHeadConfig.read(path, method)
    tensors = vllm_names(read_head_tensors(path), method)
    num_layers = target_num_layers(target)
    ids = _check(cfg, tensors, target_cfg, num_layers, where)
    embed = _target_embedding(target)
    param = next(target.parameters())
    own_embed = tensors.pop("embed_tokens.weight", None)
    if own_embed is None and embed.weight.shape[-1] != cfg.hidden_size:
        raise EagleHeadError(f"{where}hidden_size {cfg.hidden_size} differs from the target embedding's "
                             f"{embed.weight.shape[-1]} and the head ships no embed_tokens.weight")
    head = make_head(cfg, embed, target.compute_logits, len(ids))
    d2t = tensors.pop("d2t", None)
    shared_lm_head = method == EAGLE3 and "lm_head.weight" not in tensors
    if shared_lm_head:
        if cfg.hidden_size != target.lm_head.weight.shape[-1]:
            raise EagleHeadError(f"{where}no lm_head.weight and the target's lm_head does not take H="
                                 f"{cfg.hidden_size}")
        tensors["lm_head.weight"] = target.lm_head.weight.detach()
    expected = {name: tuple(p.shape) for name, p in head.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise EagleHeadError(f"{where}tensors do not match vLLM's {method} layout: missing {missing[:8]}, "
                             f"unexpected {unexpected[:8]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise EagleHeadError(f"{where}{name} is {list(tensors[name].shape)}, expected {list(shape)}")
    head.load_state_dict(tensors)
    for module in head.modules():  # not ``head.to``: the rotary module holds no tensors and overrides _apply
        for name, p in list(module._parameters.items()):
            module._parameters[name] = nn.Parameter(p.detach().to(device=param.device, dtype=param.dtype),
                                                    requires_grad=False)
    if own_embed is not None:
        if tuple(own_embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise EagleHeadError(f"{where}embed_tokens.weight is {list(own_embed.shape)}, expected "
                                 f"{[cfg.vocab_size, cfg.hidden_size]}")
        head.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=own_embed.to(device=param.device, dtype=param.dtype))
    if d2t is not None:
        if tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise EagleHeadError(f"{where}d2t is {list(d2t.shape)}, expected [{cfg.draft_vocab_size}]")
        check_d2t(d2t, cfg, where)
        head.d2t = d2t.to(device=param.device, dtype=torch.int64)
    return head, ids
