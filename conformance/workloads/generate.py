"""Generated workloads: a hypothesis strategy that draws whole scenarios.

``scenarios(vocab_size, ...)`` draws an engine configuration and a list of requests, and builds the
same ``Scenario`` the hand-written corpus materialises, so everything that runs a corpus scenario
runs a generated one. What is drawn, and why:

- K in 0..3 and the drafter: the model's MTP head, or the scripted drafter with an acceptance pattern
  (ragged, all-accept, all-reject, cycle), so accepted counts 0..K all occur; drawn last (with
  ``drafters``), a drafter that is a model of its own instead: an EAGLE-3 or EAGLE-1 head made for the
  model, or the model cut to its first layer or whole as a draft model;
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

With ``caching`` (an engine under test that supports prefix caching), also: prefix caching on or off
and its mode (align, all); up to two shared prefixes (lengths weighted to block multiples -1, 0, +1)
that requests start with; and requests that extend an earlier one (its prompt and reply, then a few
tokens: a chat's next turn). A caching workload without KV pressure gets a pool that holds everything
it can allocate, so the cached-token counts of the requests that arrive after others finished are
pinned to their ceiling. Last (``_geometry``): the n-gram drafter in place of the drafted one (with
``ngram``), and with caching a block size of 2..K (several boundaries in one verify step) and a prompt
that holds another's first block one block in (equal blocks at different offsets).

With ``params`` (drawn after all of that, so earlier draws keep their meaning): each request may carry
SamplingParams fields that need no tokenizer, in vLLM's names: allowed_token_ids (a few ids up to a
quarter of the vocabulary), logit_bias, min_tokens (up to max_tokens), the three penalties, logprobs
and prompt_logprobs; a generated request's parameters may change nothing (``conformance fuzz`` does not
count that as a failure: it is the workload's property, not the engine's).

Prompt contents come from a per-request seed, so shrinking works on a handful of numbers: fewer
requests, shorter prompts, earlier arrivals, fewer tokens, fewer aborts, smaller K, no sharing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from conformance.workloads.scenario import (
    MAMBA_CACHE_MODES,
    PATTERNS,
    EngineSettings,
    RequestSpec,
    Scenario,
    longest_prompt,
)

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
        needed = math.ceil((model_len + 2 * k + 1) / block_size)  # kv_positions_per_request: up to mml + 2K
        kv_blocks = needed + draw(st.integers(0, 4))
    settings = EngineSettings(num_speculative_tokens=k, drafter=drafter, pattern=pattern, max_num_seqs=seats,
                              max_num_batched_tokens=budget, block_size=block_size, num_kv_blocks=kv_blocks,
                              max_model_len=model_len)
    return settings, model_len


def _prompt_length(draw, k: int, budget: int, max_prompt: int) -> int:
    special = sorted({n for n in (1, k + 1, k + 2, budget - 1, budget, budget + 1, 2 * budget + 1, max_prompt)
                      if 1 <= n <= max_prompt})
    return draw(st.one_of(st.sampled_from(special), st.integers(1, max_prompt)))


def _shared_prefixes(draw, vocab_size: int, block_size: int, max_prompt: int) -> list[tuple[int, ...]]:
    """0..2 prefixes for requests to share, of lengths weighted to block multiples -1, 0 and +1."""
    edges = sorted(
        {n * block_size + d for n in (1, 2, 3) for d in (-1, 0, 1) if 1 <= n * block_size + d <= max_prompt}
    )
    prefixes = []
    for _ in range(draw(st.integers(0, 2))):
        length = draw(st.one_of(st.sampled_from(edges), st.integers(1, max_prompt))) if edges else 1
        rng = random.Random(draw(st.integers(0, 2**16)))
        prefixes.append(tuple(rng.randrange(vocab_size) for _ in range(length)))
    return prefixes


def _cached(draw, settings: EngineSettings) -> EngineSettings:
    """Prefix caching off, or on in one of the modes."""
    mode = draw(st.sampled_from((None, *MAMBA_CACHE_MODES)))
    return settings if mode is None else replace(settings, enable_prefix_caching=True, mamba_cache_mode=mode)


def _extends(draw, requests: list[RequestSpec], max_prompt: int) -> tuple[str | None, int]:
    """An earlier request to continue (not aborted, its next turn at most ``max_prompt`` tokens long), and how
    many new tokens follow its reply; (None, 0) for a request of its own."""
    if not requests:
        return None, 0
    pick = draw(st.one_of(st.none(), st.integers(0, len(requests) - 1)))
    if pick is None or requests[pick].abort_step is not None:
        return None, 0
    src, new = requests[pick], draw(st.integers(0, 4))
    fits = longest_prompt(requests, src.request_id) + src.max_tokens + new <= max_prompt
    return (src.request_id, new) if fits else (None, 0)


def roomy_pool(scenario: Scenario) -> int:
    """KV blocks holding everything the workload can allocate, and one request of the model's length."""
    s, model_len = scenario.settings, scenario.settings.max_model_len or 1024
    needed = sum(
        math.ceil((scenario.longest_prompt(r.request_id) + r.max_tokens + 2 * s.k + 1) / s.block_size) + 1
        for r in scenario.requests
    )
    return max(needed, math.ceil((model_len + 2 * s.k + 1) / s.block_size))


