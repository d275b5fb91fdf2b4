"""Request state, owned by the scheduler and read by the runners."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from refengine.logits_process import NONE, Processors
from refengine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop id or stop string that finished it (None: EOS, length)
    processors: Processors = NONE  # the params' logits processors as token ids (set at admission)
    seed: int = 0  # the sampling seed: params.seed, or drawn at admission (``sampling.draw_seed``), reported
    compiled_grammar: object = None  # structured outputs: the engine's compiled grammar (set when added)
    grammar: object = None  # its GrammarState, advanced by the committed outputs (None while it holds none)

    # What the kept tokens advance besides the tokens (``refengine.postprocess``).
    logprobs: list | None = None  # one {id: logprob} per output token when params.logprobs is set
    # when params.prompt_logprobs is set: None, then one {id: logprob} per prompt token after the first,
    # filled in prompt order as chunks are computed (complete when it holds one entry per prompt token)
    prompt_logprobs: list | None = None
    stop_text_checked: int = 0  # characters of the output text already searched for stop strings
    stop_text_end: int | None = None  # the output text ends here (a stop string was found)

    # Progress. ``num_computed_tokens`` counts committed tokens whose KV/state is written.
    num_computed_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens to prefill since (re)admission: len(all_token_ids) then
    draft_token_ids: list[int] = field(default_factory=list)  # drafts for the next verify step
    num_valid: int = 1  # tokens the previous step kept (bonus included); 1 after prefill

    # Resources.
    block_ids: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # s_0..s_K

    # Prefix caching.
    block_keys: list[bytes] = field(default_factory=list)  # key of each full block of all_token_ids so far
    num_shared_tokens: int = 0  # at admission: tokens of its longest run of cached KV blocks (align stops a
    #                             prefill chunk there, so a later request sharing them hits)
    num_cached_tokens: int | None = None  # tokens served from the cache at the first admission

    # Statistics.
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verify step
    num_preemptions: int = 0

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """contract 2: rows of a request still inside its (re)admission prompt run the prefill form."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def has_initial_state(self) -> bool:
        """A request with no computed tokens starts from zero state, whatever its query length."""
        return self.num_computed_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
