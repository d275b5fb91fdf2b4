"""Run the suite against each mutant and score it: a mutant is caught when any check fails."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from conformance.harness import Case, run_scenario
from conformance.model import preflight
from conformance.mutants import MUTANTS, Mutant, MutantAdapter
from conformance.workloads import scenario_ids


@dataclass
class MutantResult:
    mutant: Mutant
    caught: bool
    seconds: float  # until the first failing scenario finished (or the whole tier, when missed)
    scenario: str | None = None  # the scenario that caught it
    checks: tuple[str, ...] = ()  # the checks that failed there
    summary: str = ""  # the first failing check's one-line summary
    replay: str = ""


def scenario_order(mutant: Mutant, tier: str) -> list[str]:
    ids = scenario_ids(tier)
    preferred = [s for s in mutant.scenarios if s in ids]
    return preferred + [s for s in ids if s not in preferred]


def run_mutant(mutant: Mutant, model: str | None, tier: str = "default", device: str = "cpu",
               preferred_only: bool = False) -> MutantResult:
    """Run scenarios (the mutant's preferred ones first) until one fails."""
    facts = preflight(model, device)
    case = Case(f"mutant:{mutant.id}", MutantAdapter(mutant), facts, model, tier, device)
    start = time.perf_counter()
    order = scenario_order(mutant, tier)
    if preferred_only:
        order = [s for s in order if s in mutant.scenarios]
    for sid in order:
        result, _ = run_scenario(sid, case)
        if result.error is not None:
            raise RuntimeError(f"mutant {mutant.id}: scenario {sid} could not run: {result.error}")
        if result.failures:
            first = result.failures[0]
            return MutantResult(mutant, True, time.perf_counter() - start, sid,
                                tuple(c.check for c in result.failures), first.summary,
                                first.details.get("replay", result.replay))
    return MutantResult(mutant, False, time.perf_counter() - start)


def run_mutants(model: str | None, tier: str = "default", only: list[str] | None = None, device: str = "cpu",
                progress: Callable[[MutantResult, int, int], None] | None = None) -> list[MutantResult]:
    chosen = [m for m in MUTANTS if not only or m.id in only]
    unknown = set(only or ()) - {m.id for m in MUTANTS}
    if unknown:
        raise KeyError(f"unknown mutants: {', '.join(sorted(unknown))}")
    results = []
    for i, m in enumerate(chosen, 1):
        results.append(run_mutant(m, model, tier, device))
        if progress is not None:
            progress(results[-1], i, len(chosen))
    return results


def format_score(results: list[MutantResult]) -> str:
    lines = []
    for r in results:
        m = r.mutant
        if r.caught:
            lines.append(f"  CAUGHT  {m.id:28s} {r.seconds:5.1f}s  by {r.scenario} [{', '.join(r.checks)}]")
        else:
            lines.append(f"  MISSED  {m.id:28s} {r.seconds:5.1f}s  no scenario failed")
        lines.append(f"          {m.origin}; breaks {m.contract}: {m.description}")
        if r.caught:
            lines.append(f"          first failure: {r.summary}")
    caught = sum(r.caught for r in results)
    lines.append(f"mutation score: {caught}/{len(results)} caught")
    return "\n".join(lines)
