"""The checks catch deliberately corrupted traces, and pass on the real ones they were taken from."""

from __future__ import annotations

import copy

import pytest

from conformance import checks
from conformance.results import FAIL, NA, PASS
from conformance.workloads import get_def

SCENARIO = "short-prompts-mixed-k3"  # new short prompts next to running decodes, K=3 verify steps
CACHING_ONLY = {"cache-lossless", "restored-state", "cache-floor"}  # n/a without prefix caching
# n/a for requests without parameters (the statistical ones: without groups of seeded sampled requests)
PARAMS_ONLY = {"logprobs", "params-change-output", "sampler-frequencies", "spec-distribution",
               "structured-outputs"}


@pytest.fixture(scope="module")
def run(recorded_run):
    result, traces = recorded_run(SCENARIO)
    assert result.ok, result.checks
    return result, traces


@pytest.fixture
def traces(run):
    return copy.deepcopy(run[1])


def test_real_traces_pass_every_check(run):
    result, _ = run
    statuses = {c.check: c.status for c in result.checks}
    assert set(statuses) == set(checks.CHECK_NAMES)
    assert statuses["full-graph-metadata"] == NA  # the reference engine runs no graphs
    assert statuses["aborts"] == NA  # the workload aborts nothing
    assert all(statuses[name] == NA for name in CACHING_ONLY)  # the workload runs without prefix caching
    assert all(statuses[name] == NA for name in PARAMS_ONLY)  # its requests carry no parameters
    assert statuses["rescored"] == NA  # the exact verdict compares the tokens bitwise ('tokens')
    assert all(
        s == PASS
        for name, s in statuses.items()
        if name not in {"full-graph-metadata", "aborts", "rescored", *CACHING_ONLY, *PARAMS_ONLY}
    )


def test_flipped_token_reports_first_divergence(traces):
    req = traces["test"].requests["r01"]
    req.token_ids[3] = (req.token_ids[3] + 1) % 256
    req.token_ids[6] = (req.token_ids[6] + 1) % 256  # a later difference must not hide the first
    result = checks.check_tokens(traces["reference"], traces["test"])
    assert result.status == FAIL and result.request_id == "r01"
    assert result.details["position"] == 3
    assert f"[{req.token_ids[3]}]" in result.report
    assert "acceptance per verify step" in result.report
    assert result.details["verify_step"] is not None  # position 3 came out of a verify step (K=3)


def test_length_and_finish_reason_differences_are_divergences(traces):
    req = traces["test"].requests["r00"]
    del req.token_ids[-1]
    result = checks.check_tokens(traces["reference"], traces["test"])
    assert result.failed and result.details["position"] == len(req.token_ids)
    assert "[end]" in result.report


def test_changed_accepted_count_fails_acceptance(traces):
    req = traces["test"].requests["r02"]
    drafted, accepted = req.acceptance[1]
    req.acceptance[1] = (drafted, (accepted + 1) % (drafted + 1))
    result = checks.check_acceptance(traces["reference"], traces["test"])
    assert result.failed and result.request_id == "r02" and result.details["verify_step"] == 1
    assert "verify step 1" in result.summary


def _make_full(step, padded: int, per_request: int, offsets: int):
    step.graph_mode = "full"
    step.num_reqs_padded = padded
    k1 = 4  # K+1 state slots per request
    step.metadata_shapes = {
        "decode.query_start_loc": [offsets],
        "decode.state_indices": [per_request, k1],
        "decode.num_accepted_tokens": [per_request],
    }


def test_full_graph_metadata_sized_by_tokens_fails(traces):
    step = next(
        s for s in traces["test"].steps if len(s.rows) == 3 and all(r.kind == "decode" for r in s.rows)
    )
    _make_full(step, padded=4, per_request=4, offsets=5)
    assert checks.check_full_graph_metadata(traces["test"]).status == PASS
    tokens = sum(r.query_len for r in step.rows)  # 3 rows x (1 + K) = 12 tokens
    _make_full(step, padded=4, per_request=tokens, offsets=tokens + 1)
    result = checks.check_full_graph_metadata(traces["test"])
    assert result.failed and result.details["step"] == step.index
    assert f"leading dimension {tokens + 1}, expected 5" in result.summary


