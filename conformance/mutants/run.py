"""Run the suite against each mutant and score it: a mutant is caught when any check fails."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from conformance.harness import Case, run_scenario
from conformance.model import describe_model, preflight, run_dtype
from conformance.mutants import MUTANTS, Mutant, MutantAdapter
from conformance.tiny_models import TINY_PREFIX
from conformance.workloads import scenario_ids

FUZZ_BUDGET = 10  # generated workloads tried on a mutant the hand-written tier missed


@dataclass
class MutantResult:
    mutant: Mutant
    caught: bool
    seconds: float  # until the first failing scenario finished (or the whole tier, when missed)
    scenario: str | None = None  # the scenario that caught it
    checks: tuple[str, ...] = ()  # the checks that failed there
    summary: str = ""  # the first failing check's one-line summary
    replay: str = ""
    untried: str | None = None  # why no scenario could exercise it on this model (e.g. it needs MTP)
    by_fuzz: bool = False  # caught by the fixed fuzz budget, after the hand-written tier missed it
    model: str | None = None  # the model it ran on (None: the embedded default model)
    tier: str = "default"

    @property
    def model_name(self) -> str:
        return self.model or "embedded default model"

    @property
    def rerun(self) -> str:
        """The command that runs this mutant again: the replay of its first failure, else its tier."""
        if self.caught and self.replay:
            return self.replay
        cmd = ["conformance", "run", "--engine", f"mutant:{self.mutant.id}", "--tier", self.tier]
        return shlex.join(cmd + (["--model", self.model] if self.model else []))


def model_for(mutant: Mutant, model: str | None) -> str | None:
    """The model a mutant runs on: ``model``, unless the mutant declares a family (it patches that
    family's mixer) and ``model`` is of another one; then that family's tiny model."""
    if getattr(mutant, "tokenizer", False) and (model is None or not describe_model(model).has_tokenizer):
        return None
    family = getattr(mutant, "family", None)
    if family is None or (model is not None and describe_model(model).family == family):
        return model
    return TINY_PREFIX + family


def scenario_order(mutant: Mutant, tier: str) -> list[str]:
    ids = scenario_ids(tier)
    preferred = [s for s in mutant.scenarios if s in ids]
    return preferred + [s for s in ids if s not in preferred]


def run_mutant(mutant: Mutant, model: str | None, tier: str = "default", device: str = "cpu",
               preferred_only: bool = False, dtype: str = "float32") -> MutantResult:
    """Run scenarios (the mutant's preferred ones first) until a check fails (the scenario stops there)."""
    model = model_for(mutant, model)
    facts = preflight(model, device, dtype)
    # A trigger the reference run misses says nothing of the mutant: it must be caught by a check of it.
    case = Case(f"mutant:{mutant.id}", MutantAdapter(mutant), facts, model, tier, device,
                run_dtype(dtype, facts), allow_unexercised=True)
    start = time.perf_counter()
    order = scenario_order(mutant, tier)
    if preferred_only:
        order = [s for s in order if s in mutant.scenarios]
    skipped: dict[str, str] = {}
    for sid in order:
        result, _ = run_scenario(sid, case, fail_fast=True)
        if result.error is not None:
            raise RuntimeError(f"mutant {mutant.id}: scenario {sid} could not run: {result.error}")
        if result.skipped:
            skipped[sid] = result.skipped
        if result.failures:
            first = result.failures[0]
            return MutantResult(mutant, True, time.perf_counter() - start, sid,
                                tuple(c.check for c in result.failures), first.summary,
                                first.details.get("replay", result.replay))
    missed = MutantResult(mutant, False, time.perf_counter() - start)
    aimed = [s for s in mutant.scenarios if s in order]
    if aimed and all(s in skipped for s in aimed):  # the scenarios written for it cannot run on this model
        missed.untried = (
            "; ".join(sorted({f"{skipped[s]}" for s in aimed})) + f" ({', '.join(aimed)} skipped)"
        )
    return missed


def fuzz_mutant(
    mutant: Mutant,
    model: str | None,
    device: str = "cpu",
    *,
    seed: int = 0,
    examples: int = FUZZ_BUDGET,
    out_dir: str | None = None,
    dtype: str = "float32",
) -> MutantResult:
    """A fixed budget of generated workloads (no shrinking) against the mutant."""
    import tempfile

    from conformance.fuzz import fuzz

    model = model_for(mutant, model)
    facts = preflight(model, device, dtype)
    case = Case(f"mutant:{mutant.id}", MutantAdapter(mutant), facts, model, "default", device,
                run_dtype(dtype, facts))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # The engine-level workloads only: a seed draws what it drew before request parameters existed (the
        # parameters' mutants have their scenarios in the tier), so a budget that caught a mutant still does.
        report = fuzz(case, seed=seed, max_examples=examples, out_dir=out_dir or tmp, shrink=False,
                      params=False)
    if not report.failed:
        return MutantResult(mutant, False, time.perf_counter() - start)
    return MutantResult(
        mutant,
        True,
        time.perf_counter() - start,
        f"fuzz seed {seed}",
        (report.search.check,),
        f"a generated workload failed {report.search.check}",
        report.replay or "",
        by_fuzz=True,
    )


def run_mutants(model: str | None, tier: str = "default", only: list[str] | None = None, device: str = "cpu",
                progress: Callable[[MutantResult, int, int], None] | None = None,
                fuzz_budget: int = FUZZ_BUDGET, dtype: str = "float32") -> list[MutantResult]:
    """Each mutant through the hand-written tier (its own scenarios first), then, when that missed it,
    through ``fuzz_budget`` generated workloads."""
    chosen = [m for m in MUTANTS if not only or m.id in only]
    unknown = set(only or ()) - {m.id for m in MUTANTS}
    if unknown:
        raise KeyError(f"unknown mutants: {', '.join(sorted(unknown))}")
    results = []
    for i, m in enumerate(chosen, 1):
        result = run_mutant(m, model, tier, device, dtype=dtype)
        if not result.caught and not result.untried and fuzz_budget:
            result = fuzz_mutant(m, model, device, examples=fuzz_budget, dtype=dtype)
        results.append(replace(result, model=model_for(m, model), tier=tier))
        if progress is not None:
            progress(results[-1], i, len(chosen))
    return results


def format_score(results: list[MutantResult]) -> str:
    lines = []
    for r in results:
        m = r.mutant
        if r.caught:
            lines.append(f"  CAUGHT  {m.id:28s} {r.seconds:5.1f}s  by {r.scenario} [{', '.join(r.checks)}]")
        elif r.untried:
            lines.append(f"  UNTRIED {m.id:28s} {r.seconds:5.1f}s  {r.untried}")
        else:
            lines.append(
                f"  MISSED  {m.id:28s} {r.seconds:5.1f}s  no scenario and no generated workload failed"
            )
        lines.append(f"          {m.origin}; breaks {m.contract}: {m.description}")
        lines.append(f"          model: {r.model_name}")
        if r.caught:
            lines.append(f"          first failure: {r.summary}")
        lines.append(f"          replay: {r.rerun}")
    caught = sum(r.caught for r in results)
    tried = [r for r in results if not r.untried]
    lines.append(f"mutation score: {caught}/{len(tried)} caught" + (
        f"; {len(results) - len(tried)} could not be tried on this model: "
        + ", ".join(r.mutant.id for r in results if r.untried) if len(tried) < len(results) else ""))
    return "\n".join(lines)
