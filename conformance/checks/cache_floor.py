"""The cache floor: how few cached tokens a request may get, under memory pressure too.

``cached-tokens`` bounds every count from above, and from below only where nothing at all can have been
evicted before the request was admitted. That leaves a cache that hits less than it must unseen wherever
the pool is under pressure: one that evicts the wrong blocks (the newest instead of the least recently
used), or drops a checkpoint it should have kept. This check derives a lower bound per request that holds
under pressure, from the engine under test's own trace.

**Survival.** The pool evicts least recently released first, and only when it has no never-used block
left. A request S that finished released its blocks at the end of its last step. For one of them, X, to
be evicted by the time request R looked its prompt up, the allocation that took X found every one of the
pool's N blocks either referenced or released after X, so N distinct blocks were each held by some
request at some moment between S's last step and R's first step: S itself, and the requests that ran in
that window. Each of them holds at most its *footprint* (``blocks_by`` of its rows up to R's first step,
times its admissions); X, held by S and then by its taker, counts twice. So if the footprints of S and of
every request that ran in the window add up to at most N, nothing S left can have been evicted: R must
find all of it. The same count bounds the checkpoints (an engine keeps a checkpoint slot for every KV
block, evicted least recently used first, one reservation per published block).

**The floor.** R's lower bound is the ceiling (``prefix_cache.ceiling``) its prompt gets from the sources
that survive: the requests whose output came back before R was added (what they must have left,
``prefix_cache.settled``) whose window footprints fit the pool. Aborted requests are neither bounded nor
sources. The window is counted in engine steps, from the source's last row to R's first, both included.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.checks.prefix_cache import Geometry, Timeline, blocks_by, ceiling, settled
from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import Trace


@dataclass(frozen=True)
class Floor:
    lower: int
    sources: tuple[str, ...]  # the surviving sources the bound comes from
    dropped: tuple[str, ...]  # finished before R arrived, but their blocks may have been evicted


def window_footprint(source: str, first: int, timeline: Timeline, k: int, block_size: int,
                     exclude: str) -> int:
    """Blocks ``source`` and every request that ran from its last step to step ``first`` can have held
    (``exclude``, the request looking up, allocates only after its lookup). A request that lived through
    the window without a row in it (a verify row the budget left out) holds its blocks too."""
    start = timeline.rows[source][-1].step
    total = 0
    for rid, rows in timeline.rows.items():
        if rid == exclude:
            continue
        before = [r for r in rows if r.step <= first]
        if not before or (rid != source and rows[-1].step < start):  # done before the window opened
            continue
        total += timeline.admissions(rid, first) * blocks_by(before, k, block_size)
    return total


def floor(rid: str, scenario, trace: Trace, timeline: Timeline) -> Floor:
    """Request ``rid``'s cached-token floor in ``trace`` (the module's rule)."""
    s = scenario.settings
    g = Geometry.of(s)
    req = trace.requests[rid]
    first = timeline.first_step(rid)
    aborted = set(scenario.aborted)
    kept, dropped = [], []
    for oid, other in sorted(trace.requests.items()):
        if oid == rid or oid in aborted or other.returned_at is None or req.added_at is None \
                or other.returned_at > req.added_at or not timeline.rows.get(oid):
            continue
        footprint = window_footprint(oid, first, timeline, s.k, s.block_size, rid)
        (kept if footprint <= s.num_kv_blocks else dropped).append(oid)
    sources = [settled(trace.requests[o], g) for o in kept]
    return Floor(ceiling(tuple(req.prompt_token_ids), sources, g), tuple(kept), tuple(dropped))


def check_cache_floor(scenario, test: Trace) -> CheckResult:
    """No request gets fewer cached tokens than the blocks that cannot have been evicted give it."""
    name = "cache-floor"
    if not scenario.caching:
        return not_applicable(name, "the scenario runs without prefix caching")
    if scenario.settings.num_kv_blocks is None:
        return not_applicable(name, "the scenario leaves the KV pool's size to the engine")
    timeline = Timeline(test)
    if not timeline.has_rows:
        return not_applicable(name, "the engine reports no step rows")
    aborted = set(scenario.aborted)
    bounded = floored = 0
    for rid in sorted(test.requests):
        if rid in aborted or timeline.first_step(rid) is None:
            continue
        f = floor(rid, scenario, test, timeline)
        got = test.requests[rid].num_cached_tokens or 0
        bounded += 1
        floored += f.lower > 0
        if got < f.lower:
            req = test.requests[rid]
            g = Geometry.of(scenario.settings)
            return failed(
                name,
                f"request {rid}: {got} cached tokens, at least {f.lower} expected",
                f"request {rid} ({len(req.prompt_token_ids)}-token prompt, first step "
                f"{timeline.first_step(rid)}) reports {got} cached tokens, but the cache must still hold "
                f"{f.lower}: what {', '.join(f.sources)} left when they finished, which the requests "
                f"that ran since cannot have evicted from a pool of {scenario.settings.num_kv_blocks} "
                "KV blocks"
                + (f" (not counted, as evictable: {', '.join(f.dropped)})" if f.dropped else "")
                + f"\n  mode {g.mode}, block size {g.block_size}, block keys cover {g.lookahead} token(s) "
                "past the block",
                rid,
                cached=got,
                lower=f.lower,
                sources=list(f.sources),
            )
    return passed(name, f"{bounded} requests at or above their floors ({floored} with a floor above 0)")


@check(
    "cache-floor",
    reads=("test",),
    needs=("num_cached_tokens", "rows", "num_computed_tokens", "query_len"),
    passes_when=(
        "with prefix caching and a scenario-sized KV pool: no request gets fewer cached tokens than what "
        "the requests that finished before it arrived left, wherever those blocks cannot have been evicted "
        "by its first step, under memory pressure too (see *Prefix caching*)"
    ),
)
def _cache_floor(c: CheckInputs) -> CheckResult:
    return check_cache_floor(c.scenario, c.test)
