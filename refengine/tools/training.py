"""A dense, differentiable full-sequence forward of the same model, for training.

The engine forward writes into paged caches and state pools; this one runs padded batches
``[B, T]`` with plain torch ops on the very same parameters (``Qwen3NextForCausalLM`` and its
submodules), so training optimises exactly the model the engine serves:

- GDN: causal depthwise conv + SiLU, fp32 gates, L2-normalised q/k, the gated delta rule in its
  chunked (WY / UT) form, gated RMSNorm, out_proj;
- gated attention: per-head [query | gate] split, zero-centred q/k norm, partial NeoX RoPE, causal
  softmax, sigmoid output gate;
- MTP: the first pass pairs the final-norm hidden at t with the embedding of token t+1 (position t);
  chained step s pairs the previous step's MTP output with token t+s+1 at position t+s and attends,
  as the engine's MTP KV cache does, to first-pass keys at positions <= t plus the chained keys of
  steps 1..s for the same t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gated_delta_rule.naive import chunk_gated_delta_rule_dense, l2_normalize
from kernels.norm.naive import naive_rms_norm
from kernels.rotary.naive import naive_rotate
from refengine.model.attention import GatedAttention
from refengine.model.qwen3_next.gdn import GatedDeltaNet
from refengine.model.qwen3_next.model import DecoderLayer, Qwen3NextForCausalLM

CHUNK = 64  # tokens per chunk of the chunked delta rule


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """The kernels' RMSNorm reference over the last axis of any shape."""
    return naive_rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, zero_centered=zero_centered).view(x.shape)


def chunk_delta_rule(q, k, v, g, beta, chunk: int = CHUNK) -> torch.Tensor:
    """Gated delta rule from a zero state through the kernels' dense chunk reference.
    q, k [B, T, H, Dk] (normalised, q scaled), v [B, T, H, Dv], g (log decay) and beta [B, T, H],
    all float32 -> o [B, T, H, Dv]."""
    b, _, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    o, _ = chunk_gated_delta_rule_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        g.transpose(1, 2), beta.transpose(1, 2), state, chunk)
    return o.transpose(1, 2)


def gdn_forward(mod: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] (after input_layernorm) -> [B, T, H]."""
    b, t, _ = x.shape
    qkv = F.linear(x, mod.in_proj_qkv.weight)  # [B, T, C]
    width = mod.conv1d.weight.shape[1]
    conv = F.conv1d(qkv.transpose(1, 2), mod.conv1d.weight[:, None, :], padding=width - 1,
                    groups=qkv.shape[-1])[..., :t]
    conv = F.silu(conv.transpose(1, 2).float())
    q, k, v = torch.split(conv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    r = mod.num_v_heads // mod.num_k_heads
    q = l2_normalize(q.reshape(b, t, mod.num_k_heads, mod.head_k_dim)) * mod.head_k_dim**-0.5
    k = l2_normalize(k.reshape(b, t, mod.num_k_heads, mod.head_k_dim))
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    v = v.reshape(b, t, mod.num_v_heads, mod.head_v_dim)
    a = F.linear(x, mod.in_proj_a.weight).float()
    g = -torch.exp(mod.A_log.float()) * F.softplus(a + mod.dt_bias.float())
    beta = torch.sigmoid(F.linear(x, mod.in_proj_b.weight).float())
    o = chunk_delta_rule(q, k, v, g, beta)  # [B, T, Hv, Dv]
    z = F.linear(x, mod.in_proj_z.weight).reshape(b, t, mod.num_v_heads, mod.head_v_dim)
    y = rms_norm(o, mod.norm.weight, mod.norm.eps, zero_centered=False) * F.silu(z.float())
    return F.linear(y.reshape(b, t, mod.value_dim).to(x.dtype), mod.out_proj.weight)


def attention_qkv(mod: GatedAttention, x: torch.Tensor, positions: torch.Tensor):
    """x [B, T, H] -> q [B, Hq, T, D], k and v [B, Hq, T, D] (KV heads repeated), gate [B, T, Hq*D]."""
    b, t, _ = x.shape
    d = mod.head_dim
    q_gate = F.linear(x, mod.q_proj.weight).view(b, t, mod.num_heads, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:].reshape(b, t, mod.num_heads * d)
    k = F.linear(x, mod.k_proj.weight).view(b, t, mod.num_kv_heads, d)
    v = F.linear(x, mod.v_proj.weight).view(b, t, mod.num_kv_heads, d)
    q = rms_norm(q, mod.q_norm.weight, mod.q_norm.eps)
    k = rms_norm(k, mod.k_norm.weight, mod.k_norm.eps)
    q, k = naive_rotate(q, k, *mod.rotary.cos_sin(positions))  # batched [B, T, H, D], differentiable
    r = mod.num_heads // mod.num_kv_heads
    k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate


def attention_out(mod: GatedAttention, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [B, Hq, T, D] -> [B, T, H]."""
    b, _, t, _ = o.shape
    o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
    return F.linear(o, mod.o_proj.weight)


