"""What a scenario is: an engine configuration plus requests that arrive at given steps.

Scenarios are defined once (``ScenarioDef``) and materialised per tier and model
(``ScenarioDef.materialize``): prompts come from a generator seeded by the scenario id, so the
same id, tier and vocabulary always give the same token ids, on every machine and every xdist
worker. Nothing here draws unseeded randomness.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

TIERS = ("default", "nightly")
DRAFTERS = ("mtp", "scripted", "ngram", "draft_model", "eagle", "eagle3")
EAGLE_DRAFTERS = ("eagle", "eagle3")  # they read a head folder (EngineSettings.draft_model, optional)
PATTERNS = ("hash", "all-accept", "all-reject", "cycle")  # the scripted patterns the fuzzer draws
# and "gaps" (scripted steps without drafts: scripted-zero-draft-k*), which it does not: a longer list
# would change what every seed draws
SCRIPTED_PATTERNS = (*PATTERNS, "gaps")
MAMBA_CACHE_MODES = ("align", "all")
# Per-request parameters a scenario may give (vLLM's SamplingParams names and meanings, see
# refengine/sampling_params.py); stored on a RequestSpec as sorted (name, value) pairs, lists as tuples.
REQUEST_PARAMS = ("allowed_token_ids", "bad_words", "logit_bias", "min_tokens", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "stop", "include_stop_str_in_output",
                  "logprobs", "prompt_logprobs", "temperature", "top_k", "top_p", "min_p", "seed",
                  "structured_outputs")
# The ones that change no token: a request with only these is unrestricted (a seed only matters with a
# temperature).
OUTPUT_NEUTRAL_PARAMS = frozenset({"logprobs", "prompt_logprobs", "include_stop_str_in_output", "seed"})
# The ones under which a request samples: its spec-decoded output equals its plain output in distribution
# only (the nightly statistical checks), not token for token.
SAMPLING_PARAMS = frozenset({"temperature", "top_k", "top_p", "min_p", "seed"})
# The ones that need the model's tokenizer (text).
TEXT_PARAMS = frozenset({"bad_words", "stop", "structured_outputs"})


def _frozen_structured(value) -> str:
    """``structured_outputs`` (a dict of StructuredOutputsParams fields, or its JSON text) as canonical JSON
    text: hashable, and the same whichever form it came in."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs: not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be an object of StructuredOutputsParams fields, got "  # noqa: TRY004
                         f"{value!r}")
    return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in value.items() if v is not None},
                      sort_keys=True)


def sampling_value(name: str, value):
    """A frozen parameter as SamplingParams takes it (``logit_bias`` a dict, ``structured_outputs`` a dict
    of its fields)."""
    if name == "logit_bias":
        return dict(value)
    if name == "structured_outputs":
        return json.loads(value)
    return value


def freeze_params(params) -> tuple[tuple[str, object], ...]:
    """``{name: value}`` (or pairs) -> sorted ``(name, value)`` pairs, hashable and JSON-ready: lists become
    tuples, ``logit_bias`` sorted ``(id, bias)`` pairs; None values dropped. ValueError names an unknown
    parameter."""
    items = dict(params or {})
    unknown = sorted(set(items) - set(REQUEST_PARAMS))
    if unknown:
        raise ValueError(f"unknown request parameter(s) {unknown}; known: {list(REQUEST_PARAMS)}")
    out = []
    for name, value in sorted(items.items()):
        if value is None:
            continue
        if name == "logit_bias":
            pairs = value.items() if isinstance(value, dict) else value
            value = tuple(sorted((int(t), float(b)) for t, b in pairs))
        elif name == "structured_outputs":
            value = _frozen_structured(value)
        elif isinstance(value, list | tuple):
            value = tuple(value)
        out.append((name, value))
    return tuple(out)