def test_full_graph_step_without_padded_count_fails(traces):
    step = traces["test"].steps[-1]
    _make_full(step, padded=4, per_request=4, offsets=5)
    step.num_reqs_padded = None
    assert checks.check_full_graph_metadata(traces["test"]).failed


def _first_new_short_row(trace):
    return next(r for s in trace.steps for r in s.rows if r.num_computed_tokens == 0 and r.query_len <= 5
                and len(s.rows) > 1)


@pytest.mark.parametrize("corruption", ["decode", "initial-state", "slot-read"])
def test_short_prompt_misclassified_fails(traces, corruption):
    row = _first_new_short_row(traces["test"])
    if corruption == "decode":
        row.kind = "decode"
    elif corruption == "initial-state":
        row.has_initial_state = True
    else:
        row.state_slot_read = 7
    result = checks.check_new_prompt_prefill(traces["test"])
    assert result.failed and result.request_id == row.request_id
    assert "alongside" in result.report  # it shared the step with running decodes


@pytest.mark.parametrize("field, value", [("drafter_input_ids", -1), ("input_ids", 256),
                                          ("next_draft_token_ids", -1), ("draft_token_ids", 1 << 20)])
def test_out_of_range_ids_fail(traces, field, value):
    row = next(r for s in traces["test"].steps for r in s.rows if getattr(r, field))
    getattr(row, field)[0] = value
    result = checks.check_id_range(traces["test"], vocab_size=256)
    assert result.failed and result.details == {"step": row.step, "field": field, "value": value}


def test_shared_state_slot_fails(traces):
    step = next(s for s in traces["test"].steps if sum(r.state_slot_read is not None for r in s.rows) >= 2)
    a, b = [r for r in step.rows if r.state_slot_read is not None][:2]
    b.state_slot_read = a.state_slot_read
    assert checks.check_state_slots(traces["test"]).failed


def test_pools_left_allocated_fail(traces):
    traces["test"].occupancy = None  # the fallbacks of an instance without occupancy()
    traces["test"].pools_empty = False
    assert checks.check_pools_empty(traces["test"]).failed
    traces["test"].pools_empty, traces["test"].request_slots_in_use = None, None
    assert checks.check_pools_empty(traces["test"]).status == NA


def test_pools_empty_reads_the_engines_occupancy(traces):
    """The real engine's figures are in the verdict; a pool still in use fails, named with its count."""
    occ = traces["test"].occupancy
    assert occ is not None and occ["kv_blocks_free"] > 0 and occ["kv_blocks_used"] == 0
    ok = checks.check_pools_empty(traces["test"])
    assert ok.status == PASS and f"KV blocks 0 used / {occ['kv_blocks_free']} free" in ok.summary
    for key, words in (("kv_blocks_used", "2 KV blocks"), ("state_slots_used", "2 state slots"),
                       ("request_slots_used", "2 request slots"), ("running", "2 running requests")):
        traces["test"].occupancy = {**occ, key: 2}
        result = checks.check_pools_empty(traces["test"])
        assert result.failed and words in result.summary, (key, result.summary)


def test_logits_digest_difference_fails(traces):
    req = traces["test"].requests["r03"]
    pos, rows, _ = req.logits[1]
    req.logits[1] = (pos, rows, "0" * 16)
    result = checks.check_logits_digests(traces["reference"], traces["test"])
    assert result.failed and result.details["position"] == pos


def test_speculation_that_changes_output_fails_lossless(traces):
    for trace in (traces["reference"], traces["test"]):  # both engines agree, both wrong
        trace.requests["r04"].token_ids[0] ^= 1
    assert checks.check_tokens(traces["reference"], traces["test"]).status == PASS
    result = checks.check_spec_lossless(traces["plain"], traces["test"])
    assert result.failed and result.details["position"] == 0
    assert "plain greedy" in result.report


def test_engine_error_fails_runs(traces):
    traces["test"].error = "Traceback (most recent call last):\nRuntimeError: boom\n"
    result = checks.check_runs(traces["test"], list(traces["reference"].requests))
    assert result.failed and "RuntimeError: boom" in result.summary


