"""The checks: each is a plain function over one or two traces returning a CheckResult."""

from __future__ import annotations

from conformance.checks.aborts import check_aborts
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
from conformance.checks.invariants import (
    check_full_graph_metadata,
    check_id_range,
    check_new_prompt_prefill,
    check_pools_empty,
    check_runs,
    check_state_slots,
)
from conformance.checks.triggers import TRIGGERS, check_triggers

# Every check name, in report order; expectation files use them as "<scenario-id>/<check>".
CHECK_NAMES = (
    "runs", "tokens", "acceptance", "request-outputs", "aborts", "logits-digests", "spec-lossless",
    "full-graph-metadata", "new-prompt-prefill", "id-range", "state-slots", "pools-empty", "workload-triggers",
)

__all__ = [
    "CHECK_NAMES", "TRIGGERS", "acceptance_history", "check_aborts", "check_acceptance",
    "check_full_graph_metadata", "check_id_range", "check_logits_digests", "check_new_prompt_prefill",
    "check_pools_empty", "check_request_outputs", "check_runs", "check_spec_lossless", "check_state_slots",
    "check_tokens", "check_triggers", "first_difference", "token_window",
]
