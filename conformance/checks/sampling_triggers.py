"""Triggers of the sampled scenarios (in conformance.checks.triggers.TRIGGERS), judged on the reference
run."""

from __future__ import annotations

from collections.abc import Callable

from conformance.trace import Trace
from conformance.workloads.scenario import Scenario


def _sampled(sc: Scenario, seeded: bool | None = None) -> set[str]:
    return {r.request_id for r in sc.requests
            if r.samples and (seeded is None or ("seed" in r.sampling) == seeded)}


def _seeded_beside_unseeded(sc: Scenario, t: Trace) -> bool:
    """One step held a seeded sampled request, an unseeded one and a greedy one."""
    seeded, unseeded, sampled = _sampled(sc, True), _sampled(sc, False), _sampled(sc)
    for s in t.steps:
        ids = {r.request_id for r in s.rows}
        if ids & seeded and ids & unseeded and ids - sampled:
            return True
    return False


def _sampled_verify(sc: Scenario, t: Trace, kept: Callable[[int, int], bool]) -> bool:
    sampled = _sampled(sc)
    return any(kept(d, a) for rid in sampled if rid in t.requests for d, a in t.requests[rid].acceptance)


SAMPLING_TRIGGERS: dict[str, tuple[str, Callable[[Scenario, Trace], bool]]] = {
    "seeded-beside-unseeded": (
        "a seeded sampled request, an unseeded one and a greedy one shared a step", _seeded_beside_unseeded),
    "sampled-draft-rejected": (
        "a sampled request's verify step rejected a draft (its token drawn from the residual)",
        lambda sc, t: _sampled_verify(sc, t, lambda d, a: a < d)),
    "sampled-drafts-all-kept": (
        "a sampled request's verify step kept every one of its K drafts (a bonus token drawn)",
        lambda sc, t: _sampled_verify(sc, t, lambda d, a: d == a == sc.k)),
}