def test_workload_that_stops_hitting_its_trigger_fails(traces):
    scenario = get_def(SCENARIO).materialize("default", 256)
    for step in traces["reference"].steps:  # pretend new prompts never met running decodes
        step.rows = [r for r in step.rows if r.num_computed_tokens > 0] or step.rows[:1]
    result = checks.check_triggers(scenario, traces["reference"])
    assert result.failed and "mixed-batch" in result.details["missed"]


def test_missed_trigger_on_a_users_checkpoint_is_not_exercised_not_failed(traces):
    scenario = get_def(SCENARIO).materialize("default", 256)
    for step in traces["reference"].steps:
        step.rows = [r for r in step.rows if r.num_computed_tokens > 0] or step.rows[:1]
    result = checks.check_triggers(scenario, traces["reference"], strict=False)
    assert result.status == NA and "mixed-batch" in result.details["not_exercised"]
    assert SCENARIO in result.details["warning"] and "not exercised" in result.summary
    assert checks.check_triggers(scenario, traces["test"], strict=False).status == PASS


def test_public_counters_must_match_their_history_and_prompts_the_reference(traces):
    assert checks.check_request_outputs(traces["reference"], traces["test"], 3).status == PASS
    rid = next(r for r, q in sorted(traces["test"].requests.items()) if q.acceptance)
    req = traces["test"].requests[rid]
    req.num_accepted_tokens += 1  # the counter no longer describes the history
    result = checks.check_request_outputs(traces["reference"], traces["test"], 3)
    assert result.failed and result.request_id == rid and "num_accepted_tokens" in result.summary
    req.num_accepted_tokens -= 1
    req.num_draft_tokens -= 1
    assert "num_draft_tokens" in checks.check_request_outputs(traces["reference"], traces["test"], 3).summary
    req.num_draft_tokens += 1
    req.prompt_token_ids = req.prompt_token_ids[:-1]
    assert (
        checks.check_request_outputs(traces["reference"], traces["test"], 3).details["field"]
        == "prompt_token_ids"
    )


def test_text_is_compared_where_the_tokens_agree(traces):
    rid = min(traces["test"].requests)
    traces["reference"].requests[rid].text, traces["test"].requests[rid].text = "abc", "abd"
    result = checks.check_request_outputs(traces["reference"], traces["test"], 3)
    assert result.failed and result.details["field"] == "text"
    traces["test"].requests[rid].token_ids.append(1)  # differing tokens: the "tokens" check's failure
    assert checks.check_request_outputs(traces["reference"], traces["test"], 3).status == PASS


def test_the_reported_seed_is_compared(traces):
    """Both engines draw an unseeded request's seed the same way at admission and report it: a run replays
    from what it reported only if the engine under test reports the seed the reference does."""
    rid = min(traces["test"].requests)
    assert traces["reference"].requests[rid].seed == traces["test"].requests[rid].seed is not None
    traces["test"].requests[rid].seed += 1
    result = checks.check_request_outputs(traces["reference"], traces["test"], 3)
    assert result.failed and result.details["field"] == "seed" and result.request_id == rid
    traces["test"].requests[rid].seed = None  # an engine that reports none: nothing to compare
    assert checks.check_request_outputs(traces["reference"], traces["test"], 3).status == PASS


def test_a_verify_step_drafting_more_than_k_fails_request_outputs(traces):
    req = next(q for _, q in sorted(traces["test"].requests.items()) if q.acceptance)
    req.acceptance[0] = (4, 0)
    req.num_draft_tokens = sum(d for d, _ in req.acceptance)
    result = checks.check_request_outputs(traces["reference"], traces["test"], 3)
    assert result.failed and "K=3" in result.summary


def test_request_slots_left_in_use_fail_pools_empty(traces):
    traces["test"].occupancy = None
    traces["test"].request_slots_in_use = 0
    assert "request slots" in checks.check_pools_empty(traces["test"]).summary
    traces["test"].request_slots_in_use = 2
    result = checks.check_pools_empty(traces["test"])
    assert result.failed and "2 request slot(s)" in result.summary
    traces["test"].pools_empty, traces["test"].request_slots_in_use = None, None
    assert checks.check_pools_empty(traces["test"]).status == NA


