"""The scripted drafter: the true greedy continuation, right for a scripted number of tokens.

Given each request's plain greedy output (speculation is lossless, so it is also the output of
the run being drafted for), it proposes the next K true tokens, of which only the first ``c`` are
kept and the rest are replaced by wrong tokens. ``c`` comes from a deterministic schedule keyed by
(request id, number of output tokens committed when drafting), so every accepted count 0..K is
reachable on purpose and both engines see exactly the same drafts at the same point of a request,
however their steps (and preemptions) split its history.

The "gaps" pattern also scripts how many drafts are proposed: K correct drafts, then a step with none,
then K-1 correct drafts of K-1 proposed (K > 1), then a step with none, over and over, keyed by the
committed outputs alone (``schedule``). Accepted drafts followed by a step without any, and a step
whose rows verify drafts next to rows verifying none (requests that started an odd number of steps
apart), then happen on any model: nothing depends on what the model predicts.

The truth comes from outside the engine: ``truth(request)`` returns the request's plain greedy
continuation (at least ``max_tokens + K`` tokens, so drafts made near the end are scripted too).
A conformance harness has it from its own plain run; ``refengine.LLM`` fills in a source that runs
a private reference engine on the same weights when none is given.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refengine.drafters.base import (
    DeviceDraftContext,
    DraftInputs,
    DraftOutputs,
    HostDraftContext,
    Proposal,
)

PATTERNS = ("hash", "all-accept", "all-reject", "cycle", "gaps")
TruthSource = Callable[[Any], list[int]]  # a refengine.request.Request -> its plain greedy output tokens


class ScriptedDrafter:
    method = "scripted"
    uses_kv_cache = False

    def __init__(
        self,
        num_speculative_tokens: int,
        vocab_size: int,
        pattern: str | Callable[[str, int], int] = "hash",
        truth: TruthSource | None = None,
    ):
        """``pattern``: a name from PATTERNS, or (request id, committed outputs) -> correct drafts."""
        if isinstance(pattern, str) and pattern not in PATTERNS:
            raise ValueError(
                f"scripted drafter pattern must be one of {PATTERNS} or a callable, got {pattern!r}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.pattern = pattern
        self.truth = truth

    def check_model(self, model) -> None:
        if self.truth is None:
            raise ValueError("the scripted drafter needs a truth source (each request's plain greedy output)")

    def num_correct(self, request_id: str, position: int) -> int:
        """Correct drafts proposed when ``position`` output tokens are committed."""
        k = self.num_speculative_tokens
        if callable(self.pattern):
            c = int(self.pattern(request_id, position))
        elif self.pattern == "all-accept":
            c = k
        elif self.pattern == "all-reject":
            c = 0
        elif self.pattern == "cycle":
            c = position % (k + 1)
        elif self.pattern == "gaps":
            c = self.schedule(request_id, position)[1]
        else:
            digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
            c = int.from_bytes(digest, "little") % (k + 1)
        if not 0 <= c <= k:
            raise ValueError(f"scripted drafter: {c} correct drafts is outside 0..{k}")
        return c

    def schedule(self, request_id: str, position: int) -> tuple[int, int]:
        """(drafts proposed, of which correct) when ``position`` output tokens are committed: K and
        ``num_correct`` for every pattern but "gaps", whose cycle is described in the module's docstring
        (a position off the cycle, e.g. after a preemption, proposes none until the cycle comes round)."""
        k = self.num_speculative_tokens
        if self.pattern != "gaps":
            return k, self.num_correct(request_id, position)
        cycle = [(k, k), (0, 0)] + ([(k - 1, k - 1), (0, 0)] if k > 1 else [])
        offset, period, at = 0, sum(c + 1 for _, c in cycle), {}
        for entry in cycle:
            at[offset] = entry
            offset += entry[1] + 1
        return at.get((position - 1) % period, (0, 0))

    @property
    def scripts_counts(self) -> bool:
        """Whether fewer than K drafts may be proposed (the device proposer then reports its counts)."""
        return self.pattern == "gaps"

    def host_proposer(self, ctx: HostDraftContext) -> ScriptedHostProposer:
        return ScriptedHostProposer(self)

    def device_proposer(self, ctx: DeviceDraftContext) -> ScriptedDeviceProposer:
        return ScriptedDeviceProposer(self, ctx)


class ScriptedHostProposer:
    def __init__(self, drafter: ScriptedDrafter):
        self.drafter = drafter
        self._truth: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> truth tokens

    def drafts_for(self, req) -> list[int]:
        d = self.drafter
        truth = self._truth.get(req)
        if truth is None:
            truth = self._truth[req] = list(d.truth(req))
        last = req.all_token_ids[-1]
        if not 0 <= last < d.vocab_size:
            raise ValueError(f"drafter input {last} for request {req.request_id!r} is outside the vocabulary")
        m = len(req.output_token_ids)  # drafts stand for outputs m, m+1, ...
        n, c = d.schedule(req.request_id, m)
        drafts = []
        for j in range(n):
            true = truth[m + j] if m + j < len(truth) else 0
            drafts.append(true if j < c else (true + 1) % d.vocab_size)
        return drafts

    def propose(self, outcomes: list, result) -> list[Proposal | None]:
        """Drafts for every row that sampled and still runs, from its committed tokens."""
        return [Proposal(self.drafts_for(o.request), [o.request.all_token_ids[-1]])
                if o.tokens is not None and not o.request.is_finished else None
                for o in outcomes]


@dataclass
class StagedTruth:
    truth: torch.Tensor  # [n, Lt] int64 host, plain greedy outputs (0 past their end)
    num_correct: torch.Tensor  # [n, Lt] int32 host, correct drafts when j outputs are committed
    num_drafts: torch.Tensor  # [n, Lt] int32 host, drafts proposed when j outputs are committed


class ScriptedDeviceProposer:
    """Owns the device tables of true continuations and scripted correct counts, keyed by request slot."""

    def __init__(self, drafter: ScriptedDrafter, ctx: DeviceDraftContext):
        self.drafter = drafter
        self.ctx = ctx
        slots, width = ctx.state.token_ids.shape  # R request slots, L = max_model_len + 2K + 1
        self.truth = torch.zeros(slots, width, dtype=torch.int64, device=ctx.device)  # [R, L]
        self.num_correct = torch.zeros(slots, width, dtype=torch.int32, device=ctx.device)  # [R, L]
        self.num_drafts = torch.zeros(slots, width, dtype=torch.int32, device=ctx.device)  # [R, L]

    def stage(self, admitted: list) -> StagedTruth | None:
        if not admitted:
            return None
        d, width = self.drafter, self.truth.shape[1]
        pin = self.truth.is_cuda
        staged = StagedTruth(torch.zeros(len(admitted), width, dtype=torch.int64, pin_memory=pin),
                             torch.zeros(len(admitted), width, dtype=torch.int32, pin_memory=pin),
                             torch.zeros(len(admitted), width, dtype=torch.int32, pin_memory=pin))
        for i, req in enumerate(admitted):
            truth = list(d.truth(req))[:width]
            staged.truth[i, : len(truth)] = torch.tensor(truth, dtype=torch.int64)
            schedule = [d.schedule(req.request_id, j) for j in range(width)]
            staged.num_drafts[i] = torch.tensor([n for n, _ in schedule])
            staged.num_correct[i] = torch.tensor([c for _, c in schedule])
        return staged

    def admit(self, idx: torch.Tensor, staged: StagedTruth | None) -> None:
        if staged is not None:
            non_blocking = self.truth.is_cuda  # pinned at staging, so the copy does not wait for the device
            self.truth[idx] = staged.truth.to(self.truth.device, non_blocking=non_blocking)
            self.num_correct[idx] = staged.num_correct.to(self.truth.device, non_blocking=non_blocking)
            self.num_drafts[idx] = staged.num_drafts.to(self.truth.device, non_blocking=non_blocking)

    def propose(self, d: DraftInputs) -> DraftOutputs:
        """Drafts for the sampling rows into ``state.draft_tokens``; other rows keep theirs. With scripted
        counts ("gaps") also how many (the columns past a row's count hold ids inside the vocabulary)."""
        st, k, vocab = self.ctx.state, self.drafter.num_speculative_tokens, self.drafter.vocab_size
        r = d.idx
        m = (st.num_tokens[r] - st.num_prompt[r]).long()  # drafts stand for outputs m, m+1, ...
        width = self.truth.shape[1]
        cols = m[:, None] + torch.arange(k, device=r.device)[None, :]
        truth = self.truth[r[:, None], cols.clamp(max=width - 1)]
        truth = torch.where(cols < width, truth, torch.zeros_like(truth))
        c = self.num_correct[r, m.clamp(max=width - 1)]
        j = torch.arange(k, device=r.device)[None, :]
        drafts = torch.where(j < c[:, None].long(), truth, (truth + 1) % vocab)
        counts = self.num_drafts[r, m.clamp(max=width - 1)].long() if self.drafter.scripts_counts else None
        return DraftOutputs(drafts, None, st.last_sampled[r][:, None], num_drafts=counts)
