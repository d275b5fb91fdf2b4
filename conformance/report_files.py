"""The machine-readable JSON report (every result). JUnit XML is pytest's own (``--junitxml``), for the
CLI too, with the properties conformance.plugin records."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conformance.results import FAIL, ScenarioResult

JSON_FORMAT = "conformance-report/1"


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
            "passed": sum(r.outcome == "pass" for r in results),
            "failed": sum(r.outcome == "fail" for r in results),
            "xfailed": sum(r.outcome == "xfail" for r in results),
            "errors": sum(r.outcome == "error" for r in results),
            "skipped": sum(r.outcome == "skip" for r in results),
            "checks_failed": sum(c.status == FAIL for c in checks),
            "checks_total": len(checks),
        },
        "scenarios": [r.to_dict() for r in results],
    }


def write_json(path: str | Path, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