def test_an_output_handed_back_twice_fails_runs(traces):
    traces["test"].duplicate_outputs.append("r01")
    result = checks.check_runs(traces["test"], list(traces["reference"].requests))
    assert result.failed and result.request_id == "r01"


def test_helpers():
    assert checks.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert checks.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert checks.first_difference([1, 2], [1, 2, 3]) == 2
    assert checks.token_window(list(range(20)), 10, width=2) == "... 8 9 [10] 11 12 ..."
    assert checks.token_window([1, 2], 2) == "1 2 [end]"
    assert checks.acceptance_history([(3, 1), (3, 3)], mark=1) == "3/1 [3/3]"


def test_a_degenerate_model_fails_even_when_both_engines_agree(traces):
    """NaN or constant weights make both engines emit one token forever: that is no pass."""
    ref, test = traces["reference"], traces["test"]
    assert checks.check_degenerate_run(ref, test).status == PASS
    assert any(row.logits_finite for s in ref.steps for row in s.rows), "records carry the finite-logits flag"
    for trace in (ref, test):
        for req in trace.requests.values():
            req.token_ids = [0] * max(len(req.token_ids), 4)
    result = checks.check_degenerate_run(ref, test)
    assert result.failed and "only token 0" in result.summary


def test_non_finite_logits_fail(traces):
    row = next(r for s in traces["test"].steps for r in s.rows if r.logits_finite is not None)
    row.logits_finite = False
    result = checks.check_degenerate_run(traces["reference"], traces["test"])
    assert result.failed and "non-finite logits" in result.summary and result.request_id == row.request_id


class _SparseRecords:
    """The reference engine seen through an adapter whose step records lack some RowRecord fields."""

    def __init__(self, dropped: tuple[str, ...]):
        from conformance.engines import reference_adapter

        self.inner, self.dropped, self.name = reference_adapter(), dropped, "sparse-records"

    def supports(self, feature: str) -> bool:
        return self.inner.supports(feature)

    def start(self, spec):
        import dataclasses
        from types import SimpleNamespace

        def strip(record):
            rows = [SimpleNamespace(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)
                                       if f.name not in self.dropped}) for r in record.rows]
            return SimpleNamespace(**{**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)},
                                      "rows": rows})

        return self.inner.start(
            dataclasses.replace(spec, observer=lambda record: spec.observer(strip(record)))
        )


@pytest.mark.parametrize("dropped, na", [
    (("drafter_input_ids", "next_draft_token_ids"), {"id-range", "drafts"}),
    (("state_slot_read",), {"state-slots", "new-prompt-prefill"}),
])
def test_checks_needing_a_field_the_records_lack_are_not_applicable(small_case, dropped, na):
    """Not a pass over whatever fields happen to be there: the check says which field it lacked."""
    import dataclasses

    from conformance.harness import run_scenario

    case = dataclasses.replace(small_case, engine="sparse-records", adapter=_SparseRecords(dropped))
    result, traces = run_scenario("short-prompts-k1", case)
    by_name = {c.check: c for c in result.checks}
    assert traces["test"].missing_fields == list(dropped)
    for name in na:
        assert by_name[name].status == NA and dropped[0] in by_name[name].summary, by_name[name]
    skip = na | {"aborts", "full-graph-metadata", "rescored"} | CACHING_ONLY | PARAMS_ONLY
    assert all(c.status == PASS for c in result.checks if c.check not in skip)


def test_the_checks_and_the_harness_know_no_engine():
    """The suite is engine-agnostic: the checks, the harness and the traces import nothing from refengine
    (refengine's own adapter lives in conformance/engines.py)."""
    import ast
    from pathlib import Path

    import conformance

    root = Path(conformance.__file__).parent
    files = [
        *root.joinpath("checks").glob("*.py"),
        root / "harness.py",
        root / "trace.py",
        root / "results.py",
    ]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "refengine"]
    assert not offenders, offenders
