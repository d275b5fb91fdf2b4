"""ci/: infrastructure reruns repeat the original run's options; failures are classified by their
type, never by words in a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def _fake_nightly(nightly, monkeypatch, first_run_xml: str):
    """Replace the subprocess runner: the first pytest run writes ``first_run_xml``, every rerun
    reports its node ids as passed. Returns the list of commands run."""
    calls: list[list[str]] = []

    def fake_run(cmd, log=None):
        calls.append(cmd)
        xml = Path(cmd[cmd.index("--junitxml") + 1])
        if len(calls) == 1:
            xml.write_text(first_run_xml)
        else:
            ids = [a for a in cmd if "::" in a]
            xml.write_text(_xml(*(_case(i.replace("/", ".").replace(".py::", "::")) for i in ids)))
        return 0

    monkeypatch.setattr(nightly, "run", fake_run)
    monkeypatch.setattr(nightly, "NIGHTLY_EXTRA_COMMANDS", ())
    return calls


def _has(cmd: list[str], *seq: str) -> bool:
    return any(cmd[i:i + len(seq)] == list(seq) for i in range(len(cmd)))


INFRA_WITH_ASSERT = ('<error message="conformance.plugin.InfrastructureError: reference engine crashed" '
                     'type="InfrastructureError">Traceback (most recent call last):\n  ...\n'
                     "AssertionError: block table out of sync</error>")


@pytest.mark.parametrize("flags,expected,absent", [
    (["--engine", "async:full", "--model", "/ckpt", "--device", "cuda:1"],
     [("-m", ""), ("--conformance-tier", "nightly"), ("--conformance-strict-expectations",),
      ("--conformance-engine", "async:full"), ("--conformance-model", "/ckpt"), ("--conformance-device", "cuda:1")],
     []),
    (["--tier", "default", "--no-strict"], [("-m", ""), ("--conformance-tier", "default")],
     ["--conformance-strict-expectations", "--conformance-engine", "--conformance-model"]),
])
def test_infrastructure_reruns_repeat_the_original_options(flags, expected, absent, ci, tmp_path, monkeypatch):
    nightly, _ = ci
    monkeypatch.delenv("CONFORMANCE_ENGINE", raising=False)
    calls = _fake_nightly(nightly, monkeypatch, _xml(_case(NIGHTLY_ONLY, INFRA_WITH_ASSERT)))
    code = nightly.main(["--reports", str(tmp_path), "--skip-bench", "--baseline", str(tmp_path / "none.txt"),
                         *flags])
    first, rerun = calls
    assert "tests/conformance/test_suite.py::test_scenario[soak-k3]" in rerun
    for seq in expected:
        assert _has(first, *seq) and _has(rerun, *seq), seq
    for flag in absent:
        assert flag not in first and flag not in rerun
    assert code == 0  # the infrastructure failure passed on its rerun
    assert "1 rerun, 1 passed" in (tmp_path / "summary.md").read_text()


def test_suite_options_in_free_pytest_args_are_refused(ci, tmp_path):
    nightly, _ = ci
    with pytest.raises(SystemExit) as info:
        nightly.main(["--reports", str(tmp_path), "tests/conformance", "--conformance-engine", "async"])
    assert info.value.code == 2


def test_a_mismatch_is_never_rerun(ci, tmp_path, monkeypatch):
    nightly, _ = ci
    mismatch = '<failure message="Failed: CONFORMANCE MISMATCH&#10;mtp-k3 diverges">...</failure>'
    calls = _fake_nightly(nightly, monkeypatch, _xml(_case(NIGHTLY_ONLY, mismatch)))
    code = nightly.main(["--reports", str(tmp_path), "--skip-bench", "--baseline", str(tmp_path / "none.txt")])
    assert len(calls) == 1 and code == 1


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
