"""The JSON report is well-formed and carries what CI needs; traces round-trip through JSON. (JUnit is
pytest's: tests/conformance/test_cli.py and test_plugin.py read it.)"""

from __future__ import annotations

import json

from conformance.report_files import build_json, write_json
from conformance.report_text import format_result, format_summary, status_line
from conformance.results import CheckResult, ScenarioResult, failed
from conformance.trace import Trace

ENV = {"python": "3.11", "torch": "2.13.0+cpu", "triton": "3.9.0", "cuda": "none", "device": "cpu"}
META = {"engine": "async", "tier": "default", "model": "tiny", "environment": ENV, "elapsed": 3.5}


def _results() -> list[ScenarioResult]:
    bad = failed("tokens", "request r01: first divergence at output position 4", "windows <&> here", "r01",
                 position=4, verify_step=1, step=9, replay="conformance replay x --request r01")
    return [
        ScenarioResult(
            "mtp-k3",
            "d",
            "default",
            "async",
            "tiny",
            "K=3",
            [CheckResult("runs", "pass", "ok"), bad, CheckResult("full-graph-metadata", "n/a", "none")],
            1.5,
            replay="conformance replay mtp-k3",
        ),
        ScenarioResult("mtp-k1", "d", "default", "async", "tiny", "K=1", [], 0.1, skipped="no MTP head"),
        ScenarioResult(
            "chunk-tails-k0",
            "d",
            "default",
            "async",
            "tiny",
            "K=0",
            [],
            0.2,
            error="the reference engine failed:\nRuntimeError: x",
        ),
    ]


def test_json_report_round_trips(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, build_json(_results(), **META))
    data = json.loads(path.read_text())
    assert data["format"] == "conformance-report/1" and data["engine"] == "async"
    assert data["summary"] == {
        "scenarios": 3,
        "passed": 0,
        "failed": 1,
        "xfailed": 0,
        "errors": 1,
        "skipped": 1,
        "checks_failed": 1,
        "checks_total": 3,
        "not_exercised": 0,
    }
    back = [ScenarioResult.from_dict(s) for s in data["scenarios"]]
    assert back == _results()


def test_text_report_names_everything_a_reader_needs():
    res = _results()
    text = format_result(res[0])
    for needle in ("FAILED scenario mtp-k3", "engine under test : async", "[FAIL] tokens",
                   "replay: conformance replay x --request r01", "not applicable: full-graph-metadata"):
        assert needle in text
    assert status_line(res[0], 2, 10, 12.0).startswith("[ 2/10] FAIL  mtp-k3")
    assert "ERROR" in status_line(res[2]) and "SKIP" in status_line(res[1])
    assert "3 scenarios" in format_summary(res, 1.0)


def test_trace_round_trips_through_json(small_case):
    from conformance.harness import run_scenario

    _, traces = run_scenario("short-prompts-k1", small_case)
    assert set(traces) == {"reference", "test", "plain"}
    for trace in traces.values():
        again = Trace.from_dict(json.loads(json.dumps(trace.to_dict())))
        assert again == trace
