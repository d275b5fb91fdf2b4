"""ci/: the nightly's one pytest run carries its suite options and pytest-rerunfailures options that
rerun infrastructure errors only (tried on real child pytest runs); failures are classified by their
type, never by words in a traceback."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from junitparser import JUnitXml

REPO = Path(__file__).resolve().parents[2]
NIGHTLY_ONLY = "tests.conformance.test_suite::test_scenario[soak-k3]"


@pytest.fixture
def ci(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "ci"))
    import nightly
    import summarize_junit

    return nightly, summarize_junit


def _xml(*cases: str) -> str:
    return f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>"


def _case(test_id: str, body: str = "") -> str:
    classname, _, name = test_id.partition("::")
    return f'<testcase classname="{classname}" name="{name}">{body}</testcase>'


def _fake_nightly(nightly, monkeypatch, junit: str, log_tail: str):
    """Replace the subprocess runner: the pytest run writes ``junit`` and a log ending in ``log_tail``.
    Returns the list of commands run."""
    calls: list[list[str]] = []

    def fake_run(cmd, log=None):
        calls.append(cmd)
        Path(cmd[cmd.index("--junitxml") + 1]).write_text(junit)
        if log is not None:
            log.write_text(f"collected 2 items\n\n{log_tail}\n")
        return 0

    monkeypatch.setattr(nightly, "run", fake_run)
    monkeypatch.setattr(nightly, "NIGHTLY_EXTRA_COMMANDS", ())
    return calls


def _has(cmd: list[str], *seq: str) -> bool:
    return any(cmd[i:i + len(seq)] == list(seq) for i in range(len(cmd)))


def _nightly(nightly, tmp_path, *flags: str) -> int:
    return nightly.main(["--reports", str(tmp_path), "--skip-bench", "--baseline", str(tmp_path / "none.txt"),
                         *flags])


INFRA_WITH_ASSERT = ('<error message="conformance.plugin.InfrastructureError: reference engine crashed" '
                     'type="InfrastructureError">Traceback (most recent call last):\n  ...\n'
                     "AssertionError: block table out of sync</error>")
RERUN_OPTIONS = ("--reruns", "--only-rerun", "--rerun-except")
PASSED_AFTER_RERUN = _xml(_case(NIGHTLY_ONLY))


@pytest.mark.parametrize(
    "flags,expected,absent",
    [
        (
            ["--engine", "async:full", "--model", "/ckpt", "--device", "cuda:1"],
            [
                ("-m", ""),
                ("--conformance-tier", "nightly"),
                ("--conformance-strict-expectations",),
                ("--conformance-engine", "async:full"),
                ("--conformance-model", "/ckpt"),
                ("--conformance-device", "cuda:1"),
                ("--reruns", "1"),
                ("--conformance-fail-on-skip",),  # the gate refuses skipped scenarios by default
            ],
            ["--conformance-step-timeout"],
        ),
        (
            ["--tier", "default", "--no-strict", "--infra-reruns", "3", "--allow-skips",
             "--step-timeout", "60"],
            [("-m", ""), ("--conformance-tier", "default"), ("--reruns", "3"),
             ("--conformance-step-timeout", "60.0")],
            ["--conformance-strict-expectations", "--conformance-engine", "--conformance-model",
             "--conformance-fail-on-skip"],
        ),
    ],
)
def test_the_main_run_carries_the_rerun_and_suite_options(flags, expected, absent, ci, tmp_path, monkeypatch):
    nightly, _ = ci
    monkeypatch.delenv("CONFORMANCE_ENGINE", raising=False)
    calls = _fake_nightly(nightly, monkeypatch, PASSED_AFTER_RERUN, "===== 1 passed, 2 rerun in 3.21s =====")
    code = _nightly(nightly, tmp_path, *flags)
    (cmd,) = calls  # the reruns happen inside the one pytest run
    reruns = int(cmd[cmd.index("--reruns") + 1])
    assert _has(cmd, *nightly.rerun_options(reruns))
    assert cmd.count("--only-rerun") == len(nightly.INFRA_TYPES)
    for seq in expected:
        assert _has(cmd, *seq), seq
    for flag in absent:
        assert flag not in cmd
    assert code == 0
    summary = (tmp_path / "summary.md").read_text()
    assert f"infrastructure reruns (at most {reruns} per test): 2 rerun" in summary
    assert "| 1 | 0 | 0 | 0 | 0 | 1 |" in summary


def test_infra_reruns_0_disables_the_reruns(ci, tmp_path, monkeypatch):
    nightly, _ = ci
    calls = _fake_nightly(nightly, monkeypatch, _xml(_case(NIGHTLY_ONLY, INFRA_WITH_ASSERT)),
                          "===== 1 failed in 3.21s =====")
    code = _nightly(nightly, tmp_path, "--infra-reruns", "0")
    (cmd,) = calls
    assert not any(a.startswith(RERUN_OPTIONS) for a in cmd)
    assert _has(cmd, "--conformance-tier", "nightly")
    assert code == 1  # the infrastructure failure is not in the baseline
    assert "infrastructure reruns: off (--infra-reruns 0)" in (tmp_path / "summary.md").read_text()


def test_a_missing_summary_line_leaves_the_rerun_count_unknown(ci, tmp_path, monkeypatch):
    nightly, _ = ci
    _fake_nightly(nightly, monkeypatch, PASSED_AFTER_RERUN, "Fatal Python error: Aborted")
    _nightly(nightly, tmp_path)
    assert "1 per test): unknown" in (tmp_path / "summary.md").read_text()
    assert nightly.reruns_in_log(tmp_path / "absent.log") is None


@pytest.mark.parametrize("free", [["--conformance-engine", "async"], ["-m", "slow"], ["--reruns", "5"],
                                  ["--only-rerun", ".*"], ["--rerun-except=x"]])
def test_suite_and_rerun_options_in_free_pytest_args_are_refused(free, ci, tmp_path):
    nightly, _ = ci
    with pytest.raises(SystemExit) as info:
        nightly.main(["--reports", str(tmp_path), "tests/conformance", *free])
    assert info.value.code == 2


def _run_child(nightly, tmp_path, module: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``module`` run by a child pytest with exactly nightly's rerun options (one rerun); returns the
    process and its JUnit file. The log (stdout) goes to tests.log, as in the nightly."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_child.py").write_text(module)
    xml = tmp_path / "tests.xml"
    cmd = nightly.pytest_cmd("test_child.py", "-p", "no:cacheprovider", "-p", "no:xdist", f"--junitxml={xml}",
                             *nightly.rerun_options(1))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run(
        cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    (tmp_path / "tests.log").write_text(proc.stdout + proc.stderr)
    assert xml.is_file(), proc.stdout + proc.stderr
    return proc, xml


def _testcases(xml: Path) -> Counter:
    """How many ``<testcase>`` elements each test name has: one per attempt."""
    return Counter(tc.name for suite in JUnitXml.fromfile(str(xml)) for tc in suite)


def _attempts(tmp_path: Path, name: str) -> int:
    f = tmp_path / f"{name}.attempts"
    return int(f.read_text()) if f.exists() else 0


CHILD_HEADER = """\
from pathlib import Path

