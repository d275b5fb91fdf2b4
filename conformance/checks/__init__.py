"""The checks: each is a plain function over one or two traces returning a CheckResult, declared once
beside it with ``@check`` (see registry.py): its name, the traces it reads, the record fields it needs."""

from __future__ import annotations

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
from conformance.checks.params import check_logprobs, check_params_change_output, check_stop_semantics
from conformance.checks.prefix_cache import check_cache_lossless, check_cached_tokens, check_restored_state
from conformance.checks.registry import (
    Check,
    CheckInputs,
    check,
    declaration,
    declared,
    declaring,
)
from conformance.checks.rescored import check_rescored, judge
from conformance.checks.sanity import check_degenerate_run, check_output_records
from conformance.checks.statistics import check_sampler_frequencies, check_spec_distribution
from conformance.checks.structured import check_structured_outputs
from conformance.checks.triggers import CACHE_TRIGGERS, TRIGGERS, check_triggers


def lacking(name: str, missing_fields) -> list[str]:
    """The fields check ``name`` needs that the records lacked."""
    c = declaration(name)
    return c.lacking(missing_fields) if c is not None else []


def __getattr__(name: str):
    # Read from the declarations on each use, so a check a test declares for a while is among them.
    if name == "CHECK_NAMES":  # every check's name, in report order
        return tuple(c.name for c in declared())
    if name == "NEEDS":  # the record fields each check needs of the engine under test (see Check.needs)
        return {c.name: c.needs for c in declared() if c.needs}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CACHE_TRIGGERS",
    "CHECK_NAMES",
    "NEEDS",
    "TRIGGERS",
    "Check",
    "CheckInputs",
    "acceptance_history",
    "check",
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
    "check_logprobs",
    "check_new_prompt_prefill",
    "check_output_records",
    "check_params_change_output",
    "check_pools_empty",
    "check_request_outputs",
    "check_rescored",
    "check_restored_state",
    "check_runs",
    "check_sampler_frequencies",
    "check_spec_distribution",
    "check_spec_lossless",
    "check_state_slots",
    "check_stop_semantics",
    "check_structured_outputs",
    "check_tokens",
    "check_triggers",
    "declaration",
    "declared",
    "declaring",
    "first_difference",
    "judge",
    "lacking",
    "token_window",
]
