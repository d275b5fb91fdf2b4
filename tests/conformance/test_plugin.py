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


# What the outer test run sets that a user's own suite run would not see (popped for the suite's runs
# started by tests, in this process or a child).
OUTER_RUN_SETTINGS = ("CONFORMANCE_ENGINE", "CONFORMANCE_MODEL", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER",
                      "PYTEST_XDIST_WORKER_COUNT")


def run_suite(pytester, *args: str) -> subprocess.CompletedProcess:
    """``pytest --pyargs conformance.suite ARGS`` as a user runs it, in this process (pytester: a fresh
    config and plugin manager, the outer run's modules and environment restored after), without the
    interpreter start and imports a child process pays; the exit status and output as a child's."""
    env = dict(os.environ)
    for key in OUTER_RUN_SETTINGS:  # a user's shell has none of the outer run's settings
        os.environ.pop(key, None)
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-rxXf",
                                              "--pyargs", "conformance.suite", *args)
    finally:
        os.environ.clear()
        os.environ.update(env)
    return subprocess.CompletedProcess(args, int(result.ret), result.stdout.str(), result.stderr.str())


def test_expected_failures_mismatches_and_stale_entries(tmp_path, tiny_checkpoint, pytester):
    xfails = tmp_path / "xfails.toml"
    xfails.write_text('[expected-failures]\n"short-prompts-k0/tokens" = "flipped on purpose"\n'
                      '"short-prompts-k0/output-records" = "flipped after the step"\n'
                      '"short-prompts-k0/pools-empty" = "fixed long ago"\n')
    proc = run_suite(
        pytester,
        "--conformance-engine",
        CORRUPT,
        "--conformance-model",
        tiny_checkpoint,
        "--conformance-xfail-file",
        str(xfails),
        "-k",
        "short-prompts-k0 or graph-padding-k0",
        "--junitxml",
        str(tmp_path / "j.xml"),
        "--conformance-report-json",
        str(tmp_path / "r.json"),
    )
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
    options = {"conformance_strict_expectations": strict, "conformance_fail_on_skip": False,
               "conformance_require_feature": []}
    return SimpleNamespace(node=SimpleNamespace(user_properties=[]),
                           config=SimpleNamespace(getoption=options.__getitem__))


def test_conclude_outcomes_and_strict_expectations():
    ok = ScenarioResult(
        "mtp-k3", "d", "default", "async", "m", "K=3", [CheckResult("tokens", "pass", "same")]
    )
    stale = Expectations("x.toml", {"mtp-k3/tokens": "fixed since"})
    request = _fake_request(strict=False)
    with pytest.warns(plugin.StaleExpectationWarning, match="mtp-k3/tokens"):
        plugin.conclude(request, ok, stale)  # passes, with a warning
    assert dict(request.node.user_properties)["engine"] == "async"
    with pytest.raises(pytest.fail.Exception, match="stale expected failure"):
        plugin.conclude(_fake_request(strict=True), ok, stale)
    broken = ScenarioResult(
        "mtp-k3", "d", "default", "async", "m", "K=3", error="RuntimeError: reference broke"
    )
    with pytest.raises(plugin.InfrastructureError):
        plugin.conclude(_fake_request(strict=False), broken, Expectations())
    skipped = ScenarioResult("mtp-k3", "d", "default", "async", "m", "K=3", skipped="no MTP head")
    with pytest.raises(pytest.skip.Exception):
        plugin.conclude(_fake_request(strict=False), skipped, Expectations())


def _fake_config(args=(), gpus=None):
    return SimpleNamespace(
        args=list(args), getoption=lambda name: gpus if name == "conformance_gpus" else None
    )


