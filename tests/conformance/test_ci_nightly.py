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


@pytest.mark.parametrize("flags,expected,absent", [
    (["--engine", "async:full", "--model", "/ckpt", "--device", "cuda:1"],
     [("-m", ""), ("--conformance-tier", "nightly"), ("--conformance-strict-expectations",),
      ("--conformance-engine", "async:full"), ("--conformance-model", "/ckpt"), ("--conformance-device", "cuda:1"),
      ("--reruns", "1")],
     []),
    (["--tier", "default", "--no-strict", "--infra-reruns", "3"],
     [("-m", ""), ("--conformance-tier", "default"), ("--reruns", "3")],
     ["--conformance-strict-expectations", "--conformance-engine", "--conformance-model"]),
])
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
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
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

INFRA_MISMATCH_ASSERT = CHILD_HEADER + """

def test_infra():
    if attempt("infra") == 1:
        raise InfrastructureError("reference engine crashed\\nTraceback ...\\nAssertionError: slot out of sync")


def test_mismatch():
    attempt("mismatch")
    pytest.fail("CONFORMANCE MISMATCH\\nscenario x diverges at output position 4", pytrace=False)


def test_assert():
    attempt("assert")
    assert [1, 2] == [1, 3]
"""


def test_rerun_options_rerun_an_infrastructure_error_never_a_mismatch_or_assert(ci, tmp_path):
    nightly, sj = ci
    proc, xml = _run_child(nightly, tmp_path, INFRA_MISMATCH_ASSERT)
    assert proc.returncode == 1
    assert _testcases(xml) == {"test_infra": 2, "test_mismatch": 1, "test_assert": 1}
    assert {n: _attempts(tmp_path, n) for n in ("infra", "mismatch", "assert")} == {
        "infra": 2, "mismatch": 1, "assert": 1}
    final = {c.id: c for c in sj.read_junit([xml])}
    assert {i: c.outcome for i, c in final.items()} == {
        "test_child::test_infra": "passed", "test_child::test_mismatch": "failed", "test_child::test_assert": "failed"}
    assert final["test_child::test_mismatch"].kind == final["test_child::test_assert"].kind == sj.MISMATCH
    assert nightly.reruns_in_log(tmp_path / "tests.log") == 1


@pytest.mark.parametrize("exc", ["InfrastructureError", "TimeoutError", "ConnectionResetError"])
def test_rerun_options_rerun_an_infrastructure_error_in_a_fixture(exc, ci, tmp_path):
    nightly, sj = ci
    proc, xml = _run_child(nightly, tmp_path, CHILD_HEADER + f"""

@pytest.fixture
def engine():
    if attempt("engine") == 1:
        raise {exc}("no answer from the device")
    return "engine"


@pytest.fixture
def broken():
    attempt("broken")
    raise ValueError("bad block size, not a TimeoutError: never rerun")


def test_engine(engine):
    assert engine == "engine"


def test_broken(broken):
    pass
""")
    assert _testcases(xml) == {"test_engine": 2, "test_broken": 1}
    assert _attempts(tmp_path, "engine") == 2 and _attempts(tmp_path, "broken") == 1
    outcomes = {c.id: c.outcome for c in sj.read_junit([xml])}
    assert outcomes == {"test_child::test_engine": "passed", "test_child::test_broken": "error"}
    assert proc.returncode == 1 and nightly.reruns_in_log(tmp_path / "tests.log") == 1


def test_a_mismatch_raised_while_handling_an_infrastructure_error_is_not_rerun(ci, tmp_path):
    """pytest-rerunfailures matches --only-rerun along the exception chain; --rerun-except keeps these."""
    nightly, _ = ci
    proc, xml = _run_child(nightly, tmp_path, CHILD_HEADER + """

def test_mismatch_after_timeout():
    attempt("mismatch")
    try:
        raise TimeoutError("slow reference")
    except TimeoutError:
        pytest.fail("CONFORMANCE MISMATCH\\nscenario x", pytrace=False)


def test_assert_after_infra():
    attempt("assert")
    try:
        raise InfrastructureError("harness broke")
    except InfrastructureError:
        assert 1 == 2
""")
    assert proc.returncode == 1
    assert _testcases(xml) == {"test_mismatch_after_timeout": 1, "test_assert_after_infra": 1}
    assert _attempts(tmp_path, "mismatch") == _attempts(tmp_path, "assert") == 1
    assert nightly.reruns_in_log(tmp_path / "tests.log") == 0


