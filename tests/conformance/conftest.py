"""Fixtures for the conformance suite's own tests, and the choice of what this repository's
``pytest -n auto`` runs through the shipped suite (tests/conformance/test_suite.py)."""

from __future__ import annotations

import json

import pytest
from filelock import FileLock

from tests.helpers.checkpoints import write_checkpoint

# ---- What this repository's own test run puts under test: the one place to change ---------------
# The engine under test for tests/conformance/test_suite.py. Switch to "async" (FULL_AND_PIECEWISE
# graphs; or "async:full", "async:none", ...) or "reference" (self-conformance).
REPO_ENGINE_UNDER_TEST = "async"
# The checkpoint: a tiny transformers-written preset from tests/helpers/checkpoints.py, or None for
# the embedded default model (refengine/data/default_model) once it is installed.
REPO_MODEL_PRESET: str | None = None
# ---------------------------------------------------------------------------------------------------

TINY_PRESET = "next-tiny"  # the checkpoint the suite's self-tests use, whatever the choice above


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(shared_dir):
    """``get(preset) -> str``: a tiny checkpoint, written once per test run and shared by xdist workers."""

    def get(preset: str) -> str:
        target = shared_dir / f"conformance-ckpt-{preset}"
        with FileLock(str(shared_dir / f"conformance-ckpt-{preset}.lock")):
            if not (target / "tiny_spec.json").is_file():  # written last by write_checkpoint
                write_checkpoint(target, preset)
        return str(target)

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_dir) -> str:
    return tiny_checkpoint_dir(TINY_PRESET)


@pytest.fixture(scope="session")
def conformance_default_engine() -> str:
    return REPO_ENGINE_UNDER_TEST


@pytest.fixture(scope="session")
def conformance_default_model(tiny_checkpoint_dir) -> str | None:
    return None if REPO_MODEL_PRESET is None else tiny_checkpoint_dir(REPO_MODEL_PRESET)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory, worker_id):
    """A folder shared by this test run's xdist workers (the base temp dir's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker_id != "master" else base


@pytest.fixture(scope="session")
def recorded_run(small_case, shared_dir):
    """``get(scenario_id) -> (ScenarioResult, traces)``: run once per test run, shared through JSON."""
    from conformance.harness import run_scenario
    from conformance.results import ScenarioResult
    from conformance.trace import Trace

    def get(scenario_id: str):
        path = shared_dir / f"conformance-run-{scenario_id}.json"
        with FileLock(str(path) + ".lock"):
            if not path.is_file():
                result, traces = run_scenario(scenario_id, small_case)
                path.write_text(json.dumps({"result": result.to_dict(),
                                            "traces": {k: t.to_dict() for k, t in traces.items()}}))
        data = json.loads(path.read_text())
        return (ScenarioResult.from_dict(data["result"]),
                {k: Trace.from_dict(v) for k, v in data["traces"].items()})

    return get


@pytest.fixture(scope="session")
def small_case(tiny_checkpoint):
    """A Case running the reference engine as the engine under test on the tiny checkpoint."""
    from conformance.session import Selection

    return Selection(engine="reference", model=tiny_checkpoint).open_case()
