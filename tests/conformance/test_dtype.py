"""``--dtype`` on ``conformance run | replay | fuzz | mutate`` and ``--conformance-dtype``: both engines
are built in it, the output says so, a failure's replay command carries it, and the engines stay exact
(tokens, acceptance, logits bitwise) in bfloat16 as in float32: the same kernels in the same dtype."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from conformance.cli import main
from conformance.engines import RefEngineAdapter
from tests.conformance.test_cli import CORRUPT, run_cli
from tests.conformance.test_plugin import REPO
from tests.refengine.test_cli_dtype import stored_in


@pytest.fixture
def built(monkeypatch) -> list[tuple[str, torch.dtype]]:
    """(adapter name, parameter dtype) of every engine the conformance adapters build."""
    seen = []
    build = RefEngineAdapter.build

    def recording_build(self, spec):
        llm = build(self, spec)
        seen.append((self.name, next(llm.engine.model.parameters()).dtype))
        return llm

    monkeypatch.setattr(RefEngineAdapter, "build", recording_build)
    return seen


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    return str(stored_in(tiny_checkpoint, tmp_path_factory.mktemp("bf16") / "tiny", torch.bfloat16))


def test_bfloat16_run_is_exact_and_says_so(tiny_checkpoint, built, tmp_path):
    picked = ["mtp-k3", "chunk-tails-k3", "graph-padding-k1"]
    code, out = run_cli(
        "run",
        "--engine",
        "async",
        "--dtype",
        "bfloat16",
        "--model",
        tiny_checkpoint,
        *(a for sid in picked for a in ("--scenario", sid)),
        "--report-json",
        str(tmp_path / "r.json"),
    )
    assert code == 0, out
    # said before the first scenario
    assert "dtype: both engines run in bfloat16 with the same kernels" in out
    # and in the summary
    assert "3 scenarios in" in out and "both engines in bfloat16: 3 passed, 0 failed" in out
    assert {name for name, _ in built} >= {"reference", "async:full_and_piecewise"}
    assert {dtype for _, dtype in built} == {torch.bfloat16}
    for s in json.loads((tmp_path / "r.json").read_text())["scenarios"]:
        checks = {c["check"]: c["status"] for c in s["checks"]}
        assert s["dtype"] == "bfloat16" and checks["tokens"] == checks["acceptance"] == "pass", s[
            "scenario_id"
        ]
        assert checks["logits-digests"] == "pass", s["scenario_id"]  # bitwise-equal logits, in bfloat16


def test_auto_runs_in_the_checkpoints_dtype(bf16_checkpoint, built):
    code, out = run_cli("run", "--engine", "reference", "--dtype", "auto", "--model", bf16_checkpoint,
                        "--scenario", "short-prompts-k0")
    assert code == 0, out
    assert "both engines run in bfloat16" in out and "both engines in bfloat16: 1 passed" in out
    assert built and {dtype for _, dtype in built} == {torch.bfloat16}


def test_a_failures_replay_command_carries_the_dtype(tiny_checkpoint, built):
    code, out = run_cli("run", "--engine", CORRUPT, "--dtype", "float16", "--model", tiny_checkpoint,
                        "--scenario", "short-prompts-k0")
    assert code == 1, out
    replays = [line.strip() for line in out.splitlines() if "conformance replay short-prompts-k0" in line]
    assert replays and all(line.endswith("--dtype float16") for line in replays), replays
    assert "dtype             : float16 (both engines)" in out
    code, out = run_cli("replay", "short-prompts-k0", "--engine", CORRUPT, "--dtype", "float16", "--model",
                        tiny_checkpoint)
    assert code == 1 and "dtype             : float16 (both engines)" in out
    assert {dtype for _, dtype in built} == {torch.float16}


def test_fuzz_and_mutate_run_in_the_dtype_and_say_so(tiny_checkpoint, built, tmp_path):
    out = io.StringIO()
    assert (
        main(
            [
                "fuzz",
                "--engine",
                "reference",
                "--examples",
                "1",
                "--max-prompt",
                "8",
                "--dtype",
                "bfloat16",
                "--model",
                tiny_checkpoint,
                "--out",
                str(tmp_path),
                "-q",
            ],
            out=out,
        )
        == 0
    )
    assert "dtype bfloat16 (both engines)" in out.getvalue().splitlines()[0]
    assert built and {dtype for _, dtype in built} == {torch.bfloat16}
    built.clear()
    out = io.StringIO()
    assert (
        main(
            [
                "mutate",
                "--mutant",
                "short-prompt-as-decode",
                "--dtype",
                "bfloat16",
                "--model",
                tiny_checkpoint,
            ],
            out=out,
        )
        == 0
    )
    text = out.getvalue()
    assert "dtype bfloat16 (both engines)" in text.splitlines()[0] and "mutation score: 1/1 caught" in text, (
        text
    )
    assert {name for name, _ in built} >= {"reference", "mutant:short-prompt-as-decode"}
    assert {dtype for _, dtype in built} == {torch.bfloat16}


def test_the_plugin_refuses_an_unknown_dtype_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CONFORMANCE_DTYPE": "float64"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "conformance.suite"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert [line for line in out.splitlines() if line.strip()] == [
        ("ERROR: conformance: $CONFORMANCE_DTYPE must be one of float32, bfloat16, float16, auto, "
         "got 'float64'")
    ]
