"""A CI gate on the suite: skips are reported and can fail the run, a hanging engine fails its scenario
by name and the run goes on, an interrupted run says so (and its JUnit file too)."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET

import pytest

from tests.conformance.test_cli import run_cli
from tests.conformance.test_plugin import run_suite

DECLINING = "tests.conformance.gate_engines:declining"
HANGING = "tests.conformance.gate_engines:hanging"
INTERRUPTED = "tests.conformance.gate_engines:interrupted"
# one scenario the declining engine runs (K=0), two it skips (MTP drafts; prefix caching)
PICKED = ("short-prompts-k0", "short-prompts-k3", "prefix-block-edges-k0")


def _cases(path) -> dict[str, tuple[str, dict]]:
    """testcase name -> (outcome element or "passed", properties)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tag = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        out[case.get("name")] = (tag, {p.get("name"): p.get("value") for p in case.iter("property")})
    return out


def _run(engine, tiny_checkpoint, tmp_path, *extra, scenarios=PICKED):
    return run_cli("run", "--engine", engine, "--model", tiny_checkpoint,
                   *(a for sid in scenarios for a in ("--scenario", sid)),
                   "--junit-xml", str(tmp_path / "r.xml"), *extra)


def test_skips_are_reported_by_reason_and_feature(tiny_checkpoint, tmp_path):
    code, out = _run(DECLINING, tiny_checkpoint, tmp_path)
    assert code == 0, out  # without a gate option a skip is not a failure ...
    # ... but the header and the summary say what was and was not exercised, and why
    assert "engine features: supports step_records, batch_invariant, pools, bitwise; lacks mtp, " \
           "scripted_drafter, " \
           "ngram_drafter, draft_model, eagle_drafter, prefix_caching (the scenarios needing them are " \
           "skipped" in out
    assert "gate: a failing check or an infrastructure error fails the run; skipped scenarios do not" in out
    assert "skipped: 2 of 3 scenarios did not run" in out
    assert "1 x the engine under test does not support the mtp drafter: short-prompts-k3" in out
    assert "1 x the engine under test does not support prefix caching: prefix-block-edges-k0" in out
    assert "mtp 0 ran, 1 skipped (NOT EXERCISED)" in out and "prefix_caching 0 ran, 1 skipped" in out
    assert "checks exercised: " in out and "never applied (n/a in every scenario that ran): " in out


def test_fail_on_skip_fails_each_skipped_scenario(tiny_checkpoint, tmp_path):
    code, out = _run(DECLINING, tiny_checkpoint, tmp_path, "--fail-on-skip")
    assert code == 1, out
    assert "a skipped scenario fails it (--fail-on-skip)" in out  # said up front
    assert "FAIL  short-prompts-k3" in out and "PASS  short-prompts-k0" in out
    assert "1 passed, 2 failed" in out
    cases = _cases(tmp_path / "r.xml")
    assert cases["test_scenario[short-prompts-k3]"][0] == "failure"
    assert cases["test_scenario[short-prompts-k3]"][1]["failure_type"] == "SkipNotAllowed"
    assert cases["test_scenario[short-prompts-k0]"][0] == "passed"


def test_a_required_feature_fails_its_skips_and_a_minimum_counts_the_runs(tiny_checkpoint, tmp_path):
    code, out = _run("reference", tiny_checkpoint, tmp_path, "--require-feature", "prefix_caching",
                     "--min-scenarios", "4", scenarios=PICKED[:1])
    assert code == 1, out
    assert "GATE FAILED: only 1 of 1 scenarios ran (0 skipped); --min-scenarios requires at least 4" in out
    assert _cases(tmp_path / "r.xml")["gate"][0] == "error"  # a CI reading only the JUnit file sees it
    code, out = _run(DECLINING, tiny_checkpoint, tmp_path, "--require-feature", "mtp")
    assert code == 1 and out == ""  # refused before any scenario ran