def layer_forward(layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, mixer=None) -> torch.Tensor:
    """One pre-norm decoder layer; ``mixer(h) -> [B, T, H]`` overrides plain causal attention."""
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
    if layer.mixer_name == GatedDeltaNet.attr_name:
        h = gdn_forward(layer.linear_attn, h)
    elif mixer is not None:
        h = mixer(h)
    else:
        mod = layer.self_attn
        q, k, v, gate = attention_qkv(mod, h, positions)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=mod.scale)
        h = attention_out(mod, o, gate)
    x = x + h
    mlp = layer.mlp
    h = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    return x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                        mlp.down_proj.weight)


def hidden_states(model: Qwen3NextForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> final-norm hidden [B, T, H], the tensor the engine feeds lm_head and the MTP."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x = layer_forward(layer, x, positions)
    norm = model.model.norm
    return rms_norm(x, norm.weight, norm.eps)


def logits(model: Qwen3NextForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, model.lm_head.weight).float()


def mtp_hidden_chain(model: Qwen3NextForCausalLM, ids: torch.Tensor, hidden: torch.Tensor,
                     steps: int) -> list[torch.Tensor]:
    """MTP outputs for ``steps`` draft steps, each [B, T-1, H] indexed by the base position t.

    Step 0 row t pairs hidden[t] with ids[t+1] at position t (its logits predict ids[t+2]); step s
    row t pairs step s-1's row t with ids[t+s+1] at position t+s (predicting ids[t+s+2]). Rows whose
    input id would fall past the sequence reuse the last id; their outputs must be ignored.
    """
    mtp = model.mtp
    embed = model.model.embed_tokens
    layer = mtp.layers[0]
    mod = layer.self_attn
    t = ids.shape[1]
    n = t - 1
    base = torch.arange(n, device=ids.device)
    first_keys: list[torch.Tensor] = []
    chain_keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs: list[torch.Tensor] = []
    prev = hidden[:, :n]
    for s in range(steps):
        tok = ids[:, torch.clamp(base + s + 1, max=t - 1)]
        e = rms_norm(embed(tok), mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_embedding.eps)
        h = rms_norm(prev, mtp.pre_fc_norm_hidden.weight, mtp.pre_fc_norm_hidden.eps)
        x = F.linear(torch.cat([e, h], dim=-1), mtp.fc.weight)

        def mixer(hn, s=s):
            q, k, v, gate = attention_qkv(mod, hn, base + s)
            if s == 0:
                first_keys.extend((k, v))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=mod.scale)
                return attention_out(mod, o, gate)
            chain_keys.append((k, v))
            k0, v0 = first_keys
            scores = (q @ k0.transpose(-1, -2)).masked_fill(base[None, :] > base[:, None], float("-inf"))
            own = torch.stack([(q * kj).sum(-1) for kj, _ in chain_keys], dim=-1)  # [B, Hq, n, s]
            probs = torch.softmax(torch.cat([scores, own], dim=-1).float() * mod.scale, dim=-1).to(q.dtype)
            o = probs[..., :n] @ v0
            for j, (_, vj) in enumerate(chain_keys):
                o = o + probs[..., n + j, None] * vj
            return attention_out(mod, o, gate)

        x = layer_forward(layer, x, base + s, mixer)
        prev = rms_norm(x, mtp.norm.weight, mtp.norm.eps)
        outs.append(prev)
    return outs
