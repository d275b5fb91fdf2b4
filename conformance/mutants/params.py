"""The record of requests that carry state (issue 34), re-created in one async engine instance.

Each patches the instance's processor state (``engine.state.processors``), its verifier or its post-step
writer's stop rules, never a module or a class for longer than one call of that instance. The scenarios
that catch them (``params-mixed-k3``, ``params-stop-strings-k3``, ``params-ngram-k3``) are tuned to the
embedded default model, whose byte-level tokenizer the stop strings and bad words need: the mutants
declare ``tokenizer=True`` and ``conformance mutate`` runs them there unless ``--model`` has a tokenizer.
"""

from __future__ import annotations

import torch

from conformance.mutants.base import Mutant
from refengine.logits_process import logprob_dict

MIXED, TEXT, NGRAM = "params-mixed-k3", "params-stop-strings-k3", "params-ngram-k3"


def _with(module, name, value, fn):
    """``fn`` with ``module.name`` set to ``value`` for the length of each call (one instance's calls)."""
    def wrapped(*args, **kw):
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args, **kw)
        finally:
            setattr(module, name, old)
    return wrapped


def _row_slots(slot: torch.Tensor, row: torch.Tensor) -> dict[int, int]:
    """Padded row -> request slot, from ``apply``'s per-logits-row arguments (host read: eager mode only)."""
    return dict(zip(row.tolist(), slot.tolist()))


def _alias_after_reorder(engine, names: tuple[str, ...]) -> None:
    """A slot that moved to another batch row since the previous step reads the rows ``names`` of the slot
    now sitting at its old batch row: two rows share one state after the swap."""
    proc = engine.state.processors
    apply = proc.apply
    last: dict[int, int] = {}  # slot -> padded row in the previous step

    def aliased(logits, slot, row, *rest):
        now = _row_slots(slot, row)
        at = {r: s for r, s in now.items()}
        saved = {n: getattr(proc, n) for n in names}
        try:
            for r, s in now.items():
                old = last.get(s)
                if old is not None and old != r and at.get(old) not in (None, s):
                    for n in names:
                        t = getattr(proc, n)
                        if t is saved[n]:
                            t = t.clone()
                            setattr(proc, n, t)
                        t[s] = saved[n][at[old]]
            return apply(logits, slot, row, *rest)
        finally:
            for n, t in saved.items():
                setattr(proc, n, t)
            last.clear()
            last.update({s: r for r, s in now.items()})

    proc.apply = aliased


def _mask_aliasing(engine) -> None:
    """vLLM #48419: a row swap copies the allowed-id mask through two views, so both rows get one mask."""
    _alias_after_reorder(engine, ("allowed",))


def _state_shared_after_swap(engine) -> None:
    """vLLM #49613/#51890: after a swap two rows share one request's state (penalty counts, factors, bias)."""
    _alias_after_reorder(engine, ("output_counts", "factors", "prompt_mask", "bias"))


def _stale_mask_on_reuse(engine) -> None:
    """vLLM #43894: an admission writes the allowed-id mask only for restricted requests, so an
    unrestricted request on a reused slot keeps its previous owner's whitelist."""
    proc = engine.state.processors
    admit = proc.admit

    def admit_keeping_masks(idx, w, *args):
        kept = proc.allowed[idx.long()].clone()
        admit(idx, w, *args)
        free = w["proc.restricted"] == 0
        proc.allowed[idx.long()[free]] = kept[free]

    proc.admit = admit_keeping_masks


def _min_tokens_off_by_one(engine) -> None:
    """vLLM #41768 (2): inside a verify window min_tokens counts one output fewer, so it holds the stop ids
    one draft position too far."""
    proc = engine.state.processors
    apply = proc.apply

    def late(logits, slot, row, j, num_outputs, *rest):
        return apply(logits, slot, row, j, num_outputs - (j > 0).long(), *rest)

    proc.apply = late


def _zero_draft_misaligned(engine) -> None:
    """vLLM #41768 (3): rows whose drafter proposed no draft are skipped when the drafts are laid out for
    the processors, so every row after one reads the drafts (penalty and bad-word history) of the row
    after it. (Host read of the device's draft counts: eager mode only.)"""
    runner, proc = engine.runner, engine.state.processors
    apply, verify = proc.apply, runner.verify
    step_drafts: list = []

    def verify_seeing_counts(shape, rows, step, hidden):
        step_drafts.append(step.num_drafts)
        try:
            return verify(shape, rows, step, hidden)
        finally:
            step_drafts.clear()

    def packed(logits, slot, row, j, num_outputs, drafts, tail):
        with_drafts = torch.nonzero(step_drafts[-1] > 0).flatten()
        moved = torch.zeros_like(drafts)
        moved[: with_drafts.shape[0]] = drafts[with_drafts]
        return apply(logits, slot, row, j, num_outputs, moved, tail)

    runner.verify = verify_seeing_counts
    proc.apply = packed


