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

# Every child interpreter a test starts (CLIs, child pytest runs) inherits this and writes no
# __pycache__ into the checkout (tests/test_checkout_untouched.py).
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"


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


def pytest_configure(config):
    if _runs_tests(config):
        _set_up_torch()
    # Many tests run the same reference workloads (each mutant, CLI test and scenario test runs the oracle,
    # plain, cached and bare runs of its scenarios): the deterministic reference engine's traces are shared
    # in this process. A test that swaps the reference side is not served from it (the cache applies to
    # the stock reference engine only); users' `conformance` commands never turn it on.
    # The session's first process also names a folder through which its xdist workers and the interpreters
    # its tests start share those runs.
    from conformance import reference_cache

    reference_cache.enable()
    if not os.environ.get(reference_cache.DIR_ENV):
        config._reference_traces = os.environ[reference_cache.DIR_ENV] = tempfile.mkdtemp(
            prefix="reference-traces-")


def pytest_unconfigure(config):
    folder = getattr(config, "_reference_traces", None)
    if folder is not None:
        from conformance import reference_cache

        os.environ.pop(reference_cache.DIR_ENV, None)
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
