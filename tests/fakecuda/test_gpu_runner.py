"""``ci/gpu_runner.sh --dry-run``: the GPU run's plan, and the checks that need no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "ci"))
import check_env


def test_dry_run_checks_of_the_environment():
    info = {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": "none", "triton": "3.9.0", "device": "cpu"}
    envs = check_env.tox_cuda_envs()
    assert envs["cu128"] == "12.8" and "12.6" in envs.values(), envs
    assert check_env.dry_run_problems(info, "12.8", envs) == [], "no GPU is not a dry-run problem"
    assert "not a CUDA version" in check_env.dry_run_problems(info, "12", envs)[0]
    assert "no tox environment installs torch for CUDA 11.8" in check_env.dry_run_problems(
        info, "11.8", envs)[0]
    assert "set EXPECTED_CUDA" in check_env.dry_run_problems(info, None, envs)[0]
    old = dict(info, python="3.10.4", triton="not installed")
    assert len(check_env.dry_run_problems(old, "12.8", envs)) == 2


def dry_run(expected_cuda: str, *pytest_args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, EXPECTED_CUDA=expected_cuda, REPORTS="reports/never-written")
    return subprocess.run(["bash", str(REPO / "ci/gpu_runner.sh"), "--dry-run", *pytest_args], check=False,
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_gpu_runner_dry_run_prints_the_plan_and_checks_what_it_can():
    done = dry_run("12.8", "tests/test_lint.py")
    assert done.returncode == 0, done.stdout + done.stderr
    plan = done.stdout.split("Checks without a GPU:")[0]
    reports = "reports/never-written"
    for line in ("python ci/check_env.py --device cuda --cuda 12.8",
                 f"python -m kernels.compile_check --targets sm_80,sm_90 > {reports}/compile-check.txt",
                 f"pytest -n auto -rxXfE -o junit_family=xunit1 --junitxml {reports}/tests.xml "
                 + "tests/test_lint.py",
                 "conformance run --engine async:full_and_piecewise --device cuda --tier default",
                 ("conformance run --engine async --device cuda --dtype bfloat16 --verdict rescored "
                  "--reference-dtype float32 --reference-device cpu --tier default")):
        assert line in plan, f"{line!r} not in the plan:\n{plan}"
    assert "tox: cu128" in done.stdout and "pytest selection: 1 test collected" in done.stdout
    assert not (REPO / "reports/never-written").exists(), "a dry run writes nothing"


@pytest.mark.slow
@pytest.mark.parametrize("cuda,args,expected", [
    ("11.1", ("tests/test_lint.py",), "no tox environment installs torch for CUDA 11.1"),
    ("12.8", ("tests/no_such_file.py",), "the suite's pytest selection does not collect"),
])
def test_gpu_runner_dry_run_fails_on(cuda, args, expected):
    done = dry_run(cuda, *args)
    assert done.returncode == 1 and expected in done.stdout + done.stderr, done.stdout + done.stderr
