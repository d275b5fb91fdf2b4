"""``conformance list / run / replay``: exit codes, reports, and what a failure prints."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conformance.cli import main
from conformance.workloads import scenario_ids
from tests.conformance.test_plugin import REPO

CORRUPT = "tests.conformance.corrupt_engine:factory"


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def test_list_through_the_console_script():
    exe = shutil.which("conformance") or pytest.skip("the conformance console script is not installed")
    proc = subprocess.run([exe, "list", "--tier", "default"], capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == scenario_ids("default")
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # every id has a description


def test_run_passes_with_reports(tiny_checkpoint, tmp_path):
    """(The whole default tier runs through the same suite in tests/conformance/test_suite.py.)"""
    picked = ["chunk-tails-k1", "mtp-k3", "short-prompts-mixed-k3"]
    code, out = run_cli("run", "--engine", "reference", "--tier", "default", "--model", tiny_checkpoint,
                        *(a for sid in picked for a in ("--scenario", sid)),
                        "--report-json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml"))
    assert code == 0, out
    n = len(picked)
    assert f"[{n}/{n}] PASS" in out and f"{n} scenarios" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["failed"] == 0 and len(data["scenarios"]) == n
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0" and suite.get("errors") == "0"


def test_corrupted_engine_fails_with_divergence_and_replay(tiny_checkpoint, tmp_path):
    code, out = run_cli(
        "run",
        "--engine",
        CORRUPT,
        "--scenario",
        "short-prompts-k3",
        "--model",
        tiny_checkpoint,
        "--junit-xml",
        str(tmp_path / "r.xml"),
    )
    assert code == 1
    assert "FAIL  short-prompts-k3" in out and "[FAIL] tokens" in out
    assert "diverges at output position 2" in out
    assert "replay: conformance replay short-prompts-k3 --request r" in out and f"--engine {CORRUPT}" in out
    assert "How to read a failure" in out
    case = (
        ET.parse(tmp_path / "r.xml")
        .getroot()
        .find("testsuite/testcase[@name='test_scenario[short-prompts-k3]']")
    )
    assert case.get("classname") == "conformance.suite.test_conformance"
    failure = case.find("failure")
    assert failure is not None and "diverges" in failure.text and "[FAIL] tokens" in failure.text
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["failure_type"] == "ConformanceMismatch" and props["first_divergence_position"] == "2"


def _junit(path) -> dict[tuple[str, str], tuple[str, str | None]]:
    """(classname, name) -> (outcome element or "passed", failure_type property) of every testcase."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tag = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        out[(case.get("classname"), case.get("name"))] = (tag, props.get("failure_type"))
    return out


