"""The draft-model record, re-created in one async engine instance's draft-model proposer.

Each replaces a method of the instance's proposer (``engine.runner.proposer``); an engine drafting with
anything else is left as it is. Scenario ``draft-model-k3`` (the run's model cut to layers 0 and 3: on the
embedded default model a GDN layer and an attention layer) catches both.
"""

from __future__ import annotations

import torch

from conformance.mutants.base import Mutant
from refengine.drafters.draft_model import DraftModelDeviceProposer

SCENARIO = "draft-model-k3"


def _proposer(engine) -> DraftModelDeviceProposer | None:
    proposer = getattr(engine.runner, "proposer", None)
    return proposer if isinstance(proposer, DraftModelDeviceProposer) else None


def _state_not_rolled_back(engine) -> None:
    """mlx-lm #1109: the chained passes run in the request's live state slot, not a scratch copy of it, so
    the state the next verify reads has advanced over the bonus token and the drafts, rejected or not."""
    proposer = _proposer(engine)
    if proposer is not None:
        proposer.chain_slots = lambda slot0, live_slot, live: torch.where(live, live_slot, slot0)


def _kv_not_rewound(engine) -> None:
    """The chained passes continue from the end of the verify query, past its rejected positions, instead
    of from the last kept one: the draft KV and positions of the chain sit where the rejected drafts were."""
    proposer = _proposer(engine)
    if proposer is None:
        return
    base = proposer.chain_base

    def past_rejected(d):
        qlen = (d.query_start_loc[1:] - d.query_start_loc[:-1]).long()
        return base(d) + qlen - d.kept

    proposer.chain_base = past_rejected


def draft_model_mutants() -> tuple:
    """The mutants of the draft-model drafter."""
    contract = "issue 35: a draft model keeps the target's slot contract (read at a-1 after a verify)"
    return (
        Mutant("draft-model-state-not-rolled-back", "mlx-lm #1109", contract,
               "a hybrid draft model's chained passes advance its live recurrent state: a rejected draft "
               "stays in the state the next step reads", _state_not_rolled_back, scenarios=(SCENARIO,)),
        Mutant("draft-model-kv-not-rewound", "own", contract,
               "after rejections the draft model's chain writes its KV and positions past the rejected "
               "drafts, not at the last kept position", _kv_not_rewound, scenarios=(SCENARIO,)),
    )
