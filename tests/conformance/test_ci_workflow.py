"""The GitHub Actions workflow users copy: valid for GitHub (checked by check-jsonschema against its
vendored schema of workflow files, offline), and its jobs run the commands this repository has."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "conformance.yml"


def _validate(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema with its built-in (vendored: no network) schema of GitHub workflow files."""
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_the_workflow_is_valid_for_github():
    proc = _validate(WORKFLOW)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("old,new", [("runs-on: ubuntu-latest", "run-on: ubuntu-latest"),
                                     ("timeout-minutes: 60", "timeout-minutes: an hour"),
                                     ("  pull_request:\n", "  pull_requests:\n")])
def test_the_validator_refuses_a_broken_workflow(old, new, tmp_path):
    text = WORKFLOW.read_text()
    assert old in text
    broken = tmp_path / "broken.yml"
    broken.write_text(text.replace(old, new, 1))
    proc = _validate(broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr


def _runs(job: dict) -> list[str]:
    """Every command line of the job's ``run`` steps (continuation lines joined)."""
    return [" ".join(line.split()) for step in job["steps"] if "run" in step
            for line in step["run"].replace("\\\n", " ").splitlines() if line.strip()]


def test_pull_requests_run_the_cpu_tier_and_the_nightly_runs_on_a_gpu_runner():
    wf = _workflow()
    triggers = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as a boolean
    assert {"pull_request", "schedule"} <= set(triggers)
    cpu, gpu = wf["jobs"]["cpu"], wf["jobs"]["nightly-gpu"]
    assert "pull_request" in cpu["if"] and "schedule" in gpu["if"]
    assert any(r.startswith("tox -e cpu") for r in _runs(cpu))
    assert "self-hosted" in gpu["runs-on"] and "gpu" in gpu["runs-on"]
    assert any("tox -e cu128" in r for r in _runs(gpu)) and any("ci/nightly.py" in r for r in _runs(gpu))
    for job in (cpu, gpu):
        assert any("GITHUB_STEP_SUMMARY" in r for r in _runs(job)), "a job summary is written"
        uploads = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
        assert uploads and all(s.get("if") == "always()" for s in uploads), "JUnit is uploaded, failed or not"
        assert any("--junitxml" in r or "--junit-xml" in r for r in _runs(job))


def test_the_workflow_commands_take_the_flags_they_are_given(monkeypatch):
    """Each repository command in the workflow parses its arguments (a renamed flag breaks this test)."""
    monkeypatch.syspath_prepend(str(REPO / "ci"))
    import nightly
    import summarize_junit

    from conformance.cli import build_parser

    commands = [shlex.split(r.replace("$REPORTS", "reports/x"))
                for job in _workflow()["jobs"].values() for r in _runs(job)]
    checked = 0
    for argv in commands:
        program = Path(argv[0]).name
        if program == "conformance":
            build_parser().parse_args(argv[1:])
        elif program == "python" and argv[1] == "ci/nightly.py":
            args = nightly.build_parser().parse_args(argv[2:])
            assert not args.pytest_args, f"free pytest arguments where flags were meant: {args.pytest_args}"
        elif program == "python" and argv[1] == "ci/summarize_junit.py":
            summarize_junit.build_parser().parse_args(argv[2:])
        else:
            continue
        checked += 1
    assert checked >= 4
