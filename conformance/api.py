"""The engine boundary: what an adapter for an engine under test gets, and what it must give back.

Free of torch and refengine (the pytest plugin and the outside-engine adapters import it). To plug in
another engine, write an adapter and name it by import path::

    conformance run --engine mypkg.conformance_adapter:make_adapter
    pytest --pyargs conformance.suite --conformance-engine mypkg.conformance_adapter:make_adapter

``make_adapter`` is an ``EngineAdapter`` (or a zero-argument callable returning one). Its ``start``
builds one engine instance for one workload (``RunSpec``). The instance delivers, for every finished
request, an object with the fields of ``refengine.outputs.RequestOutput``; fields it cannot fill are left
out (``acceptance``, ``num_cached_tokens``, ``logprobs`` ...): the checks that read them are then ``n/a``
with the field named, never passed. It may call ``spec.observer`` once per step with an object shaped
like ``refengine.outputs.StepRecord`` (rows of ``RowRecord``); without step records the per-step checks
are ``n/a``. ``conformance/adapters/`` holds the built-in adapters, one module per engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from conformance.features import (  # noqa: F401 (the feature names, re-exported)
    DRAFTER_FEATURES,
    FEATURES,
    REQUIRABLE_FEATURES,
    SCENARIO_FEATURES,
    missing_features,
)
from conformance.workloads.scenario import EngineSettings


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
    # Tensor-parallel ranks of the engine under test (vLLM's spelling); the reference always runs on one.
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class RequestParams:
    """One request's decoding settings, as the harness hands them to an engine instance (an adapter turns
    them into its engine's own sampling parameters; the names are vLLM's)."""

    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # The request's other SamplingParams fields, vLLM's names (conformance.workloads.scenario.REQUEST_PARAMS):
    # allowed_token_ids, bad_words, logit_bias ({id: bias}), min_tokens, the three penalties, stop,
    # include_stop_str_in_output, logprobs, prompt_logprobs, structured outputs, temperature/top-k/top-p/
    # min-p and seed. An engine must honour each one it is given.
    sampling: dict = dataclasses.field(default_factory=dict)


class EngineInstance(Protocol):
    """One engine serving one workload. Required: the four methods below."""

    def add_request(self, request_id: str, prompt: list[int] | str, params: RequestParams) -> None: ...
    def step(self) -> list[Any]: ...  # RequestOutputs of the requests that finished in this step
    def has_unfinished(self) -> bool: ...
    def pools_empty(self) -> bool | None: ...  # None: cannot tell


class Introspection(Protocol):
    """What an instance may also offer; the harness looks each up on the instance and does without it.

    - ``abort(request_id) -> RequestOutput | None``: scenarios that abort requests need it;
    - ``occupancy() -> {"kv_blocks_used": n, "kv_blocks_free": n, "state_slots_used": ..., ...}`` (the
      fields of refengine.core.Occupancy, any subset): pools-empty then names each pool still in use;
    - ``request_slots_in_use() -> int``: state slots held by requests (the slot invariants read it);
    - ``close()``: release the engine (threads, processes, memory) once the workload ended.
    """

    def abort(self, request_id: str) -> Any: ...
    def occupancy(self) -> dict[str, int]: ...
    def request_slots_in_use(self) -> int: ...
    def close(self) -> None: ...


@runtime_checkable
class EngineAdapter(Protocol):
    name: str

    def supports(self, feature: str) -> bool: ...
    def start(self, spec: RunSpec) -> EngineInstance: ...


class UnknownEngine(ValueError):
    pass


class EngineRefused(ValueError):
    """An engine cannot run the given checkpoint or settings at all (one line: the constraint and the engine).
    Raised before any work, so a run stops there instead of reporting every scenario as broken."""