def test_cli_and_pytest_give_the_same_ids_and_outcomes(tiny_checkpoint, tmp_path, pytester):
    """One route: the CLI's JUnit is pytest's, with the ids a ``pytest --pyargs`` run from any folder
    (pytester's) gives."""
    from tests.conformance.test_plugin import run_suite

    picked = ["short-prompts-k3", "graph-padding-k0"]
    code, out = run_cli("run", "--engine", CORRUPT, "--model", tiny_checkpoint, "--scenario", picked[0],
                        "--scenario", picked[1], "--junit-xml", str(tmp_path / "cli.xml"))
    assert code == 1, out
    proc = run_suite(pytester, "--conformance-engine", CORRUPT, "--conformance-model", tiny_checkpoint,
                     "--conformance-scenario", picked[0], "--conformance-scenario", picked[1],
                     "--junitxml", str(tmp_path / "py.xml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cli, py = _junit(tmp_path / "cli.xml"), _junit(tmp_path / "py.xml")
    assert cli == py
    assert set(cli) == {("conformance.suite.test_conformance", f"test_scenario[{s}]") for s in picked}
    assert set(cli.values()) == {("failure", "ConformanceMismatch")}


def test_the_cli_uses_the_packaged_expectations_and_strict_mode(tiny_checkpoint, tmp_path, monkeypatch):
    """No --xfail-file: the engine's packaged file applies, its stale entries warn, and fail when strict."""
    import conformance.session

    packaged = tmp_path / "packaged.toml"
    packaged.write_text('[expected-failures]\n"short-prompts-k1/tokens" = "fixed since"\n')
    monkeypatch.setattr(conformance.session, "expectations_file_for", lambda engine: packaged)
    argv = ["run", "--engine", "reference", "--scenario", "short-prompts-k1", "--model", tiny_checkpoint]
    code, out = run_cli(*argv)
    assert code == 0, out
    assert "warning: stale expected failure(s) in" in out and "short-prompts-k1/tokens no longer fail" in out
    assert f"expected failures: {packaged} (1 entries)" in out and "no longer fails is a warning" in out
    assert (
        _status(out) == "PASS" and "stale expected failure short-prompts-k1/tokens passed: a warning" in out
    )
    assert "1 passed, 0 failed" in out and "stale expected failure short-prompts-k1/tokens: passed" in out
    code, out = run_cli(*argv, "--strict-expectations", "--junit-xml", str(tmp_path / "s.xml"))
    assert code == 1, out
    assert "an entry that no longer fails fails the run (--strict-expectations)" in out  # said up front
    assert (
        _status(out) == "FAIL"
        and "short-prompts-k1/tokens passed: fails the run (strict expectations)" in out
    )
    assert "0 passed, 1 failed" in out  # the summary counts it as the failure it is
    assert (
        "FAILED short-prompts-k1: stale expected failure short-prompts-k1/tokens (strict expectations)" in out
    )
    assert list(_junit(tmp_path / "s.xml").values()) == [("failure", None)]


def _status(out: str) -> str:
    """The verdict of the one progress line of a one-scenario run."""
    (line,) = [line for line in out.splitlines() if line.startswith("[1/1] ")]
    return line.split()[1]


class _BrokenReference:
    name = "broken-reference"

    def supports(self, feature):
        return True

    def start(self, spec):
        raise RuntimeError("reference engine out of order (planted)")


def test_an_infrastructure_failure_is_an_error_not_a_mismatch(tiny_checkpoint, tmp_path, monkeypatch):
    """The reference engine breaking says nothing about the engine under test: JUnit <error>, classified
    as infrastructure by ci/summarize_junit.py (whatever its traceback holds)."""
    import conformance.harness

    sys.path.insert(0, str(REPO / "ci"))
    try:
        import summarize_junit
    finally:
        sys.path.remove(str(REPO / "ci"))
    monkeypatch.setattr(conformance.harness, "reference_adapter", _BrokenReference)
    code, out = run_cli(
        "run",
        "--engine",
        "reference",
        "--scenario",
        "short-prompts-k1",
        "--model",
        tiny_checkpoint,
        "--junit-xml",
        str(tmp_path / "e.xml"),
    )
    assert code == 1
    assert "ERROR short-prompts-k1" in out and "reference engine out of order (planted)" in out
    assert list(_junit(tmp_path / "e.xml").values()) == [("error", "InfrastructureError")]
    (case,) = summarize_junit.read_junit([tmp_path / "e.xml"])
    assert case.outcome == "error" and case.kind == summarize_junit.INFRASTRUCTURE


def test_replay_prints_the_request_step_by_step(tiny_checkpoint):
    code, out = run_cli("replay", "short-prompts-k3", "--request", "r00", "--engine", CORRUPT, "--model",
                        tiny_checkpoint)
    assert code == 1
    assert "== reference ==" in out and f"== {CORRUPT} ==" in out and "step  kind" in out
    code, _ = run_cli("replay", "short-prompts-k3", "--request", "r99", "--engine", "reference", "--model",
                      tiny_checkpoint)
    assert code == 2


@pytest.mark.parametrize("argv", [
    ["run", "--engine", "reference", "--scenario", "no-such-scenario"],
    ["run", "--engine", "no-such-engine"],
    ["run", "--engine", "nosuchmodule.x:factory"],
    ["run", "--engine", "reference", "--model", "/nonexistent/checkpoint"],
    ["run", "--engine", "reference", "--scenario", "soak-k3", "--tier", "default"],
])
def test_usage_errors_exit_2(argv, tiny_checkpoint):
    if "--model" not in argv:
        argv = [*argv, "--model", tiny_checkpoint]
    assert run_cli(*argv)[0] == 2


def test_an_engine_factory_that_raises_is_one_line(capsys):
    """The user's factory raising is the engine being unusable: one line naming it and the error, exit 2."""
    from tests.conformance.broken_factory import MESSAGE

    engine = "tests.conformance.broken_factory:factory"
    assert main(["run", "--engine", engine], out=io.StringIO()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"conformance run: cannot load engine '{engine}': factory() raised RuntimeError: {MESSAGE}"
    ]


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["run", "--tier", "weekly"])
    assert e.value.code == 2


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "list"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0 and "soak-k3" in proc.stdout


def test_xfail_file_turns_listed_failures_into_expected_ones(tiny_checkpoint, tmp_path):
    xfails = tmp_path / "x.toml"
    xfails.write_text(
        '[expected-failures]\n"short-prompts-k3/tokens" = "flipped on purpose"\n'
        '"short-prompts-k3/output-records" = "flipped after the step"\n'
        '"short-prompts-k3/spec-lossless" = "flipped on purpose"\n"short-prompts-k3/acceptance" = "x"\n'
    )
    code, out = run_cli(
        "run",
        "--engine",
        CORRUPT,
        "--scenario",
        "short-prompts-k3",
        "--model",
        tiny_checkpoint,
        "--xfail-file",
        str(xfails),
    )
    assert code == 0, out
    assert "expected failure" in out and "short-prompts-k3/acceptance no longer fail" in out
    assert _status(out) == "XFAIL" and not re.search(r"\bFAIL(ED)?\b", out)  # exit 0: nothing said to fail
    assert "0 failed, 3 failed as expected" in out
    assert "0 passed, 0 failed, 1 expected failures" in out
    assert (
        "expected failure short-prompts-k3: tokens (flipped on purpose), output-records (flipped after the "
        "step), spec-lossless (flipped on purpose)" in out
    )


def test_replay_without_request_prints_every_step_of_the_scenario(tiny_checkpoint):
    code, out = run_cli("replay", "churn-k1", "--engine", "reference", "--model", tiny_checkpoint)
    assert code == 0
    table = out[out.index("== reference =="):]
    assert "step  graph  request  kind" in table and "== reference (under test) ==" in table
    assert sum(f"  r{i:02d}      prefill" in table for i in range(8)) == 8  # every request's rows, not one
    assert "r07: " in table and "finish length" in table


def test_scenario_files_run_and_bad_ones_are_usage_errors(tiny_checkpoint, tmp_path):
    from conformance.workloads import load_scenario
    from conformance.workloads.files import write_scenario_file

    path = write_scenario_file(tmp_path / "s.json", load_scenario("short-prompts-k1", "default", 256), 256)
    code, out = run_cli(
        "run", "--scenario-file", str(path), "--engine", "reference", "--model", tiny_checkpoint
    )
    assert code == 0 and "[1/1] PASS  short-prompts-k1" in out
    code, out = run_cli("run", "--scenario-file", str(path), "--engine", CORRUPT, "--model", tiny_checkpoint)
    assert code == 1 and f"conformance replay --scenario-file {path} --request" in out
    (tmp_path / "bad.json").write_text('{"format": "something-else"}')
    assert run_cli("run", "--scenario-file", str(tmp_path / "bad.json"), "--model", tiny_checkpoint)[0] == 2
    # neither id nor file
    assert run_cli("replay", "--engine", "reference", "--model", tiny_checkpoint)[0] == 2


def _broken_checkpoints(src, root):
    """A truncated weights file, NaN weights and an unreadable tokenizer, each beside a good config."""
    import safetensors.torch

    made = {}
    for name in ("truncated", "nan", "tokenizer"):
        shutil.copytree(src, root / name)
        made[name] = root / name
    data = (made["truncated"] / "model.safetensors").read_bytes()
    (made["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    tensors = safetensors.torch.load_file(str(made["nan"] / "model.safetensors"))
    first = min(k for k, v in tensors.items() if v.is_floating_point())
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = float("nan")
    safetensors.torch.save_file(tensors, str(made["nan"] / "model.safetensors"), metadata={"format": "pt"})
    (made["tokenizer"] / "tokenizer.json").write_text("{ not json")
    return made


@pytest.mark.parametrize("kind", ["truncated", "nan", "tokenizer"])
def test_a_broken_checkpoint_is_one_error_up_front(kind, tmp_path, capsys):
    """Not a traceback per scenario: one line naming the checkpoint and the problem, exit 2."""
    from refengine.llm import default_model_path

    broken = _broken_checkpoints(default_model_path(), tmp_path)[kind]
    assert main(["run", "--model", str(broken)], out=io.StringIO()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(broken) in err[0] and "Traceback" not in err[0], err


def test_an_unusable_device_is_one_error_up_front(capsys):
    import torch

    device = f"cuda:{torch.cuda.device_count() + 3}"
    assert main(["run", "--device", device], out=io.StringIO()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and device in err[0], err


def test_a_missing_checkpoint_folder_is_named_as_missing(capsys, tmp_path):
    """The same words as refengine's loader: a folder that is not there is said to be missing; a folder
    without config.json is not a checkpoint."""
    missing = tmp_path / "nowhere"
    assert main(["run", "--engine", "reference", "--model", str(missing)], out=io.StringIO()) == 2
    assert capsys.readouterr().err.strip() == f"conformance run: checkpoint folder {missing} does not exist"
    assert main(["run", "--engine", "reference", "--model", str(tmp_path)], out=io.StringIO()) == 2
    assert "expected a folder with config.json" in capsys.readouterr().err
