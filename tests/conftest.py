"""Test-wide set-up: Triton runs under its interpreter when there is no CUDA device; one torch
thread per xdist worker on any machine; the reference engine's traces shared within each test process
(conformance/reference_cache.py)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# pytester: the suite's pytest runs in the test's own process (tests/conformance/test_plugin.py run_suite)
pytest_plugins = ["pytester"]

# The test processes write no __pycache__ into the checkout (tests/test_checkout_untouched.py); the child
# interpreters the tests start keep theirs in one folder of the run instead (_share_bytecode).
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
# The run's bytecode folder, named by its first process for its xdist workers. Not PYTHONPYCACHEPREFIX
# itself: a worker started with it would compile torch and everything else it imports into the empty folder.
BYTECODE_ENV = "REFENGINE_TEST_BYTECODE_DIR"


def _runs_tests(config) -> bool:
    """False in an xdist controller, which only hands tests to its workers: it needs no torch, and
    importing it there (about 2 s) would delay every worker's start."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(config.option, "numprocesses", None)


def _set_up_torch() -> None:
    import torch

    if not torch.cuda.is_available():
        # Read when a Triton kernel is decorated, so it must be set before any kernel module loads
        # (the test modules import them when they are collected, after this).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not torch.cuda.is_available() or os.environ.get("PYTEST_XDIST_WORKER"):
        # The models under test are tiny: intra-op threads only contend with the other xdist workers
        # (with `-n auto` there is one worker per core, several of them sharing each GPU).
        torch.set_num_threads(1)


def _share_bytecode(config) -> None:
    """The interpreters this process's tests start (CLIs, child pytest runs: a few dozen in the default
    tier) read and write their bytecode in the run's folder, outside the checkout: each of them would
    otherwise compile every module it imports from source (about 0.8 s of a child that imports the
    engines; the first child fills the folder)."""
    folder = _run_folder(config, BYTECODE_ENV, "bytecode-")
    if _runs_tests(config):
        os.environ["PYTHONPYCACHEPREFIX"] = folder
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _run_folder(config, env: str, prefix: str) -> str:
    """The folder ``env`` names for this test run: made by the run's first process (which removes it at
    the end), inherited by its xdist workers and the interpreters its tests start."""
    if not os.environ.get(env):
        os.environ[env] = tempfile.mkdtemp(prefix=prefix)
        config._run_folders = [*getattr(config, "_run_folders", []), (env, os.environ[env])]
    return os.environ[env]


def pytest_configure(config):
    if _runs_tests(config):
        _set_up_torch()
    _share_bytecode(config)
    # Many tests run the same reference workloads (each mutant, CLI test and scenario test runs the oracle,
    # plain, cached and bare runs of its scenarios): the deterministic reference engine's traces are shared
    # in this process. A test that swaps the reference side is not served from it (the cache applies to
    # the stock reference engine only); users' `conformance` commands never turn it on.
    # The session's first process also names a folder through which its xdist workers and the interpreters
    # its tests start share those runs.
    from conformance import reference_cache

    reference_cache.enable()
    _run_folder(config, reference_cache.DIR_ENV, "reference-traces-")


def pytest_unconfigure(config):
    for env, folder in getattr(config, "_run_folders", []):
        os.environ.pop(env, None)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_finish(session):
    # Everything alive after collection (torch, transformers, the test modules) lives as long as the
    # session: moved out of the collector's reach, the full collections the tests trigger scan only
    # what the tests make (summed over the default tier's workers, 38 s of collection before, 13 s after).
    # A young generation of 5000 objects instead of 700 makes the full collections rarer again (2 x 4.6
    # s of them before, 2 x 2.5 s after; garbage in cycles lives a few more steps).
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(5000, 10, 10)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    from refengine.sampling import seed_torch

    seed_torch(0)
    yield
