"""Engines under test with one planted prefix-caching bug each: the reference engine with its cache on,
broken in one place, to show that each prefix-caching check fails on the bug it exists for.

``--engine tests.conformance.caching_engines:<bug>`` loads one (``correct`` plants nothing).
"""

from __future__ import annotations

import dataclasses

from conformance.engines import LLMInstance, RefEngineAdapter, RunSpec

BUGS = {
    "correct": "nothing: the reference engine with its cache, under another name",
    "never-hits": "runs without a cache although asked for one: it silently never hits",
    "overclaims": "reports one block more cached tokens than it served",
    "skips-restore": "serves a hit without copying the cached state into the request's slot",
    "corrupts-after-hit": "changes the first token a request served from the cache generates",
    "leaks-a-block": "keeps one extra reference on the first block of the first hit",
    "miscounts-hits": "its occupancy() counters never count a hit",
}


class CachingBugAdapter(RefEngineAdapter):
    def __init__(self, bug: str):
        super().__init__("reference", "none", uncached=bug == "never-hits")
        self.bug, self.name = bug, f"caching-bug:{bug}"

    def supports(self, feature: str) -> bool:
        return feature == "prefix_caching" or super().supports(feature)

    def start(self, spec: RunSpec):
        llm = self.build(spec)
        prefix = llm.engine.core.scheduler.prefix
        if self.bug == "skips-restore":
            llm.engine.caches.restore_checkpoint = lambda source, target: None
        elif self.bug == "leaks-a-block":
            _leak_first_hit(prefix)
        elif self.bug == "miscounts-hits":
            prefix.count = lambda total, hit: setattr(
                prefix, "num_query_tokens", prefix.num_query_tokens + total
            )
        return _Outputs(LLMInstance(llm), self.bug, spec.settings.block_size)


def _leak_first_hit(prefix) -> None:
    find, leaked = prefix.find, []

    def find_and_leak(req, total):
        hit = find(req, total)
        if hit.blocks and not leaked:
            prefix.kv_pool.take(hit.blocks[:1])
            leaked.append(hit.blocks[0])
        return hit

    prefix.find = find_and_leak


class _Outputs:
    """The instance, with the bugs that live in what ``step()`` hands back."""

    def __init__(self, inner: LLMInstance, bug: str, block_size: int):
        self.inner, self.bug, self.block_size = inner, bug, block_size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        return [self._planted(out) for out in self.inner.step()]

    def _planted(self, out):
        if self.bug == "overclaims" and out.num_cached_tokens:
            return dataclasses.replace(out, num_cached_tokens=out.num_cached_tokens + self.block_size)
        if self.bug == "corrupts-after-hit" and out.num_cached_tokens and out.token_ids:
            return dataclasses.replace(out, token_ids=[(out.token_ids[0] + 1) % 7, *out.token_ids[1:]])
        return out


def correct():
    return CachingBugAdapter("correct")


def never_hits():
    return CachingBugAdapter("never-hits")