def test_auto_workers_only_for_a_conformance_run(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    cores = len(os.sched_getaffinity(0))
    assert plugin.pytest_xdist_auto_num_workers(_fake_config(["tests"])) is None  # another run: xdist decides
    suite = _fake_config(["conformance.suite"])
    assert plugin.pytest_xdist_auto_num_workers(suite) == cores  # the cores, whatever the GPU count
    assert plugin.pytest_xdist_auto_num_workers(_fake_config(["tests"], gpus="all")) == cores
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert plugin.pytest_xdist_auto_num_workers(suite) == 3


def test_gpu_pinning_only_when_asked(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert plugin._pinning_gpus(_fake_config(["tests/kernels"])) == []
    assert plugin._pinning_gpus(_fake_config(["conformance/suite/test_conformance.py::test_scenario"])) == [
        "4",
        "6",
    ]
    assert plugin._pinning_gpus(_fake_config(["tests"], gpus="all")) == ["4", "6"]
    assert plugin._pinning_gpus(_fake_config(["tests"], gpus="1, 3")) == ["1", "3"]
    with pytest.raises(pytest.UsageError, match="--conformance-gpus"):
        plugin._pinning_gpus(_fake_config(["tests"], gpus=","))

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setenv(plugin.GPU_IDS_ENV, "4,6")
    plugin.pytest_load_initial_conftests(None, None, [])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"  # round robin: several workers share each GPU


PROBE_TEST = """
import json, os

def test_probe():
    keys = ("PYTEST_XDIST_WORKER_COUNT", "CUDA_VISIBLE_DEVICES", "CONFORMANCE_GPU_IDS")
    with open(os.path.join(os.environ["PROBE_DIR"], os.environ["PYTEST_XDIST_WORKER"] + ".json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
"""


def _probe_unrelated_project(tmp_path: Path) -> list[dict]:
    project, probes = tmp_path / "project", tmp_path / "probes"
    project.mkdir()
    probes.mkdir()
    (project / "test_probe.py").write_text(PROBE_TEST)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "0,1,2", "PROBE_DIR": str(probes)}
    for key in ("PYTEST_XDIST_AUTO_NUM_WORKERS", plugin.GPU_IDS_ENV, "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "auto", "-q"]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(p.read_text()) for p in sorted(probes.iterdir())]


def test_another_projects_run_is_unchanged_with_gpus_visible(tmp_path, monkeypatch):
    """``pytest -n auto`` of an unrelated project: the workers xdist alone would start (its own answer to
    ``-n auto``, asked here), each with the environment as it was."""
    from xdist import plugin as xdist_plugin

    probes = _probe_unrelated_project(tmp_path)
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)  # as the child ran
    auto = SimpleNamespace(option=SimpleNamespace(numprocesses="auto"))
    alone = xdist_plugin.pytest_xdist_auto_num_workers(auto)
    assert probes == [{"PYTEST_XDIST_WORKER_COUNT": str(alone), "CUDA_VISIBLE_DEVICES": "0,1,2",
                       "CONFORMANCE_GPU_IDS": None}]  # the one test ran on one of them


# ---- a plugin that costs nothing where unused -------------------------------------------------------
# Every pytest run of an environment holding the package loads the plugin (a pytest11 entry point). What
# a conformance run needs and other runs do not is imported when the run uses it.
HEAVY = ("torch", "refengine", "conformance.mutants")
LOADED = """
def loaded(names):
    import sys
    return sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names))
"""


def _clean_env() -> dict[str, str]:
    """This environment without what would make a child run a conformance run (or a worker of one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONFORMANCE_", "PYTEST_"))}
    return {**env, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, list[str]]:
    """In a fresh interpreter: what importing the plugin loads of HEAVY, then what importing the adapter
    API (conformance.engines) loads of refengine's tools."""
    code = LOADED + f"""
import json
import conformance.plugin
plugin = loaded({HEAVY!r})
import conformance.engines
print(json.dumps({{"plugin": plugin, "engines": loaded(["refengine.tools"])}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_clean_env(), capture_output=True,
                          text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_loading_the_plugin_imports_neither_torch_nor_refengine_nor_the_mutants(fresh_imports):
    assert fresh_imports["plugin"] == []


def test_the_adapter_api_imports_nothing_of_refengines_tools(fresh_imports):
    """A third-party adapter imports conformance.engines: it gets no command-line tool with it."""
    assert fresh_imports["engines"] == []


UNRELATED_TEST = LOADED + f"""

def test_the_plugin_is_loaded_and_nothing_heavy_with_it():
    import sys

    assert "conformance.plugin" in sys.modules
    assert loaded({HEAVY!r}) == []
"""


def test_an_unrelated_pytest_run_imports_neither_torch_nor_refengine(tmp_path):
    """Another project's one-test run, no conftest: the plugin is loaded, torch, refengine and the
    mutants are not (the test checks from inside the run, after collection and its hooks)."""
    project = tmp_path / "unrelated"
    project.mkdir()
    (project / "test_unrelated.py").write_text(UNRELATED_TEST)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_unrelated.py"]
    proc = subprocess.run(cmd, cwd=project, env=_clean_env(), capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_a_broken_checkpoint_ends_the_pytest_run_once(tmp_path):
    """Not an error per scenario, even under xdist: one line naming the checkpoint and pytest's
    usage-error status. (Without xdist the run ends from the fixture: tests/conformance/test_cli.py.)"""
    from refengine.llm import default_model_path
    from tests.conformance.test_cli import _broken_checkpoints

    broken = _broken_checkpoints(default_model_path(), tmp_path)["truncated"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CONFORMANCE_ENGINE", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "conformance.suite",
           "--conformance-model", str(broken), "-n", "2"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    lines = [line for line in out.splitlines() if f"checkpoint '{broken}' cannot be used" in line]
    assert len(lines) == 1 and "SafetensorError" in lines[0], out
    assert "Traceback" not in out and "test_scenario[" not in out, out


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_an_engine_factory_that_raises_ends_the_run_once(tmp_path, workers, pytester):
    """A user's adapter whose factory raises is one usage error naming the engine and the error, as a
    broken checkpoint is: not a traceback per scenario (23 of them, 924 lines, before)."""
    from tests.conformance.broken_factory import MESSAGE

    engine = "tests.conformance.broken_factory:factory"
    if not workers:  # one process: in this one
        proc = run_suite(pytester, "--conformance-engine", engine)
    else:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("CONFORMANCE_ENGINE", None)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "conformance.suite",
               "--conformance-engine", engine, *workers]
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    lines = [line for line in out.splitlines() if MESSAGE in line]
    assert len(lines) == 1 and f"cannot load engine '{engine}': factory() raised RuntimeError" in lines[0], (
        out
    )
    assert "Traceback" not in out and "test_scenario[" not in out, out
