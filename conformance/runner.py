"""``conformance run``: the shipped pytest suite, run in-process, printed the conformance way.

There is one route to a verdict. The command line builds the pytest arguments of the suite
(``pytest --pyargs conformance.suite --conformance-...``) and runs them in this process, so the
expectations (packaged defaults, stale-entry warnings, strict mode), the pass / fail / xfail /
error outcomes, the infrastructure-vs-mismatch classification and the JUnit XML (pytest's own
writer, ``--junitxml``) are the plugin's. What this module adds is only the printing: a status
line per scenario, the failure reports, warnings and the summary, instead of pytest's terminal.

The run is isolated from the folder it is started in: no ini file, no conftest outside the
package, no ``PYTEST_ADDOPTS``, no other installed pytest plugin, no cache.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import conformance
from conformance import session
from conformance.env import describe, environment
from conformance.plugin import NotExercisedWarning, StaleExpectationWarning

# pytest's exit status -> the command's: 2 for usage errors and for a setup that cannot run at all.
EXIT_STATUS = {pytest.ExitCode.OK: 0, pytest.ExitCode.TESTS_FAILED: 1, pytest.ExitCode.USAGE_ERROR: 2,
               pytest.ExitCode.NO_TESTS_COLLECTED: 2, pytest.ExitCode.INTERRUPTED: 130}


def suite_args(
    sel: session.Selection,
    *,
    scenarios=(),
    scenario_files=(),
    strict: bool = False,
    threads: int = 1,
    junit_xml: str | None = None,
    report_json: str | None = None,
    fail_on_skip: bool = False,
    min_scenarios: int = 0,
    require_features=(),
    exitfirst: bool = False,
) -> list[str]:
    """The pytest command line of a ``conformance run`` (what ``pytest`` would be given by hand)."""
    root = Path(conformance.__file__).resolve().parent
    args = [
        "--pyargs",
        "conformance.suite",
        "-p",
        "conformance.plugin",
        "-p",
        "no:cacheprovider",
        "-c",
        os.devnull,
        "--rootdir",
        str(root.parent),
        "--confcutdir",
        str(root),
        "-o",
        "addopts=",
        "--conformance-engine",
        sel.engine,
        "--conformance-tier",
        sel.tier,
        "--conformance-device",
        sel.device,
        "--conformance-dtype",
        sel.dtype,
        "--conformance-threads",
        str(threads),
    ]
    if sel.model is not None:
        args += ["--conformance-model", sel.model]
    if sel.xfail_file is not None:
        args += ["--conformance-xfail-file", sel.xfail_file]
    if sel.enable_prefix_caching:
        args.append("--conformance-enable-prefix-caching")
    if sel.mamba_cache_mode is not None:
        args += ["--conformance-mamba-cache-mode", sel.mamba_cache_mode]
    if sel.drafter is not None:
        args += ["--conformance-drafter", sel.drafter]
    if sel.draft_model is not None:
        args += ["--conformance-draft-model", sel.draft_model]
    if sel.tensor_parallel_size != 1:
        args += ["--conformance-tensor-parallel-size", str(sel.tensor_parallel_size)]
    if sel.verdict != "exact":
        args += ["--conformance-verdict", sel.verdict]
    for flag, value in (("--conformance-reference-dtype", sel.reference_dtype),
                        ("--conformance-reference-device", sel.reference_device),
                        ("--conformance-tolerance", None if sel.tolerance is None else repr(sel.tolerance))):
        if value is not None:
            args += [flag, value]
    if strict:
        args.append("--conformance-strict-expectations")
    if sel.step_timeout is not None:
        args += ["--conformance-step-timeout", repr(sel.step_timeout)]
    if fail_on_skip:
        args.append("--conformance-fail-on-skip")
    if sel.allow_unexercised:
        args.append("--conformance-allow-unexercised")
    if sel.require_exercised:
        args.append("--conformance-require-exercised")
    if sel.drafter is not None:
        args += ["--conformance-drafter", sel.drafter]
    if sel.draft_model is not None:
        args += ["--conformance-draft-model", sel.draft_model]
    if sel.tensor_parallel_size != 1:
        args += ["--conformance-tensor-parallel-size", str(sel.tensor_parallel_size)]
    if min_scenarios:
        args += ["--conformance-min-scenarios", str(min_scenarios)]
    for feature in require_features:
        args += ["--conformance-require-feature", feature]
    for sid in scenarios:
        args += ["--conformance-scenario", sid]
    for f in scenario_files:
        args += ["--conformance-scenario-file", str(f)]
    if junit_xml:
        args += ["--junitxml", str(junit_xml)]
    if report_json:
        args += ["--conformance-report-json", str(report_json)]
    if exitfirst:
        args.append("--exitfirst")  # pytest's own: the run ends after the first failing scenario
    return args


def run_suite(sel: session.Selection, *, out, verbose: bool = False, model_label: str | None = None,
              dtype: str | None = None, features: dict[str, bool] | None = None, **options) -> int:
    """Run the suite for ``sel`` in this process, printing to ``out``; returns the command's exit status.
    ``dtype``: what ``sel.dtype`` resolves to on this checkpoint, for the header ("auto" is resolved);
    ``features``: the engine under test's answer for each adapter feature, for the header."""
    printer = RunPrinter(out, sel, verbose, model_label or sel.model or "embedded default model",
                         expectations_note(sel, options.get("strict", False)), dtype or sel.dtype,
                         features=features,
                         gate=gate_note(allow_unexercised=sel.allow_unexercised,
                                        require_exercised=sel.require_exercised, **options))
    started = time.time()
    with _isolated_environment():
        code = pytest.main(["-p", "no:terminal", *suite_args(sel, **options)], plugins=[printer])
    written = written_reports(options.get("junit_xml"), options.get("report_json"), started)
    if printer.setup_error is not None:
        where = f" (reports written: {', '.join(written)})" if written else ""
        print(f"conformance run: {printer.setup_error}{where}", file=sys.stderr)
    elif written:
        print(f"reports written: {', '.join(written)}", file=out, flush=True)
    return EXIT_STATUS.get(code, 1)


