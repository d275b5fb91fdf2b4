"""The machine-readable JSON report (every result). JUnit XML is pytest's own (``--junitxml``), for the
CLI too, with the properties conformance.plugin records; a run that ends before pytest can write it (a
gate refused up front, an engine or checkpoint that cannot be used, Ctrl-C before the first scenario)
gets both files from :func:`write_run_error_reports`, holding one ``conformance::<name>`` error.

Both files count alike: a run-level error (``gate``, ``interrupted``) is an error testcase of the JUnit
file and is counted in the JSON summary's ``errors`` (and listed in ``run_errors``)."""

from __future__ import annotations

import json
import platform
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.results import FAIL, ScenarioResult

JSON_FORMAT = "conformance-report/1"
RUN_ERROR_TYPES = {"gate": "GateFailed", "interrupted": "Interrupted"}  # the ``failure_type`` property


def gate_options(*, fail_on_skip: bool = False, min_scenarios: int = 0, require_features=(),
                 step_timeout: float | None = None, require_exercised: bool = False) -> dict:
    """The options of the run's gate, as the JSON report and the JUnit properties name them."""
    return {"fail_on_skip": bool(fail_on_skip), "min_scenarios": int(min_scenarios or 0),
            "require_features": list(require_features or ()), "step_timeout": step_timeout,
            "require_exercised": bool(require_exercised)}


def junit_properties(meta: dict) -> list[tuple[str, str]]:
    """The run's JUnit (testsuite) properties from its metadata: engine, model, family, dtype, tier,
    device, the verdict and each gate option (``gate_<option>``); what is unknown is left out."""
    named = ("engine", "model", "family", "dtype", "verdict", "tier", "device")
    props = [(k, str(meta[k])) for k in named if meta.get(k)]
    for key, value in (meta.get("gate") or {}).items():
        if value is None:
            continue
        text = ",".join(value) if isinstance(value, list) else str(value).lower() if isinstance(value, bool) \
            else f"{value:g}" if isinstance(value, float) else str(value)
        props.append((f"gate_{key}", text))
    return props


def build_json(results: list[ScenarioResult], *, engine: str, tier: str, model: str, environment: dict,
               elapsed: float, family: str | None = None, dtype: str | None = None, device: str | None = None,
               gate: dict | None = None, run_errors=(), verdict: str | None = None) -> dict:
    """``run_errors``: (name, message) of each run-level error (``gate``, ``interrupted``), counted in
    ``summary.errors`` as the JUnit file counts its ``conformance::<name>`` testcases."""
    checks = [c for r in results for c in r.checks]
    dtypes = sorted({r.dtype for r in results})
    return {
        "format": JSON_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "engine": engine,
        "tier": tier,
        "model": model,
        "family": family if family is not None else next((r.family for r in results if r.family), ""),
        "dtype": dtype if dtype is not None else ", ".join(dtypes),
        # how the scenarios' tokens were judged ("exact" | "rescored"; each scenario says its own too)
        "verdict": verdict if verdict is not None else (", ".join(sorted({r.verdict for r in results}))
                                                         or "exact"),
        "device": device if device is not None else environment.get("device", ""),
        "gate": gate if gate is not None else gate_options(),
        "environment": environment,
        "duration_s": round(elapsed, 3),
        "summary": {
            "scenarios": len(results),
            "passed": sum(r.outcome == "pass" for r in results),
            "failed": sum(r.outcome == "fail" for r in results),
            "xfailed": sum(r.outcome == "xfail" for r in results),
            "errors": sum(r.outcome == "error" for r in results) + len(run_errors),
            "skipped": sum(r.outcome == "skip" for r in results),
            "checks_failed": sum(c.status == FAIL for c in checks),
            "checks_total": len(checks),
            "not_exercised": sum(len(r.gaps) for r in results if not r.skipped and not r.error),
        },
        "run_errors": [{"name": name, "message": message} for name, message in run_errors],
        # the named gaps: what a scenario that ran did not exercise on this checkpoint, and why (warnings)
        "not_exercised": [{"scenario": r.scenario_id, **g} for r in results if not r.skipped and not r.error
                          for g in r.gaps],
        "scenarios": [r.to_dict() for r in results],
    }


def write_json(path: str | Path, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def write_run_error_reports(junit_xml: str | Path | None, report_json: str | Path | None, name: str,
                            message: str, meta: dict, environment: dict | None = None) -> list[str]:
    """The reports of a run that ended before its first scenario (``name``: ``gate`` or ``interrupted``):
    a JUnit file of one error testcase ``conformance::<name>`` whose message is ``message`` (the layout
    pytest writes, the run's properties on the testsuite), and the JSON report with no scenario, that
    error in ``run_errors`` (and in ``gate_failures`` or ``interrupted``). Returns the paths written; a
    path that cannot be written is left out (the run's one line still says why it ended)."""
    written = []
    if junit_xml:
        suite = ET.Element("testsuite", name="pytest", errors="1", failures="0", skipped="0", tests="1",
                           time="0.000", timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           hostname=platform.node())
        props = ET.SubElement(suite, "properties")
        for key, value in junit_properties(meta):
            ET.SubElement(props, "property", name=key, value=value)
        case = ET.SubElement(suite, "testcase", classname="conformance", name=name, time="0.000")
        case_props = ET.SubElement(case, "properties")
        ET.SubElement(case_props, "property", name="failure_type", value=RUN_ERROR_TYPES.get(name, name))
        ET.SubElement(case, "error", message=message).text = message
        root = ET.Element("testsuites", name="pytest tests")
        root.append(suite)
        xml = '<?xml version="1.0" encoding="utf-8"?>' + ET.tostring(root, encoding="unicode")
        if _write(junit_xml, xml):
            written.append(str(junit_xml))
    if report_json:
        report = build_json([], engine=meta.get("engine", ""), tier=meta.get("tier", ""),
                            model=meta.get("model", ""), environment=environment or {}, elapsed=0.0,
                            family=meta.get("family", ""), dtype=meta.get("dtype", ""),
                            device=meta.get("device", ""), gate=meta.get("gate"),
                            run_errors=[(name, message)])
        report["interrupted"] = message if name == "interrupted" else None
        report["gate_failures"] = [message] if name == "gate" else []
        if _write(report_json, json.dumps(report, indent=2) + "\n"):
            written.append(str(report_json))
    return written


def _write(path: str | Path, text: str) -> bool:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError:
        return False
    return True
