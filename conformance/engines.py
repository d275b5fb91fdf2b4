"""Engines under test: a small protocol, refengine's own engines, and loading by name or import path.

To plug in another engine, write an adapter and name it by import path::

    conformance run --engine mypkg.conformance_adapter:make_adapter
    pytest --pyargs conformance.suite --conformance-engine mypkg.conformance_adapter:make_adapter

``make_adapter`` is an ``EngineAdapter`` (or a zero-argument callable returning one). Its
``start`` builds one engine instance for one workload. The instance must deliver, for every
finished request, an object with the fields of ``refengine.outputs.RequestOutput``, and should call
``spec.observer`` once per step with an object shaped like ``refengine.outputs.StepRecord``
(rows of ``RowRecord``). An engine without step records still gets the token and acceptance
checks; the per-step checks then have nothing to look at.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from conformance import reference_cache
from conformance.features import (  # noqa: F401 (the feature names: defined apart, free of torch)
    DRAFTER_FEATURES,
    FEATURES,
    REQUIRABLE_FEATURES,
    SCENARIO_FEATURES,
    missing_features,
)
from conformance.workloads import EngineSettings
from refengine import SamplingParams
from refengine.config import DEFAULT_ASYNC_GRAPH_MODE, GRAPH_MODES

# refengine's engines that restore cached prefixes (both);
# an adapter without the feature skips those scenarios.
CACHING_ENGINES = ("reference", "async")
BUILTIN_ENGINES = ("reference", "async", *(f"async:{m}" for m in GRAPH_MODES))


@dataclass(frozen=True)
class RunSpec:
    """What ``EngineAdapter.start`` gets: one workload's engine configuration."""

    model: str | None  # checkpoint folder; None: the embedded default model
    settings: EngineSettings
    vocab_size: int
    observer: Callable[[Any], None]  # call with each step's StepRecord
    device: str = "cpu"
    seed: int = 0
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16": the weights and activations, both engines


@dataclass(frozen=True)
class RequestParams:
    """One request's greedy decoding settings, as the harness hands them to an engine instance (an
    adapter turns them into its engine's own sampling parameters; the names are vLLM's)."""

    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # The request's other SamplingParams fields, vLLM's names (conformance.workloads.scenario.REQUEST_PARAMS):
    # allowed_token_ids, bad_words, logit_bias ({id: bias}), min_tokens, the three penalties, stop,
    # include_stop_str_in_output, logprobs, prompt_logprobs. An engine must honour each one it is given.
    sampling: dict = dataclasses.field(default_factory=dict)


class EngineInstance(Protocol):
    def add_request(self, request_id: str, prompt: list[int] | str, params: RequestParams) -> None: ...
    def step(self) -> list[Any]: ...  # RequestOutputs of the requests that finished in this step
    def has_unfinished(self) -> bool: ...
    def pools_empty(self) -> bool | None: ...  # None: cannot tell
    # Optional: occupancy() -> {"kv_blocks_used": n, "kv_blocks_free": n, "state_slots_used": ..., ...}
    # (the fields of refengine.core.Occupancy, any subset); pools-empty then names each pool still in use.


@runtime_checkable
class EngineAdapter(Protocol):
    name: str

    def supports(self, feature: str) -> bool: ...
    def start(self, spec: RunSpec) -> EngineInstance: ...


class UnknownEngine(ValueError):
    pass


class LLMInstance:
    """refengine's LLM seen through the EngineInstance protocol (``llm.engine`` is the engine itself)."""

    def __init__(self, llm):
        self.llm = llm

    def add_request(self, request_id, prompt, params: RequestParams) -> None:
        self.llm.add_request(
            request_id,
            prompt,
            SamplingParams(
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                stop_token_ids=list(params.stop_token_ids),
                **params.sampling,
            ),
        )

    def step(self):
        return self.llm.step()

    def has_unfinished(self) -> bool:
        return self.llm.has_unfinished()

    def abort(self, request_id: str):
        return self.llm.abort(request_id)

    def pools_empty(self) -> bool:
        return self.llm.engine.pools_empty()

    def occupancy(self) -> dict[str, int]:
        return dataclasses.asdict(self.llm.occupancy())