def written_reports(junit_xml: str | None, report_json: str | None, since: float) -> list[str]:
    """The report files the run wrote (modified at ``since``, a ``time.time()``, or later), in words with
    their full paths."""
    named = (("JUnit XML", junit_xml), ("JSON", report_json))
    return [f"{what} {Path(path).resolve()}" for what, path in named
            if path and Path(path).is_file() and Path(path).stat().st_mtime >= since - 1]


def dtype_note(dtype: str) -> str:
    """How the engines are compared in ``dtype``: the same kernels in the same dtype, so exactly."""
    tail = "" if dtype == "float32" else f", in {dtype} as in float32"
    return (f"dtype: both engines run in {dtype} with the same kernels; tokens and acceptance are compared "
            f"exactly and logits bitwise{tail}")


def features_note(features: dict[str, bool]) -> str:
    """What the engine under test says it supports; scenarios that need what it lacks are skipped."""
    has = [f for f, ok in features.items() if ok]
    lacks = [f for f, ok in features.items() if not ok]
    return (f"engine features: supports {', '.join(has) or 'none'}"
            + (f"; lacks {', '.join(lacks)} (the scenarios needing them are skipped, the checks needing them "
               "n/a)" if lacks else ""))


def gate_note(*, fail_on_skip: bool = False, min_scenarios: int = 0, require_features=(), step_timeout=None,
              allow_unexercised: bool = False, require_exercised: bool = False, **_) -> str:
    """What fails the run besides a failing check, said up front."""
    parts = ["a failing check or an infrastructure error fails the run"]
    parts.append("a skipped scenario fails it (--fail-on-skip)" if fail_on_skip
                 else "skipped scenarios do not (--fail-on-skip, --min-scenarios, --require-feature "
                 "change that)")
    if require_features:
        parts.append(f"required features: {', '.join(require_features)} (a scenario needing one may not "
                     "skip)")
    if min_scenarios:
        parts.append(f"at least {min_scenarios} scenarios must run")
    if require_exercised:
        parts.append("a trigger or parameter a scenario does not exercise fails it, also one the checkpoint "
                     "decides (--require-exercised)")
    elif allow_unexercised:
        parts.append("a trigger a scenario misses is a warning (--allow-unexercised)")
    else:
        parts.append("a trigger a scenario misses fails it (workload-triggers; --allow-unexercised warns "
                     "instead), unless the checkpoint decides it: then it is not exercised, a warning and a "
                     "named gap of the summary (--require-exercised fails it)")
    return "gate: " + "; ".join(parts)


def expectations_note(sel: session.Selection, strict: bool) -> str:
    """What the run does with expected failures, said up front (the file, and what a stale entry does)."""
    exp = sel.expectations()
    if exp.source is None:
        return (
            "expected failures: none listed (no expectations file applies); every failing check fails the run"
        )
    stale = ("fails the run (--strict-expectations)" if strict
             else "is a warning (--strict-expectations makes it fail the run)")
    return (f"expected failures: {exp.source} ({exp.count()} entries); a listed check that fails is an "
            f"expected failure (XFAIL, exit 0), an entry that no longer fails {stale}")


