"""A check is one declared function in one file: the example of conformance/README.md's "Adding a check",
loaded from a module of its own, is run by the harness, named by the reports and known to the expectation
files, and the declarations are as they were once its test ends."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest

from conformance import checks
from conformance.expectations import Expectations, judge, unknown_entries
from conformance.harness import evaluate
from conformance.report_text import format_check_table, format_result
from conformance.results import FAIL, NA, PASS
from conformance.workloads import get_def, scenario_ids

REPO = Path(__file__).resolve().parents[2]
NAME = "rows-of-known-requests"  # the README example's check
SCENARIO = "short-prompts-mixed-k3"  # the run tests/conformance/test_checks.py records too


def _example() -> str:
    text = (REPO / "conformance" / "README.md").read_text()
    section = text.split("\n## Adding a check\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    return code


@pytest.fixture
def example_check(tmp_path):
    """The README's example check, declared from a module file of its own for the length of one test."""
    path = tmp_path / "my_checks.py"
    path.write_text(_example())
    before = checks.CHECK_NAMES
    with checks.declaring():
        spec = importlib.util.spec_from_file_location("my_checks", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        yield checks.declaration(NAME)
    assert checks.CHECK_NAMES == before and checks.declaration(NAME) is None


@pytest.fixture
def run(recorded_run, small_case):
    """The recorded run's result, its traces and its scenario as the harness ran it. Tests ask for it before
    ``example_check``: the run is shared with other tests, so it is recorded with the shipped checks only."""
    result, traces = recorded_run(SCENARIO)
    scenario = small_case.apply(get_def(SCENARIO).materialize(small_case.tier, small_case.facts.vocab_size))
    return result, traces, scenario


def test_the_shipped_declarations_in_report_order():
    assert checks.CHECK_NAMES[:2] == ("runs", "tokens") and checks.CHECK_NAMES[-1] == "workload-triggers"
    assert [c.name for c in checks.declared() if c.late] == [
        "aborts", "spec-lossless", "cache-lossless", "params-change-output", "spec-distribution",
        "workload-triggers"]
    assert [c.name for c in checks.declared() if c.runs_when_test_broke] == [
        "runs", "cache-lossless", "params-change-output", "workload-triggers"]
    assert [c.name for c in checks.declared() if not c.replay] == [
        "params-change-output", "sampler-frequencies", "spec-distribution", "workload-triggers"]


def test_a_declared_check_is_run_and_reported(run, example_check, small_case):
    result, traces, scenario = run
    assert example_check.reads == ("test",) and example_check.needs == ("rows",)
    assert checks.CHECK_NAMES[-1] == NAME and checks.NEEDS[NAME] == ("rows",)

    result.checks = evaluate(scenario, traces, small_case)
    assert [c.check for c in result.checks] == list(checks.CHECK_NAMES)
    assert result.checks[-1].status == PASS, result.checks[-1]
    assert f"[PASS] {NAME}: " in format_result(result, show_passing=True)
    assert NAME in format_check_table(result.checks)
    assert NAME in [c["check"] for c in result.to_dict()["checks"]]
    entry = Expectations(entries={f"{SCENARIO}/{NAME}": "issue #1"})
    assert unknown_entries(entry, scenario_ids("nightly"), checks.CHECK_NAMES) == []
    assert judge(result, entry).stale == [f"{SCENARIO}/{NAME}"]


def test_a_declared_check_fails_and_is_na_as_declared(run, example_check, small_case):
    result, traces, scenario = run
    ghost = copy.deepcopy(traces)
    ghost["test"].steps[0].rows[0].request_id = "ghost"
    result.checks = evaluate(scenario, ghost, small_case)
    failing = {c.check: c for c in result.checks}[NAME]
    assert failing.status == FAIL and "ghost" in failing.summary
    assert f"[FAIL] {NAME}: " in format_result(result)
    expected = Expectations(entries={f"{SCENARIO}/{NAME}": "issue #1"})
    assert judge(result, expected).expected == {NAME: "issue #1"}

    lacking = copy.deepcopy(traces)
    lacking["test"].missing_fields = ["rows"]
    verdict = {c.check: c for c in evaluate(scenario, lacking, small_case)}[NAME]
    assert verdict.status == NA and verdict.summary == "the engine's records lack rows"
