"""Seeded sampling and speculative verification: the one written definition, for both engines.

A request with ``temperature > 0`` samples. Its processed logits (``refengine.logits_process``) go
through vLLM 0.33's sampling order:

    1. temperature   logits / temperature
    2. min_p         ids whose probability is below min_p * the top probability -> -inf
    3. top_k         ids below the k-th largest logit -> -inf (ties with it kept)
    4. top_p         the smallest set of most likely ids whose mass reaches top_p is kept, the rest -> -inf

and a token is drawn from the softmax of what is left. Every random number is a pure function of the
request's seed, the position of the token being chosen (its index in prompt + output) and, for the
Gumbel draw, the token id: a counter-based integer hash (splitmix64 finaliser) over int64 tensors,
so the host, the device and a replayed graph all get the same bits, whatever the batch row, the step or
the other requests. Three streams, each salted apart: ``SAMPLE`` (Gumbel-max draw of a position's
token), ``ACCEPT`` (the uniform a draft is accepted against), ``RECOVER`` (the uniform that picks a
rejected position's token). The drafters here are greedy (their proposal q is one-hot), and use none
of them.

Verification (standard rejection sampling, per row): draft j is accepted when ``u_accept < p(draft)
/ q(draft)``, i.e. ``u_accept < p(draft)`` with q one-hot; at the first rejection the token is drawn
from the normalised ``max(p - q, 0)`` (p with the draft's mass removed) by inverse CDF with
``u_recover``; when every draft is accepted the bonus token is drawn from p. A row without drafts is
plain sampling. Greedy rows (``temperature == 0``) keep ``kernels.greedy_verify``'s exact argmax
verification. Both engines call ``verify``; the reference hands it its rows' logits, the async engine
its padded step (no host read: it is captured into FULL graphs).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

import kernels

MASK63 = (1 << 63) - 1
SAMPLE, ACCEPT, RECOVER = 0x5A4D, 0xACC3, 0x2EC0  # stream salts (independent hash inputs)


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 ``x`` (wrapping arithmetic), elementwise."""
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def uniform(seed: torch.Tensor, position: torch.Tensor, salt: int, token: torch.Tensor | None = None):
    """float64 uniforms in (0, 1), a pure function of (seed, position, salt[, token]) (broadcast int64)."""
    h = mix(mix(seed.long() ^ salt) + position.long())
    if token is not None:
        h = mix(h + token.long())
    return (_srl(h, 11).to(torch.float64) + 0.5) * 2.0 ** -53


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, less its CUDA part where there is no CUDA device: that part waits for a
    CUDA initialisation that never comes, and records the caller's whole stack on every call."""
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


def draw_seed(engine_seed: int, request_id: str) -> int:
    """The seed a request without one gets at admission: a function of the engine's seed and the request's
    id, reported in its output (so the run can be replayed request by request). Not of the order requests
    arrived in: two engines given the same requests at different steps (a next turn added once the turn
    before came back) draw the same seeds."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    t = torch.tensor([engine_seed & MASK63], dtype=torch.int64)
    key = torch.tensor([_signed(int.from_bytes(digest, "little"))], dtype=torch.int64)
    return int(mix(mix(t) ^ key)[0]) & MASK63


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors (N rows)."""

    temperature: torch.Tensor  # [N] float32, 0: greedy
    top_k: torch.Tensor  # [N] int64, 0: off
    top_p: torch.Tensor  # [N] float32, 1: off
    min_p: torch.Tensor  # [N] float32, 0: off
    seed: torch.Tensor  # [N] int64

    @classmethod
    def of(cls, params: list, seeds: list[int], device) -> RowParams:
        """From ``SamplingParams`` and the requests' seeds (host lists)."""
        f32 = {"dtype": torch.float32, "device": device}
        return cls(torch.tensor([p.temperature for p in params], **f32),
                   torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in params], **f32),
                   torch.tensor([p.min_p for p in params], **f32),
                   torch.tensor(seeds, dtype=torch.int64, device=device))


