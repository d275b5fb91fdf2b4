"""Prefix caching: every request's cached-token count is the ceiling its mode and prompt geometry allow,
the state restored on a hit is the state the uncached run had there, and the reference engine's own
cache changes nothing.

**The ceiling.** A prompt is looked up block by block (``block_size`` tokens). A hit of ``h`` tokens
needs the KV of every block of the first ``h`` tokens cached and a recurrent-state checkpoint at ``h``,
and leaves the last prompt token to compute (``h <= len(prompt) - 1``). A block's key covers its tokens
and all before it; with an MTP drafter (K > 0: it keeps a KV cache whose entry at a position pairs it
with the next token) one token more. With an EAGLE drafter (K > 0) keys cover a block's own tokens, and
vLLM's rule for such drafters applies: a hit drops the last block of its run of cached KV blocks first
(the head's KV at a block's last position pairs it with the token after the block), so counts are one
block lower. What a request leaves in the cache once its tokens are committed:

- KV: every full block of its committed tokens;
- checkpoints, mode ``all``: at every block boundary of its committed tokens (prefill chunks never
  cross a boundary);
- checkpoints, mode ``align`` (vLLM 0.32+): at its prompt's last checkpoint ``(L - max(1, lookahead))
  // B * B`` (one block less with an EAGLE drafter) and its prompt's end when that is on the grid (its
  prefill stops at both), at every
  boundary a decode or verify step committed past the prompt, where a budget-cut prefill chunk ended on
  the grid, and where its hit fell short of the blocks it shared with the cache (the junction stop).

A finished request's committed tokens are all but its last output token, its last step's included
(with an MTP drafter too: the drafter writes its KV at a finishing request's last positions).

**The bounds.** From the engine under test's own trace (its prompts, outputs and steps) each request
gets two bounds; equal bounds pin its count exactly:

- upper: what the requests that ran before its first step can have left, from their rows (where each
  prefill chunk ended, how far each verify step committed); without step records, everything any other
  request's tokens could give;
- lower: what the requests whose output came back before it was added must have left, if nothing can
  have been evicted before it was admitted: the scenario sets ``num_kv_blocks``, and the blocks every
  other request can have allocated by then fit in it (``no_eviction_before``; an engine keeps a state
  checkpoint for every cached block). Otherwise, and for aborted requests, the lower bound is 0.
  A request asking for prompt logprobs reads no cached prefix (vLLM's rule: its entries need the whole
  prompt computed): both bounds are 0, and the engine's lookup counters leave it out.

A count above the upper bound claims tokens the cache cannot hold; below the lower bound, the cache
missed a prefix it must hold, so a cache that silently never hits fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conformance.checks.compare import check_acceptance, check_logits_digests, check_tokens
from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import RequestTrace, RowTrace, Trace

EAGLE_DRAFTERS = ("eagle", "eagle3")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")  # optional occupancy() fields


@dataclass(frozen=True)
class Geometry:
    """What decides where a cache can hit: the block size, the mode, and the key's lookahead."""

    block_size: int
    mode: str  # "align" | "all"
    lookahead: int  # tokens past a block its key covers: 1 with an MTP drafter (K > 0), else 0
    # an EAGLE drafter (K > 0): a hit drops the last block of its matched KV run (vLLM's rule for drafters
    # whose KV at a block's last position depends on the next token), and align's last stop moves one
    # block back with it
    drop_last_block: bool = False

    @classmethod
    def of(cls, settings, block_size: int | None = None) -> Geometry:
        """``block_size``: the one the engine reported using, when it picks its own (vLLM on CPU: 32 up)."""
        lookahead = 1 if settings.k and settings.drafter == "mtp" else 0
        drop = bool(settings.k) and settings.drafter in EAGLE_DRAFTERS
        return cls(block_size or settings.block_size, settings.mamba_cache_mode or "align", lookahead, drop)

    def last_stop(self, num_prompt_tokens: int) -> int:
        """align: the prompt's last checkpoint (vLLM 0.32+), one block less with ``drop_last_block``."""
        end = (num_prompt_tokens - max(1, self.lookahead)) // self.block_size * self.block_size
        return max(end - self.block_size, 0) if self.drop_last_block else end


