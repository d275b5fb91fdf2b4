"""Reports a CI reader can act on: every run that fails before its first scenario still writes its JUnit
and JSON files with a ``gate`` error naming the reason (``conformance run`` and the pytest plugin); the
files name the failing checks, the model, family, dtype, tier and gate options, and count alike; the
summary says what did not run once, prints the failure guide only for a failed check and says where the
reports went; ``ci/summarize_junit.py`` turns a missing or empty file into one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.conformance.test_cli import CORRUPT, run_cli
from tests.conformance.test_plugin import OUTER_RUN_SETTINGS, REPO

DECLINING = "tests.conformance.gate_engines:declining"
BROKEN = "tests.conformance.broken_factory:factory"


def _junit(path) -> tuple[dict, dict[str, dict]]:
    """(testsuite attributes with its properties under "properties", testcase name -> {"tag", "message",
    "properties"})."""
    suite = ET.parse(path).getroot().find("testsuite")
    head = {**suite.attrib, "properties": {p.get("name"): p.get("value")
                                           for p in suite.findall("./properties/property")}}
    cases = {}
    for case in suite.iter("testcase"):
        result = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases[case.get("name")] = {"tag": "passed" if result is None else result.tag,
                                   "message": "" if result is None else result.get("message", ""),
                                   "properties": props}
    return head, cases


def _reports(tmp_path) -> list[str]:
    return ["--junit-xml", str(tmp_path / "r.xml"), "--report-json", str(tmp_path / "r.json")]


def _gate_error(tmp_path) -> tuple[str, dict]:
    """The gate error's message in the JUnit file, and the JSON report; both must hold it."""
    head, cases = _junit(tmp_path / "r.xml")
    assert list(cases) == ["gate"] and cases["gate"]["tag"] == "error", cases
    assert cases["gate"]["properties"]["failure_type"] == "GateFailed"
    assert head["errors"] == "1" and head["tests"] == "1"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["gate_failures"] == [cases["gate"]["message"]]
    assert report["run_errors"] == [{"name": "gate", "message": cases["gate"]["message"]}]
    assert report["summary"]["errors"] == 1 and report["scenarios"] == []
    return cases["gate"]["message"], report


# ---- item: a gate failure before the first scenario leaves both reports ---------------------------------
def test_a_required_feature_refused_up_front_writes_both_reports(tiny_checkpoint, tmp_path, capsys):
    code, out = run_cli("run", "--engine", DECLINING, "--model", tiny_checkpoint, "--require-feature", "mtp",
                        "--fail-on-skip", *_reports(tmp_path))
    assert code == 1 and out == ""
    message, report = _gate_error(tmp_path)
    assert "does not support required feature(s) mtp (--require-feature)" in message
    assert report["gate"] == {"fail_on_skip": True, "min_scenarios": 0, "require_features": ["mtp"],
                              "step_timeout": 600.0, "require_exercised": False}
    assert report["family"] == "qwen3_next" and report["dtype"] == "float32"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"reports written: {tmp_path / 'r.xml'}, {tmp_path / 'r.json'}" in err[0], err


@pytest.mark.parametrize("what", ["engine", "checkpoint"])
def test_an_unusable_engine_or_checkpoint_writes_both_reports(what, tmp_path, capsys):
    argv = ["--engine", BROKEN] if what == "engine" else ["--model", str(tmp_path / "nowhere")]
    code, _ = run_cli("run", *argv, *_reports(tmp_path))
    assert code == 2
    message, _ = _gate_error(tmp_path)
    expected = "factory() raised RuntimeError" if what == "engine" else "does not exist"
    assert expected in message and message in capsys.readouterr().err


def _pytest(cwd, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in OUTER_RUN_SETTINGS:
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
                           "conformance.suite", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          check=False, timeout=300)


@pytest.mark.parametrize("workers", [[], pytest.param(["-n", "2"], marks=pytest.mark.slow)],
                         ids=["one-process", "xdist"])
def test_the_plugin_writes_both_reports_when_the_engine_cannot_load(workers, tmp_path, pytester):
    reports = ("--junitxml", str(tmp_path / "r.xml"), "--conformance-report-json", str(tmp_path / "r.json"))
    if workers:
        proc = _pytest(tmp_path, "--conformance-engine", BROKEN, *reports, *workers)
    else:  # one process: in this one
        from tests.conformance.test_plugin import run_suite

        proc = run_suite(pytester, "--conformance-engine", BROKEN, *reports)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    message, _ = _gate_error(tmp_path)
    assert f"cannot load engine '{BROKEN}': factory() raised RuntimeError" in message


