"""The conformance suite on MoE checkpoints: scenarios pass and the seed-bug mutants are still caught."""

from __future__ import annotations

import io

import pytest

from conformance.cli import main
from conformance.model import describe_model
from conformance.mutants import MUTANTS, get_mutant
from conformance.mutants.run import format_score, run_mutant

# Scenarios whose traffic exercises MoE routing under moving batches, MTP drafts and logits digests.
SCENARIOS = ("churn-k1", "mtp-k3", "short-prompts-mixed-k3")


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_checkpoint_dir):
    return tiny_checkpoint_dir("next-moe")  # every layer sparse, MTP layer sparse too


def test_moe_checkpoint_is_described(moe_checkpoint):
    facts = describe_model(moe_checkpoint)
    assert facts.has_mtp and facts.vocab_size == 256


def test_conformance_run_passes_on_moe(moe_checkpoint):
    argv = ["run", "--engine", "async", "--tier", "default", "--model", moe_checkpoint]
    for scenario in SCENARIOS:
        argv += ["--scenario", scenario]
    out = io.StringIO()
    code = main(argv, out=out)
    assert code == 0, out.getvalue()
    n = len(SCENARIOS)
    assert f"{n} scenarios" in out.getvalue() and f"{n} passed, 0 failed" in out.getvalue()


# The MoE layers change the MLP only; one mutant per bug class runs in the default tier (every mutant
# runs on the dense checkpoint in test_mutants.py), the rest with -m slow.
ON_MOE = ("stale-accepted-counts", "zero-draft-reads-first-slot", "pc-stale-kept-counts")


@pytest.mark.parametrize("mutant_id", [m.id if m.id in ON_MOE else pytest.param(m.id, marks=pytest.mark.slow)
                                       for m in MUTANTS])
def test_mutant_is_caught_on_moe(moe_checkpoint, mutant_id):
    result = run_mutant(get_mutant(mutant_id), moe_checkpoint, "default", preferred_only=True)
    assert result.caught, format_score([result])
