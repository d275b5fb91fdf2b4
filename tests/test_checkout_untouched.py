"""The child interpreters the default tier starts write nothing into the checkout.

A child writes ``__pycache__`` next to every module it imports unless told not to. The children run
here on a private copy of the checkout's packages: other xdist workers (and the children of other
tests) cannot add files to it while the test compares its file lists, and the copy holds no bytecode
yet, so bytecode that already sits in the real checkout cannot hide what a child would write. A
control run, with bytecode writing allowed, proves the child imports the copy and that the
comparison sees what it writes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conformance.test_workloads import prompts_in_child, quiet_env

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("conformance", "kernels", "refengine")  # pyproject's packages: what a child can import


def _copy_packages(dst: Path) -> Path:
    """The checkout's packages (sources and data, no bytecode) under ``dst``."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, dst / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _files(root: Path) -> set[str]:
    """Every file and folder under ``root`` (ignored ones such as ``__pycache__`` included), relative."""
    return {str(path.relative_to(root)) for path in root.rglob("*")}


@pytest.mark.parametrize("env", ["quiet", "inherited"], ids=["own-environment", "test-session-environment"])
def test_a_child_process_writes_nothing_into_the_checkout(env, tmp_path):
    """``own-environment``: the child as test_workloads.py starts it; ``test-session-environment``: a
    child that inherits the test session's environment, as the CLI, docs and child-pytest tests start
    theirs (tests/conftest.py sends their bytecode to a folder of the run, PYTHONPYCACHEPREFIX)."""
    base = quiet_env() if env == "quiet" else dict(os.environ)
    checkout = _copy_packages(tmp_path / "checkout")
    before = _files(checkout)
    prompts = prompts_in_child(base, checkout)
    assert prompts, "the child built no workloads"
    assert sorted(_files(checkout) - before) == []

    control = {**base, "PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": ""}  # bytecode next to the code
    assert prompts_in_child(control, checkout) == prompts
    written = _files(checkout) - before
    assert any(name.endswith(".pyc") for name in written), "the control child wrote no bytecode into the copy"
