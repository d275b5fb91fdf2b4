"""The engine interface both engines implement, and the step skeleton they share.

An engine holds an ``EngineCore`` (requests, scheduler, pools, outputs) and adds how a step runs
(``_step``). Everything else the outside calls is here, once: adding, validating and aborting
requests, observers, the step's fault handling (check -> run -> recover -> deliver) and the
"no progress" error, ``has_unfinished``, ``occupancy`` and ``close``. ``refengine.LLM`` talks to an
engine through this interface only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from refengine.core import EngineCore, Occupancy
from refengine.outputs import RequestOutput, StepRecord
from refengine.request import Request
from refengine.sampling_params import SamplingParams


class NoProgressError(RuntimeError):
    """Requests are waiting, yet the scheduler can place none of them and nothing is running."""


class Engine(ABC):
    core: EngineCore

    # ---- what an engine adds ------------------------------------------------------------------
    @abstractmethod
    def _step(self) -> bool:
        """Run one step; False when it neither scheduled work nor finished a request."""

    def _reset(self) -> None:
        """After a fault escaped ``_step``: drop the engine's own in-flight work (none by default)."""

    def _in_flight(self) -> bool:
        """Work submitted but not yet committed through the core."""
        return False

    def _request_slots(self) -> tuple[int, int]:
        """(used, free) rows of persistent per-request state; (0, 0) for an engine that keeps none."""
        return 0, 0

    def close(self) -> None:
        """Release what the engine holds beyond memory (worker threads, streams)."""

    # ---- the interface ------------------------------------------------------------------------
    @property
    def model_config(self):
        return self.core.model_config

    def validate(self, request_id: str, prompt_token_ids, params: SamplingParams) -> list[int]:
        """The prompt's token ids if the request would be accepted; ``EngineError`` naming the problem."""
        return self.core.validate(request_id, prompt_token_ids, params)

    def _inference_mode(self) -> torch.inference_mode:
        """The mode a step runs in. On CPU, inference mode: a step there is bound by the cost of
        dispatching many small ops, and inference mode drops autograd's part of it (nothing an engine
        computes is differentiated). The tensors a step creates are then inference tensors, which only
        code in that mode may write in place: adding and aborting requests write host state only. On CUDA
        nothing changes (CUDA graphs carry the per-op cost there)."""
        return torch.inference_mode(torch.device(self.core.config.device).type == "cpu")

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams) -> Request:
        return self.core.add_request(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.core.abort(request_id)

    def add_observer(self, fn: Callable[[StepRecord], None]) -> None:
        self.core.observers.append(fn)

    def step(self) -> list[RequestOutput]:
        with self._inference_mode():
            core = self.core
            core.check_usable()
            try:
                progressed = self._step()
            except BaseException as fault:
                # The step may have written state slots and KV entries it did not commit: start over.
                core.recover(fault, reset=self._reset)
                raise
            if not progressed and core.scheduler.has_unfinished():
                raise NoProgressError(
                    "scheduler made no progress: the KV pool cannot hold any waiting request")
            return core.deliver()

    def has_unfinished(self) -> bool:
        return self.core.scheduler.has_unfinished() or self._in_flight() or self.core.has_undelivered

    def occupancy(self) -> Occupancy:
        return self.core.occupancy(*self._request_slots())

    def pools_empty(self) -> bool:
        return self.occupancy().empty and not self._in_flight()
