"""The EAGLE drafters' record (issue 35), re-created in one async engine instance.

Each patches the instance's EAGLE proposer (``engine.runner.proposer``: its head, positions or chained
input), its runner's auxiliary layer ids, its step-input staging or its prefix cache. ``eagle3-k3`` (the
suite's seeded EAGLE-3 head, whose drafts are mostly rejected) catches the drafter's through the drafts
check; ``pc-eagle3-k3`` the prefix cache's through the cached-token bounds.
"""

from __future__ import annotations

import torch

from conformance.mutants.base import Mutant

SCENARIO = "eagle3-k3"
CACHED = "pc-eagle3-k3"


def _proposer(engine):
    proposer = engine.runner.proposer
    if getattr(proposer, "head", None) is None:
        raise TypeError("an EAGLE mutant needs an engine drafting with an EAGLE head")
    return proposer


def _aux_from_neighbour(engine) -> None:
    """The auxiliary states are taken one layer early: the state after layer i-1 for id i."""
    runner = engine.runner
    if runner.aux_layers:
        runner.aux_layers = tuple(max(i - 1, 0) if i else 1 for i in runner.aux_layers)
        runner.proposer.aux_layers = runner.aux_layers


def _d2t_not_applied(engine) -> None:
    """The draft vocabulary's ids are proposed as target ids (``d2t`` never added)."""
    head = engine.runner.proposer.head
    if getattr(head, "d2t", None) is not None:
        head.d2t = torch.zeros_like(head.d2t)


def _kv_not_rewound(engine) -> None:
    """The chained passes run at positions after every verified token, rejected ones included: the head's KV
    and RoPE positions are not rewound to the kept tokens."""
    proposer = _proposer(engine)
    chain_positions = proposer.chain_positions

    def unrewound(d):
        query = (d.query_start_loc[1:] - d.query_start_loc[:-1]).long()
        rejected = torch.where(d.is_sampling, query - d.kept, torch.zeros_like(query))
        return chain_positions(d) + rejected

    proposer.chain_positions = unrewound


def _chain_fed_target_hidden(engine) -> None:
    """The first chained pass is fed the target's hidden state at the last kept position, not the head's."""
    proposer = _proposer(engine)

    def target_hidden(d, for_chain, last):
        return d.hidden[last]

    proposer.chain_hidden = target_hidden


def _keeps_last_block(engine) -> None:
    """Prefix caching with an EAGLE drafter hits its whole matched KV run: the head's KV at the last block's
    last position was written paired with another request's next token."""
    prefix = engine.core.scheduler.prefix
    if prefix is not None:
        prefix.drop_last_block = False


def eagle_mutants(shared_host_buffer) -> tuple:
    """The mutants of the EAGLE drafters; ``shared_host_buffer``: seed 001's patch (conformance.mutants)."""
    drafter = "issue 35: the EAGLE head computes what vLLM's computes"
    return (
        Mutant("eagle-shared-host-buffer", "seed 001 (async scheduling x spec decode), on EAGLE",
               "contract 7: host buffers",
               "with an EAGLE drafter, the step inputs the target and the drafter read are staged in one "
               "host buffer the next step rewrites while the copy is pending", shared_host_buffer,
               scenarios=(SCENARIO,)),
        Mutant("eagle3-aux-neighbour-layer", "own (EAGLE-3)", drafter,
               "EAGLE-3's auxiliary hidden states are taken from the layer before each configured id",
               _aux_from_neighbour, scenarios=(SCENARIO,)),
        Mutant("eagle3-d2t-not-applied", "own (EAGLE-3)", drafter,
               "an EAGLE-3 head with a reduced draft vocabulary proposes draft ids as target ids (no d2t)",
               _d2t_not_applied, scenarios=(SCENARIO,)),
        Mutant("eagle-kv-not-rewound", "own (EAGLE)", "contract 5: drafter inputs are committed tokens",
               "after a rejection the head's chained passes run at the positions past the rejected drafts",
               _kv_not_rewound, scenarios=(SCENARIO,)),
        Mutant("eagle-chain-target-hidden", "own (EAGLE)", drafter,
               "the chained passes are fed the target's hidden state instead of the head's own output",
               _chain_fed_target_hidden, scenarios=(SCENARIO,)),
        Mutant("eagle-pc-keeps-last-block", "own (EAGLE x prefix caching)",
               "contract 9: a hit is what vLLM's cache manager gives",
               "with an EAGLE drafter a prefix-cache hit keeps the last block of its matched run",
               _keeps_last_block, scenarios=(CACHED,)),
    )