def _placeholder_in_history(engine) -> None:
    """vLLM #26467/#27910: the async placeholder of a rejected position is spliced with the row's last kept
    token, which the penalty history then counts once per rejected position."""
    proc = engine.state.processors
    advance = proc.advance

    def spliced(idx, sampled):
        kept = (sampled >= 0).sum(1)
        last = sampled.gather(1, (kept - 1).clamp(min=0)[:, None])
        filled = torch.where((sampled < 0) & (kept[:, None] > 0), last.expand_as(sampled), sampled)
        advance(idx, filled)

    proc.advance = spliced


def _penalties_count_rejected(engine) -> None:
    """vLLM #18902-like: the penalty history counts every verified draft, the rejected ones too."""
    proc = engine.state.processors
    apply, advance = proc.apply, proc.advance
    seen = {}

    def remember(logits, slot, row, j, num_outputs, drafts, tail):
        seen["drafts"] = drafts
        return apply(logits, slot, row, j, num_outputs, drafts, tail)

    def with_rejected(idx, sampled):
        drafts = seen.get("drafts")
        if drafts is None or drafts.shape[1] == 0:
            return advance(idx, sampled)
        kept = (sampled >= 0).sum(1, keepdim=True)  # [Np, 1]
        pos = torch.arange(drafts.shape[1], device=sampled.device)[None, :]
        rejected = torch.where((pos >= kept - 1) & (kept > 0), drafts, torch.full_like(drafts, -1))
        advance(idx, sampled)
        advance(idx, rejected)

    proc.apply, proc.advance = remember, with_rejected


def _processor_only_at_bonus(engine) -> None:
    """vLLM #42744: the rejection sampler applies the processors to the bonus position only; draft
    positions are judged on the raw logits."""
    proc = engine.state.processors
    apply = proc.apply

    def bonus_only(logits, slot, row, j, *rest):
        processed = apply(logits, slot, row, j, *rest)
        counts = torch.bincount(row, minlength=int(row.max()) + 1 if row.numel() else 0)
        last = j == counts[row] - 1
        return torch.where(last[:, None], processed, logits.to(processed.dtype))

    proc.apply = bonus_only


def _logprobs_one_position_late(engine) -> None:
    """vLLM #31336: a kept token's logprobs are read from the next position's row (a rejected draft's)."""
    from refengine.async_engine import runner as runner_module

    tables = runner_module.logprob_tables
    late = lambda logits, cu, tokens: tables(logits, cu + 1, tokens)
    engine.runner.verify = _with(runner_module, "logprob_tables", late, engine.runner.verify)


def _writer(engine, mutated) -> None:
    """Run the instance's post-step writer as ``mutated(postprocess, core, outcomes, **kw)``."""
    from refengine.async_engine import engine as engine_module

    real = engine_module.postprocess
    engine._commit = _with(engine_module, "postprocess", lambda *a, **kw: mutated(real, *a, **kw),
                           engine._commit)


def _tokens_past_stop(engine) -> None:
    """vLLM #47616: the text is cut at the stop string, but the window's kept tokens after it (and their
    logprobs) are still returned."""
    def mutated(real, core, outcomes, **kw):
        before = {id(o.request): len(o.request.output_token_ids) for o in outcomes}
        finished, proposals = real(core, outcomes, **kw)
        for o in outcomes:
            req = o.request
            if o.tokens is None or req not in finished or not isinstance(req.stop_reason, str):
                continue
            appended = len(req.output_token_ids) - before[id(req)]
            for i in range(appended, len(o.tokens)):
                req.output_token_ids.append(o.tokens[i])
                if req.logprobs is not None:
                    values, ids, chosen = o.logprobs[i]
                    req.logprobs.append(logprob_dict(values, ids, o.tokens[i], chosen, req.params.logprobs))
        return finished, proposals

    _writer(engine, mutated)


def _stop_missed_in_window(engine) -> None:
    """SGLang #23802: stop strings are looked for once per row, in the text's tail after its last kept
    token only, so one completed earlier in an accepted window is missed."""
    core = engine.core
    stop_string = core.stop_string
    ends: dict[int, int] = {}

    def mutated(real, core_, outcomes, **kw):
        ends.clear()
        for o in outcomes:
            if o.tokens is not None:
                ends[id(o.request)] = len(o.request.output_token_ids) + len(o.tokens)
        return real(core_, outcomes, **kw)

    def tail_only(req):
        if len(req.output_token_ids) < ends.get(id(req), 0):
            return None, None, req.stop_text_checked
        text = core.tokenizer.decode(req.output_token_ids) if core.tokenizer is not None else ""
        req.stop_text_checked = max(req.stop_text_checked, len(text) - 1)
        return stop_string(req)

    core.stop_string = tail_only
    _writer(engine, mutated)


