"""ci/: JUnit reading and summaries against a baseline, and the environment check."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
  <testcase classname="tests.conformance.test_suite" name="test_scenario[mtp-k3]" time="1.0">
    <properties><property name="replay" value="conformance replay mtp-k3 --request r01"/></properties>
    <failure message="CONFORMANCE MISMATCH">FAILED scenario mtp-k3 ... diverges at output position 4</failure>
  </testcase>
  <testcase classname="tests.conformance.test_suite" name="test_scenario[churn-k3]@gw1" time="1.0">
    <error message="worker 'gw1' crashed while running">Fatal Python error: Segmentation fault</error>
  </testcase>
  <testcase classname="tests.conformance.test_suite" name="test_scenario[short-prompts-k0]" time="0.1"/>
  <testcase classname="tests.kernels.test_norm" name="test_rms" time="0.1">
    <skipped type="pytest.xfail" message="known"/>
  </testcase>
  <testcase classname="tests.kernels.test_linear" name="test_odd" time="0.1">
    <failure message="torch.OutOfMemoryError: CUDA out of memory">...</failure>
  </testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def ci(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "ci"))
    import check_env
    import nightly
    import summarize_junit

    return check_env, nightly, summarize_junit


def test_junit_cases_are_classified(ci, tmp_path):
    _, _, sj = ci
    (tmp_path / "t.xml").write_text(JUNIT)
    cases = {c.id: c for c in sj.read_junit([tmp_path / "t.xml"])}
    assert cases["tests.conformance.test_suite::test_scenario[mtp-k3]"].kind == sj.MISMATCH
    assert cases["tests.conformance.test_suite::test_scenario[churn-k3]"].kind == sj.INFRASTRUCTURE
    assert cases["tests.kernels.test_linear::test_odd"].kind == sj.INFRASTRUCTURE
    assert cases["tests.kernels.test_norm::test_rms"].outcome == "xfailed"
    assert cases["tests.conformance.test_suite::test_scenario[short-prompts-k0]"].kind is None


def test_summary_against_baseline(ci, tmp_path):
    _, _, sj = ci
    (tmp_path / "t.xml").write_text(JUNIT)
    baseline = tmp_path / "baseline.txt"
    baseline.write_text("# known\ntests.kernels.test_linear::test_odd\n"
                        "tests.conformance.test_suite::test_scenario[short-prompts-k0]  # fixed now\n")
    out = tmp_path / "summary.md"
    code = sj.main(
        [str(tmp_path / "t.xml"), "--baseline", str(baseline), "--output", str(out), "--fail-on-new"]
    )
    text = out.read_text()
    assert code == 1
    assert "### New failures: 2" in text and "### Still failing (in the baseline): 1" in text
    assert "### Fixed (in the baseline, now passing): 1" in text
    assert "`conformance replay mtp-k3 --request r01`" in text
    assert "| 1 | 2 | 1 | 0 | 1 | 5 |" in text  # passed, failed, errors, skipped, xfailed, total
    sj.main([str(tmp_path / "t.xml"), "--write-baseline", str(baseline)])
    assert sj.main([str(tmp_path / "t.xml"), "--baseline", str(baseline), "--output", str(out),
                    "--fail-on-new"]) == 0


# The JUnit pytest-rerunfailures leaves (16.7, with xdist 3.8): one result-less testcase per earlier
# attempt, a nameless one for the attempt of a crashed worker; a failed test whose teardown also errs
# is two testcases, both kept.
RERUN_JUNIT = """<testsuites><testsuite>
  <testcase classname="t" name="test_infra"><properties><property name="p" value="1"/></properties></testcase>
  <testcase time="0.000"/>
  <testcase classname="t" name="test_infra_always"/>
  <testcase classname="t" name="test_infra"><properties><property name="p" value="2"/></properties></testcase>
  <testcase classname="t" name="test_infra_always">
    <error message="InfrastructureError: down">x</error></testcase>
  <testcase classname="t" name="test_crashed"/>
  <testcase classname="t" name="test_double"><failure message="assert 0">x</failure></testcase>
  <testcase classname="t" name="test_double">
    <error message='failed on teardown with "OSError: x"'>y</error></testcase>
</testsuite></testsuites>
"""


def test_read_junit_keeps_the_final_attempt_of_a_rerun_test(ci, tmp_path):
    _, _, sj = ci
    (tmp_path / "t.xml").write_text(RERUN_JUNIT)
    cases = sj.read_junit([tmp_path / "t.xml"])
    assert [(c.id, c.outcome) for c in cases] == [
        ("t::test_infra", "passed"), ("t::test_infra_always", "error"), ("t::test_crashed", "passed"),
        ("t::test_double", "failed"), ("t::test_double", "error")]
    assert cases[0].properties == {"p": "2"}
    assert cases[1].kind == sj.INFRASTRUCTURE and cases[1].text == "x"


def test_read_junit_fields(ci, tmp_path):
    _, _, sj = ci
    (tmp_path / "t.xml").write_text(
        '<testsuite><testcase classname="a.b" name="t[x]@gw2" time="1.5">'
        '<properties><property name="failure_type" value="ConformanceMismatch"/></properties>'
        '<failure type="ConformanceMismatch" message="slot 3">the text</failure></testcase>'
        '<testcase classname="a.b" name="s"><skipped type="pytest.skip" message="no GPU"/></testcase>'
        "</testsuite>"
    )
    failed, skipped = sj.read_junit([tmp_path / "t.xml"])
    assert (failed.id, failed.outcome, failed.seconds, failed.message, failed.text, failed.failure_type) == (
        "a.b::t[x]", "failed", 1.5, "slot 3", "the text", "ConformanceMismatch")
    assert failed.properties == {"failure_type": "ConformanceMismatch"} and failed.kind == sj.MISMATCH
    assert (skipped.outcome, skipped.message, skipped.kind) == ("skipped", "no GPU", None)


def test_nightly_runs_the_mutants_into_the_reports_folder(ci):
    _, nightly, _ = ci
    mutant_runs = [
        cmd for cmd in nightly.NIGHTLY_EXTRA_COMMANDS if "tests/conformance/test_mutants.py" in cmd
    ]
    assert len(mutant_runs) == 1
    assert any(part.startswith("--junitxml={reports}/") for part in mutant_runs[0])


def test_check_env(ci):
    check_env, _, _ = ci
    assert check_env.factor_to_cuda("cu128") == "12.8" and check_env.factor_to_cuda("cu130") == "13.0"
    cpu = {"torch": "2.13.0+cpu", "cuda": "none", "device": "cpu"}
    assert check_env.problems(cpu, None, "cpu") == []
    assert check_env.problems(cpu, "12.8", "cuda")  # wrong build and no GPU
    gpu = {"torch": "2.9.0+cu126", "cuda": "12.6", "device": "cuda", "gpus": "H100"}
    assert check_env.problems(gpu, "12.6", "cuda") == []
    assert "expects CUDA 12.8" in check_env.problems(gpu, "12.8", "cuda")[0]
    import torch

    assert check_env.main(["--device", "cuda" if torch.cuda.is_available() else "cpu"]) == 0


def test_declared_types_are_the_ones_the_plugin_records(ci):
    from conformance import plugin

    _, _, sj = ci
    assert sj.DECLARED == {plugin.MISMATCH: sj.MISMATCH, plugin.INFRASTRUCTURE: sj.INFRASTRUCTURE}
