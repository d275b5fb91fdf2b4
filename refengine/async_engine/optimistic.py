"""The async engine's host-side optimistic bookkeeping. Never an input to the device.

Under asynchronous scheduling the host plans step N+1 before step N's verifier output is known,
so it assumes every scheduled draft is accepted: ``num_computed_tokens`` and the placeholder count
run ahead, and the drafts of a request are placeholders (-1). These values are upper bounds that
only steer scheduling (how many tokens a request may still need, which blocks to reserve). Positions,
slot mappings, state offsets and drafter inputs come from the device's authoritative state
(contracts 3 and 4 in refengine/README.md); everything optimistic lives here so it is easy to see what must
never feed them. ``settle`` corrects the host view once a step's output arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.postprocess import RowOutcome
from refengine.request import Request
from refengine.scheduler import ScheduledRow

PLACEHOLDER = -1  # a draft the host has not seen yet


@dataclass(eq=False)
class AsyncRequest(Request):
    idx: int = -1  # request slot of the persistent device state; -1 while not running
    num_output_placeholders: int = 0  # optimistic tokens scheduled but not yet confirmed
    num_staged_blocks: int = 0  # block ids the device table already has


def scheduled_num_tokens(req: AsyncRequest) -> int:
    """The scheduler's view of a request's length: committed tokens plus optimistic placeholders."""
    return req.num_tokens + req.num_output_placeholders


def assume_accepted(row: ScheduledRow, num_speculative_tokens: int) -> None:
    """At planning: count every scheduled token as computed and every draft as accepted."""
    req = row.request
    if row.samples:
        req.num_output_placeholders += 1 + len(row.draft_token_ids)
        req.draft_token_ids = [PLACEHOLDER] * num_speculative_tokens
    req.num_computed_tokens += row.num_tokens


def settle(outcome: RowOutcome) -> None:
    """At processing, for a running request: take back what planning assumed of the row; the post-step
    writer (``refengine.postprocess``) then adds what the verifier kept."""
    req, row = outcome.request, outcome.row
    if row.samples:
        req.num_output_placeholders -= 1 + len(row.draft_token_ids)
    req.num_computed_tokens -= row.num_tokens


def forget(req: AsyncRequest) -> None:
    """On preemption: the request starts over from its committed tokens."""
    req.num_output_placeholders = 0