import pytest


class InfrastructureError(RuntimeError):
    pass


def attempt(name):
    \"\"\"Count an attempt of ``name`` in a marker file beside this module; return the count.\"\"\"
    marker = Path(__file__).with_name(f"{name}.attempts")
    count = int(marker.read_text()) + 1 if marker.exists() else 1
    marker.write_text(str(count))
    return count
"""

CHILD_TESTS = (
    CHILD_HEADER
    + """

def test_infra():
    if attempt("infra") == 1:
        raise InfrastructureError("reference engine crashed\\nTraceback ...\\n"
                                  "AssertionError: slot out of sync")


def test_mismatch():
    attempt("mismatch")
    pytest.fail("CONFORMANCE MISMATCH\\nscenario x diverges at output position 4", pytrace=False)


def test_assert():
    attempt("assert")
    assert [1, 2] == [1, 3]


@pytest.fixture(params=["InfrastructureError", "TimeoutError", "ConnectionResetError"])
def engine(request):
    if attempt("engine-" + request.param) == 1:
        raise {"InfrastructureError": InfrastructureError, "TimeoutError": TimeoutError,
               "ConnectionResetError": ConnectionResetError}[request.param]("no answer from the device")
    return "engine"


@pytest.fixture
def broken():
    attempt("broken")
    raise ValueError("bad block size, not a TimeoutError: never rerun")


def test_engine(engine):
    assert engine == "engine"


def test_broken(broken):
    pass


def test_mismatch_after_timeout():
    attempt("mismatch-after-timeout")
    try:
        raise TimeoutError("slow reference")
    except TimeoutError:
        pytest.fail("CONFORMANCE MISMATCH\\nscenario x", pytrace=False)


def test_assert_after_infra():
    attempt("assert-after-infra")
    try:
        raise InfrastructureError("harness broke")
    except InfrastructureError:
        assert 1 == 2
