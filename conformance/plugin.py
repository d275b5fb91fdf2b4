"""pytest plugin for the conformance suite (registered through the ``pytest11`` entry point).

It stays inert until a test asks for the ``conformance_scenario`` fixture (the shipped suite,
``pytest --pyargs conformance.suite``, or a module re-exporting its test). Choosing what runs:

  --conformance-engine E     engine under test: reference | async | async:<graph mode> |
                             package.module:factory   (else $CONFORMANCE_ENGINE, else the
                             ``conformance_default_engine`` fixture, "async" unless a conftest overrides it)
  --conformance-tier T       default | nightly
  --conformance-model PATH   checkpoint (else $CONFORMANCE_MODEL, else ``conformance_default_model``,
                             None = the embedded default model)
  --conformance-dtype D      float32 | bfloat16 | float16 | auto (the checkpoint's own), both engines
                             (else $CONFORMANCE_DTYPE, else float32)
  --conformance-enable-prefix-caching   every scenario with prefix caching for the engine under test
  --conformance-mamba-cache-mode M      with it: align | all (default: each scenario's own, else align)
  --conformance-xfail-file F expected failures (TOML); default: conformance/expectations/<engine>.toml
  --conformance-strict-expectations   a listed expected failure that passes fails the scenario
  --conformance-scenario ID  only this scenario (repeatable; default: the whole tier)
  --conformance-scenario-file F   also (or, with no --conformance-scenario, only) this workload file
  --conformance-gpus IDS     spread xdist workers over these GPUs ("all" or "0,1,2"), round robin
  --conformance-step-timeout S    an engine call that has not returned after S seconds fails its scenario
  --conformance-fail-on-skip      a skipped scenario fails (a CI gate that skips is not green)
  --conformance-require-feature F the engine must support F; a scenario needing it may not skip
  --conformance-min-scenarios N   fewer than N scenarios ran (were not skipped): the run fails
  --conformance-allow-unexercised a trigger a scenario misses warns instead of failing the scenario
  --conformance-require-exercised a trigger or parameter the checkpoint decides, not exercised, fails too
                                  (default: a warning and a named gap of the summary)

The run's header (only in runs that name the suite or collect its test) and the "conformance summary"
say what was exercised: the skipped scenarios by reason, the features the scenarios needed, the checks
that applied nowhere.

Worker count and GPU pinning are the only things it changes outside its own fixtures, and only when
asked: when the shipped suite is named on the command line (``conformance.suite``) or
``--conformance-gpus`` is given. Any other pytest run in an environment where the package is
installed (another project's tests) keeps xdist's own ``-n auto`` and its ``CUDA_VISIBLE_DEVICES``.

``conformance run`` is this same suite run in-process (conformance.cli): the expectations, the strict
mode, the pass / fail / xfail / error outcomes and the JUnit ids are the ones defined here. A
scenario's test id is ``conformance/suite/test_conformance.py::test_scenario[<id>]`` (JUnit
``conformance.suite.test_conformance`` / ``test_scenario[<id>]``) wherever pytest's rootdir is. An
infrastructure failure (the reference engine or the harness broke) is a setup *error* of that test,
a failed check a test *failure*. A checkpoint or device that cannot be used at all ends the run
before any scenario, with one line and exit status 4 (pytest's usage error).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

# Every pytest run of an environment holding the package loads this module: what it imports here is
# free of torch, refengine and the mutants (tests/conformance/test_plugin.py holds it to that). The
# engines, the harness, the checks and the model load in the fixtures and hooks of a conformance run.
from conformance import session as settings  # (hooks take a parameter named session)
from conformance.env import describe, environment
from conformance.expectations import judge, unknown_entries
from conformance.features import REQUIRABLE_FEATURES, missing_features
from conformance.results import ScenarioResult
from conformance.watchdog import DEFAULT_STEP_TIMEOUT
from conformance.workloads import TIERS, UnknownScenario, scenario_ids
from conformance.workloads.scenario import MAMBA_CACHE_MODES


def _int_at_least_1(text: str) -> int:
    """``--conformance-tensor-parallel-size``: an integer >= 1, refused in one line otherwise (the plugin
    imports nothing of refengine, so not refengine.tools.errors.int_at_least, which the CLI uses)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _nats(text: str) -> float:
    """``--conformance-tolerance``: a finite number of nats >= 0, refused in one line otherwise."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected nats >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected nats >= 0, got {value}")
    return value


SUITE_PATH = "conformance/suite/test_conformance.py"  # the shipped suite's test ids start with this
SUITE_FILE = Path(__file__).resolve().parent / "suite" / "test_conformance.py"

RESULT_PROPERTY = "conformance_result"  # carries a ScenarioResult from the worker to the controller
TEST_ID_PROPERTY = "conformance_test_id"  # carries a shipped test's rootdir-independent id to the controller
GPU_IDS_ENV = "CONFORMANCE_GPU_IDS"  # exported by the xdist controller, read by each worker
_EXPORTED_GPU_IDS = pytest.StashKey[bool]()
_SCENARIOS = pytest.StashKey[list[str]]()


class StaleExpectationWarning(UserWarning):
    """An expected failure that no longer fails."""


class NotExercisedWarning(UserWarning):
    """A scenario ran and agreed, but did not hit a trigger it exists for (on a user's checkpoint)."""


class InfrastructureError(RuntimeError):
    """The harness or the reference engine broke: no verdict about the engine under test."""


def pytest_addoption(parser):
    g = parser.getgroup("conformance", "engine conformance suite (pytest --pyargs conformance.suite)")
    g.addoption("--conformance-engine", default=None, help="engine under test: reference, async, "
                "async:<graph mode> or package.module:factory (default: $CONFORMANCE_ENGINE, else async)")
    g.addoption("--conformance-tier", default=None, choices=TIERS, help="workload tier (default: default)")
    g.addoption(
        "--conformance-model",
        default=None,
        help="checkpoint folder (default: $CONFORMANCE_MODEL, else the embedded default model)",
    )
    g.addoption("--conformance-device", default=None, help="device for both engines (default: cpu)")
    g.addoption(
        "--conformance-dtype",
        default=None,
        help="dtype both engines run in: float32, bfloat16, float16 "
        "or auto, the checkpoint's own (default: $CONFORMANCE_DTYPE, else float32)",
    )
    g.addoption(
        "--conformance-enable-prefix-caching",
        action="store_true",
        help="run every scenario with prefix "
        "caching for the engine under test (the reference engine it is compared with runs without)",
    )
    g.addoption(
        "--conformance-mamba-cache-mode",
        default=None,
        help="with --conformance-enable-prefix-caching: "
        "align or all (default: each scenario's own mode, else align)",
    )
    g.addoption("--conformance-drafter", default=None, help="every speculating scenario with this drafter "
                "(mtp, scripted, ngram, draft_model, eagle, eagle3; default: each scenario's own)")
    g.addoption("--conformance-tensor-parallel-size", type=_int_at_least_1, default=1, metavar="N",
                help="tensor-parallel ranks of the engine under test (an outside engine's own TP; default 1)")
    g.addoption("--conformance-draft-model", default=None, metavar="PATH",
                help="with --conformance-drafter draft_model: the draft checkpoint (a folder, tiny:<family>, "
                "or cut:<layers>); with eagle|eagle3: the head's folder (default: a seeded head)")
    g.addoption("--conformance-verdict", default="exact", choices=("exact", "rescored", "auto"),
                help="how the engine's tokens are judged: exact (bitwise the reference's), rescored (the "
                "reference scores the engine's own output within a calibrated tolerance), auto (exact for an "
                "engine declaring 'bitwise' in the reference's dtype and device, else rescored)")
    g.addoption("--conformance-reference-dtype", default=None,
                help="with --conformance-verdict rescored: the reference's dtype (default: the run's)")
    g.addoption("--conformance-reference-device", default=None,
                help="with --conformance-verdict rescored: the reference's device (default: the run's)")
    g.addoption("--conformance-tolerance", type=_nats, default=None, metavar="NATS",
                help="with --conformance-verdict rescored: this tolerance instead of the calibrated one")
    g.addoption("--conformance-xfail-file", default=None, help="TOML file of expected failures "
                "(default: the engine's file in conformance/expectations/)")
    g.addoption("--conformance-strict-expectations", action="store_true",
                help="fail (not just warn) when a listed expected failure passes")
    g.addoption("--conformance-report-json", default=None, metavar="FILE", help="write all results as JSON")
    g.addoption(
        "--conformance-threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)"
    )
    g.addoption("--conformance-scenario", action="append", default=[], metavar="ID",
                help="run only this scenario of the tier (repeatable; default: every scenario of the tier)")
    g.addoption(
        "--conformance-scenario-file",
        action="append",
        default=[],
        metavar="FILE",
        help="run the workload in this scenario file, e.g. one written by `conformance fuzz` (repeatable; "
        "with no --conformance-scenario, only the files run)",
    )
    g.addoption("--conformance-step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT, metavar="SECONDS",
                help="a call into the engine under test (start, add_request, step, ...) that has not "
                "returned after this long fails its scenario, and the run goes on "
                f"(default {DEFAULT_STEP_TIMEOUT:g})")
    g.addoption("--conformance-fail-on-skip", action="store_true",
                help="a skipped scenario fails (a gate that skips is not a pass)")
    g.addoption("--conformance-allow-unexercised", action="store_true",
                help="a trigger a scenario's reference run misses is a warning, not a failure (default: the "
                "scenario fails; the nightly gate never allows it)")
    g.addoption("--conformance-require-exercised", action="store_true",
                help="every trigger and parameter a scenario exists to exercise must be, also where the "
                "checkpoint decides (default: such a miss is a warning and a named gap, 'not exercised'); "
                "for the models the corpus is tuned to")
    g.addoption("--conformance-min-scenarios", type=int, default=0, metavar="N",
                help="fail the run when fewer than N scenarios ran (were not skipped)")
    g.addoption("--conformance-require-feature", action="append", default=[], metavar="FEATURE",
                help="the engine under test must support FEATURE, and no scenario needing it may be skipped "
                f"(repeatable; one of {', '.join(REQUIRABLE_FEATURES)})")
    g.addoption("--conformance-gpus", default=None, metavar="IDS",
                help="pin xdist workers round robin to these GPUs: 'all' (every visible GPU) or a comma list "
                "of ids; several workers share each GPU")


def _visible_gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _names_suite(args) -> bool:
    """Whether the command line names the shipped suite (``--pyargs conformance.suite`` or its path)."""
    for arg in args or ():
        target = str(arg).split("::")[0].replace(os.sep, "/").rstrip("/")
        if target == "conformance.suite" or target.startswith("conformance.suite.") \
                or target.endswith("conformance/suite") or "conformance/suite/" in target:
            return True
    return False


def _is_active(config) -> bool:
    return config.getoption("conformance_gpus") is not None or _names_suite(config.args)


def _pinning_gpus(config) -> list[str]:
    """The GPUs to spread workers over: the option's list, or every visible GPU for the shipped suite."""
    wanted = config.getoption("conformance_gpus")
    if wanted is None:
        return _visible_gpu_ids() if _names_suite(config.args) else []
    if wanted.strip() == "all":
        return _visible_gpu_ids()
    ids = [d.strip() for d in wanted.split(",") if d.strip()]
    if not ids:
        raise pytest.UsageError("--conformance-gpus: give 'all' or a comma-separated list of GPU ids")
    return ids


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """On an xdist worker of a conformance run, pin one GPU (before any conftest can initialise CUDA). A
    run of the shipped suite that asks for no benchmark option leaves pytest-benchmark out, so it does not
    create its ``.benchmarks`` folder in the caller's directory."""
    if _names_suite(args) and not any(str(a).startswith("--benchmark") for a in args):
        early_config.pluginmanager.set_blocked("benchmark")
    worker, ids = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(GPU_IDS_ENV)
    if worker and ids and worker.startswith("gw"):
        gpus = ids.split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` for a conformance run: one worker per usable core (several share a GPU).

    Any other run gets no answer from here, so xdist (or another plugin) decides as it would
    without this package installed.
    """
    if not _is_active(config):
        return None
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    return int(env) if env else _usable_cores()


def pytest_configure(config):
    config.addinivalue_line("markers", "conformance: a conformance-suite scenario test (conformance.suite)")
    _check_options(config)
    if config.getoption("conformance_scenario") or config.getoption("conformance_scenario_file"):
        # a mistyped id or a broken file: one usage error now, not a collection error later
        _scenarios(config)
    is_worker = hasattr(config, "workerinput")
    if not is_worker:
        _prepare_report_folder(config.getoption("conformance_report_json"), "--conformance-report-json")
        config.pluginmanager.register(ResultCollector(config), "conformance-results")
    if is_worker or not getattr(config.option, "numprocesses", None) or GPU_IDS_ENV in os.environ:
        return
    ids = _pinning_gpus(config)
    if ids:  # read by the workers xdist starts after this; removed again when the run ends
        os.environ[GPU_IDS_ENV] = ",".join(ids)
        config.stash[_EXPORTED_GPU_IDS] = True


def _prepare_report_folder(path: str | None, flag: str) -> None:
    """Create the folder a report file goes into now, before the run, as pytest does for its JUnit file
    (but at the start, not after the run), and refuse a path that cannot be a file."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise pytest.UsageError(f"conformance: {flag} {path} is a folder; name a file")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise pytest.UsageError(f"conformance: {flag} {path}: cannot create its folder "
                                f"({e.strerror or e})") from None


def _check_options(config) -> None:
    """Option values out of range: one usage error naming the option and the value, before anything runs."""
    threads = config.getoption("conformance_threads")
    if threads < 1:
        raise pytest.UsageError(f"conformance: --conformance-threads must be >= 1, got {threads}")
    timeout = config.getoption("conformance_step_timeout")
    if timeout is not None and not timeout > 0:
        raise pytest.UsageError(f"conformance: --conformance-step-timeout must be > 0 seconds, got {timeout}")
    if config.getoption("conformance_require_exercised") and \
            config.getoption("conformance_allow_unexercised"):
        raise pytest.UsageError("conformance: --conformance-require-exercised asks for every trigger, "
                                "--conformance-allow-unexercised lets a missed one warn: give one of them")
    least = config.getoption("conformance_min_scenarios") or 0
    if least < 0:
        raise pytest.UsageError(f"conformance: --conformance-min-scenarios must be >= 0, got {least}")
    required = config.getoption("conformance_require_feature") or []
    unknown = [f for f in required if f not in REQUIRABLE_FEATURES]
    if unknown:
        raise pytest.UsageError(f"conformance: --conformance-require-feature {unknown[0]!r} is not a "
                                f"feature; choose from {', '.join(REQUIRABLE_FEATURES)}")
    dtype = _dtype(config)
    if dtype != settings.DEFAULT_DTYPE and dtype not in _dtype_choices():
        where = "--conformance-dtype" if config.getoption("conformance_dtype") else f"${settings.ENV_DTYPE}"
        raise pytest.UsageError(
            f"conformance: {where} must be one of {', '.join(_dtype_choices())}, got {dtype!r}"
        )
    mode = config.getoption("conformance_mamba_cache_mode")
    if mode is not None and mode not in MAMBA_CACHE_MODES:
        raise pytest.UsageError(f"conformance: --conformance-mamba-cache-mode must be one of "
                                f"{', '.join(MAMBA_CACHE_MODES)}, got {mode!r}")
    if mode is not None and not config.getoption("conformance_enable_prefix_caching"):
        raise pytest.UsageError(
            "conformance: --conformance-mamba-cache-mode needs --conformance-enable-prefix-caching"
        )


def _dtype(config) -> str:
    return settings.pick(config.getoption("conformance_dtype"), settings.ENV_DTYPE, settings.DEFAULT_DTYPE)


def _dtype_choices() -> tuple[str, ...]:
    """What LLM(dtype=...) takes: read from refengine (and torch) only for a run that names a dtype."""
    from refengine.config import DTYPE_CHOICES

    return DTYPE_CHOICES


def pytest_sessionstart(session):
    """Under xdist, the controller proves the engine, the checkpoint and the device usable before any
    worker starts, so an engine that cannot be loaded (its factory raises) or a broken checkpoint is
    one usage error, not an error per scenario (what only a conftest's ``conformance_default_engine``
    or ``conformance_default_model`` names is known inside the workers alone; their fixtures check it)."""
    config = session.config
    if (
        hasattr(config, "workerinput")
        or not getattr(config.option, "numprocesses", None)
        or not _is_active(config)
    ):
        return
    from conformance.model import UnusableSetup, preflight

    opt = config.getoption
    engine = settings.pick(opt("conformance_engine"), settings.ENV_ENGINE, None)
    model = settings.pick(opt("conformance_model"), settings.ENV_MODEL, None)
    device = settings.pick(opt("conformance_device"), settings.ENV_DEVICE, None)
    try:
        if engine is not None:
            _require_features(config, settings.resolve_engine(engine))
        if model is not None or device is not None:
            preflight(model, device or "cpu", _dtype(config))
    except (UnusableSetup, FileNotFoundError, ValueError) as e:  # UnknownEngine is a ValueError
        _report_refusal(config, str(e))
        raise pytest.UsageError(f"conformance: {e}") from None
    except pytest.exit.Exception as e:  # a required feature missing (_require_features)
        _report_refusal(config, str(e.msg))
        raise


def _require_features(config, adapter) -> None:
    """End the run (exit status 1, before any scenario) when the engine lacks a required feature."""
    lacking = missing_features(adapter, config.getoption("conformance_require_feature"))
    if lacking:
        _end_run(config, f"conformance: the engine under test ({adapter.name}) does not support required "
                 f"feature(s) {', '.join(lacking)} (--require-feature): the gate fails before any scenario "
                 "runs", returncode=pytest.ExitCode.TESTS_FAILED)


def pytest_unconfigure(config):
    if config.stash.get(_EXPORTED_GPU_IDS, False):
        os.environ.pop(GPU_IDS_ENV, None)


def pytest_report_header(config):
    """The run's header, in runs that name the suite (or pin GPUs); see pytest_report_collectionfinish."""
    return _header(config) if _is_active(config) else None


def pytest_report_collectionfinish(config, items):
    """The header for a run that did not name the suite but collected its test (a module re-exporting
    it); a run without conformance tests (another project's) gets nothing from this plugin."""
    if _is_active(config) or not any("conformance_scenario" in getattr(i, "fixturenames", ()) for i in items):
        return None
    return _header(config)


def _header(config) -> str:
    engine = config.getoption("conformance_engine") or os.environ.get(settings.ENV_ENGINE)
    engine = engine or f"{settings.DEFAULT_ENGINE} (suite default; a conftest may choose another)"
    model = config.getoption("conformance_model") or os.environ.get(settings.ENV_MODEL) or "default"
    tier = config.getoption("conformance_tier") or "default"
    caching = ""
    if config.getoption("conformance_enable_prefix_caching"):
        caching = (
            f", prefix caching {config.getoption('conformance_mamba_cache_mode') or 'on'} (engine under test)"
        )
    gate = _gate_description(config)
    verdict = config.getoption("conformance_verdict")
    if verdict != "exact":  # who judges the tokens: the reference in its dtype, by rescoring
        ref = config.getoption("conformance_reference_dtype") or _dtype(config)
        caching += f", verdict {verdict} (reference in {ref})"
    return (f"conformance: engine {engine}, tier {tier}, model {model}, dtype {_dtype(config)} (both engines)"
            f"{caching}; {describe(environment(probe_device=False))}" + (f"\nconformance gate: {gate}" if gate
                                                                        else ""))


def _gate_description(config) -> str:
    """What besides failing checks fails the run (the skip gate), in words; "" when nothing."""
    parts = []
    if config.getoption("conformance_allow_unexercised"):
        parts.append("a trigger a scenario misses is a warning (--allow-unexercised)")
    if config.getoption("conformance_require_exercised"):
        parts.append("a trigger or parameter a scenario does not exercise fails it (--require-exercised)")
    if config.getoption("conformance_fail_on_skip"):
        parts.append("a skipped scenario fails")
    required = config.getoption("conformance_require_feature")
    if required:
        parts.append(f"features {', '.join(required)} required (a scenario needing one may not be skipped)")
    least = config.getoption("conformance_min_scenarios")
    if least:
        parts.append(f"at least {least} scenarios must run")
    return "; ".join(parts)


def _scenarios(config) -> list[str]:
    """The scenario ids and scenario-file paths this run parametrises over, selected once."""
    if _SCENARIOS not in config.stash:
        try:
            config.stash[_SCENARIOS] = settings.select_scenarios(
                config.getoption("conformance_tier") or "default",
                config.getoption("conformance_scenario"),
                config.getoption("conformance_scenario_file"),
            )
        except (UnknownScenario, ValueError) as e:
            raise pytest.UsageError(f"conformance: {e}") from None
    return config.stash[_SCENARIOS]


def pytest_generate_tests(metafunc):
    if "conformance_scenario" in metafunc.fixturenames:
        ids = _scenarios(metafunc.config)
        metafunc.parametrize("conformance_scenario", ids, ids=ids)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "conformance_scenario" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.conformance)
            _canonical_id(item)


def _canonical_id(item) -> None:
    """Give the shipped suite's tests one id wherever pytest's rootdir is (``pytest --pyargs`` from any
    folder, ``conformance run``): the reports (JUnit, the short summary, baselines) then name a
    scenario the same way everywhere. The controller puts the id on the reports (ResultCollector);
    a module of the user's that re-exports the test keeps its own id."""
    if getattr(item, "path", None) is None or Path(item.path).resolve() != SUITE_FILE:
        return
    wanted = f"{SUITE_PATH}::{item.name}"
    if item.nodeid != wanted:
        item.user_properties.append((TEST_ID_PROPERTY, wanted))


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def conformance_default_engine() -> str:
    """Engine under test when neither the option nor the environment names one (override in a conftest)."""
    return settings.DEFAULT_ENGINE


@pytest.fixture(scope="session")
def conformance_default_model() -> str | None:
    """Checkpoint when neither the option nor the environment names one; None: the embedded model."""
    return None


@pytest.fixture(scope="session")
def conformance_selection(pytestconfig, conformance_default_engine, conformance_default_model):
    opt = pytestconfig.getoption
    return settings.Selection(
        engine=settings.pick(opt("conformance_engine"), settings.ENV_ENGINE, conformance_default_engine),
        model=settings.pick(opt("conformance_model"), settings.ENV_MODEL, conformance_default_model),
        tier=opt("conformance_tier") or "default",
        device=settings.pick(opt("conformance_device"), settings.ENV_DEVICE, "cpu"),
        xfail_file=opt("conformance_xfail_file"), dtype=_dtype(pytestconfig),
        enable_prefix_caching=opt("conformance_enable_prefix_caching"),
        mamba_cache_mode=opt("conformance_mamba_cache_mode"), step_timeout=opt("conformance_step_timeout"),
        allow_unexercised=opt("conformance_allow_unexercised"), drafter=opt("conformance_drafter"),
        draft_model=opt("conformance_draft_model"),
        tensor_parallel_size=opt("conformance_tensor_parallel_size"),
        verdict=opt("conformance_verdict"), reference_dtype=opt("conformance_reference_dtype"),
        reference_device=opt("conformance_reference_device"), tolerance=opt("conformance_tolerance"),
        require_exercised=bool(opt("conformance_require_exercised")))


@pytest.fixture(scope="session")
def conformance_case(pytestconfig, conformance_selection):
    """The engine adapter and the checkpoint's facts, opened once. An engine that cannot be loaded, or
    a checkpoint or device that cannot be used, ends the whole run here: one line, no traceback, no
    error per scenario."""
    from conformance.api import EngineRefused, UnknownEngine
    from conformance.model import UnusableSetup
    from conformance.verdict import VerdictError

    if conformance_selection.device == "cpu":
        import torch

        torch.set_num_threads(pytestconfig.getoption("conformance_threads"))
    try:
        case = conformance_selection.open_case()
    except (UnknownEngine, EngineRefused, UnusableSetup, FileNotFoundError, VerdictError) as e:
        _end_run(pytestconfig, f"conformance: {e}")
    _require_features(pytestconfig, case.adapter)
    return case


def _end_run(config, message: str, returncode=pytest.ExitCode.USAGE_ERROR):
    """A setup the whole run cannot use: end the run with ``message`` (one line; by default a usage
    error). An xdist worker cannot end the run, so there each test errors with that one line instead."""
    if hasattr(config, "workerinput"):
        pytest.fail(message, pytrace=False)
    pytest.exit(message, returncode=returncode)


@pytest.fixture
def conformance_result(request, conformance_scenario, conformance_case) -> ScenarioResult:
    """One scenario run through the reference engine and the engine under test, every check applied.

    When the reference engine or the harness breaks there is no verdict about the engine under
    test: the test errors in setup with an InfrastructureError (JUnit ``<error>``, never a failure).
    """
    from conformance.harness import run_scenario
    from conformance.workloads import file_scenario

    node = request.node  # a rerun (pytest-rerunfailures) reuses the item: drop the last attempt's properties
    node.user_properties[:] = [(k, v) for k, v in node.user_properties if not _recorded_key(k)]
    if conformance_scenario in request.config.getoption("conformance_scenario_file"):
        case = conformance_case
        scenario = file_scenario(conformance_scenario, case.facts.vocab_size, case.tier)
        result, _ = run_scenario(scenario, conformance_case, scenario_file=conformance_scenario)
    else:
        result, _ = run_scenario(conformance_scenario, conformance_case)
    if result.error:
        _record(node, result)
        _infrastructure_error(node, result)
    return result


@pytest.fixture(scope="session")
def conformance_expectations(pytestconfig, conformance_selection):
    from conformance.checks import CHECK_NAMES
    from conformance.expectations import ExpectationError

    try:
        exp = conformance_selection.expectations()
    except ExpectationError as e:
        _end_run(pytestconfig, f"conformance: {e}")
    from conformance.findings import finding_ids

    typos = unknown_entries(exp, [*scenario_ids("nightly"), *finding_ids()], CHECK_NAMES)
    if typos:
        warnings.warn(
            StaleExpectationWarning(f"{exp.source}: entries name no scenario or check: {', '.join(typos)}"),
            stacklevel=1,
        )
    return exp


MISMATCH, INFRASTRUCTURE = "ConformanceMismatch", "InfrastructureError"  # the ``failure_type`` property
SKIP_REFUSED = "SkipNotAllowed"  # a skipped scenario under --fail-on-skip or --require-feature


def _refused_skip(config, result: ScenarioResult) -> str:
    """Why the run refuses this skipped scenario ("" when it accepts the skip)."""
    getoption = getattr(config, "getoption", None)
    if getoption is None:
        return ""
    if getoption("conformance_fail_on_skip"):
        return "--fail-on-skip"
    needed = [f for f in getoption("conformance_require_feature") or () if f in result.features]
    return f"it needs required feature {', '.join(needed)}" if needed else ""


RECORDED = ("engine", "model", "family", "dtype", "tier", "torch", "triton", "cuda", "device", "replay",
            "failure_type", "failed_checks", "verdict", "reference_dtype", "tolerance", RESULT_PROPERTY)


def _recorded_key(key: str) -> bool:
    """A property ``_record`` or ``conclude`` sets (the test id property, set at collection, is not)."""
    return key in RECORDED or key.startswith("first_divergence_")


def _record(node, result: ScenarioResult) -> None:
    """The JUnit properties of a scenario test, and the result for the controller's reports."""
    env = environment()
    node.user_properties += [("engine", result.engine), ("model", result.model), ("family", result.family),
                             ("dtype", result.dtype), ("tier", result.tier), ("torch", env["torch"]),
                             ("triton", env["triton"]), ("cuda", env["cuda"]), ("device", env["device"]),
                             ("verdict", result.verdict)]
    if result.verdict == "rescored":  # who judged the tokens, within how many nats
        node.user_properties += [("reference_dtype", result.reference_dtype), ("tolerance", result.tolerance)]
    if result.failed_checks:  # what a CI reader filters on: the checks that failed the scenario
        node.user_properties.append(("failed_checks", ",".join(result.failed_checks)))
    for c in result.failures[:1]:
        for key in ("position", "verify_step", "step"):
            if c.details.get(key) is not None:
                node.user_properties.append((f"first_divergence_{key}", c.details[key]))
        node.user_properties.append(("replay", c.details.get("replay", result.replay)))
    node.user_properties.append((RESULT_PROPERTY, json.dumps(result.to_dict())))


def _infrastructure_error(node, result: ScenarioResult):
    node.user_properties.append(("failure_type", INFRASTRUCTURE))  # read by ci/summarize_junit.py
    raise InfrastructureError(result.error)


def conclude(request, result: ScenarioResult, expectations) -> None:
    """Turn a scenario result into the pytest outcome: pass, fail, xfail, skip, or error."""
    __tracebackhide__ = True
    from conformance.report_text import LEGEND, format_result

    node = request.node
    for c in result.checks:
        if c.details.get("warning"):
            warnings.warn(NotExercisedWarning(c.details["warning"]), stacklevel=1)
    verdict = judge(result, expectations)
    strict = bool(request.config.getoption("conformance_strict_expectations"))
    result.expected, result.stale, result.stale_fails = verdict.expected, verdict.stale, strict
    refused = _refused_skip(request.config, result) if verdict.outcome == "skip" else ""
    result.skip_fails = bool(refused)
    _record(node, result)
    stale = verdict.stale_message(expectations.source) if verdict.stale else ""
    if stale and not strict:
        warnings.warn(StaleExpectationWarning(stale), stacklevel=1)
    if refused:
        node.user_properties.append(("failure_type", SKIP_REFUSED))
        pytest.fail(f"SKIPPED, NOT ALLOWED ({refused}): {result.skipped}", pytrace=False)
    if verdict.outcome == "skip":
        pytest.skip(result.skipped)
    if verdict.outcome == "error":
        _infrastructure_error(node, result)
    stale_failure = f"{stale} (strict expectations: a stale entry fails the run)" if stale and strict else ""
    if verdict.outcome == "fail":
        node.user_properties.append(("failure_type", MISMATCH))
        first = f"CONFORMANCE MISMATCH in {result.scenario_id}: {', '.join(result.failed_checks)} failed"
        pytest.fail(first + "\n" + format_result(result) + "\n\n" + LEGEND
                    + (f"\n\n{stale_failure}" if stale_failure else ""), pytrace=False)
    if stale_failure:
        pytest.fail(stale_failure, pytrace=False)
    if verdict.outcome == "xfail":
        pytest.xfail("; ".join(f"{k}: {v}" for k, v in verdict.expected.items()))


# ---- reporting on the controller ------------------------------------------------------------
class ResultCollector:
    """Collects scenario results from test reports (xdist forwards workers' reports here), applies the
    run-level gate (--conformance-min-scenarios) and says in the reports when the run was cut short."""

    def __init__(self, config):
        self.config = config
        self.by_node: dict[str, ScenarioResult] = {}  # test id -> its scenario's result, in finishing order
        self.gate_failures: list[str] = []  # why the gate failed the run, beyond failing scenarios
        self.interrupted: str | None = None  # what cut the run short (Ctrl-C), in words
        self.setup_error: str | None = None  # why the run ended before its scenarios (pytest.exit), in words

    @property
    def results(self) -> list[ScenarioResult]:
        return list(self.by_node.values())

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report):
        props = getattr(report, "user_properties", None)
        if not props:
            return
        blobs = [v for k, v in props if k == RESULT_PROPERTY]
        report.nodeid = next((v for k, v in props if k == TEST_ID_PROPERTY), report.nodeid)
        ours = (RESULT_PROPERTY, TEST_ID_PROPERTY)
        report.user_properties = [(k, v) for k, v in props if k not in ours]  # keep JUnit readable
        if blobs and report.when in ("setup", "call"):  # setup: an infrastructure error
            self.by_node[report.nodeid] = ScenarioResult.from_dict(json.loads(blobs[-1]))

    def pytest_keyboard_interrupt(self, excinfo):
        if isinstance(excinfo.value, pytest.exit.Exception):  # a setup the run cannot use (_end_run)
            self.setup_error = str(excinfo.value.msg).removeprefix("conformance: ")
        else:
            self.interrupted = (f"interrupted ({excinfo.typename}) after {len(self.by_node)} scenario(s); "
                                "the rest did not run, and no verdict covers them")

    @pytest.hookimpl(tryfirst=True)  # before the JUnit file is written
    def pytest_sessionfinish(self, session):
        if self.interrupted:
            _junit_error(self.config, "interrupted", self.interrupted)
        elif self.setup_error:  # the run ended before its scenarios: the reports say why
            self.gate_failures = [self.setup_error]
            _junit_error(self.config, "gate", self.setup_error)
        else:
            least = self.config.getoption("conformance_min_scenarios")
            self.gate_failures = gate_failures(self.results, least)
            for message in self.gate_failures:
                _junit_error(self.config, "gate", message)
            if self.gate_failures and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        _junit_properties(self.config, self.meta())
        self._write_json()

    def meta(self) -> dict:
        """The run's engine, model, family, dtype, tier, device and gate options (the reports' metadata)."""
        return run_meta(self.config, self.results[0] if self.results else None)

    @property
    def run_errors(self) -> list[tuple[str, str]]:
        """The run-level errors the JUnit file holds as ``conformance::<name>`` testcases."""
        return ([("interrupted", self.interrupted)] if self.interrupted else []) + \
            [("gate", m) for m in self.gate_failures]

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        if self.results:
            from conformance.report_text import format_summary

            r0 = self.results[0]
            tr.section("conformance summary")
            from conformance.adapters import describe_engine

            tr.write_line(f"engine under test {describe_engine(r0.engine)}, model {r0.model}, tier {r0.tier}")
            tr.write_line(format_summary(self.results, sum(r.duration_s for r in self.results)))
            for r in self.results:
                for c in r.failures:
                    replay = c.details.get("replay", r.replay)
                    tr.write_line(f"  replay {r.scenario_id} ({c.check}): {replay}")
        said = [self.setup_error]  # pytest's own line ends such a run
        for line in ([self.interrupted] if self.interrupted else []) + self.gate_failures:
            if line not in said:
                tr.write_line(f"conformance: {line}", red=True, bold=True)
        path = self.config.getoption("conformance_report_json")
        if path:
            tr.write_line(f"conformance: JSON report written to {Path(path).resolve()}")

    def _write_json(self):
        path = self.config.getoption("conformance_report_json")
        if not path:
            return
        from conformance.report_files import build_json, write_json

        meta = self.meta()
        report = build_json(self.results, engine=meta["engine"], tier=meta["tier"], model=meta["model"],
                            environment=environment(), elapsed=sum(r.duration_s for r in self.results),
                            family=meta["family"], dtype=meta["dtype"], device=meta["device"],
                            gate=meta["gate"], run_errors=self.run_errors, verdict=meta["verdict"])
        report["interrupted"] = self.interrupted
        report["gate_failures"] = self.gate_failures
        write_json(path, report)


def gate_failures(results: list[ScenarioResult], min_scenarios: int) -> list[str]:
    """Why the run fails as a whole beyond its scenarios' own verdicts (--conformance-min-scenarios)."""
    ran = sum(not r.skipped for r in results)
    if results and not ran:  # every scenario skipped: nothing was checked, whatever --min-scenarios says
        return [f"no scenario ran: all {len(results)} were skipped, so nothing was checked"]
    if ran >= min_scenarios:
        return []
    return [(f"only {ran} of {len(results)} scenarios ran ({len(results) - ran} skipped); "
             f"--min-scenarios requires at least {min_scenarios}")]


def _junit_error(config, name: str, message: str) -> None:
    """An ``<error>`` testcase ``conformance::<name>`` in the run's JUnit file (when it writes one), so a
    CI that reads only the JUnit file sees the run-level failure too (the testsuite counts it as an error,
    as the JSON report's summary does)."""
    from _pytest.junitxml import xml_key

    from conformance.report_files import RUN_ERROR_TYPES

    xml = config.stash.get(xml_key, None)
    if xml is None:
        return
    reporter = xml.node_reporter(f"conformance::{name}")
    reporter.attrs.update(classname="conformance", name=name)
    reporter.add_property("failure_type", RUN_ERROR_TYPES.get(name, name))
    reporter._add_simple("error", message, message)  # counted as an error of the testsuite


def _junit_properties(config, meta: dict) -> None:
    """The run's engine, model, family, dtype, tier, device and gate options as testsuite properties."""
    from _pytest.junitxml import xml_key

    from conformance.report_files import junit_properties

    xml = config.stash.get(xml_key, None)
    if xml is not None:
        for name, value in junit_properties(meta):
            xml.add_global_property(name, value)


def run_meta(config, first: ScenarioResult | None = None) -> dict:
    """What the reports say about the run: from its first result where there is one (the model's label
    and family, the dtype "auto" resolved to), else from the options."""
    from conformance.report_files import gate_options

    opt = config.getoption
    return {
        "engine": first.engine if first else settings.pick(opt("conformance_engine"), settings.ENV_ENGINE,
                                                           settings.DEFAULT_ENGINE),
        "model": first.model if first else (settings.pick(opt("conformance_model"), settings.ENV_MODEL, None)
                                            or "embedded default model"),
        "family": first.family if first else "",
        "dtype": first.dtype if first else _dtype(config),
        "verdict": first.verdict if first else opt("conformance_verdict"),
        "tier": opt("conformance_tier") or "default",
        "device": settings.pick(opt("conformance_device"), settings.ENV_DEVICE, "cpu"),
        "gate": gate_options(fail_on_skip=opt("conformance_fail_on_skip"),
                             min_scenarios=opt("conformance_min_scenarios"),
                             require_features=opt("conformance_require_feature"),
                             step_timeout=opt("conformance_step_timeout"),
                             require_exercised=opt("conformance_require_exercised")),
    }


def _report_refusal(config, message: str) -> None:
    """A run refused before its session could write its reports (an engine, checkpoint or device that
    cannot be used, a required feature missing, found while the session starts): both report files
    written here, with a ``gate`` error naming ``message``."""
    from _pytest.junitxml import xml_key

    from conformance.report_files import write_run_error_reports

    xml = config.stash.get(xml_key, None)
    write_run_error_reports(None if xml is None else xml.logfile, config.getoption("conformance_report_json"),
                            "gate", message.removeprefix("conformance: "), run_meta(config),
                            environment(probe_device=False))
