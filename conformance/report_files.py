"""Machine-readable reports: JSON (every result) and JUnit XML (one testcase per scenario and check)."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.results import FAIL, NA, ScenarioResult

JSON_FORMAT = "conformance-report/1"
MISMATCH = "ConformanceMismatch"  # JUnit failure type of a check that failed: never rerun
INFRASTRUCTURE = "InfrastructureError"  # JUnit error type of a broken harness or reference run


def build_json(results: list[ScenarioResult], *, engine: str, tier: str, model: str, environment: dict,
               elapsed: float) -> dict:
    checks = [c for r in results for c in r.checks]
    return {
        "format": JSON_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "engine": engine,
        "tier": tier,
        "model": model,
        "environment": environment,
        "duration_s": round(elapsed, 3),
        "summary": {
            "scenarios": len(results),
            "passed": sum(r.ok and not r.skipped for r in results),
            "failed": sum(bool(r.unexpected_failures) for r in results),
            "xfailed": sum(bool(r.failures) and not r.unexpected_failures for r in results),
            "errors": sum(r.error is not None for r in results),
            "skipped": sum(bool(r.skipped) for r in results),
            "checks_failed": sum(c.status == FAIL for c in checks),
            "checks_total": len(checks),
        },
        "scenarios": [r.to_dict() for r in results],
    }


def write_json(path: str | Path, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def build_junit(results: list[ScenarioResult], *, engine: str, tier: str, model: str, environment: dict,
                elapsed: float) -> ET.ElementTree:
    suites = ET.Element("testsuites")
    suite = ET.SubElement(suites, "testsuite", name="conformance", timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
                          time=f"{elapsed:.3f}")
    props = ET.SubElement(suite, "properties")
    for key, value in {"engine": engine, "tier": tier, "model": model, **environment}.items():
        ET.SubElement(props, "property", name=key, value=str(value))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for r in results:
        entries = r.checks or [None]
        for c in entries:
            counts["tests"] += 1
            case = ET.SubElement(suite, "testcase", classname=f"conformance.{r.scenario_id}",
                                 name=c.check if c else "scenario",
                                 time=f"{r.duration_s / len(entries):.3f}")
            if r.skipped:
                counts["skipped"] += 1
                ET.SubElement(case, "skipped", message=r.skipped)
            elif r.error:
                counts["errors"] += 1
                el = ET.SubElement(case, "error", message=r.error.strip().splitlines()[-1], type=INFRASTRUCTURE)
                el.text = r.error
            elif c.status == NA:
                counts["skipped"] += 1
                ET.SubElement(case, "skipped", message=f"n/a: {c.summary}")
            elif c.status == FAIL and c.check in r.expected:
                counts["skipped"] += 1
                ET.SubElement(case, "skipped", type="pytest.xfail", message=f"expected failure: {r.expected[c.check]}")
            elif c.status == FAIL:
                counts["failures"] += 1
                case_props = ET.SubElement(case, "properties")
                for key in ("position", "verify_step", "step", "replay"):
                    if c.details.get(key) is not None:
                        ET.SubElement(case_props, "property", name=_prop(key), value=str(c.details[key]))
                if c.request_id:
                    ET.SubElement(case_props, "property", name="request", value=c.request_id)
                el = ET.SubElement(case, "failure", message=c.summary, type=MISMATCH)
                el.text = c.report
    for key, value in counts.items():
        suite.set(key, str(value))
    ET.indent(suites)
    return ET.ElementTree(suites)


def _prop(key: str) -> str:
    return {"position": "first_divergence_position", "step": "first_divergence_engine_step",
            "verify_step": "first_divergence_verify_step"}.get(key, key)


def write_junit(path: str | Path, tree: ET.ElementTree) -> None:
    tree.write(path, encoding="utf-8", xml_declaration=True)
