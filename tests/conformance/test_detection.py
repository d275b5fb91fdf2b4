"""The checks that bound cache hits from below and compare drafts, the geometry triggers, and failing fast:
each passes on real traces and fails on the corruption it exists for."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from conformance.checks.cache_floor import check_cache_floor, floor
from conformance.checks.drafts import check_drafts
from conformance.checks.prefix_cache import Timeline
from conformance.checks.triggers import TRIGGERS
from conformance.results import FAIL, NA, PASS
from conformance.trace import RequestTrace, RowTrace, StepTrace, Trace
from conformance.workloads import EngineSettings, RequestSpec, Scenario, get_def

# ---- cache-floor -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eviction_order(recorded_run, small_case):
    result, traces = recorded_run("prefix-eviction-order-k0")
    assert result.ok, result.checks
    scenario = get_def("prefix-eviction-order-k0").materialize("default", small_case.facts.vocab_size)
    return scenario, traces


def test_cache_floor_pins_the_request_a_pressured_pool_must_still_serve(eviction_order):
    scenario, traces = eviction_order
    test = traces["test"]
    assert check_cache_floor(scenario, test).status == PASS
    f = floor("r05", scenario, test, Timeline(test))
    assert f.lower == 12 and "r03" in f.sources  # the newest source survives the filler
    assert "r00" in f.dropped  # the oldest was evictable: r06, its next turn, is not held to it
    assert floor("r06", scenario, test, Timeline(test)).lower == 0


def test_a_cache_that_evicts_the_newest_blocks_fails_the_floor(eviction_order):
    scenario, traces = eviction_order
    test = copy.deepcopy(traces["test"])
    test.requests["r05"].num_cached_tokens = 4
    result = check_cache_floor(scenario, test)
    assert result.status == FAIL and result.request_id == "r05"
    assert result.details["lower"] == 12 and "at least 12" in result.summary


def test_a_pool_too_small_for_the_window_gives_no_floor(eviction_order):
    """The survival rule: with half the pool, the filler alone may have evicted the source."""
    scenario, traces = eviction_order
    small = dataclasses.replace(scenario, settings=dataclasses.replace(scenario.settings, num_kv_blocks=8))
    test = copy.deepcopy(traces["test"])
    test.requests["r05"].num_cached_tokens = 0
    assert floor("r05", small, test, Timeline(test)).lower == 0
    assert check_cache_floor(small, test).status == PASS


def test_cache_floor_is_not_applicable_without_caching_or_a_pool_size(eviction_order):
    scenario, traces = eviction_order
    off = dataclasses.replace(scenario, settings=scenario.settings.uncached())
    sized = dataclasses.replace(scenario, settings=dataclasses.replace(scenario.settings, num_kv_blocks=None))
    assert check_cache_floor(off, traces["test"]).status == NA
    assert check_cache_floor(sized, traces["test"]).status == NA


# ---- drafts ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_run(recorded_run):
    result, traces = recorded_run("short-prompts-mixed-k3")
    assert result.ok, result.checks
    return traces


def _sampling_rows(trace: Trace, rid: str) -> list[RowTrace]:
    return [r for r in trace.rows_of(rid) if r.output_token_ids is not None]


def test_drafts_pass_on_real_traces_and_name_the_row_that_differs(mtp_run):
    traces = copy.deepcopy(mtp_run)
    assert check_drafts(traces["reference"], traces["test"], 3).status == PASS
    row = _sampling_rows(traces["test"], "r00")[1]
    row.drafter_input_ids[0] = (row.drafter_input_ids[0] + 1) % 256
    result = check_drafts(traces["reference"], traces["test"], 3)
    assert result.status == FAIL and result.request_id == "r00"
    assert result.details["field"] == "drafter_input_ids" and result.details["step"] == row.step


def test_next_drafts_are_compared_even_where_acceptance_agrees(mtp_run):
    traces = copy.deepcopy(mtp_run)
    row = _sampling_rows(traces["test"], "r01")[0]
    row.next_draft_token_ids[-1] = (row.next_draft_token_ids[-1] + 1) % 256
    result = check_drafts(traces["reference"], traces["test"], 3)
    assert result.status == FAIL and result.details["field"] == "next_draft_token_ids"


def test_the_row_a_request_finishes_in_is_not_compared(mtp_run):
    """The reference engine drafts nothing for a request that is done; an engine a step ahead may."""
    traces = copy.deepcopy(mtp_run)
    _sampling_rows(traces["test"], "r00")[-1].next_draft_token_ids = [1, 2, 3]
    assert check_drafts(traces["reference"], traces["test"], 3).status == PASS
    assert check_drafts(traces["reference"], traces["test"], 0).status == NA


# ---- geometry triggers -------------------------------------------------------------------------------


def _row(rid, step, kind, start, qlen, out=None):
    positions = list(range(start, start + qlen))
    return RowTrace(step, rid, kind, start > 0, start, qlen, None, 0, [1] * qlen, positions,
                    [], out, None if out is None else len(out) - 1, None, [], [])


def _trace(rows_by_step, requests) -> Trace:
    t = Trace("x", "s")
    t.steps = [StepTrace(i, "none", None, {}, [], rows) for i, rows in enumerate(rows_by_step)]
    for rid, (prompt, tokens, cached, reason) in requests.items():
        t.requests[rid] = RequestTrace(rid, list(prompt), list(tokens), reason, [(3, 1)],
                                       num_cached_tokens=cached)
    return t


def _scenario(**settings) -> Scenario:
    return Scenario("s", "", "default", EngineSettings(**settings), (RequestSpec("r00", (1,), 1),))


def _holds(trigger: str, scenario: Scenario, trace: Trace) -> bool:
    return TRIGGERS[trigger][1](scenario, trace)


def test_boundaries_in_one_step_and_checkpoint_inside_step():
    sc = _scenario(num_speculative_tokens=3, block_size=2, enable_prefix_caching=True)
    prompt = (5, 6, 7)
    source = _row("r00", 1, "decode", 3, 4, [8, 9, 10, 11])  # kept 3..7: boundaries 4 and 6 inside
    t = _trace([[_row("r00", 0, "prefill", 0, 3, [8])], [source], [_row("r01", 2, "prefill", 4, 2, [1])]],
               {"r00": (prompt, (8, 9, 10, 11, 12), 0, "length"),
                "r01": ((5, 6, 7, 8, 9, 10), (1,), 4, "length")})
    assert _holds("boundaries-in-one-step", sc, t) and _holds("checkpoint-inside-step", sc, t)
    source.output_token_ids = [8]  # a step that kept one token passes one boundary at its end
    assert not _holds("boundaries-in-one-step", sc, t) and not _holds("checkpoint-inside-step", sc, t)


def test_blocks_at_offsets():
    sc = _scenario(block_size=2, enable_prefix_caching=True)
    t = _trace([], {"r00": ((1, 2, 3, 4), (9,), 0, "length"), "r01": ((3, 4, 1, 2), (9,), 0, "length")})
    assert _holds("blocks-at-offsets", sc, t)
    t.requests["r01"].prompt_token_ids = [1, 2, 3, 4]  # the same blocks at the same offsets
    assert not _holds("blocks-at-offsets", sc, t)


def test_off_grid_chunk_before_hit():
    sc = _scenario(block_size=4, enable_prefix_caching=True)
    prompt = tuple(range(10, 23))
    rows = [[_row("r00", 0, "prefill", 0, 2)], [_row("r00", 1, "prefill", 2, 2)],
            [_row("r01", 2, "prefill", 8, 6, [1])]]
    t = _trace(rows, {"r00": (prompt, (1,), 0, "length"), "r01": (prompt + (3,), (1,), 8, "length")})
    assert _holds("off-grid-chunk-before-hit", sc, t)
    t.steps[1].rows[0].num_computed_tokens = 4  # on the grid
    assert not _holds("off-grid-chunk-before-hit", sc, t)


def test_length_stops_at_max_model_len_under_speculation():
    ngram = _scenario(num_speculative_tokens=3, drafter="ngram", max_model_len=8)
    mtp = _scenario(num_speculative_tokens=3, max_model_len=8)
    t = _trace([], {"r00": ((1, 2, 3), (4, 5, 6, 7, 8), 0, "length")})
    assert _holds("length-stop-at-max-len", mtp, t) and _holds("ngram-max-model-len", ngram, t)
    assert not _holds("ngram-max-model-len", mtp, t)
    t.requests["r00"].token_ids.pop()  # max_tokens ended it one short of the limit
    assert not _holds("length-stop-at-max-len", mtp, t)


def test_chunk_sharing_a_step_with_a_sampling_prompt():
    sc = _scenario(num_speculative_tokens=3)
    t = _trace([[_row("r00", 0, "prefill", 4, 4), _row("r01", 0, "prefill", 0, 3, [1])]], {})
    assert _holds("chunk-ahead-of-sampling", sc, t)
    assert not _holds("chunk-ahead-of-sampling", _scenario(num_speculative_tokens=1), t)
    t.steps[0].rows[1].num_computed_tokens = 2  # a final chunk of an older prompt, not a new one
    assert not _holds("chunk-ahead-of-sampling", sc, t)


def test_the_async_engine_places_the_chunk_ahead_of_the_new_prompt(small_case):
    """What chunk-ahead-k3 exists for: in the async engine's batch the chunk runs ahead of a sampling row."""
    from conformance.engines import load_engine
    from conformance.harness import run_workload

    scenario = get_def("chunk-ahead-k3").materialize("nightly", small_case.facts.vocab_size)
    trace = run_workload(load_engine("async:none"), scenario, small_case.facts, label="async")
    assert trace.error is None, trace.error
    ahead = [s.index for s in trace.steps for i, r in enumerate(s.rows)
             if r.output_token_ids is None and any(o.output_token_ids is not None for o in s.rows[i + 1:])]
    assert ahead


# ---- failing fast ------------------------------------------------------------------------------------


def test_fail_fast_stops_at_the_first_failing_check_before_the_plain_run(small_case):
    from conformance.harness import run_scenario
    from conformance.mutants import MutantAdapter, get_mutant

    mutant = MutantAdapter(get_mutant("stale-accepted-counts"))
    case = dataclasses.replace(small_case, engine="mutant", adapter=mutant)
    result, traces = run_scenario("scripted-ragged-k3", case, fail_fast=True)
    assert [c.status for c in result.checks][-1] == FAIL
    assert [c.check for c in result.checks if c.failed] == [result.checks[-1].check]
    assert "plain" not in traces


def test_fail_fast_on_a_passing_scenario_runs_every_check(small_case):
    from conformance import checks
    from conformance.harness import run_scenario

    result, traces = run_scenario("short-prompts-k1", small_case, fail_fast=True)
    assert result.ok and [c.check for c in result.checks] == list(checks.CHECK_NAMES) and "plain" in traces


def test_run_exitfirst_is_pytests_own():
    from conformance.runner import suite_args
    from conformance.session import Selection

    sel = Selection(engine="async")
    assert "--exitfirst" in suite_args(sel, exitfirst=True) and "--exitfirst" not in suite_args(sel)