@pytest.mark.parametrize("message,failure_type,text,kind", [
    # An infrastructure error stays one whatever its traceback holds (pytest's and the CLI's forms).
    ("conformance.plugin.InfrastructureError: reference run failed", None, "AssertionError: x\nassert a == b",
     "infrastructure"),
    ("AssertionError: block table out of sync", "InfrastructureError", "Traceback ... AssertionError", "infrastructure"),
    ("slot 3 holds the wrong state", "ConformanceMismatch", "", "mismatch"),
    ("Failed: CONFORMANCE MISMATCH\nscenario x", None, "", "mismatch"),
    ("assert [1, 2] == [1, 3]", None, "", "mismatch"),
    ("AssertionError: tokens differ", None, "", "mismatch"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB", None, "", "infrastructure"),
    ("RuntimeError: CUDA error: an illegal memory access", None, "", "infrastructure"),
    ("worker 'gw1' crashed while running 'tests/x.py::t'", None, "Fatal Python error", "infrastructure"),
    ('failed on setup with "TimeoutError: no device"', None, "", "infrastructure"),
    # A real error whose traceback mentions an infrastructure word is not infrastructure.
    ("ValueError: bad block size", None, "File torch/cuda/memory.py: OutOfMemoryError handler", "other"),
    ('failed on setup with "OSError: missing file"', None, "", "other"),
])
def test_classification_by_type_and_crash_line(message, failure_type, text, kind, ci, tmp_path):
    _, sj = ci
    attrs = f' type="{failure_type}"' if failure_type else ""
    message = message.replace("\n", "&#10;").replace('"', "&quot;")
    (tmp_path / "t.xml").write_text(_xml(_case("a.b::t", f'<failure message="{message}"{attrs}>{text}</failure>')))
    (case,) = sj.read_junit([tmp_path / "t.xml"])
    assert case.kind == kind


def test_the_failure_type_property_wins(ci, tmp_path):
    _, sj = ci
    body = ('<properties><property name="failure_type" value="InfrastructureError"/></properties>'
            '<failure message="assert 0">AssertionError</failure>')
    (tmp_path / "t.xml").write_text(_xml(_case("a.b::t", body)))
    assert sj.read_junit([tmp_path / "t.xml"])[0].kind == sj.INFRASTRUCTURE


def test_declared_types_are_the_ones_conformance_writes(ci):
    _, sj = ci
    from conformance import report_files

    assert sj.DECLARED == {report_files.MISMATCH: sj.MISMATCH, report_files.INFRASTRUCTURE: sj.INFRASTRUCTURE}


def test_pytest_junit_of_a_real_infrastructure_error(ci, tmp_path):
    """pytest's own JUnit for the plugin's InfrastructureError, with AssertionError in its text."""
    _, sj = ci
    (tmp_path / "test_infra.py").write_text(
        "from conformance.plugin import InfrastructureError\n\n"
        "def test_reference_crash():\n"
        "    raise InfrastructureError('Traceback (most recent call last):\\nAssertionError: slot out of sync')\n\n"
        "def test_check_failed():\n"
        "    assert [1, 2] == [1, 3]\n")
    xml = tmp_path / "out.xml"
    code = pytest.main([str(tmp_path / "test_infra.py"), "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                        "--rootdir", str(tmp_path), f"--junitxml={xml}"])
    assert code == 1
    kinds = {c.id.rsplit("::", 1)[1]: c.kind for c in sj.read_junit([xml])}
    assert kinds == {"test_reference_crash": sj.INFRASTRUCTURE, "test_check_failed": sj.MISMATCH}


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
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "FLAKY_MARKER": str(tmp_path / "marker")}
    for key in ("CONFORMANCE_ENGINE", "PYTEST_ADDOPTS"):
        env.pop(key, None)
    xml = tmp_path / "suite.xml"
    cmd = [*nightly.pytest_cmd("-p", "flaky_reference", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "--pyargs", "conformance.suite", "--conformance-scenario", "short-prompts-k1",
                               "--conformance-engine", "reference", "--conformance-model", tiny_checkpoint,
                               *nightly.rerun_options(1), "--junitxml", str(xml))]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 rerun" in proc.stdout
    (case,) = summarize_junit.read_junit([xml])  # the final attempt only
    assert case.outcome == "passed" and "failure_type" not in case.properties, case
