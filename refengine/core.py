"""The engine core both engines are built on, by composition.

It owns what does not depend on how a step runs: the live requests, validation of new ones,
add, abort and finish, the scheduler and its pools, stop rules, the public outputs, observers, and
pool occupancy. An engine (reference or async) holds one ``EngineCore`` and adds its own step:
schedule -> run -> postprocess (``refengine.postprocess``, the one writer of what a step changed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels._dispatch import backend_for
from kernels.attention import check_block_size
from refengine.config import EngineConfig
from refengine.logits_process import Processors, resolve
from refengine.outputs import RequestOutput, StepRecord
from refengine.request import Request
from refengine.sampling import draw_seed
from refengine.sampling_params import SamplingParams
from refengine.scheduler import Scheduler


class EngineError(ValueError):
    """Bad input to the engine (the request is refused; everything else keeps running)."""


class EngineFaulted(RuntimeError):
    """A fault inside a step left the engine unable to continue exactly; every later call refuses."""


@dataclass(frozen=True)
class Occupancy:
    """How full an engine's pools are (used / free), and its request counts."""

    kv_blocks_used: int
    kv_blocks_free: int
    state_slots_used: int
    state_slots_free: int
    request_slots_used: int  # rows of persistent per-request state (async engine; 0 for the reference)
    request_slots_free: int
    waiting: int
    running: int
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache on admission (0 without caching)
    prefix_cache_hits: int = 0  # of those, tokens served from it
    checkpoint_slots_held: int = 0  # checkpoint slots set aside for steps not yet processed (async engine)

    @property
    def empty(self) -> bool:
        return not (self.kv_blocks_used or self.state_slots_used or self.request_slots_used
                    or self.waiting or self.running or self.checkpoint_slots_held)


def check_kernel_settings(config: EngineConfig) -> None:
    """Refuse, when the engine is built, settings the kernels it will run cannot serve."""
    if backend_for(config.device) == "triton":
        check_block_size(config.cache.block_size)


