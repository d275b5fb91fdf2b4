"""The reference engine: a step is schedule -> execute -> commit -> propose drafts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from refengine.cache import ModelCaches
from refengine.config import CacheConfig, EngineConfig
from refengine.drafter import ScriptedDrafter
from refengine.outputs import RequestOutput, StepRecord
from refengine.reference_runner import ReferenceRunner, StepResult
from refengine.request import Request
from refengine.sampling_params import SamplingParams
from refengine.scheduler import Scheduler, SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineError(ValueError):
    """Bad input to the engine (the request is refused; everything else keeps running)."""


class LLMEngine:
    def __init__(self, config: EngineConfig, model, model_config, tokenizer=None):
        self.config = config
        self.model = model
        self.model_config = model_config
        self.tokenizer = tokenizer
        k = config.speculative.num_speculative_tokens
        self.drafter = _make_drafter(config, model, model_config)
        self.scheduler = Scheduler(config)
        self.caches = ModelCaches(model_config, config.num_kv_blocks, config.cache.block_size,
                                  config.num_state_slots, k, DTYPES[config.dtype], config.device,
                                  with_mtp=self.drafter == "mtp")
        self.runner = self._make_runner()
        self.requests: dict[str, Request] = {}  # live (unfinished) requests
        self.observers: list[Callable[[StepRecord], None]] = []
        self._arrivals = 0
        self._steps = 0
        self._truth_engine: LLMEngine | None = None

    def _make_runner(self):
        c = self.config
        return ReferenceRunner(self.model, self.caches, block_size=c.cache.block_size,
                               num_spec_tokens=c.speculative.num_speculative_tokens, drafter=self.drafter,
                               gdn_prefill_chunked=c.gdn_prefill_chunked, device=c.device)

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams) -> Request:
        return Request(request_id, ids, params, self._arrivals)

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids, params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise EngineError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use by a live request")
        ids = list(prompt_token_ids)
        if not ids:
            raise EngineError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_config.vocab_size
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise EngineError(f"request {request_id!r}: prompt token {t!r} at index {pos} is not an id in "
                                  f"[0, {vocab})")
        max_len = self.config.scheduler.max_model_len
        if len(ids) >= max_len:
            raise EngineError(f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room under "
                              f"max_model_len={max_len}")
        return ids

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams) -> None:
        ids = self.validate(request_id, prompt_token_ids, params)
        req = self._new_request(request_id, ids, params)
        self._arrivals += 1
        if isinstance(self.drafter, ScriptedDrafter):
            self.drafter.truth[request_id] = self._plain_greedy(ids, params)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput:
        req = self.requests.get(request_id)
        if req is None:
            raise EngineError(f"abort: no live request with id {request_id!r}")
        self.scheduler.finish(req, "abort")
        del self.requests[request_id]
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.rows:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting request")
            return []
        result = self.runner.execute(sched, record_digests=bool(self.observers))
        finished = self._commit(sched, result)
        self.runner.propose(sched, result)
        self._observe(sched, result)
        return [self._output(r) for r in finished]

    def _commit(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        finished = []
        for row, valid, rec in zip(sched.rows, result.valid_tokens, result.records):
            req = row.request
            if valid is None:  # a prompt chunk that does not reach the end: nothing sampled
                req.num_computed_tokens += row.num_tokens
                continue
            drafted, kept = len(row.draft_token_ids), len(valid)
            req.num_computed_tokens += row.num_tokens - (drafted - (kept - 1))
            req.num_valid_prev = kept
            req.draft_token_ids = []
            if rec.kind == "decode" and self.config.speculative.enabled:
                req.num_verify_steps += 1
                req.num_draft_tokens += drafted
                req.num_accepted_tokens += kept - 1
                req.acceptance.append((drafted, kept - 1))
            if self._append(req, valid):
                finished.append(req)
        return finished

    def _append(self, req: Request, tokens: list[int]) -> bool:
        """Commit ``tokens`` to ``req`` one at a time until a stop condition; True if it finished."""
        for token in tokens:
            req.output_token_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.scheduler.finish(req, reason)
                del self.requests[req.request_id]
                return True
        return False

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            return "stop"
        confirmed = len(req.prompt_token_ids) + len(req.output_token_ids)
        if len(req.output_token_ids) >= p.max_tokens or confirmed >= self.config.scheduler.max_model_len:
            return "length"
        return None

    def _observe(self, sched: SchedulerOutput, result: StepResult) -> None:
        record = StepRecord(self._steps, result.records, list(sched.preempted), "none", len(sched.rows),
                            result.gdn_shapes)
        self._steps += 1
        for fn in self.observers:
            fn(record)

    def _output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else None
        return RequestOutput(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids),
                             req.finish_reason, req.num_draft_tokens, req.num_accepted_tokens,
                             list(req.acceptance), req.num_preemptions, text)

    # ---- scripted drafting --------------------------------------------------------------------
    def _plain_greedy(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """The K=0 output for one prompt, from a private engine on the same weights."""
        if self._truth_engine is None:
            cfg = EngineConfig(model=self.config.model, engine="reference", dtype=self.config.dtype,
                               device=self.config.device, seed=self.config.seed,
                               gdn_prefill_chunked=self.config.gdn_prefill_chunked,
                               scheduler=self.config.scheduler,
                               cache=CacheConfig(block_size=self.config.cache.block_size))
            self._truth_engine = LLMEngine(cfg, self.model, self.model_config)
        eng = self._truth_engine
        # K tokens past max_tokens, so drafts made near the end are scripted too.
        k = self.config.speculative.num_speculative_tokens
        eng.add_request("truth", prompt, SamplingParams(params.max_tokens + k, params.ignore_eos, params.stop_token_ids))
        out = []
        while eng.has_unfinished():
            out += eng.step()
        return out[0].token_ids

    def pools_empty(self) -> bool:
        return self.scheduler.kv_pool.num_used == 0 and self.scheduler.slot_pool.num_used == 0


def _make_drafter(config: EngineConfig, model, model_config):
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.drafter == "mtp":
        if getattr(model, "mtp", None) is None:
            raise ValueError("drafter='mtp' needs a checkpoint with mtp.* weights; this one has none "
                             "(use num_speculative_tokens=0 or drafter='scripted')")
        return "mtp"
    if spec.drafter == "scripted":
        return ScriptedDrafter(spec.num_speculative_tokens, model_config.vocab_size)
    if isinstance(spec.drafter, ScriptedDrafter):
        return spec.drafter
    raise ValueError(f"unsupported drafter {spec.drafter!r}")
