"""A clean run of this repository's tests ends clean: no warnings summary under xdist (pytest-benchmark's
note that it is off there is expected, and silenced by pyproject's filterwarnings), while a run without
xdist still times the benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKED = """
def test_sum(benchmark):
    assert benchmark(sum, range(10)) == 45


def test_plain():
    assert True
"""


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest on ``project`` under this repository's configuration (pyproject's [tool.pytest.ini_options])."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CONFORMANCE_"))}
    cmd = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(project),
           "-p", "no:cacheprovider", *args, str(project)]
    return subprocess.run(cmd, cwd=project, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=180, check=False)


def test_an_xdist_run_with_benchmarks_ends_without_a_warning(tmp_path):
    (tmp_path / "test_benchmarked.py").write_text(BENCHMARKED)
    proc = _pytest(tmp_path, "-n", "1")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "2 passed" in output, output
    assert "PytestBenchmarkWarning" not in output and "warnings summary" not in output, output


def test_a_run_without_xdist_still_times_the_benchmarks(tmp_path):
    (tmp_path / "test_benchmarked.py").write_text(BENCHMARKED)
    proc = _pytest(tmp_path, "-p", "no:xdist", "--benchmark-only", "--benchmark-max-time=0.01")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "benchmark: 1 tests" in output and "test_sum" in output, output