def test_a_skip_is_refused_when_it_needs_a_required_feature():
    """A scenario may skip for a reason of the model's (no MTP head) while the engine supports the feature:
    a required feature still refuses that skip."""
    from types import SimpleNamespace

    from conformance.plugin import _refused_skip
    from conformance.results import ScenarioResult

    result = ScenarioResult("mtp-k3", "d", "default", "async", "m", "K=3",
                            skipped="the model has no MTP head", features=["mtp"])
    options = {"conformance_fail_on_skip": False, "conformance_require_feature": ["mtp"]}
    config = SimpleNamespace(getoption=options.get)
    assert _refused_skip(config, result) == "it needs required feature mtp"
    options["conformance_require_feature"] = ["prefix_caching"]
    assert _refused_skip(config, result) == ""
    result.skip_fails = True
    assert result.outcome == "fail"


def test_a_hanging_step_fails_its_scenario_by_name_and_the_run_goes_on(tiny_checkpoint, tmp_path):
    start = time.perf_counter()
    code, out = _run(HANGING, tiny_checkpoint, tmp_path, "--step-timeout", "0.5",
                     scenarios=("short-prompts-k0", "graph-padding-k0"))
    assert time.perf_counter() - start < 120
    assert code == 1, out
    for sid in ("short-prompts-k0", "graph-padding-k0"):
        assert f"FAIL  {sid}" in out, out
    assert "step() at engine step 0 did not return within 0.5 s (--step-timeout)" in out
    assert "0 passed, 2 failed" in out
    assert {tag for tag, _ in _cases(tmp_path / "r.xml").values()} == {"failure"}


def test_an_interrupted_run_says_so_and_its_junit_too(tiny_checkpoint, tmp_path):
    code, out = _run(INTERRUPTED, tiny_checkpoint, tmp_path, scenarios=("short-prompts-k0",))
    assert code == 130, out
    assert "INTERRUPTED after 0 of 1 scenarios: the run is incomplete" in out
    tag, _ = _cases(tmp_path / "r.xml")["interrupted"]
    assert tag == "error"


@pytest.mark.parametrize("argv", [["--conformance-fail-on-skip"],
                                  pytest.param(["--conformance-min-scenarios", "2"], marks=pytest.mark.slow)])
def test_the_plugin_has_the_same_gate(argv, tiny_checkpoint, tmp_path, pytester):
    picked = ("short-prompts-k0", "short-prompts-k3")
    proc = run_suite(pytester, "--conformance-engine", DECLINING, "--conformance-model", tiny_checkpoint,
                     *(a for sid in picked for a in ("--conformance-scenario", sid)),
                     "--junitxml", str(tmp_path / "p.xml"), *argv)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 x the engine under test does not support the mtp drafter: short-prompts-k3" in out
    if argv[0] == "--conformance-fail-on-skip":
        assert "SKIPPED, NOT ALLOWED (--fail-on-skip)" in out
    else:
        assert "only 1 of 2 scenarios ran (1 skipped); --min-scenarios requires at least 2" in out


def test_an_abandoned_engine_cannot_touch_the_run_after_its_timeout(tiny_checkpoint):
    """The hung step returns after the run gave up on it: its step record and outputs are dropped, the
    trace the run reported stays as it was, and the next workload runs on a fresh instance."""
    import threading

    from conformance.harness import run_workload
    from conformance.session import Selection
    from conformance.workloads import get_def
    from tests.conformance.gate_engines import HangingAdapter

    case = Selection(engine="reference", model=tiny_checkpoint).open_case()
    scenario = get_def("short-prompts-k0").materialize("default", case.facts.vocab_size)
    adapter = HangingAdapter()
    before = {t.name for t in threading.enumerate()}
    trace = run_workload(adapter, scenario, case.facts, label="hanging", step_timeout=0.3)
    assert "step() at engine step 0 did not return within 0.3 s" in trace.error
    snapshot = trace.to_dict()
    abandoned = [t for t in threading.enumerate() if t.name not in before and "hanging" in t.name]
    assert len(abandoned) == 1 and abandoned[0].daemon
    adapter.release.set()  # the blocked step() now returns, records its step and hands back outputs
    abandoned[0].join(timeout=60)
    assert not abandoned[0].is_alive()
    assert trace.to_dict() == snapshot  # nothing it did after the timeout reached the trace
    again = run_workload(adapter, scenario, case.facts, label="hanging", step_timeout=30)
    assert again.error is None and set(again.requests) == {r.request_id for r in scenario.requests}
