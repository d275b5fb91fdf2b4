"""The n-gram (prompt lookup) scenarios: every check on them in every graph mode, and the triggers that
keep them exercising a zero-draft step right after accepted drafts (vLLM #52942)."""

from __future__ import annotations

import copy
import itertools

import pytest

from conformance import checks
from conformance.harness import run_scenario
from conformance.results import PASS
from conformance.session import Selection
from conformance.workloads import EngineSettings, get_def, load_scenario, scenario_ids
from conformance.workloads.scenario import Builder

COMPARED = (
    "tokens",
    "acceptance",
    "request-outputs",
    "logits-digests",
    "spec-lossless",
    "id-range",
    "state-slots",
    "workload-triggers",
)


@pytest.mark.parametrize(
    "engine,scenario",
    [
        ("async:none", "ngram-k3"),
        ("async:piecewise", "ngram-k3"),
        ("async:full", "ngram-k3"),
        ("async:full", "ngram-k1"),
    ],
)
def test_ngram_scenarios_pass_every_check_in_every_graph_mode(engine, scenario):
    """On the embedded default model, where a missed trigger fails (``full_and_piecewise``, the suite's
    own ``async``, runs them in tests/conformance/test_suite.py)."""
    result, traces = run_scenario(scenario, Selection(engine=engine).open_case())
    statuses = {c.check: c.status for c in result.checks}
    assert result.ok, [(c.check, c.summary) for c in result.failures]
    assert all(statuses[name] == PASS for name in COMPARED), statuses
    if "full" in engine:
        assert statuses["full-graph-metadata"] == PASS
        full = [s for s in traces["test"].steps if s.graph_mode == "full"]
        assert any(not r.draft_token_ids for s in full for r in s.rows), (
            "no zero-draft row ran in a FULL step"
        )


@pytest.fixture(scope="module")
def traces(recorded_run):
    result, traces = recorded_run("ngram-k3")
    assert result.ok, result.checks
    return traces


def test_triggers_hold_on_the_real_trace_and_fail_when_the_workload_stops_hitting_them(traces):
    scenario = get_def("ngram-k3").materialize("default", 256)
    assert {"zero-draft-after-accept", "partial-drafts"} <= set(scenario.triggers)
    assert checks.check_triggers(scenario, traces["reference"]).status == PASS

    always = copy.deepcopy(traces["reference"])  # as if the drafter always proposed something
    for step in always.steps:
        for r in step.rows:
            if r.kind == "decode" and not r.draft_token_ids:
                r.draft_token_ids = [0]
    result = checks.check_triggers(scenario, always, require_exercised=True)  # they are the model's to reach
    assert result.failed and result.details["missed"] == ["zero-draft-after-accept"]

    whole = copy.deepcopy(traces["reference"])  # as if every proposal had K drafts or none
    for req in whole.requests.values():
        req.acceptance = [(scenario.k if d else 0, a) for d, a in req.acceptance]
    result = checks.check_triggers(scenario, whole, require_exercised=True)
    assert result.failed and result.details["missed"] == ["partial-drafts"]


def test_a_re_prefill_between_two_verify_steps_breaks_the_transition(traces):
    """Accepted drafts, a preemption's re-prefill, then no drafts: the state was rebuilt, not the case."""
    scenario = get_def("ngram-k3").materialize("default", 256)
    t = copy.deepcopy(traces["reference"])
    for rid in t.requests:
        rows = [r for r in t.rows_of(rid) if r.kind == "decode"]
        for before, after in itertools.pairwise(rows):
            if before.num_accepted and not after.draft_token_ids:
                after.kind = "prefill"  # what a re-prefill row in between would reset
    missed = checks.check_triggers(scenario, t, require_exercised=True).details["missed"]
    assert missed == ["zero-draft-after-accept"]


def test_ngram_scenarios_in_both_tiers():
    for k in (1, 3):
        for tier in ("default", "nightly"):
            assert f"ngram-k{k}" in scenario_ids(tier)
        s = load_scenario(f"ngram-k{k}", "default", 256).settings
        assert s.drafter == "ngram" and s.k == k and s.prompt_lookup_min <= s.prompt_lookup_max


def test_repeated_phrase_prompts():
    p = Builder("x", "default", 256, 3).prompt(7, repeat=3)
    assert p == p[:3] * 2 + p[:1] and len(set(p)) <= 3
    assert Builder("y", "default", 256, 3).prompt(5) == Builder("y", "default", 256, 3).prompt(5, repeat=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"drafter": "mtp", "prompt_lookup_min": 2}, "prompt_lookup_min apply to drafter 'ngram' only"),
    ({"drafter": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max must be an int >= 1 or None, got 0"),
])
def test_engine_settings_refuse_bad_prompt_lookup(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineSettings(num_speculative_tokens=2, **kwargs)


def test_the_plain_baseline_drops_the_lookup():
    s = EngineSettings(num_speculative_tokens=3, drafter="ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    assert s.plain() == EngineSettings()
    assert "prompt_lookup_min=1 prompt_lookup_max=3" in s.describe()