class RefEngineAdapter:
    """refengine's engines: ``LLM(engine="reference")`` or ``LLM(engine="async", graph_mode=...)``.

    The async engine runs with its hazard checker on and its copies delayed: a host buffer touched
    while its asynchronous copy is pending then fails the run deterministically (naming the buffer)
    instead of racing silently, and every pending copy lands as late as it can.
    """

    def __init__(self, engine: str = "reference", graph_mode: str = "none", *, uncached: bool = False):
        """``uncached``: ignore a scenario's prefix-caching settings (the oracle runs without a cache)."""
        if graph_mode not in GRAPH_MODES:
            raise UnknownEngine(f"graph mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        self.engine = engine
        self.graph_mode = graph_mode
        self.uncached = uncached
        self.name = engine if engine == "reference" else f"async:{graph_mode}"

    def supports(self, feature: str) -> bool:
        if feature == "prefix_caching":
            return self.engine in CACHING_ENGINES and not self.uncached
        return feature in FEATURES

    def start(self, spec: RunSpec) -> EngineInstance:
        return LLMInstance(self.build(spec))

    def build(self, spec: RunSpec):
        from refengine import LLM
        from refengine.drafters import ScriptedDrafter

        s = spec.settings if not self.uncached else spec.settings.uncached()
        drafter, lookup = "mtp", {}
        if s.drafter == "draft_model":
            drafter, lookup = "draft_model", {"draft_model": draft_model_path(spec.model, s.draft_model)}
        elif s.drafter == "scripted" and s.k:
            drafter = ScriptedDrafter(s.k, spec.vocab_size, s.pattern)
        elif s.drafter == "ngram":
            drafter, lookup = "ngram", {"prompt_lookup_min": s.prompt_lookup_min,
                                        "prompt_lookup_max": s.prompt_lookup_max}
        elif s.drafter in ("eagle", "eagle3") and s.k:
            from conformance.eagle_heads import head_for

            drafter, lookup = s.drafter, {"draft_model": s.draft_model or head_for(spec.model, s.drafter)}
        checked = {"delay_copies": True, "hazard_check": True} if self.engine == "async" else {}
        llm = LLM(
            model=spec.model,
            engine=self.engine,
            graph_mode=self.graph_mode,
            num_speculative_tokens=s.k,
            drafter=drafter,
            **lookup,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            block_size=s.block_size,
            num_kv_blocks=s.num_kv_blocks,
            max_model_len=s.max_model_len,
            device=spec.device,
            dtype=spec.dtype,
            seed=spec.seed,
            observer=spec.observer,
            enable_prefix_caching=s.enable_prefix_caching,
            mamba_cache_mode=s.mamba_cache_mode,
            **checked,
        )
        reference_cache.share_truth(self, llm, spec)  # this repository's test session only
        return llm


def draft_model_path(model: str | None, draft_model: str) -> str:
    """A scenario's draft model as a folder: ``cut:<layers>`` cuts the run's model (None: the embedded
    default model) to those layers, once (``refengine.tools.draft_model.cut_draft_model``)."""
    from refengine.tools.draft_model import CUT_PREFIX, cut_draft_model

    if not draft_model.startswith(CUT_PREFIX):
        return draft_model
    from refengine.llm import default_model_path
    from refengine.model.loader import resolve_model_path

    src = default_model_path() if model is None else resolve_model_path(model)
    return cut_draft_model(src, draft_model[len(CUT_PREFIX):])


def reference_adapter() -> RefEngineAdapter:
    """The side every engine is compared against: the reference engine, no graphs."""
    return RefEngineAdapter("reference", "none", uncached=True)


def cached_reference_adapter() -> RefEngineAdapter:
    """The reference engine with a scenario's prefix caching: what must equal the oracle (it without)."""
    return RefEngineAdapter("reference", "none")


def describe_engine(name: str) -> str:
    """An engine selection in words, with the graph mode plain ``async`` runs in (as every command says)."""
    if name == "async":
        return f"async (graph mode {DEFAULT_ASYNC_GRAPH_MODE}, unless a scenario names its own)"
    return name


def load_engine(name: str) -> EngineAdapter:
    """``reference``, ``async`` (graph mode DEFAULT_ASYNC_GRAPH_MODE), ``async:<graph mode>``, or
    ``pkg.module:attr``.

    (``mutant:<id>`` names are resolved one level up, by ``conformance.session``.)"""
    if name == "reference":
        return RefEngineAdapter("reference", "none")
    if name == "async":
        return RefEngineAdapter("async", DEFAULT_ASYNC_GRAPH_MODE)
    if name.startswith("async:"):
        return RefEngineAdapter("async", name.partition(":")[2])
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise UnknownEngine(
            f"unknown engine {name!r}: use one of {', '.join(BUILTIN_ENGINES)} or an import path "
            "'package.module:factory'"
        )
    try:
        obj = getattr(_import(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownEngine(f"cannot load engine {name!r}: {e}") from e
    except Exception as e:  # the user's module broke while importing: one line, not a traceback
        raise UnknownEngine(
            f"cannot load engine {name!r}: importing {module_name} raised {_one_line(e)}"
        ) from e
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "start")):
        try:
            obj = obj()
        except Exception as e:  # the factory is the user's code: one line, not a traceback
            raise UnknownEngine(f"cannot load engine {name!r}: {attr}() raised {_one_line(e)}") from e
    if not isinstance(obj, EngineAdapter):
        raise UnknownEngine(f"engine {name!r} gave {type(obj).__name__}, which lacks name/supports()/start() "
                            "(see conformance.engines.EngineAdapter)")
    return obj


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a user's exception message may span several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")


def _import(module_name: str):
    """Import a module, also from the current directory (as ``python -m`` would) for local adapters."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != module_name.split(".")[0] or cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(module_name)