def _length_before_stop(engine) -> None:
    """SGLang #31599: the max_tokens cap is checked before stop strings, so a stop string completed by the
    last allowed token finishes 'length' (the text keeps the stop string)."""
    core = engine.core
    stop_string = core.stop_string

    def capped_first(req):
        if len(req.output_token_ids) >= req.params.max_tokens:
            return None, None, req.stop_text_checked
        return stop_string(req)

    core.stop_string = capped_first


def _prompt_chunk_end_skipped(engine) -> None:
    """vLLM #41411: a prompt chunk's last position (the logprob of the next chunk's first prompt token) is
    dropped, so a prompt prefilled in chunks loses an entry at each chunk end."""
    from refengine.async_engine import planner as planner_module

    span = planner_module.prompt_logprob_span

    def skipped(req, num_computed, num_tokens):
        got = span(req, num_computed, num_tokens)
        if got is not None and got[1] == num_tokens:  # the chunk ends inside the prompt
            got = (got[0], got[1] - 1) if got[1] > 1 else None
        return got

    engine.planner.plan = _with(planner_module, "prompt_logprob_span", skipped, engine.planner.plan)


def params_mutants() -> tuple:
    """The mutants of requests that carry state."""
    def m(mid, origin, contract, description, patch, scenarios):
        return Mutant(mid, origin, contract, description, patch, "none", scenarios, tokenizer=True)

    state = "issue 34: request state moves with the request's slot"
    lossless = "issue 34: speculation stays lossless under every parameter"
    stops = "issue 34: nothing past a stop, finish_reason as vLLM's"
    return (
        m("params-mask-aliasing", "vLLM #48419", state,
          "after rows move, a moved slot reads the allowed-id mask of the slot now at its old row",
          _mask_aliasing, (MIXED,)),
        m("params-state-shared-after-swap", "vLLM #49613/#51890", state,
          "after rows move, a moved slot reads the penalty counts, factors and bias of the slot now at its "
          "old row", _state_shared_after_swap, (NGRAM,)),
        m("params-zero-draft-misaligned", "vLLM #41768", lossless,
          "rows whose drafter proposed no draft are skipped when drafts are laid out for the processors: a "
          "later row reads another row's drafts as its window history", _zero_draft_misaligned, (NGRAM,)),
        m("params-stale-mask-on-reuse", "vLLM #43894", state,
          "an unrestricted request on a reused slot keeps its previous owner's allowed-id mask",
          _stale_mask_on_reuse, (MIXED,)),
        m("params-min-tokens-off-by-one", "vLLM #41768", lossless,
          "inside a verify window min_tokens holds the stop ids one draft position too far",
          _min_tokens_off_by_one, (MIXED,)),
        m("params-placeholder-in-history", "vLLM #26467/#27910", lossless,
          "a rejected position's placeholder counts as the row's last kept token in the penalty history",
          _placeholder_in_history, (MIXED,)),
        m("params-penalties-count-rejected", "vLLM #18902", lossless,
          "the penalty history counts the rejected drafts of every verify step",
          _penalties_count_rejected, (MIXED,)),
        m("params-processor-only-at-bonus", "vLLM #42744", lossless,
          "the processors are applied at each row's bonus position only, drafts judged on raw logits",
          _processor_only_at_bonus, (MIXED,)),
        m("params-logprobs-of-rejected-draft", "vLLM #31336", lossless,
          "a kept token's logprobs are read one position late (a rejected draft's)",
          _logprobs_one_position_late, (MIXED,)),
        m("params-prompt-chunk-end-skipped", "vLLM #41411", lossless,
          "a prompt chunk's last position is skipped: the next chunk's first prompt token gets no logprobs",
          _prompt_chunk_end_skipped, (MIXED,)),
        m("params-tokens-past-stop", "vLLM #47616", stops,
          "the text is cut at a stop string but the window's later tokens and logprobs are returned",
          _tokens_past_stop, (TEXT,)),
        m("params-stop-missed-in-window", "SGLang #23802", stops,
          "stop strings are looked for only at the end of each row's kept tokens",
          _stop_missed_in_window, (TEXT,)),
        m("params-length-before-stop", "SGLang #31599", stops,
          "the max_tokens cap is checked before stop strings: a stop at the cap finishes 'length'",
          _length_before_stop, (TEXT,)),
    )