def test_summarize_junit_names_a_missing_or_empty_file_in_one_line_and_shows_the_gate(tiny_checkpoint,
                                                                                      tmp_path):
    run_cli("run", "--engine", DECLINING, "--model", tiny_checkpoint, "--require-feature", "mtp",
            *_reports(tmp_path))
    (tmp_path / "empty.xml").write_text("")
    cmd = [sys.executable, str(REPO / "ci" / "summarize_junit.py"), str(tmp_path / "r.xml"),
           str(tmp_path / "missing.xml"), str(tmp_path / "empty.xml"), "--output", str(tmp_path / "s.md")]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    why = "(the job ended before writing it; see its log)"
    assert proc.stderr.splitlines() == [f"summarize_junit: {tmp_path / 'missing.xml'}: no such file {why}",
                                        f"summarize_junit: {tmp_path / 'empty.xml'}: empty {why}"]
    summary = (tmp_path / "s.md").read_text()
    gate = "**conformance gate**: the engine under test (declining) does not support required feature(s) mtp"
    assert gate in summary
    assert "missing.xml: no such file" in summary


# ---- item: reports a CI reader can act on ----------------------------------------------------------------
def test_a_failing_scenario_names_its_checks_model_family_dtype_tier_and_gate(tiny_checkpoint, tmp_path):
    code, out = run_cli("run", "--engine", CORRUPT, "--model", tiny_checkpoint, "--scenario",
                        "short-prompts-k3", "--min-scenarios", "1", *_reports(tmp_path))
    assert code == 1, out
    head, cases = _junit(tmp_path / "r.xml")
    case = cases["test_scenario[short-prompts-k3]"]
    checks = case["properties"]["failed_checks"].split(",")
    assert "tokens" in checks
    assert case["message"].splitlines()[0].removeprefix("Failed: ") == \
        f"CONFORMANCE MISMATCH in short-prompts-k3: {', '.join(checks)} failed"
    for key, value in {"model": f"{tiny_checkpoint} (qwen3_next)", "family": "qwen3_next",
                       "dtype": "float32", "tier": "default"}.items():
        assert case["properties"][key] == value and head["properties"][key] == value, (key, head, case)
    assert head["properties"]["gate_fail_on_skip"] == "false"
    assert head["properties"]["gate_min_scenarios"] == "1"
    assert head["properties"]["gate_step_timeout"] == "600"
    assert head["properties"]["gate_require_exercised"] == "false"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["dtype"] == "float32" and report["family"] == "qwen3_next"
    assert report["gate"] == {"fail_on_skip": False, "min_scenarios": 1, "require_features": [],
                              "step_timeout": 600.0, "require_exercised": False}
    assert "How to read a failure" in out  # a check failed: the guide is printed


def test_json_and_junit_agree_and_the_summary_says_what_did_not_run_once(tiny_checkpoint, tmp_path):
    code, out = run_cli("run", "--engine", DECLINING, "--model", tiny_checkpoint, "--scenario",
                        "short-prompts-k0", "--scenario", "short-prompts-k3", "--fail-on-skip",
                        "--min-scenarios", "4", *_reports(tmp_path))
    assert code == 1, out
    head, cases = _junit(tmp_path / "r.xml")
    report = json.loads((tmp_path / "r.json").read_text())
    summary = report["summary"]
    assert (summary["errors"], summary["failed"]) == (int(head["errors"]), int(head["failures"])) == (1, 1)
    assert int(head["tests"]) == summary["scenarios"] + len(report["run_errors"]) == 3
    assert cases["gate"]["properties"]["failure_type"] == "GateFailed"
    assert "0 skipped" not in out  # the skipped scenario failed the run; it is not "0 skipped" ...
    assert "1 passed, 1 failed (1 of them skipped, which this run does not allow)" in out
    assert "skipped: 1 of 2 scenarios did not run" in out  # ... and is said once, with its reason
    assert "How to read a failure" not in out  # no check failed: no guide to reading one
    assert out.rstrip().splitlines()[-1] == \
        f"reports written: JUnit XML {tmp_path / 'r.xml'}, JSON {tmp_path / 'r.json'}"