@st.composite
def scenarios(
    draw,
    vocab_size: int,
    *,
    limits: Limits = Limits(),
    has_mtp: bool = True,
    scripted: bool = True,
    aborts: bool = True,
    caching: bool = False,
    ngram: bool = False,
    params: bool = False,
    drafters: tuple[str, ...] = (),
    name: str = "generated",
) -> Scenario:
    """A whole workload: engine settings, graph mode, and 1..limits.max_requests requests (``caching``: prefix
    caching, shared prefixes and multi-turn requests drawn too; ``ngram``: the n-gram drafter too;
    ``drafters``: drafters that are models of their own the engine runs, "eagle3", "eagle", "draft_model")."""
    settings, model_len = _settings(draw, limits, has_mtp, scripted)
    k, budget = settings.k, settings.max_num_batched_tokens
    graph_mode = draw(st.sampled_from(GRAPH_MODES))
    max_prompt = limits.max_prompt if model_len is None else min(limits.max_prompt, model_len - 1)
    prefixes = _shared_prefixes(draw, vocab_size, settings.block_size, max_prompt) if caching else []
    if caching:
        settings = _cached(draw, settings)
    n = draw(st.integers(1, limits.max_requests))
    requests: list[RequestSpec] = []
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
        extends, new = None, 0
        if caching:
            shared = draw(st.one_of(st.none(), st.integers(0, len(prefixes) - 1))) if prefixes else None
            if shared is not None:
                prompt = (prefixes[shared] + prompt)[:max_prompt]
            extends, new = _extends(draw, requests, max_prompt)
        requests.append(
            RequestSpec(
                f"r{i:02d}",
                prompt[:new] if extends else prompt,
                max_tokens,
                arrival,
                True,
                stops,
                None if abort_after is None else arrival + abort_after,
                extends,
            )
        )
    settings, requests = _geometry(draw, settings, requests, max_prompt, caching=caching, ngram=ngram)
    if params and draw(st.booleans()):  # one choice first, so shrinking drops every parameter at once
        requests = [replace(r, params=_params(draw, vocab_size, r.max_tokens)) for r in requests]
    if drafters and settings.k and draw(st.booleans()):  # drawn last: earlier draws keep their meaning
        settings = _model_drafter(draw, settings, drafters)
    return _finish(Scenario(name, _describe(requests, prefixes), "default", settings, tuple(requests), (),
                            graph_mode))