@dataclass(frozen=True)
class Published:
    """What one request left in the cache: its tokens, and the block ends with cached KV / a checkpoint."""

    tokens: tuple[int, ...]
    kv: frozenset[int]
    states: frozenset[int]


@dataclass(frozen=True)
class Bounds:
    lower: int
    upper: int
    lower_rule: str  # why the lower bound is what it is, for the report


def boundaries(after: int, through: int, block_size: int) -> range:
    """Block ends ``b`` with ``after < b <= through``."""
    return range((after // block_size + 1) * block_size, through + 1, block_size)


def ceiling(prompt: tuple[int, ...], sources: list[Published], g: Geometry) -> int:
    """The longest hit ``prompt`` can get from ``sources``: consecutive cached KV blocks from the start,
    ending at a checkpoint, at most ``len(prompt) - 1`` tokens."""
    run = []  # (block end, whether a matching source holds a checkpoint there) along the cached KV run
    for b in range(g.block_size, len(prompt), g.block_size):
        key = prompt[: b + g.lookahead]
        matching = [s for s in sources if s.tokens[: b + g.lookahead] == key]
        if not any(b in s.kv for s in matching):
            break
        run.append((b, any(b in s.states for s in matching)))
    if g.drop_last_block:
        run = run[:-1]
    return max((b for b, state in run if state), default=0)


def tokens_of(req: RequestTrace) -> tuple[int, ...]:
    return (*req.prompt_token_ids, *req.token_ids)


def settled(req: RequestTrace, g: Geometry) -> Published:
    """What a finished request has left in the cache, whatever the timing (the lower bound's sources)."""
    tokens, n, bs = tokens_of(req), len(req.prompt_token_ids), g.block_size
    committed = len(tokens) - 1
    kv = frozenset(b for b in boundaries(0, committed, bs) if b + g.lookahead <= len(tokens))
    if g.mode == "all":
        return Published(tokens, kv, kv)
    # the align split's last stop (vLLM 0.32+ get_mamba_prefill_checkpoint_position), and the prompt's end
    stops = {g.last_stop(n)} | ({n} if n % bs == 0 else set())
    return Published(tokens, kv, frozenset(b for b in kv if b in stops or b > n))


def from_rows(rows: list[RowTrace], tokens: tuple[int, ...], g: Geometry) -> Published:
    """What a request's rows can have left in the cache: the KV of every block they committed, a
    checkpoint where a prefill chunk ended on a block boundary and at every boundary a verify step passed."""
    kv, states = set(), set()
    for row in rows:
        start = row.num_computed_tokens
        end = start + (row.query_len if row.kind == "prefill" else len(row.output_token_ids or ()))
        for b in boundaries(start, end, g.block_size):
            if b + g.lookahead > len(tokens):
                break
            kv.add(b)
            if row.kind != "prefill" or b == end:
                states.add(b)
    return Published(tokens, frozenset(kv), frozenset(states))


def everything(tokens: tuple[int, ...], g: Geometry) -> Published:
    ends = frozenset(boundaries(0, len(tokens) - g.lookahead, g.block_size))
    return Published(tokens, ends, ends)


def max_blocks(req: RequestTrace, max_tokens: int, k: int, block_size: int) -> int:
    """More KV blocks than one admission of ``req`` can ever allocate (drafts and lookahead included)."""
    return math.ceil((len(req.prompt_token_ids) + max_tokens + 2 * k + 1) / block_size) + 1


def blocks_by(rows: list[RowTrace], k: int, block_size: int) -> int:
    """More KV blocks than an admission can have allocated by the time of ``rows`` (its rows so far): up to
    the furthest position they reached, plus a verify step (K+1 tokens) scheduled ahead and the lookahead."""
    end = max(r.num_computed_tokens + r.query_len for r in rows)
    return math.ceil((end + k + 2) / block_size) + 1


class Timeline:
    """When each request of a trace ran: its rows by request, its first step, its preemptions."""

    def __init__(self, trace: Trace):
        self.rows: dict[str, list[RowTrace]] = {}
        for step in trace.steps:
            for row in step.rows:
                self.rows.setdefault(row.request_id, []).append(row)
        self.preemptions = [(s.index, rid) for s in trace.steps for rid in s.preempted]
        self.has_rows = bool(trace.steps) and "rows" not in trace.missing_fields

    def first_step(self, rid: str) -> int | None:
        rows = self.rows.get(rid)
        return rows[0].step if rows else None

    def admissions(self, rid: str, through: int) -> int:
        return 1 + sum(1 for step, who in self.preemptions if who == rid and step <= through)


def no_eviction_before(rid: str, scenario, trace: Trace, timeline: Timeline) -> bool:
    """Whether nothing can have been evicted before ``rid`` was admitted: the scenario sets ``num_kv_blocks``,
    and the blocks all other requests can have allocated by then fit in it (a pool takes a cached block
    only once it has no never-used one left). With step records, what each request's rows up to ``rid``'s
    first step reached, times its admissions; without, what every request can ever allocate."""
    s = scenario.settings
    if s.num_kv_blocks is None:
        return False
    first = timeline.first_step(rid)
    if not timeline.has_rows or first is None:
        specs = {r.request_id: r for r in scenario.requests}
        total = sum(max_blocks(r, specs[o].max_tokens, s.k, s.block_size) for o, r in trace.requests.items())
        return total <= s.num_kv_blocks
    total = 0
    for other, rows in timeline.rows.items():
        before = [r for r in rows if r.step <= first]
        if other != rid and before:
            total += timeline.admissions(other, first) * blocks_by(before, s.k, s.block_size)
    return total <= s.num_kv_blocks


def lower_sources(rid: str, trace: Trace, aborted: set[str], g: Geometry) -> list[Published]:
    """The requests whose output came back before ``rid`` was added, as they must have left the cache."""
    req = trace.requests[rid]
    return [
        settled(other, g)
        for oid, other in trace.requests.items()
        if oid != rid
        and oid not in aborted
        and other.returned_at is not None
        and req.added_at is not None
        and other.returned_at <= req.added_at
    ]


def upper_sources(rid: str, trace: Trace, timeline: Timeline, g: Geometry) -> list[Published]:
    """What every other request can have left before ``rid``'s first step (all of it, without rows)."""
    if not timeline.has_rows:
        return [everything(tokens_of(o), g) for oid, o in trace.requests.items() if oid != rid]
    first = timeline.first_step(rid)
    if first is None:
        return []
    return [from_rows([r for r in timeline.rows.get(oid, []) if r.step < first], tokens_of(o), g)
            for oid, o in trace.requests.items() if oid != rid]


def bounds(
    rid: str, scenario, trace: Trace, timeline: Timeline, *, assume_no_eviction: bool = False
) -> Bounds:
    """The cached-token bounds of request ``rid`` in ``trace`` (``assume_no_eviction``: skip the pool rule,
    which tells what a cache that evicted nothing would have given)."""
    g = Geometry.of(scenario.settings, trace.block_size)
    prompt = tuple(trace.requests[rid].prompt_token_ids)
    upper = ceiling(prompt, upper_sources(rid, trace, timeline, g), g)
    aborted = set(scenario.aborted)
    if rid in skips_lookup(scenario):
        return Bounds(0, 0, "it asks for prompt logprobs, so it reads no cached prefix (vLLM's rule)")
    if rid in aborted:
        return Bounds(0, upper, "aborted, so it may never have been admitted")
    if not assume_no_eviction and not no_eviction_before(rid, scenario, trace, timeline):
        return Bounds(0, upper, "the KV pool may have evicted blocks before it was admitted")
    sources = lower_sources(rid, trace, aborted, g)
    return Bounds(ceiling(prompt, sources, g), upper, f"{len(sources)} request(s) finished before it arrived")


def skips_lookup(scenario) -> set[str]:
    """The requests admitted without a prefix-cache lookup: those asking for prompt logprobs (vLLM computes
    them over the whole prompt, so it reads no cached prefix, and its counters leave the request out)."""
    return {r.request_id for r in scenario.requests if r.sampling.get("prompt_logprobs") is not None}


def check_cached_tokens(scenario, test: Trace) -> CheckResult:
    """Every request's ``num_cached_tokens`` lies within its bounds (the module's rule); without caching it
    is 0. The engine's prefix-cache counters, when its occupancy() has them, add up to the counts."""
    name = "cached-tokens"
    if not scenario.caching:
        cached = {rid: r.num_cached_tokens for rid, r in sorted(test.requests.items()) if r.num_cached_tokens}
        if cached:
            rid, n = next(iter(cached.items()))
            return failed(name, f"request {rid} reports {n} cached tokens with prefix caching off",
                          request_id=rid, cached=n)
        return passed(
            name, f"prefix caching off: none of {len(test.requests)} requests reports cached tokens"
        )
    timeline = Timeline(test)
    pinned = 0
    for rid in sorted(test.requests):
        got, b = test.requests[rid].num_cached_tokens or 0, bounds(rid, scenario, test, timeline)
        if not b.lower <= got <= b.upper:
            return _out_of_bounds(name, scenario, test, rid, got, b)
        pinned += b.lower == b.upper
    problem = _counter_problem(scenario, test)
    if problem:
        return failed(name, problem, f"{problem}\n  occupancy: {test.occupancy}", counters=test.occupancy)
    hits = sum(r.num_cached_tokens or 0 for r in test.requests.values())
    return passed(name, f"{len(test.requests)} requests within their ceilings ({pinned} pinned exactly), "
                  f"{hits} cached tokens in all")


@check(
    "cached-tokens",
    reads=("test",),
    needs=("num_cached_tokens",),
    passes_when=(
        "every request's `num_cached_tokens` lies within the bounds its mode and prompt geometry allow (see "
        "*Prefix caching*): at most what the requests that ran before it can have left, at least what "
        "those that had finished before it arrived must have left; 0 without caching. The "
        "`prefix_cache_hits` / `prefix_cache_queries` counters of `occupancy()`, when reported, add up to "
        "the counts"
    ),
)
def _cached_tokens(c: CheckInputs) -> CheckResult:
    return check_cached_tokens(c.scenario, c.test)


def _out_of_bounds(name: str, scenario, test: Trace, rid: str, got: int, b: Bounds) -> CheckResult:
    req = test.requests[rid]
    g = Geometry.of(scenario.settings, test.block_size)
    if got > b.upper:
        why = (
            f"more than the {b.upper} tokens the cache can hold for its prompt (from the requests that ran "
            "before its first step)"
        )
    else:
        why = f"fewer than the {b.lower} tokens the cache must hold for it ({b.lower_rule})"
    summary = f"request {rid}: {got} cached tokens, expected {b.lower}" + (
        "" if b.lower == b.upper else f"..{b.upper}")
    report = (
        f"request {rid} ({len(req.prompt_token_ids)}-token prompt, added after {req.added_at} engine steps) "
        f"reports {got} cached tokens: {why}\n  mode {g.mode}, block size {g.block_size}, block keys cover "
        f"{g.lookahead} token(s) past the block; bounds {b.lower}..{b.upper}"
    )
    return failed(name, summary, report, rid, cached=got, lower=b.lower, upper=b.upper)


def _counter_problem(scenario, test: Trace) -> str | None:
    """The engine's prefix-cache counters against the counts: equal with no preemption and no aborts
    (one lookup per request, none for a request that skips it: ``skips_lookup``), at least the counts
    otherwise (a resumed request is looked up again)."""
    occ = test.occupancy or {}
    if not all(c in occ for c in COUNTERS):
        return None
    hits = sum(r.num_cached_tokens or 0 for r in test.requests.values())
    aborted = set(scenario.aborted)  # an aborted request may never have been looked up
    unlooked = aborted | skips_lookup(scenario)
    queried = sum(len(r.prompt_token_ids) for rid, r in test.requests.items() if rid not in unlooked)
    exact = not aborted and not any(r.num_preemptions for r in test.requests.values()) \
        and not any(s.preempted for s in test.steps)
    for counter, want in (("prefix_cache_hits", hits), ("prefix_cache_queries", queried)):
        got = occ[counter]
        if got != want if exact else got < want:
            return (f"occupancy() counts {counter}={got}, but the requests add up to {want}"
                    + ("" if exact else " (at least, with preemptions or aborts)"))
    return None


def check_restored_state(scenario, ref: Trace, test: Trace, batch_invariant: bool) -> CheckResult:
    """A request served from the cache starts after the hit, as a prefill from the restored state (however
    few tokens are left), and its first logits are bitwise those of the uncached run (batch-invariant
    engines): the state restored at ``h`` is the one the uncached run had at ``h``."""
    name = "restored-state"
    if not scenario.caching:
        return not_applicable(name, "the scenario runs without prefix caching")
    hits = {rid: r.num_cached_tokens for rid, r in sorted(test.requests.items()) if r.num_cached_tokens}
    if not hits:
        return not_applicable(name, "no request was served from the cache")
    compared = 0
    for rid, h in hits.items():
        rows = test.rows_of(rid)
        problem = _restore_problem(rows[0], h) if rows else "has no rows"
        if problem:
            return failed(name, f"request {rid} (hit of {h} tokens) {problem}", request_id=rid, hit=h)
        digests = _first_digests(ref.requests.get(rid), test.requests[rid]) if batch_invariant else None
        if digests is None:
            continue
        compared += 1
        if digests[0] != digests[1]:
            return failed(
                name,
                f"request {rid}: the first logits after a hit of {h} tokens differ from the uncached run's",
                f"request {rid} was served {h} tokens from the cache; the logits of "
                f"its first output token hash to {digests[1]} in {test.engine} and {digests[0]} in "
                f"{ref.engine} (no cache): the restored state is not the state the uncached run had at "
                f"position {h}",
                rid,
                position=0,
                hit=h,
            )
    return passed(name, f"{len(hits)} hits started from the restored state"
                  + (f", {compared} first logits bitwise the uncached run's" if compared else ""))


@check(
    "restored-state",
    reads=("ref", "test"),
    needs=("num_cached_tokens", "rows", "kind", "num_computed_tokens", "query_len", "has_initial_state"),
    passes_when=(
        "with prefix caching: a request served from the cache first runs after the hit, as a prefill from "
        "the restored state (however few tokens it has left), and its first logits are bitwise the uncached "
        "run's (batch-invariant engines)"
    ),
)
def _restored_state(c: CheckInputs) -> CheckResult:
    return check_restored_state(c.scenario, c.ref, c.test, c.batch_invariant)


def _restore_problem(row: RowTrace, hit: int) -> str | None:
    if row.num_computed_tokens != hit:
        return f"first ran with {row.num_computed_tokens} computed tokens, not after the hit"
    if row.kind != "prefill":
        return f"first ran as a {row.kind!r} row of {row.query_len} tokens, not a prefill"
    if not row.has_initial_state:
        return "first ran without an initial state: the restored state was not read"
    return None


def _first_digests(ref: RequestTrace | None, test: RequestTrace) -> tuple[str, str] | None:
    a = next((d for p, _, d in ref.logits if p == 0), None) if ref is not None else None
    b = next((d for p, _, d in test.logits if p == 0), None)
    return None if a is None or b is None else (a, b)


def check_cache_lossless(scenario, ref: Trace, cached: Trace | None) -> CheckResult:
    """The reference engine with the scenario's prefix caching equals it without: tokens, acceptance and
    logits digests (the oracle the engine under test is held to runs uncached; this holds it to its cache)."""
    name = "cache-lossless"
    if cached is None:
        return not_applicable(name, "the scenario runs without prefix caching")
    if cached.error is not None:
        last = cached.error.strip().splitlines()[-1] if cached.error.strip() else "error"
        return failed(
            name,
            f"{cached.engine} raised: {last}",
            f"{cached.engine} did not finish the workload:\n" + cached.error,
            traceback=cached.error,
        )
    aborted = set(scenario.aborted)
    for result in (check_tokens(ref, cached, skip=aborted), check_acceptance(ref, cached, aborted),
                   check_logits_digests(ref, cached)):
        if result.failed:
            result.check = name
            result.summary = f"with caching vs without, {result.summary}"
            result.report = ("the reference engine's prefix cache changed what it computes\n" + result.report)
            return result
    hits = sum(r.num_cached_tokens or 0 for r in cached.requests.values())
    return passed(
        name,
        f"{len(cached.requests)} requests ({hits} cached tokens): tokens, acceptance and logits "
        "digests as without the cache",
    )


@check(
    "cache-lossless",
    reads=("ref", "cached"),
    passes_when=(
        "with prefix caching: the reference engine with the scenario's cache gives the same tokens, "
        "acceptance and logits digests as without it (the oracle the engine under test is held to runs "
        "uncached)"
    ),
)
def _cache_lossless(c: CheckInputs) -> CheckResult:
    return check_cache_lossless(c.scenario, c.ref, c.cached)