def filtered_logits(x: torch.Tensor, p: RowParams) -> torch.Tensor:
    """``x`` [N, J, V] processed logits of sampling rows -> tempered logits with the ids top-k/top-p/min-p
    drop at -inf [N, J, V] float32 (steps 1-4; a greedy row's result is not used: divided by 1)."""
    v = x.shape[-1]
    t = torch.where(p.temperature > 0, p.temperature, torch.ones_like(p.temperature))
    x = x.to(torch.float32) / t[:, None, None]  # 1
    neg = torch.full_like(x, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    floor = p.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)
    x = torch.where(probs < floor, neg, x)  # 2
    desc, order = torch.sort(x, dim=-1, descending=True, stable=True)
    k = torch.where(p.top_k > 0, p.top_k.clamp(max=v), torch.full_like(p.top_k, v))  # [N]
    kth = desc.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
    x = torch.where(x < kth, neg, x)  # 3
    desc = torch.where(desc < kth, neg, desc)
    sorted_probs = torch.softmax(desc, dim=-1)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the likelier ids
    keep_sorted = before < p.top_p[:, None, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return torch.where(keep, x, neg)  # 4


def positions_of(first: torch.Tensor, width: int) -> torch.Tensor:
    """[N, J] the position each verify column chooses a token for (``first`` [N]: column 0's)."""
    return first.long()[:, None] + torch.arange(width, device=first.device)[None, :]


def gumbel_sample(y: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[N, J] ids drawn from softmax(``y`` [N, J, V]) by Gumbel-max, noise keyed (seed, position, token)."""
    v = y.shape[-1]
    ids = torch.arange(v, device=y.device)[None, None, :]
    u = uniform(seed[:, None, None], pos[:, :, None], SAMPLE, ids)
    return (y.to(torch.float64) - torch.log(-torch.log(u))).argmax(dim=-1)


def recover(probs: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, K] ids drawn from the normalised max(p - q, 0), q one-hot at ``drafts`` [N, K], by inverse CDF
    with ``u`` [N, K] float64 (``probs`` [N, K, V] float32)."""
    residual = probs.to(torch.float64).scatter(-1, drafts[:, :, None], 0.0)
    total = residual.sum(-1, keepdim=True)
    cdf = torch.cumsum(residual / total.clamp(min=1e-300), dim=-1)
    picked = (cdf <= u[:, :, None]).sum(-1)
    # float rounding may leave the cdf's end below u: the last id with mass then
    v = probs.shape[-1]
    last = v - 1 - (residual > 0).flip(-1).to(torch.int64).argmax(-1)
    return torch.minimum(picked, last)


def verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, cu: torch.Tensor,
           p: RowParams, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of N rows, greedy or sampled per row.

    ``logits`` [M, V] processed logits, row i's at ``cu[i]`` .. (1 + its draft positions); ``drafts`` [N, K]
    int64 (fillers past ``num_drafts`` [N]); ``first`` [N] the position row i's first logits row chooses
    a token for. -> (tokens int64 [N, K+1]: kept tokens then -1, num_valid int32 [N]), as
    ``kernels.greedy_verify`` for rows with temperature 0.
    """
    n, k = drafts.shape
    greedy_tokens, greedy_valid = kernels.greedy_verify(logits, drafts, num_drafts.to(torch.int32),
                                                        cu.to(torch.int32))
    m = logits.shape[0]
    at = (cu[:-1].long()[:, None] + torch.arange(k + 1, device=logits.device)[None, :]).clamp(max=m - 1)
    y = filtered_logits(logits[at], p)  # [N, K+1, V]
    pos = positions_of(first, k + 1)
    sampled = gumbel_sample(y, p.seed, pos)  # [N, K+1] a fresh draw at every column (the bonus's)
    probs = torch.softmax(y, dim=-1)
    nd = num_drafts.long()
    col = torch.arange(k + 1, device=logits.device)[None, :]
    if k:
        p_draft = probs[:, :k].gather(-1, drafts[:, :, None])[:, :, 0].to(torch.float64)  # [N, K]
        accepted = uniform(p.seed[:, None], pos[:, :k], ACCEPT) < p_draft
        accepted &= col[:, :k] < nd[:, None]
        rejected_at = torch.where(accepted, k + 1, col[:, :k]).amin(-1)  # [N] first rejection (k+1: none)
        r = torch.minimum(rejected_at, nd)  # the column that gets a drawn token
        recovered = recover(probs[:, :k], drafts, uniform(p.seed[:, None], pos[:, :k], RECOVER))
        # column r: a rejected draft's recovered token, or the bonus drawn from p when every draft was kept
        at_r = torch.where(r < nd, recovered.gather(1, r.clamp(max=k - 1)[:, None])[:, 0],
                           sampled.gather(1, r[:, None])[:, 0])
        own = torch.where(col == r[:, None], at_r[:, None], torch.cat([drafts, drafts[:, :1]], dim=1))
    else:
        r = torch.zeros(n, dtype=torch.int64, device=logits.device)
        own = sampled
    tokens = torch.where(col <= r[:, None], own, torch.full_like(own, -1))
    valid = (r + 1).to(torch.int32)
    greedy = p.temperature <= 0
    return (torch.where(greedy[:, None], greedy_tokens, tokens),
            torch.where(greedy, greedy_valid, valid))
