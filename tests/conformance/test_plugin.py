"""The pytest plugin end to end (in a child pytest), plus its xdist hooks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance import plugin
from conformance.expectations import Expectations
from conformance.results import CheckResult, ScenarioResult

REPO = Path(__file__).resolve().parents[2]
CORRUPT = "tests.conformance.corrupt_engine:factory"


def run_suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CONFORMANCE_ENGINE", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rxXf",
           "--pyargs", "conformance.suite", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300)


def test_expected_failures_mismatches_and_stale_entries(tmp_path, tiny_checkpoint):
    xfails = tmp_path / "xfails.toml"
    xfails.write_text('[expected-failures]\n"short-prompts-k0/tokens" = "flipped on purpose"\n'
                      '"short-prompts-k0/pools-empty" = "fixed long ago"\n')
    proc = run_suite(tmp_path, "--conformance-engine", CORRUPT, "--conformance-model", tiny_checkpoint,
                     "--conformance-xfail-file", str(xfails), "-k", "short-prompts-k0 or graph-padding-k0",
                     "--junitxml", str(tmp_path / "j.xml"), "--conformance-report-json", str(tmp_path / "r.json"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert re.search(r"1 failed, \d+ deselected, 1 xfailed", out)
    assert f"conformance: engine {CORRUPT}, tier default" in out  # the report header
    assert "StaleExpectationWarning" in out and "short-prompts-k0/pools-empty" in out
    assert "CONFORMANCE MISMATCH" in out and "diverges at output position 2" in out
    assert "conformance summary" in out and "replay graph-padding-k0 (tokens): conformance replay" in out
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_scenario[graph-padding-k0]"].iter("property")}
    assert props["engine"] == CORRUPT and props["first_divergence_position"] == "2"
    assert props["replay"].startswith("conformance replay graph-padding-k0 --request")
    assert "conformance_result" not in props  # the controller consumes it
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert (summary["failed"], summary["xfailed"], summary["scenarios"]) == (1, 1, 2)


def _fake_request(strict: bool):
    return SimpleNamespace(node=SimpleNamespace(user_properties=[]),
                           config=SimpleNamespace(getoption=lambda name: strict))


def test_conclude_outcomes_and_strict_expectations():
    ok = ScenarioResult("mtp-k3", "d", "default", "async", "m", "K=3", [CheckResult("tokens", "pass", "same")])
    stale = Expectations("x.toml", {"mtp-k3/tokens": "fixed since"})
    request = _fake_request(strict=False)
    with pytest.warns(plugin.StaleExpectationWarning, match="mtp-k3/tokens"):
        plugin.conclude(request, ok, stale)  # passes, with a warning
    assert dict(request.node.user_properties)["engine"] == "async"
    with pytest.raises(pytest.fail.Exception, match="stale expected failure"):
        plugin.conclude(_fake_request(strict=True), ok, stale)
    broken = ScenarioResult("mtp-k3", "d", "default", "async", "m", "K=3", error="RuntimeError: reference broke")
    with pytest.raises(plugin.InfrastructureError):
        plugin.conclude(_fake_request(strict=False), broken, Expectations())
    skipped = ScenarioResult("mtp-k3", "d", "default", "async", "m", "K=3", skipped="no MTP head")
    with pytest.raises(pytest.skip.Exception):
        plugin.conclude(_fake_request(strict=False), skipped, Expectations())


def test_auto_workers_and_gpu_pinning(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert plugin.pytest_xdist_auto_num_workers(None) == 3
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert plugin.pytest_xdist_auto_num_workers(None) == 2  # one worker per visible GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert plugin.pytest_xdist_auto_num_workers(None) == len(os.sched_getaffinity(0))  # CPU: one per core

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setenv(plugin.GPU_IDS_ENV, "4,6")
    plugin.pytest_load_initial_conftests(None, None, [])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
