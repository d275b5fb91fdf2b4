"""Generated workloads: a hypothesis strategy that draws whole scenarios.

``scenarios(vocab_size, ...)`` draws an engine configuration and a list of requests, and builds the
same ``Scenario`` the hand-written corpus materialises, so everything that runs a corpus scenario
runs a generated one. What is drawn, and why:

- K in 0..3 and the drafter: the model's MTP head, or the scripted drafter with an acceptance pattern
  (ragged, all-accept, all-reject, cycle), so accepted counts 0..K all occur;
- the graph mode an async engine runs it in (none, piecewise, full, full_and_piecewise);
- a token budget from K+1 up (small budgets cut prompts into chunks that share steps with decodes and
  verifies, so one step mixes partial prefill chunks, decodes and verify rows), seats (max_num_seqs)
  from 1 up, the KV block size, and sometimes a short max_model_len with a KV pool only a little
  larger than one request needs, which forces preemption and resumption;
- per request: the arrival step, the prompt length with extra weight on 1, K+1, K+2, the chunk
  boundaries (budget - 1, budget, budget + 1, 2 * budget + 1) and max_model_len - 1 (the longest
  prompt allowed), max_tokens (sometimes enough to run into max_model_len), stop tokens (a share of the
  vocabulary large enough that greedy output meets one, often inside an accepted draft window), and
  an abort step (often one or two steps after arrival, when the request's step is in flight).

Prompt contents come from a per-request seed, so shrinking works on a handful of numbers: fewer
requests, shorter prompts, earlier arrivals, fewer tokens, fewer aborts, smaller K.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hypothesis import strategies as st

from conformance.workloads.scenario import PATTERNS, EngineSettings, RequestSpec, Scenario

GRAPH_MODES = ("none", "piecewise", "full", "full_and_piecewise")
SCRIPTED_PATTERNS = tuple(p for p in PATTERNS if p != "hash") + ("hash",)  # shrink toward all-accept


@dataclass(frozen=True)
class Limits:
    """How big generated workloads get (the default fuzz budget keeps them small and fast)."""

    max_requests: int = 6
    max_arrival: int = 10
    max_new_tokens: int = 12
    max_prompt: int = 40  # without a max_model_len; with one, max_model_len - 1
    max_k: int = 3


def _settings(draw, limits: Limits, has_mtp: bool, scripted: bool) -> tuple[EngineSettings, int | None]:
    k = draw(st.integers(0, limits.max_k))
    drafter, pattern = "mtp", "hash"
    if k:
        options = ([("mtp", "hash")] if has_mtp else []) + ([("scripted", p) for p in SCRIPTED_PATTERNS]
                                                           if scripted else [])
        if not options:
            k = 0
        else:
            drafter, pattern = draw(st.sampled_from(options))
    budget = draw(st.one_of(st.sampled_from([64, 256]), st.integers(k + 1, 24)))
    seats = draw(st.one_of(st.just(8), st.integers(1, 6)))
    block_size = draw(st.sampled_from([16, 4, 8]))
    model_len = draw(st.one_of(st.none(), st.integers(max(8, 2 * k + 4), 48)))
    kv_blocks = None
    if model_len is not None and draw(st.booleans()):  # KV pressure: little more than one request's worth
        needed = math.ceil((model_len + 2 * k) / block_size)
        kv_blocks = needed + draw(st.integers(0, 4))
    settings = EngineSettings(num_speculative_tokens=k, drafter=drafter, pattern=pattern, max_num_seqs=seats,
                              max_num_batched_tokens=budget, block_size=block_size, num_kv_blocks=kv_blocks,
                              max_model_len=model_len)
    return settings, model_len


def _prompt_length(draw, k: int, budget: int, max_prompt: int) -> int:
    special = sorted({n for n in (1, k + 1, k + 2, budget - 1, budget, budget + 1, 2 * budget + 1, max_prompt)
                      if 1 <= n <= max_prompt})
    return draw(st.one_of(st.sampled_from(special), st.integers(1, max_prompt)))


@st.composite
def scenarios(draw, vocab_size: int, *, limits: Limits = Limits(), has_mtp: bool = True, scripted: bool = True,
              aborts: bool = True, name: str = "generated") -> Scenario:
    """A whole workload: engine settings, graph mode, and 1..limits.max_requests requests."""
    settings, model_len = _settings(draw, limits, has_mtp, scripted)
    k, budget = settings.k, settings.max_num_batched_tokens
    graph_mode = draw(st.sampled_from(GRAPH_MODES))
    max_prompt = limits.max_prompt if model_len is None else min(limits.max_prompt, model_len - 1)
    n = draw(st.integers(1, limits.max_requests))
    requests = []
    for i in range(n):
        arrival = draw(st.integers(0, limits.max_arrival))
        length = _prompt_length(draw, k, budget, max_prompt)
        max_tokens = draw(st.integers(1, limits.max_new_tokens))
        if model_len is not None and draw(st.booleans()):  # enough to run into max_model_len
            max_tokens = max(max_tokens, model_len - length)
        prompt_seed = draw(st.integers(0, 2**16))
        num_stops = draw(st.one_of(st.just(0), st.integers(1, max(1, vocab_size // 6))))
        abort_after = draw(st.one_of(st.none(), st.integers(0, 3), st.integers(0, limits.max_new_tokens + 4))
                           ) if aborts else None
        rng = random.Random(prompt_seed)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(length))
        stops = tuple(sorted(rng.sample(range(vocab_size), num_stops)))
        requests.append(RequestSpec(f"r{i:02d}", prompt, max_tokens, arrival, True, stops,
                                    None if abort_after is None else arrival + abort_after))
    description = (f"generated: {n} request(s), prompts of {[len(r.prompt) for r in requests]} tokens, arrivals "
                   f"{[r.arrival_step for r in requests]}"
                   + (f", aborts {[r.request_id for r in requests if r.abort_step is not None]}"
                      if any(r.abort_step is not None for r in requests) else ""))
    return Scenario(name, description, "default", settings, tuple(requests), (), graph_mode)