"""
)


def test_rerun_options_rerun_infrastructure_errors_only(ci, tmp_path):
    """One child run with nightly's rerun options: an infrastructure error in a test or a fixture is
    rerun (and passes); a mismatch, an assertion, any other error, and a mismatch or assertion raised
    while handling an infrastructure error (pytest-rerunfailures searches the exception chain) are not."""
    nightly, sj = ci
    proc, xml = _run_child(nightly, tmp_path, CHILD_TESTS)
    assert proc.returncode == 1
    engines = [f"test_engine[{e}]" for e in ("InfrastructureError", "TimeoutError", "ConnectionResetError")]
    assert _testcases(xml) == {
        "test_infra": 2,
        **dict.fromkeys(engines, 2),
        "test_mismatch": 1,
        "test_assert": 1,
        "test_broken": 1,
        "test_mismatch_after_timeout": 1,
        "test_assert_after_infra": 1,
    }
    once = ("mismatch", "assert", "broken", "mismatch-after-timeout", "assert-after-infra")
    assert {n: _attempts(tmp_path, n) for n in once} == dict.fromkeys(once, 1)
    assert _attempts(tmp_path, "infra") == 2
    final = {c.id.removeprefix("test_child::"): c for c in sj.read_junit([xml])}
    assert {i: c.outcome for i, c in final.items()} == {
        "test_infra": "passed",
        **dict.fromkeys(engines, "passed"),
        "test_mismatch": "failed",
        "test_assert": "failed",
        "test_broken": "error",
        "test_mismatch_after_timeout": "failed",
        "test_assert_after_infra": "failed",
    }
    assert final["test_mismatch"].kind == final["test_assert"].kind == sj.MISMATCH
    assert nightly.reruns_in_log(tmp_path / "tests.log") == 4


FLAKY_REFERENCE_PLUGIN = """
import os
from pathlib import Path

import conformance.harness as harness

REAL = harness.reference_adapter


class FlakyReference:
    name = "flaky-reference"

    def __init__(self):
        self.inner = REAL()

    def supports(self, feature):
        return self.inner.supports(feature)

    def start(self, spec):
        marker = Path(os.environ["FLAKY_MARKER"])
        if not marker.exists():
            marker.write_text("down once")
            raise RuntimeError("planted: the reference engine is down once")
        return self.inner.start(spec)


def pytest_configure(config):
    harness.reference_adapter = FlakyReference
"""


def test_the_suites_infrastructure_error_is_rerun_and_its_properties_are_fresh(ci, tmp_path, tiny_checkpoint):
    """End to end with the real conformance plugin: the reference engine breaking once is rerun by the
    nightly's options, the rerun passes, and its JUnit testcase carries no stale failure_type."""
    nightly, summarize_junit = ci
    (tmp_path / "flaky_reference.py").write_text(FLAKY_REFERENCE_PLUGIN)
    env = {
        **os.environ,
        # the caller's path last: where the suite's own dependencies were installed (a --target folder)
        "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), str(REPO), os.environ.get("PYTHONPATH"))
                                      if p),
        "FLAKY_MARKER": str(tmp_path / "marker"),
    }
    for key in ("CONFORMANCE_ENGINE", "PYTEST_ADDOPTS"):
        env.pop(key, None)
    xml = tmp_path / "suite.xml"
    cmd = [*nightly.pytest_cmd("-p", "flaky_reference", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "--pyargs", "conformance.suite", "--conformance-scenario", "short-prompts-k1",
                               "--conformance-engine", "reference", "--conformance-model", tiny_checkpoint,
                               *nightly.rerun_options(1), "--junitxml", str(xml))]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 rerun" in proc.stdout
    (case,) = summarize_junit.read_junit([xml])  # the final attempt only
    assert case.outcome == "passed" and "failure_type" not in case.properties, case


def test_the_extra_commands_emit_no_junit_family_warnings(ci, tmp_path):
    """The nightly's extra pytest commands (the mutants) record properties; with pytest's default
    junit_family (xunit2) each one warns. Their options, run on a test that records a property:"""
    import subprocess
    import sys

    nightly, _ = ci
    test = tmp_path / "test_records.py"
    test.write_text("def test_records(record_property):\n    record_property('seconds_to_catch', 1.0)\n")
    for cmd in nightly.NIGHTLY_EXTRA_COMMANDS:
        argv = [a.replace("{reports}", str(tmp_path)) for a in cmd if not a.startswith("tests/")]
        assert argv[:3] == [sys.executable, "-m", "pytest"]
        proc = subprocess.run([*argv, "-p", "no:xdist", str(test)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "junit_family" not in proc.stdout + proc.stderr
