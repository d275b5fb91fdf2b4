"""The reference engine: a step is schedule -> execute -> commit -> propose drafts.

Synchronous and readable: the runner rebuilds every step's inputs from request state, so what
this engine does defines correct behaviour for the async engine.
"""

from __future__ import annotations

from refengine.cache import ModelCaches
from refengine.config import EngineConfig, torch_dtype
from refengine.core import EngineCore, num_rejected
from refengine.drafters import make_drafter
from refengine.engine import Engine
from refengine.outputs import StepRecord
from refengine.reference.runner import ReferenceRunner, StepResult
from refengine.request import Request
from refengine.scheduler import SchedulerOutput


class ReferenceEngine(Engine):
    def __init__(self, config: EngineConfig, model, model_config, tokenizer=None):
        k = config.speculative.num_speculative_tokens
        self.config = config
        self.model = model
        self.core = EngineCore(config, model_config, tokenizer)
        self.drafter = make_drafter(config.speculative, model_config.vocab_size, config.scheduler.max_model_len)
        if self.drafter is not None:
            self.drafter.check_model(model)
        self.caches = ModelCaches(model_config, config.num_kv_blocks, config.cache.block_size,
                                  config.num_state_slots, k, torch_dtype(config.dtype), config.device,
                                  drafter_kv=self.drafter is not None and self.drafter.uses_kv_cache)
        self.runner = ReferenceRunner(model, self.caches, block_size=config.cache.block_size,
                                      num_speculative_tokens=k, drafter=self.drafter,
                                      recurrent_prefill_chunked=config.recurrent_prefill_chunked,
                                      device=config.device)
        self._steps = 0

    def _step(self) -> bool:
        core = self.core
        sched = core.scheduler.schedule()
        if not sched.rows:
            return False
        result = self.runner.execute(sched, record_digests=bool(core.observers))
        core.finished(self._commit(sched, result))
        self.runner.propose(sched, result)
        core.record(StepRecord(self._steps, result.records, list(sched.preempted), "none", len(sched.rows),
                               result.gdn_shapes, list(sched.resumed)))
        self._steps += 1
        return True

    def _commit(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        finished = []
        for row, valid, rec in zip(sched.rows, result.valid_tokens, result.records):
            req = row.request
            if valid is None:  # a prompt chunk that does not reach the end: nothing sampled
                req.num_computed_tokens += row.num_tokens
                continue
            req.num_computed_tokens += row.num_tokens - num_rejected(row, valid)
            req.num_valid = len(valid)
            req.draft_token_ids = []
            if self.core.commit(req, valid, num_drafts=len(row.draft_token_ids) if rec.kind == "decode" else None):
                finished.append(req)
        return finished