def seed_of(text: str) -> int:
    """A stable 63-bit seed for a string (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class EngineSettings:
    """The engine configuration a scenario runs under (identical for both engines)."""

    num_speculative_tokens: int = 0  # K
    drafter: str = "mtp"  # "mtp" | "scripted" | "ngram" | "draft_model" | "eagle" | "eagle3"
    pattern: str = "hash"  # scripted drafter: how many drafts per verify step are correct
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = (
        None  # ngram drafter: longest n-gram looked up (None: the engine's default)
    )
    # drafter="draft_model": its checkpoint folder, or "cut:<layers>", the run's model cut to those layers
    # (refengine make-draft-model's --layers: a count or indices, "cut:0,3"); drafter "eagle" | "eagle3":
    # the head's folder, or None: a head made for the model under test (conformance.eagle_heads, seeded)
    draft_model: str | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized by the engine
    max_model_len: int | None = None  # None: the engine's default for the model
    enable_prefix_caching: bool = False  # the engine under test only; the oracle always runs without
    mamba_cache_mode: str | None = None  # "align" | "all" with caching (None: "align")

    def __post_init__(self):
        if self.mamba_cache_mode is not None and (not self.enable_prefix_caching
                                                  or self.mamba_cache_mode not in MAMBA_CACHE_MODES):
            raise ValueError(
                f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES} with enable_prefix_caching, "
                f"got {self.mamba_cache_mode!r}"
            )
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.pattern not in SCRIPTED_PATTERNS:
            raise ValueError(f"pattern must be one of {SCRIPTED_PATTERNS}, got {self.pattern!r}")
        if (self.drafter == "draft_model" and self.draft_model is None) or (
                self.draft_model is not None and self.drafter not in ("draft_model", *EAGLE_DRAFTERS)):
            raise ValueError(f"draft_model ({self.draft_model!r}) goes with drafter 'draft_model', which "
                             f"needs one, or 'eagle' / 'eagle3', got drafter {self.drafter!r}")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise ValueError(f"draft_model must be a checkpoint folder or 'cut:<layers>', got "
                             f"{self.draft_model!r}")
        lookup = {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        given = {name: v for name, v in lookup.items() if v is not None}
        if given and self.drafter != "ngram":
            raise ValueError(
                f"{', '.join(given)} apply to drafter 'ngram' only, got drafter {self.drafter!r}"
            )
        for name, v in given.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def plain(self) -> EngineSettings:
        """The same configuration without speculation: the lossless-speculation baseline."""
        return replace(self, num_speculative_tokens=0, drafter="mtp", pattern="hash", prompt_lookup_min=None,
                       prompt_lookup_max=None, draft_model=None, enable_prefix_caching=False,
                       mamba_cache_mode=None)

    def uncached(self) -> EngineSettings:
        """The same configuration without prefix caching: what the oracle runs."""
        return replace(self, enable_prefix_caching=False, mamba_cache_mode=None)

    def describe(self) -> str:
        parts = [f"K={self.k}"]
        if self.k:
            parts.append(
                f"drafter={self.drafter}" + (f"/{self.pattern}" if self.drafter == "scripted" else "")
                + (f"/{self.draft_model}" if self.draft_model is not None else "")
            )
            parts += [
                f"{name}={v}"
                for name, v in (
                    ("prompt_lookup_min", self.prompt_lookup_min),
                    ("prompt_lookup_max", self.prompt_lookup_max),
                )
                if v is not None
            ]
        parts += [
            f"max_num_seqs={self.max_num_seqs}",
            f"max_num_batched_tokens={self.max_num_batched_tokens}",
            f"block_size={self.block_size}",
        ]
        if self.num_kv_blocks is not None:
            parts.append(f"num_kv_blocks={self.num_kv_blocks}")
        if self.max_model_len is not None:
            parts.append(f"max_model_len={self.max_model_len}")
        if self.enable_prefix_caching:
            parts.append(f"prefix-caching/{self.mamba_cache_mode or 'align'}")
        return " ".join(parts)


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...] | str  # token ids, or text for models that ship a tokenizer
    max_tokens: int
    arrival_step: int = 0  # added just before the engine's step with this index
    ignore_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()
    # Aborted just before the engine's step with this index (as for arrivals), unless its output came
    # back earlier. None: never aborted. An abort at the arrival step cancels it before it is scheduled;
    # one step after a step that scheduled it, it is aborted while that step is in flight (async engines).
    abort_step: int | None = None
    # Multi-turn: the id of an earlier request whose prompt and output this request's prompt continues.
    # ``prompt`` is then only what follows them (token ids, possibly none); the harness builds the whole
    # prompt once that request's output came back, and adds this one at ``arrival_step`` or, if the other
    # has not finished by then, right after it has.
    extends: str | None = None
    # The request's own SamplingParams fields (REQUEST_PARAMS): sorted (name, value) pairs (freeze_params).
    params: tuple[tuple[str, object], ...] = ()

    @property
    def sampling(self) -> dict:
        """``params`` as SamplingParams keyword arguments (``logit_bias`` a dict again)."""
        return {name: sampling_value(name, value) for name, value in self.params}

    @property
    def samples(self) -> bool:
        """Whether the request draws its tokens (a temperature above vLLM's greedy threshold)."""
        return self.sampling.get("temperature", 0.0) >= 1e-5

    @property
    def restricted(self) -> bool:
        """Whether a parameter of the request can change its tokens (logprobs alone cannot)."""
        return any(name not in OUTPUT_NEUTRAL_PARAMS for name, _ in self.params)

    def __post_init__(self):
        object.__setattr__(self, "params", freeze_params(self.params))
        if self.abort_step is not None and self.abort_step < self.arrival_step:
            raise ValueError(f"request {self.request_id}: abort_step {self.abort_step} comes before its "
                             f"arrival_step {self.arrival_step}")
        if self.extends is not None and isinstance(self.prompt, str):
            raise ValueError(
                f"request {self.request_id}: a request that extends another takes token ids, not text"
            )


def longest_prompt(requests, request_id: str) -> int:
    """The most tokens request ``request_id``'s prompt can hold: its own, and for a next turn those of the
    turn it extends plus that turn's ``max_tokens``."""
    r = next(r for r in requests if r.request_id == request_id)
    if r.extends is None:
        return len(r.prompt)
    src = next(s for s in requests if s.request_id == r.extends)
    return longest_prompt(requests, src.request_id) + src.max_tokens + len(r.prompt)


def check_extends(requests: tuple[RequestSpec, ...] | list[RequestSpec]) -> None:
    """A request extends an earlier request of the same workload, with a token-id prompt, never aborted
    (its output would depend on when the abort reached the engine)."""
    seen: dict[str, RequestSpec] = {}
    for r in requests:
        if r.extends is not None:
            src = seen.get(r.extends)
            if src is None:
                raise ValueError(
                    f"request {r.request_id} extends {r.extends!r}, which is not an earlier request "
                    "of the workload"
                )
            if src.abort_step is not None:
                raise ValueError(f"request {r.request_id} extends {r.extends}, which the workload aborts")
            if isinstance(src.prompt, str):
                raise ValueError(f"request {r.request_id} extends {r.extends}, whose prompt is text")
        seen[r.request_id] = r


def check_model_decides(scenario_id: str, triggers, model_decides) -> None:
    """Each (trigger, why) of ``model_decides`` names one of the scenario's triggers and gives a reason."""
    for pair in model_decides:
        if len(pair) != 2 or pair[0] not in triggers or not isinstance(pair[1], str) or not pair[1]:
            raise ValueError(f"scenario {scenario_id!r}: model_decides entry {pair!r} must be (one of its "
                             f"triggers {list(triggers)}, the reason a checkpoint may miss it)")


@dataclass(frozen=True)
class Scenario:
    """One materialised workload: everything needed to run it, nothing engine-specific."""

    id: str
    description: str
    tier: str
    settings: EngineSettings
    requests: tuple[RequestSpec, ...]
    triggers: tuple[str, ...] = ()  # what the reference run must exercise (checked by "workload-triggers")
    # The graph mode an async engine named without one ("async") runs this scenario in; None: the
    # engine's own. Generated scenarios draw it; the reference engine always runs without graphs.
    graph_mode: str | None = None
    # (trigger, why): triggers of ``triggers`` the checkpoint decides, so that a model may miss them
    # however the engine behaves (whether n-gram drafts are accepted, which text a grammar lets through).
    # A miss is "not exercised", a warning naming the reason, unless the run asks for every trigger. The
    # others are forced on any checkpoint (scripted drafts, constructed prompts, allowed ids): a miss fails.
    model_decides: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        check_extends(self.requests)
        check_model_decides(self.id, self.triggers, self.model_decides)

    @property
    def k(self) -> int:
        return self.settings.k

    @property
    def caching(self) -> bool:
        return self.settings.enable_prefix_caching

    @property
    def aborted(self) -> tuple[str, ...]:
        """Ids of the requests the workload aborts (if they have not finished by then)."""
        return tuple(r.request_id for r in self.requests if r.abort_step is not None)

    def longest_prompt(self, request_id: str) -> int:
        """The most tokens the request's prompt can hold (with those of the turns it extends)."""
        return longest_prompt(self.requests, request_id)

    def without_aborts(self) -> Scenario:
        """The same workload with every request left to finish: what an aborted request is a prefix of."""
        return replace(self, requests=tuple(replace(r, abort_step=None) for r in self.requests))

    @property
    def has_params(self) -> bool:
        """Whether a request carries a parameter that can change its tokens."""
        return any(r.restricted for r in self.requests)

    def without_params(self) -> Scenario:
        """The same requests without their parameters: what each parameter must change."""
        return replace(self, requests=tuple(replace(r, params=()) for r in self.requests))

    def to_dict(self) -> dict:
        return asdict(self)


class Builder:
    """Handed to a scenario's ``build`` function: seeded prompts and request bookkeeping."""

    def __init__(self, scenario_id: str, tier: str, vocab_size: int, k: int):
        self.tier = tier
        self.vocab_size = vocab_size
        self.k = k
        self.rng = random.Random(seed_of(f"{scenario_id}@{tier}"))
        self.requests: list[RequestSpec] = []

    @property
    def nightly(self) -> bool:
        return self.tier == "nightly"

    def size(self, default: int, nightly: int) -> int:
        return nightly if self.nightly else default

    def prompt(self, length: int, repeat: int = 0) -> tuple[int, ...]:
        """``length`` seeded random ids; with ``repeat``, one random phrase of that many ids over and over
        (n-gram prompt lookup finds its matches there)."""
        if length < 1:
            raise ValueError(f"prompt length must be >= 1, got {length}")
        if repeat < 0:
            raise ValueError(f"repeat must be >= 0, got {repeat}")
        phrase = [self.rng.randrange(self.vocab_size) for _ in range(repeat or length)]
        return tuple(phrase[i % len(phrase)] for i in range(length))

    def add(self, length: int, max_tokens: int, arrival: int = 0, *, repeat: int = 0, **kw) -> RequestSpec:
        """A request with a seeded prompt; ``params={...}``: its SamplingParams fields (REQUEST_PARAMS)."""
        return self.add_ids(self.prompt(length, repeat), max_tokens, arrival, **kw)

    def add_ids(self, prompt: tuple[int, ...], max_tokens: int, arrival: int = 0, **kw) -> RequestSpec:
        """A request with the given prompt (a shared prefix plus its own tokens, say)."""
        spec = RequestSpec(f"r{len(self.requests):02d}", tuple(prompt), max_tokens, arrival, **kw)
        self.requests.append(spec)
        return spec

    def extend(self, source: RequestSpec, length: int, max_tokens: int, arrival: int = 0) -> RequestSpec:
        """The next turn of a chat: ``source``'s prompt and output, then ``length`` new tokens (0: none)."""
        new = self.prompt(length) if length else ()
        return self.add_ids(new, max_tokens, arrival, extends=source.request_id)


@dataclass(frozen=True)
class ScenarioDef:
    id: str
    description: str
    settings: EngineSettings
    build: Callable[[Builder], None]
    triggers: tuple[str, ...] = ()
    tiers: tuple[str, ...] = TIERS
    tags: tuple[str, ...] = field(default=())
    graph_mode: str | None = None  # see Scenario.graph_mode
    model_decides: tuple[tuple[str, str], ...] = ()  # see Scenario.model_decides

    def __post_init__(self):
        check_model_decides(self.id, self.triggers, self.model_decides)

    def materialize(self, tier: str, vocab_size: int) -> Scenario:
        if tier not in self.tiers:
            raise ValueError(f"scenario {self.id!r} is not part of tier {tier!r} (tiers: {self.tiers})")
        b = Builder(self.id, tier, vocab_size, self.settings.k)
        self.build(b)
        if not b.requests:
            raise ValueError(f"scenario {self.id!r} built no requests")
        ids = [r.request_id for r in b.requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"scenario {self.id!r} has duplicate request ids")
        return Scenario(self.id, self.description, tier, self.settings, tuple(b.requests), self.triggers,
                        self.graph_mode, self.model_decides)