def _geometry(draw, settings: EngineSettings, requests: list[RequestSpec], max_prompt: int, *, caching: bool,
              ngram: bool) -> tuple[EngineSettings, list[RequestSpec]]:
    """Drawn last, so the draws before it (and the workloads of earlier seeds) keep their meaning: the
    n-gram drafter instead of the drafted one; with caching, blocks no longer than K (one verify step passes
    several boundaries) and one prompt holding another's first block one block in (equal blocks at
    different offsets)."""
    if ngram and settings.k and draw(st.booleans()):
        settings = replace(settings, drafter="ngram", pattern="hash", prompt_lookup_min=1,
                           prompt_lookup_max=3)
    if not (caching and settings.enable_prefix_caching):
        return settings, requests
    if settings.k >= 2 and settings.num_kv_blocks is None and draw(st.booleans()):
        settings = replace(settings, block_size=draw(st.integers(2, settings.k)))
    bs = settings.block_size
    own = [i for i, r in enumerate(requests) if r.extends is None and len(r.prompt) >= bs]
    if len(own) >= 2 and draw(st.booleans()):
        i, j = draw(st.sampled_from([(i, j) for i in own for j in own if i != j]))
        moved = (requests[j].prompt[:bs] + requests[i].prompt)[:max_prompt]
        requests = [replace(r, prompt=moved) if n == j else r for n, r in enumerate(requests)]
    return settings, requests


def _model_drafter(draw, settings: EngineSettings, drafters: tuple[str, ...]) -> EngineSettings:
    """A drafter that is a model of its own in place of the drafted one: an EAGLE head made for the model
    under test (seeded), or the model itself as its draft model, cut to its first layer (drafts often
    wrong; a recurrent first layer's state rolled back by the drafter) or whole (every draft right)."""
    drafter = draw(st.sampled_from(drafters))
    draft_model = draw(st.sampled_from(["cut:1", "cut:all"])) if drafter == "draft_model" else None
    return replace(settings, drafter=drafter, pattern="hash", prompt_lookup_min=None, prompt_lookup_max=None,
                   draft_model=draft_model)


def _params(draw, vocab_size: int, max_tokens: int) -> dict:
    """One request's SamplingParams fields (none of them needs a tokenizer); often none at all."""
    if not draw(st.booleans()):
        return {}
    out: dict = {}
    tenth = st.integers(-20, 20).map(lambda x: x / 10)
    if draw(st.booleans()):
        out["allowed_token_ids"] = sorted(draw(st.sets(st.integers(0, vocab_size - 1), min_size=1,
                                                       max_size=max(1, vocab_size // 4))))
    if draw(st.booleans()):
        out["logit_bias"] = draw(st.dictionaries(st.integers(0, vocab_size - 1), tenth.map(lambda b: b * 5),
                                                 min_size=1, max_size=3))
    if draw(st.booleans()):
        out["min_tokens"] = draw(st.integers(1, max_tokens))
    for name in ("presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            out[name] = draw(tenth)
    if draw(st.booleans()):
        out["repetition_penalty"] = draw(st.integers(5, 20).map(lambda x: x / 10))
    if draw(st.booleans()):
        out["logprobs"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        out["prompt_logprobs"] = draw(st.integers(0, 2))
    return out


def _finish(scenario: Scenario) -> Scenario:
    """A caching workload without KV pressure gets a pool that evicts nothing (its counts are then pinned)."""
    s = scenario.settings
    if not s.enable_prefix_caching or s.num_kv_blocks is not None:
        return scenario
    return replace(scenario, settings=replace(s, num_kv_blocks=roomy_pool(scenario)))


def _describe(requests: list[RequestSpec], prefixes: list[tuple[int, ...]]) -> str:
    text = (
        f"generated: {len(requests)} request(s), prompts of {[len(r.prompt) for r in requests]} tokens, "
        f"arrivals {[r.arrival_step for r in requests]}"
    )
    if any(r.params for r in requests):
        text += f", parameters on {[r.request_id for r in requests if r.params]}"
    if any(r.abort_step is not None for r in requests):
        text += f", aborts {[r.request_id for r in requests if r.abort_step is not None]}"
    if prefixes:
        text += f", shared prefixes of {[len(p) for p in prefixes]} tokens"
    turns = [f"{r.request_id}<-{r.extends}" for r in requests if r.extends is not None]
    return text + (f", next turns {turns}" if turns else "")
