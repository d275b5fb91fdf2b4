"""The reference engine: a step is schedule -> execute -> commit -> propose drafts.

Synchronous and readable: the runner rebuilds every step's inputs from request state, so what
this engine does defines correct behaviour for the async engine.
"""

from __future__ import annotations

from refengine.cache import ModelCaches
from refengine.config import EngineConfig, torch_dtype
from refengine.core import EngineCore, Occupancy
from refengine.drafters import make_drafter
from refengine.outputs import RequestOutput, StepRecord
from refengine.reference.runner import ReferenceRunner, StepResult
from refengine.request import Request
from refengine.scheduler import SchedulerOutput


class ReferenceEngine:
    def __init__(self, config: EngineConfig, model, model_config, tokenizer=None):
        self.config = config
        self.model = model
        self.core = EngineCore(config, model_config, tokenizer)
        self.drafter = make_drafter(config.speculative, model_config.vocab_size)
        if self.drafter is not None:
            self.drafter.check_model(model)
        self.caches = ModelCaches(model_config, config.num_kv_blocks, config.cache.block_size,
                                  config.num_state_slots, config.speculative.num_speculative_tokens,
                                  torch_dtype(config.dtype), config.device,
                                  drafter_kv=self.drafter is not None and self.drafter.uses_kv_cache)
        self.runner = ReferenceRunner(model, self.caches, block_size=config.cache.block_size,
                                      num_spec_tokens=config.speculative.num_speculative_tokens,
                                      drafter=self.drafter, recurrent_prefill_chunked=config.recurrent_prefill_chunked,
                                      device=config.device)
        self._steps = 0

    def has_unfinished(self) -> bool:
        return self.core.scheduler.has_unfinished() or self.core.has_undelivered

    def step(self) -> list[RequestOutput]:
        core = self.core
        core.check_usable()
        sched = core.scheduler.schedule()
        if not sched.rows:
            if core.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting request")
            return core.deliver()
        try:
            result = self.runner.execute(sched, record_digests=bool(core.observers))
            core.finished(self._commit(sched, result))
            self.runner.propose(sched, result)
        except BaseException as fault:
            # The step may have written state slots and KV entries it did not commit: start over.
            core.recover(fault)
            raise
        core.record(StepRecord(self._steps, result.records, list(sched.preempted), "none", len(sched.rows),
                               result.gdn_shapes, list(sched.resumed)))
        self._steps += 1
        return core.deliver()

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
                self.core.count_acceptance(req, drafted, kept - 1)
            if self.core.append(req, valid):
                finished.append(req)
        return finished

    def occupancy(self) -> Occupancy:
        return self.core.occupancy()

    def pools_empty(self) -> bool:
        return self.occupancy().empty

    def close(self) -> None:
        pass
