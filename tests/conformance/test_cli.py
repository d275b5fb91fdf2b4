"""``conformance list / run / replay``: exit codes, reports, and what a failure prints."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conformance.cli import main
from conformance.workloads import scenario_ids

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


def test_run_default_tier_passes_with_reports(tiny_checkpoint, tmp_path):
    code, out = run_cli("run", "--engine", "reference", "--tier", "default", "--model", tiny_checkpoint,
                        "--report-json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml"))
    assert code == 0, out
    n = len(scenario_ids("default"))
    assert f"[{n}/{n}] PASS" in out and f"{n} scenarios" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["failed"] == 0 and len(data["scenarios"]) == n
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0" and suite.get("errors") == "0"


def test_corrupted_engine_fails_with_divergence_and_replay(tiny_checkpoint, tmp_path):
    code, out = run_cli("run", "--engine", CORRUPT, "--scenario", "short-prompts-k3", "--model", tiny_checkpoint,
                        "--junit-xml", str(tmp_path / "r.xml"))
    assert code == 1
    assert "FAIL  short-prompts-k3" in out and "[FAIL] tokens" in out
    assert "diverges at output position 2" in out
    assert "replay: conformance replay short-prompts-k3 --request r" in out and f"--engine {CORRUPT}" in out
    assert "How to read a failure" in out
    failure = ET.parse(tmp_path / "r.xml").getroot().find("testsuite/testcase[@name='tokens']/failure")
    assert failure is not None and "diverges" in failure.text


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


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["run", "--tier", "weekly"])
    assert e.value.code == 2


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "conformance.cli", "list"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "soak-k3" in proc.stdout


def test_xfail_file_turns_listed_failures_into_expected_ones(tiny_checkpoint, tmp_path):
    xfails = tmp_path / "x.toml"
    xfails.write_text('[expected-failures]\n"short-prompts-k3/tokens" = "flipped on purpose"\n'
                      '"short-prompts-k3/spec-lossless" = "flipped on purpose"\n"short-prompts-k3/acceptance" = "x"\n')
    code, out = run_cli("run", "--engine", CORRUPT, "--scenario", "short-prompts-k3", "--model", tiny_checkpoint,
                        "--xfail-file", str(xfails))
    assert code == 0, out
    assert "expected failure" in out and "short-prompts-k3/acceptance no longer fail" in out


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
    code, out = run_cli("run", "--scenario-file", str(path), "--engine", "reference", "--model", tiny_checkpoint)
    assert code == 0 and "[1/1] PASS  short-prompts-k1" in out
    code, out = run_cli("run", "--scenario-file", str(path), "--engine", CORRUPT, "--model", tiny_checkpoint)
    assert code == 1 and f"conformance replay --scenario-file {path} --request" in out
    (tmp_path / "bad.json").write_text('{"format": "something-else"}')
    assert run_cli("run", "--scenario-file", str(tmp_path / "bad.json"), "--model", tiny_checkpoint)[0] == 2
    assert run_cli("replay", "--engine", "reference", "--model", tiny_checkpoint)[0] == 2  # neither id nor file


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
