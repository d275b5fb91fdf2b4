"""The reference engine: a step is schedule -> restore -> execute -> commit -> propose -> publish.

Synchronous and readable: the runner rebuilds every step's inputs from request state, so what
this engine does defines correct behaviour for the async engine.

Prefix caching, with plain loops on the host: a request admitted on a hit gets its checkpoint
copied into s_0 before the step runs; after the step is committed and the drafts proposed (the MTP
drafter writes its KV at the committed positions then), every block boundary the step's committed
tokens reached is published, with the state the step left there. The step holds a reference on its
rows' blocks until then, so a request that finished in this step publishes too.
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
        self.drafter = make_drafter(
            config.speculative, model_config.vocab_size, config.scheduler.max_model_len
        )
        if self.drafter is not None:
            self.drafter.check_model(model)
        self.drafter_kv = self.drafter is not None and self.drafter.uses_kv_cache
        self.core = EngineCore(config, model_config, tokenizer, drafter_kv_cache=self.drafter_kv)
        self.caches = ModelCaches(model_config, config.num_kv_blocks, config.cache.block_size,
                                  config.num_state_slots + config.num_state_checkpoints, k,
                                  torch_dtype(config.dtype), config.device, drafter_kv=self.drafter_kv)
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
        for row in sched.rows:  # a hit's state: the checkpoint goes into s_0 before the step reads it
            req = row.request
            if req.restore_slot is not None:
                self.caches.restore_checkpoint(req.restore_slot, req.state_slots[0])
                req.restore_slot = None
        result = self.runner.execute(sched, record_digests=bool(core.observers))
        held = [(list(r.request.block_ids), list(r.request.state_slots)) for r in sched.rows]
        pool = core.scheduler.kv_pool
        for blocks, _ in held:
            pool.take(blocks)
        try:
            core.finished(self._commit(sched, result))
            self.runner.propose(sched, result)
            self._publish(sched, result, held)
        finally:  # a fault publishes nothing more; recovery recomputes from the committed tokens
            for blocks, _ in held:
                pool.free(blocks)
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
            if self.core.commit(
                req, valid, num_drafts=len(row.draft_token_ids) if rec.kind == "decode" else None
            ):
                finished.append(req)
        return finished

    def _publish(self, sched: SchedulerOutput, result: StepResult, held: list) -> None:
        """Publish the block boundaries each row's committed tokens reached, and copy their states."""
        prefix = self.core.scheduler.prefix
        if prefix is None:
            return
        for row, rec, nc, (blocks, slots) in zip(
            sched.rows, result.records, result.num_computed_before, held
        ):
            req = row.request
            limit = req.num_computed_tokens  # committed, so every block it closes is final
            if (
                req.is_finished and self.drafter_kv
            ):  # the drafter wrote no KV at a finished request's last positions
                limit = nc
            for p in prefix.publish(req, blocks, nc, limit, row.num_tokens, rec.kind == "prefill"):
                self.caches.save_checkpoint(slots, p.column, p.slot)
