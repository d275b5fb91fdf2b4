"""Soak: thousands of requests through both engines with aborts, preemption and injected faults.

Every request that finishes unaborted gets exactly its plain greedy output, every aborted one a
prefix of it, and every pool (KV blocks, state slots, request slots) is empty at the end, read
through the engines' public occupancy.
"""

from __future__ import annotations

import random

import pytest

from refengine import LLM, SamplingParams

pytestmark = [pytest.mark.nightly, pytest.mark.slow]

NUM_REQUESTS = 2000


class InjectedFault(Exception):
    pass


def _workload(seed: int, shared: bool = False):
    """With ``shared``, most prompts start with one of a few common prefixes (so a prefix cache hits)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in (4, 7, 8, 12, 16)]
    items = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(256) for _ in range(rng.choice([1, 2, 3, 4, 5, 9, 17, 33]))]
        if shared and rng.random() < 0.8:
            prompt = (rng.choice(prefixes) + prompt)[:40]
        # id, prompt, max_tokens, abort?
        items.append((f"r{i}", prompt, rng.randint(1, 12), rng.random() < 0.1))
    return items


def _drive(llm: LLM, items, seed: int, fault_every: int = 0):
    """Requests arrive a few per step; some are aborted a few steps later; a fault every N steps."""
    rng = random.Random(seed)
    outs, pending, aborts, step, faults = {}, list(items), {}, 0, 0
    while pending or llm.has_unfinished():
        for _ in range(rng.randint(0, 6)):
            if pending:
                rid, prompt, max_tokens, abort = pending.pop(0)
                llm.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                if abort:
                    aborts.setdefault(step + rng.randint(0, 4), []).append(rid)
        for rid in aborts.pop(step, []):
            if rid not in outs:
                out = llm.abort(rid)
                if out is not None:
                    outs[rid] = out
        if fault_every and step % fault_every == fault_every - 1:
            llm.engine.core.observers[:] = [_raise_once()]
        try:
            for o in llm.step():
                outs[o.request_id] = o
        except InjectedFault:
            faults += 1
        step += 1
    return outs, faults


def _raise_once():
    fired = []

    def observe(record):
        if not fired:
            fired.append(True)
            raise InjectedFault("injected into an observer")

    return observe


@pytest.mark.parametrize("engine,caching", [("reference", None), ("async", None), ("reference", "align"),
                                            ("async", "all"), ("async", "align")])
def test_soak_with_aborts_preemption_and_faults(engine, caching):
    """With ``caching`` (a mamba_cache_mode), prefix caching is on and the prompts share prefixes: hits,
    eviction from a small pool, preemption of shared blocks and faults keep every reference count exact."""
    items = _workload(7, shared=caching is not None)
    common = {"num_speculative_tokens": 3, "max_num_seqs": 12, "block_size": 4, "num_kv_blocks": 48,
              "max_model_len": 64}
    plain = {
        o.request_id: o.token_ids
        for o in LLM(**{**common, "num_speculative_tokens": 0}).generate(
            [p for _, p, _, _ in items],
            [SamplingParams(max_tokens=m, ignore_eos=True) for _, _, m, _ in items],
        )
    }
    plain = {rid: plain[f"gen-{i}"] for i, (rid, _, _, _) in enumerate(items)}
    kw = {"graph_mode": "full_and_piecewise"} if engine == "async" else {}
    if caching is not None:
        kw.update(enable_prefix_caching=True, mamba_cache_mode=caching)
    llm = LLM(engine=engine, **common, **kw)
    outs, faults = _drive(llm, items, seed=11, fault_every=97)
    assert faults > 0 and len(outs) == len(items)
    preempted = sum(o.num_preemptions for o in outs.values())
    assert preempted > 0, "the small KV pool should force preemption"
    for rid, o in outs.items():
        if o.finish_reason == "abort":
            assert o.token_ids == plain[rid][: len(o.token_ids)], rid
        else:
            assert o.token_ids == plain[rid], rid
    occupancy = llm.occupancy()
    assert occupancy.empty, occupancy
    if caching is not None:
        assert occupancy.prefix_cache_hits > 0, occupancy
