"""Fuzzing: generated workloads through the reference engine and the engine under test.

``fuzz`` draws scenarios (conformance.workloads.generate) with hypothesis, runs each exactly as a
corpus scenario is run (every check), and stops at the first failing check. Hypothesis then shrinks
the workload (fewer requests, shorter prompts, earlier arrivals, fewer tokens and aborts, smaller K)
for as long as *that same check* still fails; the smallest failing workload is written as a scenario
file, with the one-line command that replays it.

Runs are deterministic for a seed: the same seed, example budget, limits and engine give the same
workloads in the same order (no example database, no wall-clock deadline). A time budget
(``budget_seconds``) stops generating new workloads once spent, so how many ran then depends on
the machine; shrinking a failure has its own time limit (``shrink_seconds``), after which the
smallest failing workload found so far is written out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from conformance.harness import Case, run_scenario
from conformance.results import ScenarioResult
from conformance.workloads import Scenario
from conformance.workloads.files import read_scenario_file, write_scenario_file
from conformance.workloads.generate import Limits, scenarios

ERROR_CHECK = "error"  # pseudo-check name when the run broke (the reference engine failed)
KNOWN = "known"  # what a judge reports for a failure that is a known bug: counted, not pursued


class _BudgetSpent(BaseException):
    """Stops hypothesis without counting as a failure (it re-raises BaseExceptions untouched)."""


class _Failed(Exception):
    """The target check failed on a workload: hypothesis shrinks while this keeps being raised."""


@dataclass
class Example:
    index: int  # 1-based count of workloads run
    phase: str  # "generate" | "shrink"
    scenario: Scenario
    failing: tuple[str, ...]  # checks that failed ("error" when the run broke)
    seconds: float
    skipped: str | None = None
    target_failed: bool = False  # the check being shrunk for failed here

    @property
    def size(self) -> str:
        return describe_size(self.scenario)


@dataclass
class Search:
    """The outcome of ``explore``: how many workloads ran and the smallest failing one, if any."""

    examples: int = 0
    skipped: int = 0
    known: int = 0  # workloads whose failure was a known, already reported bug (counted as passing)
    seconds: float = 0.0
    check: str | None = None  # the failing check that was shrunk for
    first: Scenario | None = None  # the first workload it failed on
    smallest: Scenario | None = None  # the smallest workload it still failed on
    payload: object = None  # what the judge returned with the smallest failure (a ScenarioResult)
    shrinks: int = 0  # failing workloads found while shrinking
    stopped: str = "examples"  # "examples" | "time" | "shrink time"
    log: list[Example] = field(default_factory=list)


def describe_size(sc: Scenario) -> str:
    s = sc.settings
    return (f"{len(sc.requests)} req, prompts {sum(len(r.prompt) for r in sc.requests)} tok, max_tokens "
            f"{sum(r.max_tokens for r in sc.requests)}, aborts {len(sc.aborted)}, K={s.k}"
            + (f" {s.drafter}" + (f"/{s.pattern}" if s.drafter == "scripted" else "") if s.k else "")
            + f", graph {sc.graph_mode}" + _describe_caching(sc))


def _describe_caching(sc: Scenario) -> str:
    if not sc.caching:
        return ""
    turns = sum(r.extends is not None for r in sc.requests)
    return f", cache {sc.settings.mamba_cache_mode or 'align'}" + (f", {turns} next turn(s)" if turns else "")


@contextlib.contextmanager
def _without_source_constants():
    """Keep generation a function of the seed alone.

    Hypothesis now and then draws a literal constant collected from the source of every module the
    process has imported so far, so the same seed gave different workloads depending on what else
    had been imported (another test, a CLI path). For the duration of one search it draws none.
    """
    from hypothesis.internal.conjecture import providers

    original = providers.HypothesisProvider._maybe_draw_constant
    providers.HypothesisProvider._maybe_draw_constant = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        providers.HypothesisProvider._maybe_draw_constant = original


def explore(strategy, judge: Callable[[Scenario, str | None], tuple[tuple[str, ...], object, str | None]], *,
            seed: int, max_examples: int, budget_seconds: float | None = None, shrink: bool = True,
            shrink_seconds: float = 300.0, progress: Callable[[Example], None] | None = None) -> Search:
    """Draw up to ``max_examples`` workloads from ``strategy``; ``judge(scenario, target)`` runs one and
    returns (failing checks, payload, skip reason). The first failing check becomes the target; shrinking
    keeps only workloads on which that check fails (``target``: that check while shrinking, else None: a
    judge may then judge that check alone)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as fixed_seed

    search = Search()
    start = time.perf_counter()
    shrink_start: list[float] = []

    def run_one(scenario: Scenario) -> None:
        now = time.perf_counter()
        if search.check is None and budget_seconds is not None and now - start > budget_seconds:
            search.stopped = "time"
            raise _BudgetSpent
        if search.check is not None and shrink_start and now - shrink_start[0] > shrink_seconds:
            search.stopped = "shrink time"
            raise _BudgetSpent
        t0 = time.perf_counter()
        failing, payload, skipped = judge(scenario, search.check)
        search.examples += 1
        search.skipped += skipped is not None
        if failing and failing[0] == KNOWN:
            search.known += 1
            failing = ()
        phase = "generate" if search.check is None else "shrink"
        if search.check is None and failing:
            search.check, search.first = failing[0], scenario
            shrink_start.append(time.perf_counter())
        hit = search.check is not None and search.check in failing
        example = Example(search.examples, phase, scenario, failing, time.perf_counter() - t0, skipped, hit)
        search.log.append(example)
        if progress is not None:
            progress(example)
        if hit:
            search.shrinks += phase == "shrink"
            search.smallest, search.payload = scenario, payload
            raise _Failed(search.check)

    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    test = settings(max_examples=max_examples, database=None, deadline=None, derandomize=False, phases=phases,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                    verbosity=Verbosity.quiet)(fixed_seed(seed)(given(strategy)(run_one)))
    try:
        with _without_source_constants():
            test()
    except _Failed:
        pass
    except _BudgetSpent:
        pass
    search.seconds = time.perf_counter() - start
    return search


