"""Traces: what one engine did with one workload, per step and per request.

The recorder is an observer of the engines' ``StepRecord``s; it reads records by attribute name,
so an engine from another package can hand in its own objects with the same fields. Everything
here converts to and from plain JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class RowTrace:
    """One scheduled row of one step (a RowRecord, with the step it ran in)."""

    step: int
    request_id: str
    kind: str  # "prefill" | "decode"
    has_initial_state: bool
    num_computed_tokens: int  # before the step
    query_len: int
    state_slot_read: int | None  # None: zero initial state
    state_offset: int  # state slot column read: the previous verify's num_valid - 1 (0 for prefill)
    input_ids: list[int]
    positions: list[int]
    draft_token_ids: list[int]  # drafts verified in this step
    output_token_ids: list[int] | None  # verifier output; None for a partial prefill
    num_accepted: int | None
    logits_digest: str | None
    drafter_input_ids: list[int]
    next_draft_token_ids: list[int]
    logits_finite: bool | None = None  # None: not reported (or nothing sampled)


@dataclass
class StepTrace:
    index: int
    graph_mode: str  # "none" | "piecewise" | "full"
    num_reqs_padded: int | None
    metadata_shapes: dict[str, list[int]]  # "group.field" -> shape
    preempted: list[str]
    rows: list[RowTrace]


@dataclass
class VerifyStep:
    index: int  # the request's verify step number (0, 1, ...)
    step: int | None  # engine step it ran in
    position: int | None  # output position of the first token it produced
    drafted: int
    accepted: int


@dataclass
class RequestTrace:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    acceptance: list[tuple[int, int]]  # (drafted, accepted) per verify step, as the engine reported it
    num_preemptions: int = 0
    num_draft_tokens: int | None = None  # the public counters, as reported (None: the output lacks the field)
    num_accepted_tokens: int | None = None
    text: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (None: not reported)
    added_at: int | None = None  # engine steps run when the harness added it (None: not recorded)
    returned_at: int | None = None  # engine steps run when its output came back (an abort: before the next)
    verify_steps: list[VerifyStep] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # engine step that produced each output token
    # kind of the row ("prefill"/"decode") that produced it
    token_kinds: list[str] = field(default_factory=list)
    # (position, rows, digest) per sampling row
    logits: list[tuple[int, int, str]] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop id or stop string that finished it (None: EOS, length)
    seed: int | None = None  # the sampling seed it reported using (None: not reported)
    # per output token, its logprobs entry as [[id, logprob], ...] in the engine's order (None: not asked)
    logprobs: list[list[list]] | None = None
    # per prompt position, None or [[id, logprob], ...] (None: not asked)
    prompt_logprobs: list[list[list] | None] | None = None


@dataclass
class AbortTrace:
    """When the harness aborted a request: before engine step ``step`` (the harness's count), after
    ``records_before`` step records had been delivered; ``returned``: abort() gave back an output
    (False: the engine said the request had already finished; its output comes from a later step)."""

    step: int
    records_before: int
    returned: bool
    live: int | None = None  # requests the harness had added and not yet got back, right after the abort
    queued: int | None = (
        None  # waiting + running requests the engine's occupancy() reported then (None: none)
    )


@dataclass
class Trace:
    engine: str
    scenario_id: str
    requests: dict[str, RequestTrace] = field(default_factory=dict)
    steps: list[StepTrace] = field(default_factory=list)
    pools_empty: bool | None = None  # None: the engine cannot tell
    request_slots_in_use: int | None = None  # None: the engine cannot tell
    # the instance's occupancy() once the workload ended (None: no such method); with prefix caching it
    # may count "prefix_cache_queries" and "prefix_cache_hits" (tokens looked up on admission, and served)
    occupancy: dict[str, int] | None = None
    error: str | None = None  # the engine raised (traceback text) or made no progress
    # the KV block size the engine says it used, when it picks its own (None: the scenario's)
    block_size: int | None = None
    num_engine_steps: int = 0
    aborts: dict[str, AbortTrace] = field(default_factory=dict)
    duplicate_outputs: list[str] = field(default_factory=list)  # requests handed back more than once
    # StepRecord / RowRecord fields, and optional RequestOutput ones (num_cached_tokens),
    # the engine did not report
    missing_fields: list[str] = field(default_factory=list)

    def rows_of(self, request_id: str) -> list[RowTrace]:
        return [r for s in self.steps for r in s.rows if r.request_id == request_id]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        steps = [StepTrace(**{**s, "rows": [RowTrace(**r) for r in s["rows"]]}) for s in d["steps"]]
        requests = {}
        for rid, r in d["requests"].items():
            requests[rid] = RequestTrace(**{
                **r, "acceptance": [tuple(a) for a in r["acceptance"]],
                "verify_steps": [VerifyStep(**v) for v in r["verify_steps"]],
                "logits": [tuple(x) for x in r["logits"]]})
        aborts = {rid: AbortTrace(**a) for rid, a in d.get("aborts", {}).items()}
        rest = {
            f.name: d[f.name]
            for f in fields(cls)
            if f.name not in ("steps", "requests", "aborts") and f.name in d
        }
        return cls(**rest, steps=steps, requests=requests, aborts=aborts)


class Recorder:
    """Collects step records and request outputs into a Trace."""

    def __init__(self, engine: str, scenario_id: str):
        self.trace = Trace(engine, scenario_id)
        self.added: dict[str, int] = {}  # request id -> engine steps run when the harness added it

    def on_step(self, record) -> None:
        """Record one StepRecord-shaped object. A field the object lacks is noted in
        ``trace.missing_fields`` (the checks that need it are then n/a) and recorded as empty."""
        get = self._reader()
        rows = [
            RowTrace(
                step=int(get(record, "step_index", len(self.trace.steps))),
                request_id=str(get(r, "request_id", "?")),
                kind=get(r, "kind", "?"),
                has_initial_state=bool(get(r, "has_initial_state", False)),
                num_computed_tokens=int(get(r, "num_computed_tokens", -1)),
                query_len=int(get(r, "query_len", 0)),
                state_slot_read=_opt_int(get(r, "state_slot_read", None)),
                state_offset=int(get(r, "state_offset", 0)),
                input_ids=_ints(get(r, "input_ids", [])),
                positions=_ints(get(r, "positions", [])),
                draft_token_ids=_ints(get(r, "draft_token_ids", [])),
                output_token_ids=None
                if get(r, "output_token_ids", None) is None
                else _ints(r.output_token_ids),
                num_accepted=_opt_int(get(r, "num_accepted", None)),
                logits_digest=get(r, "logits_digest", None),
                drafter_input_ids=_ints(get(r, "drafter_input_ids", [])),
                next_draft_token_ids=_ints(get(r, "next_draft_token_ids", [])),
                logits_finite=get(r, "logits_finite", None),
            )
            for r in get(record, "rows", [])
        ]
        shapes = {
            k: [int(x) for x in v] for k, v in sorted(dict(get(record, "metadata_shapes", {})).items())
        }
        self.trace.steps.append(
            StepTrace(
                index=rows[0].step if rows else int(get(record, "step_index", len(self.trace.steps))),
                graph_mode=get(record, "graph_mode", "none"),
                num_reqs_padded=get(record, "num_reqs_padded", None),
                metadata_shapes=shapes,
                preempted=list(get(record, "preempted", [])),
                rows=rows,
            )
        )

    def _reader(self):
        """``get(obj, name, default)``: the attribute, or ``default`` with the name noted as missing."""
        missing = self.trace.missing_fields

        def get(obj, name: str, default):
            if hasattr(obj, name):
                return getattr(obj, name)
            if name not in missing:
                missing.append(name)
            return default

        return get

    def on_added(self, request_id: str, steps_run: int) -> None:
        self.added[request_id] = steps_run

    def on_output(self, out, steps_run: int | None = None) -> None:
        """A finished request's output; ``steps_run``: engine steps run when it came back."""
        if out.request_id in self.trace.requests:
            self.trace.duplicate_outputs.append(out.request_id)
        cached = getattr(out, "num_cached_tokens", None)
        if cached is None and "num_cached_tokens" not in self.trace.missing_fields:
            self.trace.missing_fields.append("num_cached_tokens")
        for name in ("stop_reason", "logprobs", "prompt_logprobs"):  # RequestOutput fields of request params
            if not hasattr(out, name) and name not in self.trace.missing_fields:
                self.trace.missing_fields.append(name)
        self.trace.requests[out.request_id] = RequestTrace(
            request_id=out.request_id,
            prompt_token_ids=_ints(out.prompt_token_ids),
            token_ids=_ints(out.token_ids),
            finish_reason=out.finish_reason,
            acceptance=[(int(d), int(a)) for d, a in getattr(out, "acceptance", None) or ()],
            num_preemptions=int(getattr(out, "num_preemptions", 0)),
            num_draft_tokens=_opt_int(getattr(out, "num_draft_tokens", None)),
            num_accepted_tokens=_opt_int(getattr(out, "num_accepted_tokens", None)),
            text=getattr(out, "text", None),
            num_cached_tokens=_opt_int(cached),
            added_at=self.added.get(out.request_id),
            returned_at=steps_run,
            stop_reason=getattr(out, "stop_reason", None),
            seed=_opt_int(getattr(out, "seed", None)),
            logprobs=_logprobs(getattr(out, "logprobs", None)),
            prompt_logprobs=None if getattr(out, "prompt_logprobs", None) is None else [
                None if d is None else _entry(d) for d in out.prompt_logprobs],
        )

    def on_abort(self, request_id: str, step: int, out, live: int, occupancy=None) -> None:
        """The harness aborted ``request_id`` before engine step ``step``; ``out``: what abort() returned;
        ``live``: requests added and not yet returned, this one excluded when abort() returned it;
        ``occupancy``: the engine's occupancy() right after the call, when it has one."""
        queued = None
        if occupancy is not None and out is not None:
            occ = dict(occupancy)
            queued = int(occ.get("waiting", 0)) + int(occ.get("running", 0))
        self.trace.aborts[request_id] = AbortTrace(step, len(self.trace.steps), out is not None, live, queued)
        if out is not None:
            self.on_output(out, step)

    def finish(self, spec_enabled: bool) -> Trace:
        """Derive per-request verify steps, token steps and logits digests from the rows."""
        for req in self.trace.requests.values():
            _derive(req, self.trace.rows_of(req.request_id), spec_enabled)
        return self.trace


def _derive(req: RequestTrace, rows: list[RowTrace], spec_enabled: bool) -> None:
    produced = 0
    for row in rows:
        if row.output_token_ids is None:
            continue
        if spec_enabled and row.kind == "decode":
            req.verify_steps.append(
                VerifyStep(
                    len(req.verify_steps),
                    row.step,
                    produced,
                    len(row.draft_token_ids),
                    row.num_accepted if row.num_accepted is not None else -1,
                )
            )
        if row.logits_digest is not None:
            req.logits.append((produced, len(row.draft_token_ids) + 1, row.logits_digest))
        req.token_steps += [row.step] * len(row.output_token_ids)
        req.token_kinds += [row.kind] * len(row.output_token_ids)
        produced += len(row.output_token_ids)
    del req.token_steps[len(req.token_ids):], req.token_kinds[len(req.token_ids):]
    if not rows:  # an engine without step records: positions follow from the reported acceptance
        position = 1 if req.acceptance else 0
        for i, (drafted, accepted) in enumerate(req.acceptance):
            req.verify_steps.append(VerifyStep(i, None, position, drafted, accepted))
            position += accepted + 1


def _entry(d) -> list[list]:
    """One position's {id: logprob} as [[id, logprob], ...], in the engine's order (values as floats)."""
    return [[int(t), float(v)] for t, v in dict(d).items()]


def _logprobs(values) -> list[list[list]] | None:
    return None if values is None else [_entry(d) for d in values]


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def _opt_int(value) -> int | None:
    return None if value is None else int(value)
