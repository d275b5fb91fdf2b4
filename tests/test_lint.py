"""The repository passes its linter, the line-length rule included (pyproject.toml's [tool.ruff])."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.importorskip("ruff", reason="the lint extra (ruff) is not installed")
    return [sys.executable, "-m", "ruff"]


def test_the_repository_passes_ruff_with_the_line_length_rule():
    cmd = [*_ruff(), "check", "--no-cache", str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rules = subprocess.run([*_ruff(), "check", "--no-cache", "--show-settings", str(ROOT / "tests")],
                           capture_output=True, text=True, cwd=ROOT, check=False, timeout=120).stdout
    assert "line-too-long (E501)" in rules and "line_length = 110" in rules