class EngineCore:
    def __init__(self, config: EngineConfig, model_config, tokenizer=None, *,
                 request_type: type[Request] = Request, **scheduler_hooks):
        """``scheduler_hooks``: what the engine's scheduling differs in (see ``Scheduler``)."""
        check_kernel_settings(config)
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.request_type = request_type
        self.scheduler = Scheduler(config, **scheduler_hooks)
        self.requests: dict[str, Request] = {}  # live (unfinished) requests
        self.observers: list[Callable[[StepRecord], None]] = []
        self._arrivals = 0
        self._ready: list[Request] = []  # finished, not yet handed to the caller
        self._records: list[StepRecord] = []  # not yet shown to the observers
        self.fault: BaseException | None = None  # set when a fault could not be recovered from
        self.num_recovered_faults = 0
        self._grammars = None  # structured outputs: this engine's GrammarCompiler, built on first use

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids, params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise EngineError(
                f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}"
            )
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use by a live request")
        ids = list(prompt_token_ids)
        if not ids:
            raise EngineError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_config.vocab_size
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise EngineError(
                    f"request {request_id!r}: prompt token {t!r} at index {pos} is not an id in [0, {vocab})"
                )
        bad_stops = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stops:
            raise EngineError(
                f"request {request_id!r}: stop_token_ids {bad_stops[0]} is not an id in [0, {vocab})"
            )
        self.processors(request_id, params)
        self.compile_grammar(request_id, params)
        max_len = self.config.scheduler.max_model_len
        if len(ids) >= max_len:
            raise EngineError(f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room under "
                              f"max_model_len={max_len}")
        return ids

    def processors(self, request_id: str, params: SamplingParams) -> Processors:
        """The request's logits processors as token ids; EngineError names what the model cannot serve."""
        m = self.model_config
        try:
            return resolve(params, m.vocab_size, m.eos_token_ids, self.tokenizer)
        except ValueError as exc:
            raise EngineError(f"request {request_id!r}: {exc}") from None

    def compile_grammar(self, request_id: str, params: SamplingParams):
        """The request's compiled grammar (None without structured outputs), from this engine's cache;
        EngineError names the request and what xgrammar refused."""
        so = params.structured_outputs
        if so is None:
            return None
        if self.tokenizer is None:
            raise EngineError(f"request {request_id!r}: structured_outputs needs a tokenizer; this "
                              f"checkpoint has none")
        if self._grammars is None:
            from refengine.grammar import GrammarCompiler

            m = self.model_config
            self._grammars = GrammarCompiler(self.tokenizer, m.vocab_size, m.eos_token_ids)
        try:
            return self._grammars.compile(so)
        except ValueError as exc:
            raise EngineError(f"request {request_id!r}: {exc}") from None

    def grammar_state(self, req: Request, tokens=()):
        """A fresh matcher of ``req``'s grammar advanced by ``tokens`` (None without structured outputs)."""
        return None if req.compiled_grammar is None else self._grammars.state(req.compiled_grammar, tokens)

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams) -> Request:
        ids = self.validate(request_id, prompt_token_ids, params)
        req = self.request_type(request_id, ids, params, self._arrivals)
        req.processors = self.processors(request_id, params)
        req.seed = params.seed if params.seed is not None else draw_seed(self.config.seed, request_id)
        req.compiled_grammar = self.compile_grammar(request_id, params)
        req.grammar = self.grammar_state(req)  # the async engine replaces it with its slot's on admission
        self._arrivals += 1
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a live request now (reason ``abort``, the tokens committed so far); its pools are freed.

        None when the request already finished and its output waits for the next ``step()``.
        """
        req = self.requests.get(request_id)
        if req is None and any(r.request_id == request_id for r in self._ready):
            return None
        if req is None:
            raise EngineError(f"abort: no live request with id {request_id!r}")
        self.finish(req, "abort")
        return self.output(req)

    # ---- stop rules (``refengine.postprocess`` applies them as it appends a step's tokens) ---------------
    def stop_reason(self, req: Request, token: int) -> str | None:
        """After ``token`` was appended: "stop" (EOS unless ``ignore_eos``, or a stop id), "length", or None.

        vLLM 0.33's ``check_stop`` order: EOS, then the stop ids, then the length cap (``max_tokens``,
        ``max_model_len``), so EOS or a stop id on the ``max_tokens``-th token finishes "stop"; its
        ``min_tokens`` test comes after all three (it only holds back checks this engine lacks): the
        ``min_tokens`` processor masks EOS and the stop ids, so none comes before it.
        """
        p = req.params
        if (not p.ignore_eos and token in self.model_config.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        confirmed = len(req.prompt_token_ids) + len(req.output_token_ids)
        if len(req.output_token_ids) >= p.max_tokens or confirmed >= self.config.scheduler.max_model_len:
            return "length"
        return None

    def stop_string(self, req: Request) -> tuple[str | None, int | None, int]:
        """After a token was appended: (the stop string its text completed or None, where the output text
        then ends, characters searched so far), as vLLM's detokenizer finds it: the stop string ending
        first, never one lying wholly in the text of the first ``min_tokens`` outputs. Writes nothing."""
        p = req.params
        if not p.stop or self.tokenizer is None:
            return None, None, 0
        text = self.tokenizer.decode(req.output_token_ids)
        if len(req.output_token_ids) <= p.min_tokens:
            return None, None, len(text)
        best = None
        for stop in p.stop:
            at = text.find(stop, max(0, req.stop_text_checked + 1 - len(stop)))
            if at != -1 and (best is None or at + len(stop) < best[1] + len(best[0])):
                best = (stop, at)
        if best is None:
            return None, None, len(text)
        stop, at = best
        return stop, at + len(stop) if p.include_stop_str_in_output else at, len(text)

    def finish(self, req: Request, reason: str) -> None:
        """End a live request: its pools go back, and it leaves the live set."""
        self.scheduler.finish(req, reason)
        del self.requests[req.request_id]

    # ---- faults -------------------------------------------------------------------------------------
    def check_usable(self) -> None:
        if self.fault is not None:
            raise EngineFaulted(
                f"the engine stopped after a fault it could not recover from: {self.fault!r}"
            ) from self.fault

    def recover(self, fault: BaseException, reset: Callable[[], None] | None = None) -> None:
        """After ``fault`` escaped a step: every running request starts over from its committed tokens.

        ``reset`` first drops the engine's own in-flight work. If that fails too, the engine is
        marked faulted and refuses every later call, naming the original fault.
        """
        try:
            if reset is not None:
                reset()
            self.scheduler.preempt_all()
            self.num_recovered_faults += 1
        except BaseException as again:  # noqa: BLE001 - any failure here makes exactness unprovable
            self.fault = fault
            raise EngineFaulted(f"recovery from {fault!r} failed: {again!r}") from fault

    # ---- what the outside sees --------------------------------------------------------------------
    def finished(self, reqs: list[Request]) -> None:
        """Requests the step finished; handed out by ``deliver`` (kept until then, whatever raises)."""
        self._ready.extend(reqs)

    def record(self, record: StepRecord) -> None:
        self._records.append(record)

    @property
    def has_undelivered(self) -> bool:
        """Finished outputs (or records) the caller has not received yet: ``step()`` still has work."""
        return bool(self._ready or self._records)

    def deliver(self) -> list[RequestOutput]:
        """End of a step: show the records to the observers, then hand out the finished outputs.

        The step's state is complete before an observer runs, so an observer that raises changes
        nothing: its exception reaches the caller and the outputs come with the next ``step()``.
        """
        while self._records:
            record = self._records.pop(0)
            for fn in self.observers:
                fn(record)
        ready, self._ready = self._ready, []
        return [self.output(r) for r in ready]

    def output(self, req: Request) -> RequestOutput:
        ids = req.output_token_ids
        if req.compiled_grammar is not None and req.finish_reason == "stop" and req.stop_reason is None:
            ids = ids[:-1]  # the grammar's end token is not its text (vLLM's detokenizer skips a stop token)
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        if text is not None and req.stop_text_end is not None:
            text = text[: req.stop_text_end]
        return RequestOutput(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids),
                             req.finish_reason, req.num_draft_tokens, req.num_accepted_tokens,
                             list(req.acceptance), req.num_preemptions, text,
                             num_cached_tokens=req.num_cached_tokens or 0,
                             logprobs=None if req.logprobs is None else [dict(d) for d in req.logprobs],
                             prompt_logprobs=None if req.prompt_logprobs is None else [
                                 None if d is None else dict(d) for d in req.prompt_logprobs],
                             stop_reason=req.stop_reason, seed=req.seed)

    def occupancy(self, request_slots_used: int = 0, request_slots_free: int = 0) -> Occupancy:
        s = self.scheduler
        queries, hits, held = (0, 0, 0) if s.prefix is None else (
            s.prefix.num_query_tokens, s.prefix.num_hit_tokens, s.prefix.checkpoints.num_held)
        return Occupancy(s.kv_pool.num_used, s.kv_pool.num_free, s.slot_pool.num_used, s.slot_pool.num_free,
                         request_slots_used, request_slots_free, len(s.waiting), len(s.running), queries,
                         hits, held)
