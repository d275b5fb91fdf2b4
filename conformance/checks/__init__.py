"""The checks: each is a plain function over one or two traces returning a CheckResult."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conformance.checks.aborts import check_aborts
from conformance.checks.cache_floor import check_cache_floor
from conformance.checks.compare import (
    acceptance_history,
    check_acceptance,
    check_logits_digests,
    check_request_outputs,
    check_spec_lossless,
    check_tokens,
    first_difference,
    token_window,
)
from conformance.checks.drafts import check_drafts
from conformance.checks.invariants import (
    check_full_graph_metadata,
    check_id_range,
    check_new_prompt_prefill,
    check_pools_empty,
    check_runs,
    check_state_slots,
)
from conformance.checks.prefix_cache import check_cache_lossless, check_cached_tokens, check_restored_state
from conformance.checks.sanity import check_degenerate_run, check_output_records
from conformance.checks.triggers import CACHE_TRIGGERS, TRIGGERS, check_triggers
from conformance.results import NA, CheckResult


@dataclass(frozen=True)
class CheckInputs:
    """What a check may look at for one scenario: its traces and the run's facts."""

    scenario: Any  # conformance.workloads.Scenario
    ref: Any  # Trace of the reference engine
    test: Any  # Trace of the engine under test
    plain: Any  # Trace of the plain (K=0, no aborts) reference run, or None
    vocab_size: int
    batch_invariant: bool  # the engine under test claims bitwise batch invariance
    strict_triggers: bool  # the shipped model: a trigger it cannot produce is a failure, not a warning
    cached: Any = None  # Trace of the reference engine with the scenario's prefix caching, or None
    test_plain: Any = None  # Trace of the engine under test on the plain workload (K=0), or None

    @property
    def aborted(self) -> set[str]:
        return set(self.scenario.aborted)


def _logits_digests(c: CheckInputs) -> CheckResult:
    if not c.batch_invariant:
        return CheckResult("logits-digests", NA, "the engine under test is not batch-invariant")
    return check_logits_digests(c.ref, c.test)


# Every check, in report order: (name, function of CheckInputs). Expectation files name them as
# "<scenario-id>/<check>". A new check is one function and one line here.
CHECKS: tuple[tuple[str, Callable[[CheckInputs], CheckResult]], ...] = (
    ("runs", lambda c: check_runs(c.test, [r.request_id for r in c.scenario.requests])),
    ("tokens", lambda c: check_tokens(c.ref, c.test, skip=c.aborted)),
    ("output-records", lambda c: check_output_records(c.test)),
    ("acceptance", lambda c: check_acceptance(c.ref, c.test, aborted=c.aborted)),
    ("drafts", lambda c: check_drafts(c.ref, c.test, c.scenario.k, aborted=c.aborted)),
    ("request-outputs", lambda c: check_request_outputs(c.ref, c.test, c.scenario.k)),
    ("aborts", lambda c: check_aborts(c.scenario, c.ref, c.test, c.plain)),
    ("logits-digests", _logits_digests),
    (
        "spec-lossless",
        lambda c: check_spec_lossless(c.plain if c.scenario.k else None, c.test, skip=c.aborted,
                                      test_plain=c.test_plain),
    ),
    ("cache-lossless", lambda c: check_cache_lossless(c.scenario, c.ref, c.cached)),
    ("cached-tokens", lambda c: check_cached_tokens(c.scenario, c.test)),
    ("cache-floor", lambda c: check_cache_floor(c.scenario, c.test)),
    ("restored-state", lambda c: check_restored_state(c.scenario, c.ref, c.test, c.batch_invariant)),
    ("full-graph-metadata", lambda c: check_full_graph_metadata(c.test)),
    ("new-prompt-prefill", lambda c: check_new_prompt_prefill(c.test)),
    ("id-range", lambda c: check_id_range(c.test, c.vocab_size)),
    ("state-slots", lambda c: check_state_slots(c.test)),
    ("pools-empty", lambda c: check_pools_empty(c.test)),
    ("degenerate-run", lambda c: check_degenerate_run(c.ref, c.test)),
    (
        "workload-triggers",
        lambda c: check_triggers(c.scenario, c.ref, strict=c.strict_triggers, cached=c.cached),
    ),
)
CHECK_NAMES = tuple(name for name, _ in CHECKS)
# The checks that read the "plain" or the "cached" run: a fail-fast evaluation runs the others first, and
# those two runs only when none of them failed.
LATE = frozenset({"aborts", "spec-lossless", "cache-lossless", "workload-triggers"})

# The StepRecord / RowRecord fields (and optional RequestOutput ones) a check reads from the engine under
# test: when its records lack one (an adapter of another engine), the check is n/a, never a pass over what
# happens to be there.
NEEDS: dict[str, tuple[str, ...]] = {
    "acceptance": ("rows", "kind", "draft_token_ids", "output_token_ids", "num_accepted"),
    "drafts": ("rows", "kind", "num_computed_tokens", "query_len", "output_token_ids", "drafter_input_ids",
               "next_draft_token_ids"),
    "logits-digests": ("rows", "logits_digest"),
    "full-graph-metadata": ("rows", "graph_mode", "num_reqs_padded", "gdn_metadata_shapes"),
    "new-prompt-prefill": (
        "rows",
        "kind",
        "num_computed_tokens",
        "query_len",
        "has_initial_state",
        "state_slot_read",
        "input_ids",
    ),
    "id-range": ("rows", "input_ids", "drafter_input_ids", "draft_token_ids", "next_draft_token_ids"),
    "state-slots": ("rows", "state_slot_read"),
    "output-records": ("rows", "output_token_ids"),
    "cached-tokens": ("num_cached_tokens",),
    "cache-floor": ("num_cached_tokens", "rows", "num_computed_tokens", "query_len"),
    "restored-state": (
        "num_cached_tokens",
        "rows",
        "kind",
        "num_computed_tokens",
        "query_len",
        "has_initial_state",
    ),
}


def lacking(name: str, missing_fields) -> list[str]:
    """The fields check ``name`` needs that the records lacked."""
    return [f for f in NEEDS.get(name, ()) if f in missing_fields]

__all__ = [
    "CACHE_TRIGGERS",
    "CHECKS",
    "CHECK_NAMES",
    "LATE",
    "NEEDS",
    "TRIGGERS",
    "CheckInputs",
    "acceptance_history",
    "check_aborts",
    "check_acceptance",
    "check_cache_floor",
    "check_cache_lossless",
    "check_cached_tokens",
    "check_degenerate_run",
    "check_drafts",
    "check_full_graph_metadata",
    "check_id_range",
    "check_logits_digests",
    "check_new_prompt_prefill",
    "check_pools_empty",
    "check_request_outputs",
    "check_restored_state",
    "check_runs",
    "check_spec_lossless",
    "check_state_slots",
    "check_tokens",
    "check_triggers",
    "first_difference",
    "lacking",
    "token_window",
]
