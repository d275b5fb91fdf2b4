"""A check declares itself once, on its function: its name, the traces it reads, the record fields it
needs of the engine under test, and what it asserts (its row of conformance/README.md's table).

    @check("state-slots", reads=("test",), needs=("rows", "state_slot_read"),
           passes_when="no two requests read the same recurrent state slot in one step")
    def _state_slots(c: CheckInputs) -> CheckResult:
        return check_state_slots(c.test)

The harness, the reports and the expectation files read the declarations; the docs test holds the
README's table to them. The declarations are made as the check modules are imported and not changed
after (``declaring`` lets a test add one for the length of a ``with`` block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from conformance.results import CheckResult

# The traces a check may read: the CheckInputs fields that hold one ("scored": the reference's scoring of
# the engine under test's output under --verdict rescored, CheckInputs.scores).
TRACES = ("ref", "test", "plain", "cached", "test_plain", "bare", "scored")
# The runs made after the first two ("reference" and "test"): a check reading one is late.
LATE_TRACES = frozenset({"plain", "cached", "test_plain", "bare"})

# Report order of the shipped checks (reports, JUnit, fail-fast evaluation); a check not named here
# follows them, in the order it was declared.
REPORT_ORDER = (
    "runs",
    "tokens",
    "rescored",
    "output-records",
    "acceptance",
    "drafts",
    "request-outputs",
    "aborts",
    "logits-digests",
    "spec-lossless",
    "cache-lossless",
    "cached-tokens",
    "cache-floor",
    "restored-state",
    "full-graph-metadata",
    "new-prompt-prefill",
    "id-range",
    "state-slots",
    "pools-empty",
    "degenerate-run",
    "logprobs",
    "stop-semantics",
    "params-change-output",
    "sampler-frequencies",
    "spec-distribution",
    "structured-outputs",
    "workload-triggers",
)


@dataclass(frozen=True)
class CheckInputs:
    """What a check may look at for one scenario: its traces and the run's facts."""

    scenario: Any  # conformance.workloads.Scenario
    ref: Any  # Trace of the reference engine
    test: Any  # Trace of the engine under test
    plain: Any  # Trace of the plain (K=0, no aborts) reference run, or None
    vocab_size: int
    batch_invariant: bool  # the engine under test claims bitwise batch invariance
    strict_triggers: bool  # a trigger the workload misses fails (False: --allow-unexercised, a warning)
    cached: Any = None  # Trace of the reference engine with the scenario's prefix caching, or None
    test_plain: Any = None  # Trace of the engine under test on the plain workload (K=0), or None
    bare: Any = None  # Trace of the reference engine on the same requests without their parameters, or None
    verdict: Any = None  # conformance.verdict.Verdict of the run (None: exact)
    # Under --verdict rescored: {"test" | "test-plain": {request id: conformance.scoring.RequestScore}}, the
    # reference's scoring of those runs' outputs (None: exact)
    scores: Any = None
    # What the checkpoint decides must happen too: a trigger or bound a model may miss (the scenario's
    # ``model_decides``, a parameter that cannot be shown to matter on this model) fails instead of being
    # "not exercised" (a gate that asks for every one, e.g. on the model the corpus is tuned to).
    require_exercised: bool = False

    @property
    def aborted(self) -> set[str]:
        return set(self.scenario.aborted)

    @property
    def bitwise(self) -> bool:
        """Whether the engine under test is bitwise the reference here: the verdict is exact, or rescored
        with an engine that runs the reference's kernels in the reference's dtype on its device."""
        return self.verdict is None or not self.verdict.rescored or self.verdict.bitwise_comparable


@dataclass(frozen=True)
class Check:
    """One check. ``name`` is stable: expectation files name it as "<scenario-id>/<check>"."""

    name: str
    fn: Callable[[CheckInputs], CheckResult]
    reads: tuple[str, ...]  # the traces it reads, as README's "over" column lists them
    passes_when: str  # what it asserts: README's "passes when" column, word for word
    # The StepRecord / RowRecord fields (and optional RequestOutput ones) it reads from the engine under
    # test: when its records lack one (an adapter of another engine) the check is n/a, never a pass over
    # what happens to be there.
    needs: tuple[str, ...] = ()
    judges_broken_runs: bool = False  # reads "test" but judges a run that broke itself ("runs")
    replay: bool = True  # a failure's request is the engine under test's: the report says how to replay it

    def __post_init__(self) -> None:
        unknown = [t for t in self.reads if t not in TRACES]
        if unknown or not self.reads:
            raise ValueError(f"check {self.name!r} reads {self.reads}: each must be one of {TRACES}")

    @property
    def late(self) -> bool:
        """It reads the plain or cached runs: a fail-fast evaluation runs it only when no other failed."""
        return any(t in LATE_TRACES for t in self.reads)

    @property
    def runs_when_test_broke(self) -> bool:
        """It still runs when the engine under test did not finish the workload."""
        return self.judges_broken_runs or "test" not in self.reads

    def lacking(self, missing_fields) -> list[str]:
        """The fields it needs that the engine's records lacked."""
        return [f for f in self.needs if f in missing_fields]


_declared: dict[str, Check] = {}


def check(
    name: str,
    *,
    reads: tuple[str, ...],
    passes_when: str,
    needs: tuple[str, ...] = (),
    judges_broken_runs: bool = False,
    replay: bool = True,
) -> Callable[[Callable[[CheckInputs], CheckResult]], Callable[[CheckInputs], CheckResult]]:
    """Declare the decorated function of ``CheckInputs`` as the check ``name`` (see ``Check``)."""

    def declare(fn: Callable[[CheckInputs], CheckResult]) -> Callable[[CheckInputs], CheckResult]:
        if name in _declared:
            raise ValueError(f"check {name!r} is declared twice")
        _declared[name] = Check(name, fn, tuple(reads), passes_when, tuple(needs), judges_broken_runs,
                                replay)
        return fn

    return declare


def declared() -> tuple[Check, ...]:
    """Every check, in report order."""
    rank = {name: i for i, name in enumerate(REPORT_ORDER)}
    return tuple(sorted(_declared.values(), key=lambda c: rank.get(c.name, len(rank))))


def declaration(name: str) -> Check | None:
    return _declared.get(name)


@contextmanager
def declaring() -> Iterator[None]:
    """Checks declared inside the block are withdrawn at its end (a test's own check)."""
    before = dict(_declared)
    try:
        yield
    finally:
        _declared.clear()
        _declared.update(before)