@dataclass
class FuzzReport:
    search: Search
    engine: str
    seed: int
    file: Path | None = None  # the shrunk failing workload, written out
    replay: str | None = None  # the command that replays it
    result: ScenarioResult | None = None  # the shrunk workload's result, replayed from the file
    reproduced: bool = False  # the replay from the file failed the same check

    @property
    def failed(self) -> bool:
        return self.search.check is not None


def can_abort(case: Case) -> bool:
    """Whether both engines can abort requests (probed on one throwaway instance of each)."""
    from conformance.adapters.refengine import reference_adapter
    from conformance.api import RunSpec
    from conformance.workloads import EngineSettings

    spec = RunSpec(case.facts.path, EngineSettings(), case.facts.vocab_size, lambda record: None, case.device,
                   dtype=case.dtype)
    for adapter in (reference_adapter(), case.adapter):
        instance = adapter.start(spec)
        able = callable(getattr(instance, "abort", None))
        close = getattr(getattr(getattr(instance, "llm", None), "engine", None), "close", None)
        if callable(close):
            close()
        if not able:
            return False
    return True


# drafters that are models of their own, and the feature of the engine under test that runs each
MODEL_DRAFTERS = (("eagle3", "eagle_drafter"), ("eagle", "eagle_drafter"), ("draft_model", "draft_model"))


def fuzz(
    case: Case,
    *,
    seed: int = 0,
    max_examples: int = 20,
    budget_seconds: float | None = None,
    out_dir: str | Path = ".",
    limits: Limits | None = None,
    shrink: bool = True,
    shrink_seconds: float = 300.0,
    aborts: bool | None = None,
    caching: bool | None = None,
    params: bool = True,
    progress: Callable[[Example], None] | None = None,
    known: Callable[[ScenarioResult], str | None] | None = None,
) -> FuzzReport:
    """Fuzz ``case``'s engine against the reference; on a failure write the shrunk workload to
    ``out_dir/fuzz-s<seed>-<check>.json``. ``aborts``: draw aborts (default: when both engines can).
    ``caching``: draw prefix caching, shared prefixes and next turns (default: when the engine caches).
    ``params``: draw request parameters (a request whose drawn parameters change nothing is the workload's
    property, not a failure). ``known(result)``: a reason when a failing result is a known bug already
    reported elsewhere; such workloads are counted (``search.known``) and the search goes on past them."""
    # A drawn parameter that changes nothing on this checkpoint is the generated workload's property: "not
    # exercised" (a warning, as params-change-output says without --require-exercised), never a failure to
    # shrink. A parameter that must have changed the output on any model and did not still fails (ignored).
    if case.require_exercised:
        case = replace(case, require_exercised=False)
    facts = case.facts
    if aborts is None:
        aborts = can_abort(case)
    if caching is None:
        caching = case.adapter.supports("prefix_caching")
    name = f"fuzz-s{seed}"
    strategy = scenarios(
        facts.vocab_size,
        limits=limits or Limits(),
        has_mtp=facts.has_mtp and case.adapter.supports("mtp"),
        scripted=case.adapter.supports("scripted_drafter"),
        aborts=aborts,
        caching=caching,
        ngram=case.adapter.supports("ngram_drafter"),
        params=params,
        drafters=tuple(d for d, feature in MODEL_DRAFTERS if case.adapter.supports(feature)),
        name=name,
    )

    def judge(scenario: Scenario, target: str | None):
        # While shrinking, only the target check is judged: the plain, cached and bare runs are made only
        # when it reads them.
        only = target if target not in (None, ERROR_CHECK, KNOWN) else None
        result, _ = run_scenario(scenario, case, only=only)
        failing = tuple(c.check for c in result.failures)
        failing = failing or ((ERROR_CHECK,) if result.error else ())
        if failing and known is not None and known(result):
            failing = (KNOWN,)
        return failing, result, result.skipped

    search = explore(strategy, judge, seed=seed, max_examples=max_examples, budget_seconds=budget_seconds,
                     shrink=shrink, shrink_seconds=shrink_seconds, progress=progress)
    report = FuzzReport(search, case.engine, seed)
    if search.smallest is not None:
        smallest = replace(search.smallest, id=f"{name}-{search.check}",
                           description=f"shrunk by conformance fuzz (seed {seed}, engine {case.engine}): "
                           f"'{search.check}' fails; " + search.smallest.description)
        path = Path(out_dir) / f"{smallest.id}.json"
        origin = {
            "seed": seed,
            "engine": case.engine,
            "failing_check": search.check,
            "examples": search.examples,
            "first_failure": describe_size(search.first),
            "shrunk": describe_size(smallest),
        }
        report.file = write_scenario_file(path, smallest, facts.vocab_size, origin)
        report.replay = case.replay_command(smallest.id, scenario_file=str(report.file))
        replayed = read_scenario_file(report.file, facts.vocab_size)
        report.result, _ = run_scenario(replayed, case, scenario_file=str(report.file))
        failing = {c.check for c in report.result.failures} | (
            {ERROR_CHECK} if report.result.error else set()
        )
        report.reproduced = search.check in failing
    return report
