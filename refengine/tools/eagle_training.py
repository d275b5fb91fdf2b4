"""Train an EAGLE head on its target's own greedy text, so a tiny head has real acceptance.

The target runs once over every training sequence (the engine's own model, one step per sequence through
the reference engine's caches is not needed: a dense forward of the same modules); what the head is
trained on is its first pass, as the engine runs it: at position t the target's state (EAGLE-1 the final
hidden state, EAGLE-3 the auxiliary states) with the embedding of token t+1, predicting token t+2, with
causal attention over the sequence's positions. The head's forward here is a plain-torch copy of
``refengine.model.eagle.head`` on the same parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refengine.model.eagle import EAGLE3


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:  # [B, T, h, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = positions.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _layer(layer, x_in: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, cfg) -> torch.Tensor:
    """One head layer over [B, T, in]: returns the layer's output + residual [B, T, H]."""
    att = layer.self_attn
    b, t, _ = x_in.shape
    hq, hk, d = att.num_heads, att.num_kv_heads, att.head_dim
    q = _rope(F.linear(x_in, att.q_proj.weight).view(b, t, hq, d), positions, cfg.rope_theta)
    k = _rope(F.linear(x_in, att.k_proj.weight).view(b, t, hk, d), positions, cfg.rope_theta)
    v = F.linear(x_in, att.v_proj.weight).view(b, t, hk, d)
    k, v = k.repeat_interleave(hq // hk, 2), v.repeat_interleave(hq // hk, 2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = F.linear(o.transpose(1, 2).reshape(b, t, hq * d), att.o_proj.weight)
    residual = a + residual
    h = _rms(residual, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
    mlp = layer.mlp
    h = F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight)
    h = F.linear(h, mlp.down_proj.weight)
    return h + residual


def first_pass_logits(head, ids: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """ids [B, T] (token t+1 at row t), state [B, T, ...] the target's state at t -> logits [B, T, Vd]."""
    cfg = head.config
    positions = torch.arange(ids.shape[1])
    e = head.embed(ids).detach()
    layer = head.layers[0]
    if cfg.method == EAGLE3:
        hidden = F.linear(state, head.fc.weight)
        en = _rms(e, layer.input_layernorm.weight, cfg.rms_norm_eps)
        hn = _rms(hidden, layer.hidden_norm.weight, cfg.rms_norm_eps)
        out = _layer(layer, torch.cat([en, hn], -1), hidden, positions, cfg)
        return F.linear(_rms(out, head.norm.weight, cfg.rms_norm_eps), head.lm_head.weight)
    x = F.linear(torch.cat([e, state], -1), head.fc.weight)
    out = _layer(layer, x, x, positions, cfg)
    target = head._shared[1].__self__  # the target model (its compute_logits): its lm_head
    return F.linear(out, target.lm_head.weight.detach())


def target_ids_to_draft(head, ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (-100, ignored by the loss, for ids outside the draft vocabulary)."""
    if getattr(head, "d2t", None) is None:
        return ids
    vocab = head.config.vocab_size
    t2d = torch.full((vocab,), -100, dtype=torch.int64)
    t2d[torch.arange(head.d2t.shape[0]) + head.d2t] = torch.arange(head.d2t.shape[0])
    return t2d[ids]


def train_head(head, ids: torch.Tensor, states: torch.Tensor, steps: int = 300, lr: float = 3e-3,
               batch: int = 16, seed: int = 0, log=None) -> float:
    """Fit the head's first pass on sequences ``ids`` [N, T] with the target's states [N, T, ...]; returns
    the final loss. Only the head's own parameters move."""
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    labels = target_ids_to_draft(head, ids[:, 2:])
    loss = torch.tensor(0.0)
    for step in range(steps):
        pick = torch.randint(0, ids.shape[0], (batch,), generator=gen)
        logits = first_pass_logits(head, ids[pick, 1:-1], states[pick, :-2])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[pick].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None and step % 50 == 0:
            log(f"step {step}/{steps} loss {loss.item():.3f}")
    for p in params:
        p.requires_grad_(False)
    return loss.item()


def target_states(model, ids: torch.Tensor, aux_ids: tuple[int, ...]) -> torch.Tensor:
    """A Qwen3-Next target's states over ``ids`` [N, T] with its dense training forward: [N, T, n*H] the
    inputs of layers ``aux_ids`` (EAGLE-3), or [N, T, H] the final hidden state when ``aux_ids`` is empty."""
    from refengine.tools import training

    positions = torch.arange(ids.shape[1])
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        aux = []
        for i, layer in enumerate(model.model.layers):
            if i in aux_ids:
                aux.append(x)
            x = training.layer_forward(layer, x, positions)
        if aux_ids:
            return torch.cat(aux, -1)
        norm = model.model.norm
        return training.rms_norm(x, norm.weight, norm.eps)


def head_file_tensors(head) -> dict[str, torch.Tensor]:
    """The trained head's tensors under vLLM's on-disk names (EAGLE-3: ``midlayer.``, ``d2t``, ``t2d``)."""
    out = {}
    for name, t in head.state_dict().items():
        if head.config.method == EAGLE3 and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out[name] = t.detach().clone().contiguous()
    if getattr(head, "d2t", None) is not None:
        d2t = head.d2t.cpu()
        out["d2t"] = d2t.clone()
        target = torch.arange(d2t.shape[0]) + d2t
        out["t2d"] = torch.zeros(head.config.vocab_size, dtype=torch.bool).index_fill_(0, target, True)
    return out


TINY_HEAD = "eagle3-head"  # the head's folder inside the tiny:eagle3 checkpoint


def greedy_sequences(llm, num: int, length: int, prompt_len: int = 8, seed: int = 0) -> torch.Tensor:
    """[num, length] the target's greedy continuations of seeded byte prompts."""
    from refengine import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(32, 127, (prompt_len,), generator=gen).tolist() for _ in range(num)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=length - prompt_len, ignore_eos=True))
    return torch.tensor([p + list(o.token_ids) for p, o in zip(prompts, outs)])


def mean_acceptance_length(model: str, head: str, method: str, k: int, num: int = 16, seed: int = 1) -> float:
    """vLLM's mean acceptance length (1 + accepted drafts per verify step) of ``head`` on ``model``'s greedy
    continuations of seeded byte prompts (not the training ones)."""
    from refengine import LLM

    records: list = []
    llm = LLM(model=model, num_speculative_tokens=k, drafter=method, draft_model=head,
              observer=records.append)
    greedy_sequences(llm, num, 48, seed=seed)
    accepted = [r.num_accepted for step in records for r in step.rows
                if r.num_accepted is not None and r.draft_token_ids]
    return 1 + sum(accepted) / max(len(accepted), 1)


def make_tiny_eagle3(out, num_sequences: int = 32, length: int = 64, steps: int = 150,
                     draft_vocab: int = 128, log=None) -> None:
    """``tiny:eagle3``: the embedded default model's files in ``out`` and, in ``out/eagle3-head``, an EAGLE-3
    head (aux ids 1, 2, 3; the draft vocabulary the ``draft_vocab`` ids most frequent in its greedy text)
    trained on the model's greedy continuations of seeded byte prompts."""
    import shutil
    from pathlib import Path

    from refengine import LLM
    from refengine.llm import default_model_path
    from refengine.model.eagle import load_eagle_head
    from refengine.tools.eagle_head import default_head_aux_ids, eagle_head_tensors, write_eagle_head

    out = Path(out)
    shutil.copytree(default_model_path(), out)
    llm = LLM(model=str(out))
    ids = greedy_sequences(llm, num_sequences, length)
    net = llm.engine.model
    counts = torch.bincount(ids.flatten(), minlength=net.config.vocab_size)
    draft_ids = counts.argsort(descending=True, stable=True)[:draft_vocab]
    aux = default_head_aux_ids(len(net.model.layers))
    tensors, config = eagle_head_tensors(net, EAGLE3, aux, draft_vocab, seed=0, draft_ids=draft_ids)
    write_eagle_head(out / TINY_HEAD, tensors, config)
    head, aux_ids = load_eagle_head(out / TINY_HEAD, EAGLE3, net, net.config)
    train_head(head, ids, target_states(net, ids, aux_ids), steps=steps, log=log)
    write_eagle_head(out / TINY_HEAD, head_file_tensors(head), config)
