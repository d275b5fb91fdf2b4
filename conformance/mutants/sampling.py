"""The record of seeded sampling and rejection sampling (issue 37), re-created in one async engine instance.

Each patches the instance's sampling rows (``engine.state.sampling``) or its verifier
(``engine.runner.verify``), swapping a function of ``refengine.sampling`` only for the length of that
instance's call. ``sampling-mixed-mtp-k3`` catches them all: seeded, unseeded and greedy requests in one
batch, rows moving, drafts rejected and kept, each filter with temperatures above and below 1.
"""

from __future__ import annotations

import torch

from conformance.mutants.base import Mutant
from conformance.mutants.params import _with
from refengine import sampling

MIXED = "sampling-mixed-mtp-k3"


def _in_verify(engine, name: str, value) -> None:
    """``refengine.sampling.<name>`` is ``value`` while this engine's runner verifies a step."""
    engine.runner.verify = _with(sampling, name, value, engine.runner.verify)


def _shared_noise(engine) -> None:
    """vLLM #54282's class (two draws of one position from one noise stream): the residual draw of a rejected
    position reuses the acceptance test's uniform, so, given the rejection (u >= p(draft)), it only
    reaches the upper part of the residual's CDF. The drafters here are greedy and draw nothing, so the
    stream the acceptance shares is the target's own."""
    uniform = sampling.uniform

    def shared(seed, position, salt, token=None):
        return uniform(seed, position, sampling.ACCEPT if salt == sampling.RECOVER else salt, token)

    _in_verify(engine, "uniform", shared)


def _seed_lost_beside_unseeded(engine) -> None:
    """vLLM #51866: when an unseeded request is admitted with seeded ones, the seeded ones lose their own
    generator and draw from the process-wide one."""
    rows = engine.state.sampling
    staged = rows.staged_writes

    def dropping(w, requests):
        staged(w, requests)
        if any(r.params.samples and r.params.seed is None for r in requests):
            w.replace("sampling.seed", torch.randint(0, 1 << 62, (len(requests),), dtype=torch.int64))

    rows.staged_writes = dropping


def _noise_by_row(engine) -> None:
    """The noise is keyed by the request's batch row, not its seed: a request's draws change with the rows
    around it."""
    rows = engine.state.sampling
    params = rows.rows

    def by_row(idx):
        p = params(idx)
        p.seed = torch.arange(idx.shape[0], dtype=torch.int64, device=idx.device)
        return p

    rows.rows = by_row


def _noise_by_step(engine) -> None:
    """TensorRT-LLM #17599: the noise follows the engine's step count, not the token's position, so the
    output depends on how the engine split the request into steps."""
    steps = [0]
    verify = engine.runner.verify

    def counted(*args, **kw):
        steps[0] += 1
        return verify(*args, **kw)

    engine.runner.verify = counted
    _in_verify(engine, "positions_of", lambda first, width: torch.full_like(first, steps[0]).long()[:, None]
               + torch.arange(width, device=first.device)[None, :])


def _unnormalised_residual(engine) -> None:
    """A rejected position draws from max(p - q, 0) without dividing by its mass: the inverse CDF then runs
    off its end, and the last ids with mass take what it misses."""
    def unnormalised(probs, drafts, u):
        residual = probs.to(torch.float64).scatter(-1, drafts[:, :, None], 0.0)
        picked = (torch.cumsum(residual, dim=-1) <= u[:, :, None]).sum(-1)
        last = probs.shape[-1] - 1 - (residual > 0).flip(-1).to(torch.int64).argmax(-1)
        return torch.minimum(picked, last)

    _in_verify(engine, "recover", unnormalised)


def _top_p_before_temperature(engine) -> None:
    """vLLM #56497's class (the sampling steps misordered): top-p keeps the ids whose mass reaches top_p
    before the temperature scales the logits, so the kept set is the untempered one."""
    filtered = sampling.filtered_logits

    def misordered(x, p):
        untempered = sampling.RowParams(torch.ones_like(p.temperature), torch.zeros_like(p.top_k), p.top_p,
                                        torch.zeros_like(p.min_p), p.seed)
        kept = torch.isfinite(filtered(x, untempered))
        no_top_p = sampling.RowParams(p.temperature, p.top_k, torch.ones_like(p.top_p), p.min_p, p.seed)
        y = filtered(x, no_top_p)
        return torch.where(kept, y, torch.full_like(y, float("-inf")))

    _in_verify(engine, "filtered_logits", misordered)


def _reported_seed_not_used(engine) -> None:
    """An unseeded request reports the seed drawn at its admission, but the device draws with another one
    (drawn for another request id): its run cannot be replayed from what it reported."""
    rows = engine.state.sampling
    staged = rows.staged_writes

    def redrawn(w, requests):
        staged(w, requests)
        seeds = w.get("sampling.seed").clone()
        for i, r in enumerate(requests):
            if r.params.seed is None:
                seeds[i] = sampling.draw_seed(engine.config.seed, r.request_id + "'")
        w.replace("sampling.seed", seeds)

    rows.staged_writes = redrawn


def sampling_mutants() -> tuple:
    """The mutants of seeded and rejection sampling."""
    def m(mid, origin, contract, description, patch):
        return Mutant(mid, origin, contract, description, patch, "full_and_piecewise", (MIXED,))

    noise = "issue 37: sampled output is a function of (request seed, position)"
    lossless = "issue 37: standard rejection sampling, lossless in distribution"
    return (
        m("sampling-shared-noise", "vLLM #54282", lossless,
          "a rejected position's residual draw reuses the acceptance test's uniform, not a stream of its own",
          _shared_noise),
        m("sampling-seed-lost-beside-unseeded", "vLLM #51866", noise,
          "seeded requests admitted beside an unseeded one draw from the process-wide generator",
          _seed_lost_beside_unseeded),
        m("sampling-noise-by-row", "own (seeded sampling)", noise,
          "the noise is keyed by the request's batch row instead of its seed", _noise_by_row),
        m("sampling-noise-by-step", "TensorRT-LLM #17599", noise,
          "the noise is keyed by the engine's step count instead of the token's position", _noise_by_step),
        m("sampling-unnormalised-residual", "own (rejection sampling)", lossless,
          "a rejected position draws from max(p - q, 0) without normalising it", _unnormalised_residual),
        m("sampling-top-p-before-temperature", "vLLM #56497", noise,
          "top-p is applied to the untempered logits, before the temperature", _top_p_before_temperature),
        m("sampling-reported-seed-not-used", "own (seeded sampling)", noise,
          "an unseeded request reports the seed drawn at its admission but samples with another",
          _reported_seed_not_used),
    )
