"""Train an EAGLE head on its target's own greedy text, so a tiny head has real acceptance.

The target runs once over every training sequence (a dense forward of the same modules, no grad); the head
is trained on its first passes as the engine runs them (``chain_logits``): at position t the target's state
(EAGLE-1 the final hidden state, EAGLE-3 the auxiliary states) with the embedding of token t+1, predicting
token t+2, then chained passes fed the head's own output and the next true token, attending to the first
pass's keys and their own. The head's forward here is a plain-torch copy of ``refengine.model.eagle.head``
on the same parameters.
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


def _qkv(layer, x_in: torch.Tensor, positions: torch.Tensor, cfg):
    """q, k, v [B, Hq, T, D] of a head layer over [B, T, in] (RoPE applied, kv heads repeated)."""
    att = layer.self_attn
    b, t, _ = x_in.shape
    hq, hk, d = att.num_heads, att.num_kv_heads, att.head_dim
    q = _rope(F.linear(x_in, att.q_proj.weight).view(b, t, hq, d), positions, cfg.rope_theta)
    k = _rope(F.linear(x_in, att.k_proj.weight).view(b, t, hk, d), positions, cfg.rope_theta)
    v = F.linear(x_in, att.v_proj.weight).view(b, t, hk, d)
    k, v = k.repeat_interleave(hq // hk, 2), v.repeat_interleave(hq // hk, 2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _finish(layer, o: torch.Tensor, residual: torch.Tensor, cfg) -> torch.Tensor:
    """o [B, Hq, T, D] the attention output -> the layer's output + residual [B, T, H]."""
    att = layer.self_attn
    b, hq, t, d = o.shape
    residual = F.linear(o.transpose(1, 2).reshape(b, t, hq * d), att.o_proj.weight) + residual
    h = _rms(residual, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
    mlp = layer.mlp
    h = F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight)
    return F.linear(h, mlp.down_proj.weight) + residual


def _inputs(head, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's input, its residual) for ids [B, T] and hidden [B, T, H] (EAGLE-3: after ``fc``)."""
    cfg, layer = head.config, head.layers[0]
    e = head.embed(ids).detach()
    if cfg.method == EAGLE3:
        en = _rms(e, layer.input_layernorm.weight, cfg.rms_norm_eps)
        hn = _rms(hidden, layer.hidden_norm.weight, cfg.rms_norm_eps)
        return torch.cat([en, hn], -1), hidden
    x = F.linear(torch.cat([e, hidden], -1), head.fc.weight)
    return x, x


def _logits(head, out: torch.Tensor) -> torch.Tensor:
    if head.config.method == EAGLE3:
        return F.linear(_rms(out, head.norm.weight, head.config.rms_norm_eps), head.lm_head.weight)
    target = head._shared[1].__self__  # the target model (its compute_logits): its lm_head
    return F.linear(out, target.lm_head.weight.detach())


def chain_logits(head, ids: torch.Tensor, state: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits [B, n, Vd] of ``steps`` passes, row t of a sequence ids [B, T] (n = T - steps - 1), as the
    engine runs them: the first pass pairs the target's state at t with token t+1 at position t, attending
    causally; pass s pairs the previous pass's output with token t+s+1 at position t+s and attends to the
    first pass's keys at positions <= t and to the chained keys of row t (the head's KV cache then). Pass s
    predicts token t+s+2."""
    cfg, layer = head.config, head.layers[0]
    t_len = ids.shape[1]
    n = t_len - steps - 1
    base = torch.arange(n)
    hidden = F.linear(state[:, :n], head.fc.weight) if cfg.method == EAGLE3 else state[:, :n]
    outs, chain = [], []
    k0 = v0 = None
    for s in range(steps):
        x_in, residual = _inputs(head, ids[:, base + s + 1], hidden)
        q, k, v = _qkv(layer, x_in, base + s, cfg)
        if s == 0:
            k0, v0 = k, v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            chain.append((k, v))
            d = q.shape[-1]
            scores = (q @ k0.transpose(-1, -2)).masked_fill(base[None, :] > base[:, None], float("-inf"))
            own = torch.stack([(q * kj).sum(-1) for kj, _ in chain], dim=-1)  # [B, Hq, n, s]
            probs = torch.softmax(torch.cat([scores, own], -1) * d**-0.5, dim=-1)
            o = probs[..., :n] @ v0
            for j, (_, vj) in enumerate(chain):
                o = o + probs[..., n + j, None] * vj
        hidden = _finish(layer, o, residual, cfg)  # EAGLE-3: the pre-norm output feeds the next pass
        outs.append(_logits(head, hidden))
    return outs


def target_ids_to_draft(head, ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (-100, ignored by the loss, for ids outside the draft vocabulary)."""
    if getattr(head, "d2t", None) is None:
        return ids
    vocab = head.config.vocab_size
    t2d = torch.full((vocab,), -100, dtype=torch.int64)
    t2d[torch.arange(head.d2t.shape[0]) + head.d2t] = torch.arange(head.d2t.shape[0])
    return t2d[ids]


def train_head(head, ids: torch.Tensor, states: torch.Tensor, steps: int = 300, lr: float = 3e-3,
               batch: int = 16, chain: int = 2, seed: int = 0, log=None) -> float:
    """Fit the head's first ``chain`` passes on sequences ``ids`` [N, T] with the target's states
    [N, T, ...] (``chain_logits``); returns the final loss. Only the head's own parameters move."""
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n = ids.shape[1] - chain - 1
    labels = [target_ids_to_draft(head, ids[:, s + 2: s + 2 + n]) for s in range(chain)]
    loss = torch.tensor(0.0)
    for step in range(steps):
        pick = torch.randint(0, ids.shape[0], (batch,), generator=gen)
        outs = chain_logits(head, ids[pick], states[pick], chain)
        loss = sum(F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), lab[pick].reshape(-1),
                                   ignore_index=-100) for lg, lab in zip(outs, labels))
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


def make_tiny_eagle3(out, num_sequences: int = 32, length: int = 64, steps: int = 120,
                     draft_vocab: int = 128, log=None) -> None:
    """``tiny:eagle3``: the embedded default model's files in ``out`` and, in ``out/eagle3-head``, an EAGLE-3
    head (aux ids 1, 2, 3; the draft vocabulary the ``draft_vocab`` ids most frequent in its greedy text)
    trained (first pass and one chained pass) on the model's greedy continuations of seeded byte prompts."""
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
    train_head(head, ids, target_states(net, ids, aux_ids), steps=steps, batch=8, log=log)
    write_eagle_head(out / TINY_HEAD, head_file_tensors(head), config)
