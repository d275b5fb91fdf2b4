"""What the engines hand back: finished requests, and a per-step record for observers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    num_draft_tokens: int  # drafts proposed and verified
    num_accepted_tokens: int  # drafts accepted (bonus tokens not included)
    acceptance: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verify step
    num_preemptions: int = 0
    text: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission (as vLLM)
    logprobs: list[dict[int, float]] | None = None  # per output token: top-n ids and the chosen one -> raw
    #                                                 logprob; None unless SamplingParams.logprobs is set
    # None, then per prompt token after the first: top-n ids and the token itself -> the raw logprob of it
    # given the prompt before it (vLLM's prompt_logprobs); None unless SamplingParams.prompt_logprobs is set
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: int | str | None = None  # the stop id or stop string that finished it; None for EOS, length
    seed: int | None = None  # the sampling seed its noise used (SamplingParams.seed, or drawn at admission)


@dataclass
class RowRecord:
    """One scheduled row of one step, as the model saw it."""

    request_id: str
    kind: str  # "prefill" | "decode"
    has_initial_state: bool
    num_computed_tokens: int  # before the step
    query_len: int
    input_ids: list[int]
    positions: list[int]
    state_slot_read: int | None  # recurrent state slot the initial state came from; None for a zero state
    # column of the request's state slots read: num_valid - 1, num_valid being the tokens the previous
    # verify step kept, bonus included (as handed to the recurrent kernels; refengine/README.md's glossary);
    # 0 for prefill rows
    state_offset: int
    draft_token_ids: list[int]  # drafts verified in this step
    output_token_ids: list[int] | None  # verifier output (valid tokens), None for a partial prefill
    num_accepted: int | None  # accepted drafts, None for a partial prefill
    logits_digest: str | None = None  # hash of the verify logits' bytes (bitwise comparison across engines)
    logits_finite: bool | None = None  # every verify logit of the row is finite (None: nothing sampled)
    drafter_input_ids: list[int] = field(default_factory=list)  # every id the drafter was fed for this row
    next_draft_token_ids: list[int] = field(default_factory=list)  # drafts proposed for the next step


@dataclass
class StepRecord:
    step_index: int
    rows: list[RowRecord]
    preempted: list[str] = field(default_factory=list)  # requests preempted when this step was scheduled
    graph_mode: str = "none"  # graph mode the step ran in: "none" | "piecewise" | "full"
    num_reqs_padded: int | None = None  # rows the step's per-request tensors were sized for (graph padding)
    # "group.field" -> shape of each per-request tensor handed to the recurrent and attention kernels
    metadata_shapes: dict = field(default_factory=dict)
    resumed: list[str] = field(default_factory=list)  # requests readmitted after a preemption in this step


def logits_digest(logits: torch.Tensor) -> str:
    """A short hash of a row's logits bytes: equal digests mean bitwise-equal logits."""
    return hashlib.blake2b(logits.detach().cpu().contiguous().numpy().tobytes(), digest_size=8).hexdigest()
