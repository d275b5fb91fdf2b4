"""After a step: the one place a request's state is written, for both engines.

A step's verifier output comes back as one ``RowOutcome`` per scheduled row; ``postprocess`` turns
the outcomes into request state, in this order, for every row:

    undo     the engine's own assumptions about the row (the async host counted every scheduled token
             as computed at planning; the reference assumes nothing)
    commit   the positions the row kept become computed; a sampling row's kept-token count (bonus
             included) is recorded, its acceptance counted, and its tokens appended one at a time
             until a stop rule finishes the request (a prompt chunk's prompt logprobs, when asked for, are
             appended first); with each token its logprobs (when asked for)
             and the stop-string window advance, so nothing past a stop reaches the request: a stop
             string is found by its first token, wherever it lies in the row's kept tokens
    propose  (reference engine) the drafter reads the committed requests and returns the next drafts
             of every row that sampled and still runs; they are written here, never by the drafter (the
             async engine's drafts stay on the device; its host holds placeholders, set at planning)

Drafters, runners and the scheduler read request state; what a step changes is written here.
Request state the per-request parameters need advances here too, with the kept tokens only (the
logprobs, the stop-string window, the structured-outputs matcher; the output tokens are the penalty and
bad-word history).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from refengine.drafters.base import Proposal
from refengine.logits_process import logprob_dict
from refengine.request import Request, RequestStatus
from refengine.scheduler import ScheduledRow


@dataclass
class RowOutcome:
    """One row of a processed step, as its engine's verifier reported it."""

    row: ScheduledRow
    tokens: list[int] | None  # kept tokens, bonus included (1 <= len <= 1 + drafts); None: a prompt chunk
    #                           that sampled nothing
    num_drafts: int | None  # drafts the row verified (a decode row: 0..K); None for a prefill row
    # per kept token: (top values, top ids, the token's logprob), the raw logprobs of its position
    # (``logits_process.top_logprobs``); None when no request of the step asked for logprobs
    logprobs: list[tuple[list[float], list[int], float]] | None = None
    # a prefill chunk of a request asking for prompt logprobs: (index of the prompt token the first entry
    # is for, per position (top values, top ids, the next prompt token's logprob)); None otherwise
    prompt_logprobs: tuple[int, list[tuple[list[float], list[int], float]]] | None = None

    @property
    def request(self) -> Request:
        return self.row.request

    @property
    def num_rejected(self) -> int:
        """Draft positions of the row the verifier did not keep (0 for a row that sampled nothing)."""
        if self.tokens is None:
            return 0
        return len(self.row.draft_token_ids) - (len(self.tokens) - 1)

    @property
    def num_kept(self) -> int:
        """Positions of the row now committed: a prompt chunk's whole query, a verify row's kept tokens."""
        return self.row.num_tokens - self.num_rejected


def write_prompt_logprobs(req: Request, first: int, entries: list) -> None:
    """Append the entries for prompt tokens ``first``.. that ``req`` lacks (a readmission after preemption
    computes some again: those already there stay); each holds the top-n and the prompt token."""
    prompt, have = req.prompt_token_ids, req.prompt_logprobs
    for at, (values, ids, chosen) in enumerate(entries, first):
        if at == len(have):
            have.append(logprob_dict(values, ids, prompt[at], chosen, req.params.prompt_logprobs))


def postprocess(
    core,
    outcomes: list[RowOutcome],
    *,
    undo: Callable[[RowOutcome], None] | None = None,
    propose: Callable[[list[RowOutcome]], list[Proposal | None]] | None = None,
) -> tuple[list[Request], list[Proposal | None]]:
    """Write what a step changed into its requests; (the requests it finished, the proposals made).

    ``core``: the engine's ``EngineCore`` (stop rules, the scheduler that frees a finished request's
    pools). ``undo``: the engine's correction of its own planning assumptions, run first for each row
    of a running request. ``propose``: the host drafter, called once every row is committed.
    """
    finished = []
    for o in outcomes:
        req = o.request
        if req.is_finished:  # work scheduled for a request that finished meanwhile: nothing to write
            continue
        if req.status is RequestStatus.RUNNING:  # a preempted one restarts from its committed tokens
            if undo is not None:
                undo(o)
            req.num_computed_tokens += o.num_kept
            if o.tokens is not None:
                req.num_valid = len(o.tokens)
        if o.prompt_logprobs is not None and req.prompt_logprobs is not None:
            write_prompt_logprobs(req, *o.prompt_logprobs)
        if o.tokens is None:
            continue
        if o.num_drafts is not None and core.config.speculative.enabled:
            req.num_verify_steps += 1
            req.num_draft_tokens += o.num_drafts
            req.num_accepted_tokens += len(o.tokens) - 1
            req.acceptance.append((o.num_drafts, len(o.tokens) - 1))
        for i, token in enumerate(o.tokens):  # one at a time: nothing past a stop is appended
            req.output_token_ids.append(token)
            if req.logprobs is not None:
                values, ids, chosen = o.logprobs[i]
                req.logprobs.append(logprob_dict(values, ids, token, chosen, req.params.logprobs))
            if req.grammar is not None and not req.grammar.accept(token):  # kept tokens only advance it
                raise RuntimeError(f"request {req.request_id!r}: output token {token} at index "
                                   f"{len(req.output_token_ids) - 1} breaks its structured_outputs grammar")
            stop, end, req.stop_text_checked = core.stop_string(req)
            if stop is not None:  # a stop string ends it whatever the length rule says (as vLLM)
                req.stop_reason, req.stop_text_end = stop, end
                reason = "stop"
            else:
                reason = core.stop_reason(req, token)
                if req.grammar is not None and req.grammar.terminated:
                    reason = "stop"  # the grammar is complete (it accepted its end token): before length
                eos = not req.params.ignore_eos and token in core.model_config.eos_token_ids
                if reason == "stop" and not eos and token in req.params.stop_token_ids:
                    req.stop_reason = token  # EOS is checked first: a stop id that is EOS leaves None
            if reason is not None:
                core.finish(req, reason)
                finished.append(req)
                break
    core.finished(finished)  # handed out even if the drafter below faults: they are committed
    proposals: list[Proposal | None] = [None] * len(outcomes)
    if propose is not None:
        proposals = propose(outcomes)
        for o, p in zip(outcomes, proposals):
            if o.tokens is not None and not o.request.is_finished:  # the drafts it had are verified
                o.request.draft_token_ids = [] if p is None or p.drafts is None else list(p.drafts)
    return finished, proposals
