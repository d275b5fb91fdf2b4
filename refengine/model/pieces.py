"""A model's forward as stages, so a piecewise step can replay its token-wise work from captured graphs.

A forward is a list of stages over a *carry*, a tuple of tensors (each [T, ...], T the step's padded
token count; by convention the residual stream ``x`` [T, H] first, then ``positions`` [T]). A ``pure``
stage computes from the carry alone: weights, norms, projections, gates, residual adds, MLPs and MoE,
nothing that reads or writes a cache, a state pool or the step's metadata, and the same ops whatever the
step. A ``core`` stage reads the forward context (attention over the paged cache, the recurrent kernels,
the auxiliary-state capture). ``run`` fuses each run of consecutive pure stages into one *piece*: with
``pieces`` None it runs eagerly, the same ops in the same order as a plain forward (so every bit is the
same); otherwise ``pieces(key, fn, *carry)`` runs it (``refengine.async_engine.graphs.PieceGraphs``:
captured once per key and input shapes, replayed after), ``key`` the forward's name and the index of the
piece's first stage.

What capture requires of a pure stage: it reads nothing but its carry and the module's parameters (no
tensor of the step from a closure, since a replay would read the captured one) and writes nothing but the
tensors it returns. ``tests/refengine/test_pieces.py`` replays every piece of a whole engine run from its
first capture on CPU and holds the tokens to the reference engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

Carry = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Stage:
    fn: Callable[..., Carry]  # (*carry) -> carry
    core: bool = False  # reads the forward context: runs eagerly in every step


def pure(fn: Callable[..., Carry]) -> Stage:
    return Stage(fn)


def core(fn: Callable[..., Carry]) -> Stage:
    return Stage(fn, core=True)


def run(stages: Sequence[Stage], carry: Carry, pieces=None, name: str = "model") -> Carry:
    """``name`` tells one forward's pieces from another's (the model's, each drafter pass's)."""
    i = 0
    while i < len(stages):
        if stages[i].core:
            carry = stages[i].fn(*carry)
            i += 1
            continue
        j = i
        while j < len(stages) and not stages[j].core:
            j += 1
        fns = [s.fn for s in stages[i:j]]
        if pieces is None:
            for fn in fns:
                carry = fn(*carry)
        else:
            carry = tuple(pieces((name, i), _chained(fns), *carry))
        i = j
    return carry


def _chained(fns: list[Callable[..., Carry]]) -> Callable[..., Carry]:
    def piece(*carry: torch.Tensor) -> Carry:
        for fn in fns:
            carry = fn(*carry)
        return carry

    return piece


class SplitMixer(nn.Module):
    """A mixer that reads the forward context, split around its core for ``mixer_block``: a subclass gives
    ``pre(h, positions) -> parts``, ``core(parts, positions, ctx, cache_key) -> outputs`` and
    ``post(*parts, *outputs) -> [T, H]``; called whole, it runs the three in order."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx, cache_key: int | str) -> torch.Tensor:
        parts = self.pre(x, positions)  # x [T, H] (through the block's norm) -> [T, H]
        return self.post(*parts, *self.core(parts, positions, ctx, cache_key))


class StagedLayer(nn.Module):
    """A decoder layer given as ``stages(ctx, cache_key)`` over (x, positions); called whole, its stages run
    eagerly."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx, cache_key: int | str) -> torch.Tensor:
        return run(self.stages(ctx, cache_key), (x, positions))[0]  # [T, H] -> [T, H]


def mixer_block(norm, mixer, ctx, cache_key, tail: Callable | None = None) -> list[Stage]:
    """``x + mixer(norm(x))`` (then ``tail(x)``) as stages over (x, positions). A ``SplitMixer``'s ``pre`` and
    ``post`` are pure stages around its ``core`` (eager); any other mixer (an MLP, a MoE) is called
    ``mixer(h)`` inside the piece."""
    if not isinstance(mixer, SplitMixer):
        def whole(x, positions):
            x = x + mixer(norm(x))
            return (x if tail is None else tail(x)), positions
        return [pure(whole)]

    def pre(x, positions):
        return (x, positions, *mixer.pre(norm(x), positions))

    def mix(x, positions, *parts):
        return (x, positions, *parts, *mixer.core(parts, positions, ctx, cache_key))

    def post(x, positions, *parts):
        x = x + mixer.post(*parts)
        return (x if tail is None else tail(x)), positions

    return [pure(pre), core(mix), pure(post)]


def aux_stage(ctx, layer: int) -> list[Stage]:
    """The auxiliary-state capture before decoder layer ``layer`` (EAGLE-3's input), a core stage when the
    context wants that layer (a piece boundary, so the captured state is a piece's output); none else."""
    if layer not in ctx.aux_layers:
        return []

    def capture(x, *rest):
        ctx.capture_aux(layer, x)
        return (x, *rest)

    return [core(capture)]


def decoder_stack(embed, layers, final_norm, input_ids: torch.Tensor, positions: torch.Tensor,
                  ctx) -> torch.Tensor:
    """A decoder's forward: ``embed(input_ids)`` [T, H], each layer's stages (layer i's cache key i, the
    auxiliary capture before it), ``final_norm``; run over ``ctx.pieces``. input_ids, positions [T] ->
    [T, H]."""
    stages = [pure(lambda ids, pos: (embed(ids), pos))]
    for i, layer in enumerate(layers):
        stages += aux_stage(ctx, i) + layer.stages(ctx, i)
    stages.append(pure(lambda x, pos: (final_norm(x),)))
    return run(stages, (input_ids, positions), ctx.pieces)[0]
