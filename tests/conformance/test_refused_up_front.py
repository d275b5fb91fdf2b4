"""Every bad input is refused before the work, and the plugin leaves other projects alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conformance.test_cli import run_cli
from tests.conformance.test_plugin import REPO


@pytest.fixture
def no_run(monkeypatch):
    """Any scenario or suite run fails the test: what is refused must be refused before the work."""
    import conformance.harness
    import conformance.runner

    def forbidden(*args, **kwargs):
        raise AssertionError("the work started before the bad input was refused")

    monkeypatch.setattr(conformance.harness, "run_scenario", forbidden)
    monkeypatch.setattr(conformance.runner, "run_suite", forbidden)


def test_report_folders_are_made_before_the_run(tiny_checkpoint, tmp_path, monkeypatch):
    import conformance.runner

    seen = {}

    def fake_run_suite(sel, **options):
        seen.update({k: os.path.isdir(os.path.dirname(options[k])) for k in ("report_json", "junit_xml")})
        return 0

    monkeypatch.setattr(conformance.runner, "run_suite", fake_run_suite)
    code, _ = run_cli("run", "--engine", "reference", "--model", tiny_checkpoint, "--scenario", "mtp-k3",
                      "--report-json", str(tmp_path / "a" / "b" / "r.json"),
                      "--junit-xml", str(tmp_path / "c" / "j.xml"))
    assert code == 0 and seen == {"report_json": True, "junit_xml": True}


def test_a_report_path_that_is_a_folder_is_refused(tiny_checkpoint, tmp_path, capsys, no_run):
    code, _ = run_cli("run", "--engine", "reference", "--model", tiny_checkpoint,
                      "--report-json", str(tmp_path))
    assert code == 2 and f"--report-json {tmp_path} is a folder; name a file" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["[]", "{}", "3"])
def test_a_scenario_file_that_is_not_an_object_is_one_line(content, tiny_checkpoint, tmp_path, capsys,
                                                           no_run):
    f = tmp_path / "s.json"
    f.write_text(content)
    code, _ = run_cli("run", "--engine", "reference", "--model", tiny_checkpoint, "--scenario-file", str(f))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not a scenario file" in err[0] and "Traceback" not in err[0]


def test_replay_checks_the_request_id_before_running(tiny_checkpoint, capsys, no_run):
    code, _ = run_cli("replay", "chunk-tails-k3", "--request", "r99", "--engine", "reference", "--model",
                      tiny_checkpoint)
    assert code == 2
    assert "no request 'r99' in chunk-tails-k3 (requests: r00, r01" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "replay"])
def test_an_id_of_the_nightly_tier_says_so(command, tiny_checkpoint, capsys, no_run):
    argv = ["run", "--scenario", "soak-k3"] if command == "run" else ["replay", "soak-k3"]
    code, _ = run_cli(*argv, "--engine", "reference", "--model", tiny_checkpoint)
    assert code == 2
    assert "scenario 'soak-k3' is in the nightly tier, not in 'default': add --tier nightly" in \
        capsys.readouterr().err


def test_an_unknown_mutant_lists_the_valid_ids(capsys, monkeypatch):
    import conformance.mutants.run
    from conformance.mutants import MUTANTS

    monkeypatch.setattr(conformance.mutants.run, "run_mutants", lambda *a, **k: pytest.fail("ran"))
    code, out = run_cli("mutate", "--mutant", "nope")
    err = capsys.readouterr().err
    assert code == 2 and out == ""  # refused before the header of a run
    assert "unknown mutant 'nope'; valid ids: " in err and all(m.id in err for m in MUTANTS)


def _pytest(cwd, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in ("CONFORMANCE_ENGINE", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False, timeout=300)


@pytest.mark.slow  # three pytest processes
def test_the_header_only_in_runs_that_use_the_suite_and_no_benchmarks_folder(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "test_x.py").write_text("def test_x():\n    assert True\n")
    proc = _pytest(other, "-p", "no:xdist", "-p", "no:benchmark")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "conformance:" not in proc.stdout  # another project's run: no header of ours
    suite = tmp_path / "suite"
    suite.mkdir()
    proc = _pytest(suite, "--pyargs", "conformance.suite", "--collect-only", "-q", "-p", "no:xdist")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (suite / ".benchmarks").exists()  # pytest-benchmark stays out of a suite run
    proc = _pytest(suite, "--pyargs", "conformance.suite", "--collect-only", "-p", "no:xdist")
    assert "conformance: engine" in proc.stdout  # the suite's own run has its header