@contextmanager
def _isolated_environment():
    """No PYTEST_ADDOPTS and no automatically loaded plugins for the in-process run (restored after)."""
    saved = {k: os.environ.get(k) for k in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    os.environ.pop("PYTEST_ADDOPTS", None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RunPrinter:
    """A pytest plugin of the in-process run: prints what ``conformance run`` shows."""

    def __init__(self, out, sel: session.Selection, verbose: bool, model_label: str, expectations: str = "",
                 dtype: str = "float32", features: dict[str, bool] | None = None, gate: str = ""):
        self.out, self.sel, self.verbose, self.model_label = out, sel, verbose, model_label
        self.expectations, self.dtype, self.features, self.gate = expectations, dtype, features, gate
        self.interrupted = False
        self.total = self.done = self.failed = 0
        self.start = time.perf_counter()
        self.setup_error: str | None = None  # the one line a run that could not start ends with

    def _print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def pytest_collection_finish(self, session):
        self.total = len(session.items)
        from conformance.adapters import describe_engine

        self._print(
            f"conformance: engine under test {describe_engine(self.sel.engine)}, reference engine as oracle, "
            f"model {self.model_label}, tier {self.sel.tier}, {self.total} scenarios; "
            f"{describe(environment())}"
        )
        if self.sel.enable_prefix_caching:
            self._print(
                f"prefix caching: on for the engine under test in every scenario, mode "
                f"{self.sel.mamba_cache_mode or 'of each scenario (else align)'}; the reference engine runs "
                "without it"
            )
        self._print(self._judging())
        if self.features is not None:
            self._print(features_note(self.features))
        if self.sel.step_timeout is not None:
            self._print(f"step timeout: an engine call that has not returned after {self.sel.step_timeout:g} "
                        "s fails its scenario (--step-timeout)")
        if self.gate:
            self._print(self.gate)
        if self.expectations:
            self._print(self.expectations)

    def _judging(self) -> str:
        """How the engine is judged: the dtype note of an exact run, else the verdict's own line."""
        sel = self.sel
        if sel.verdict == "exact":
            return dtype_note(self.dtype)
        from conformance.verdict import VerdictError, choose

        try:
            bitwise = bool((self.features or {}).get("bitwise"))
            verdict = choose(sel.verdict, bitwise=bitwise, dtype=self.dtype,
                             reference_dtype=sel.reference_dtype if sel.reference_dtype != "auto" else None,
                             device=sel.device, reference_device=sel.reference_device,
                             tolerance=sel.tolerance)
        except VerdictError as e:  # the run itself ends on it, naming it
            return f"verdict {sel.verdict}: {e}"
        return verdict.describe() if verdict.rescored else dtype_note(self.dtype)

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed += 1
            self._print(f"could not collect {report.nodeid or 'the suite'}:\n{report.longreprtext}")

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        if not (report.when == "call" or (report.when == "setup" and not report.passed)):
            return
        from conformance.report_text import format_result, status_line

        self.done += 1
        result = self._results.get(report.nodeid)
        elapsed = time.perf_counter() - self.start
        if result is None:  # the test broke before the scenario ran (e.g. a fixture of the harness)
            self.failed += report.failed
            self._print(f"[{self.done}/{self.total}] ERROR {report.nodeid}\n{report.longreprtext}")
            return
        self._print(status_line(result, self.done, self.total, elapsed))
        if hasattr(report, "wasxfail"):
            self._print(
                "  expected failure(s): " + ", ".join(f"{k} ({v})" for k, v in result.expected.items())
            )
            if self.verbose:
                self._print(format_result(result, show_passing=True))
            return
        if report.failed:
            self.failed += 1
            if not result.unexpected_failures and not result.error:  # only a stale entry failed it (strict)
                message = report.longrepr.reprcrash.message if report.longrepr else ""
                self._print(f"  FAILED: {message.removeprefix('Failed: ')}")
                return
        if report.failed or self.verbose:
            self._print(format_result(result, show_passing=self.verbose))

    def pytest_warning_recorded(self, warning_message, when, nodeid, location):
        if issubclass(warning_message.category, (StaleExpectationWarning, NotExercisedWarning)):
            self._print(f"  warning: {warning_message.message}")

    def pytest_keyboard_interrupt(self, excinfo):
        if isinstance(excinfo.value, pytest.exit.Exception):
            self.setup_error = str(excinfo.value.msg).removeprefix("conformance: ")
        else:
            self.interrupted = True

    def pytest_configure(self, config):
        self.config = config

    @property
    def _results(self) -> dict:
        """Scenario results by test id, as the plugin's collector gathered them."""
        collector = self.config.pluginmanager.get_plugin("conformance-results")
        return collector.by_node if collector is not None else {}

    def pytest_sessionfinish(self, session):
        from conformance.report_text import LEGEND, format_summary

        if self.total == 0 or self.setup_error is not None:
            return
        if any(r.failed_checks for r in self._results.values()):  # the guide reads a failed check
            self._print("\n" + LEGEND)
        results = list(self._results.values())
        collector = self.config.pluginmanager.get_plugin("conformance-results")
        from conformance.adapters import describe_engine

        summary = (f"engine under test {describe_engine(self.sel.engine)}\n"
                   + format_summary(results, time.perf_counter() - self.start))
        if self.interrupted:
            summary = (f"INTERRUPTED after {len(results)} of {self.total} scenarios: the run is incomplete "
                       f"and proves nothing about the {self.total - len(results)} that did not run "
                       "(exit status 130)\n" + summary)
        for line in collector.gate_failures if collector is not None else ():
            summary += f"\nGATE FAILED: {line}"
        self._print("\n" + summary)
