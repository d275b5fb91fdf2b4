"""N-gram (prompt lookup) drafting: propose what followed the request's last n tokens earlier on.

Over a request's committed tokens ``t[0:N]`` (prompt and outputs), for n from
``prompt_lookup_max`` down to ``prompt_lookup_min``: the pattern is the last n tokens
``t[N-n:N]``, and a match is an earlier window ``t[s:s+n]`` equal to it with ``s + n < N`` (the
pattern itself is not a match; a match may overlap it). The largest n that has a match wins and,
among its matches, the earliest one (smallest ``s``): vLLM's ``NgramProposer`` picks the same
(longest n-gram, earliest occurrence). The drafts are the tokens after the match,
``t[s+n : s+n+c]`` with ``c = min(K, N - (s+n), max_model_len - N)``: fewer than K when the
sequence ends first, and none when no n matches or the request is at ``max_model_len``. So a
request may verify K drafts in one step and none in the next.

``ngram_lookup`` (plain Python, the reference engine's) is the readable definition;
``ngram_lookup_batch`` is the same lookup over a padded table of rows in torch (the async engine's,
no host reads, so a FULL step can capture it). Both must propose exactly the same drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.drafters.base import (
    DeviceDraftContext,
    DraftInputs,
    DraftOutputs,
    HostDraftContext,
    Proposal,
)

FILLER_TOKEN = 0  # what a draft column past a row's proposed drafts holds: an id in every vocabulary


def ngram_lookup(
    tokens: list[int],
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    num_speculative_tokens: int,
    max_model_len: int,
) -> list[int]:
    """The drafts for a request whose committed tokens are ``tokens`` (0..K of them)."""
    n_tokens = len(tokens)
    room = max(min(num_speculative_tokens, max_model_len - n_tokens), 0)
    for n in range(min(prompt_lookup_max, n_tokens - 1), prompt_lookup_min - 1, -1):
        pattern = tokens[n_tokens - n:]
        for s in range(n_tokens - n):  # s + n < N: at least one token follows the match
            if tokens[s: s + n] == pattern:
                return tokens[s + n: s + n + room]
    return []


def ngram_lookup_batch(token_ids: torch.Tensor, num_tokens: torch.Tensor, prompt_lookup_min: int,
                       prompt_lookup_max: int, num_speculative_tokens: int, max_model_len: int,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ngram_lookup`` for every row of ``token_ids`` [N, L] (row i's committed tokens are its first
    ``num_tokens[i]``; whatever follows is never read as a token of the row).

    Returns ``drafts`` [N, K] int64 (``FILLER_TOKEN`` past each row's count) and ``counts`` [N] int64.

    A match is seen from where it ends: for every end ``e`` (the first draft position),
    ``length[e]`` is how many tokens before ``e`` equal the tokens before ``N``, up to
    ``prompt_lookup_max``; ends run over ``1 <= e < N`` (``e = N`` is the pattern itself). The longest
    length wins (it is the largest n with a match) and, among ends of that length, the first.
    """
    rows, width = token_ids.shape
    k = num_speculative_tokens
    dev = token_ids.device
    n_tok = num_tokens.long()[:, None]  # [N, 1]
    end = torch.arange(width, device=dev)[None, :]  # [1, L] candidate first draft position
    run = torch.ones(rows, width, dtype=torch.bool, device=dev)  # [N, L] the last j tokens matched so far
    length = torch.zeros(rows, width, dtype=torch.int64, device=dev)  # [N, L] matched tokens before each end
    for j in range(1, prompt_lookup_max + 1):
        before_end = token_ids.gather(1, (end - j).clamp(min=0).expand(rows, width))  # [N, L] t[e-j]
        before_n = token_ids.gather(1, (n_tok - j).clamp(min=0))  # [N, 1] t[N-j]
        run = run & (end - j >= 0) & (before_end == before_n)
        length += run.long()
    length = torch.where((end >= 1) & (end < n_tok), length, torch.zeros_like(length))
    best = length.max(dim=1).values  # [N] the longest n-gram that matched (0: none)
    first = (length == best[:, None]).long().argmax(dim=1)  # [N] the earliest end of that length
    room = torch.minimum(n_tok[:, 0] - first, max_model_len - n_tok[:, 0]).clamp(min=0, max=k)
    counts = torch.where(best >= prompt_lookup_min, room, torch.zeros_like(room))  # [N]
    cols = torch.arange(k, device=dev)[None, :]  # [1, K]
    drafts = token_ids.gather(1, (first[:, None] + cols).clamp(max=width - 1))  # [N, K]
    drafts = torch.where(cols < counts[:, None], drafts, torch.full_like(drafts, FILLER_TOKEN))
    return drafts, counts


@dataclass
class NgramDrafter:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_model_len: int
    method: str = "ngram"
    uses_kv_cache: bool = False

    def __post_init__(self):
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"drafter 'ngram': {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"drafter 'ngram': prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def check_model(self, model) -> None:
        return None  # it reads only the request's tokens

    @property
    def verify_limit(self) -> int:
        """The length the lookup treats as the model's: a verify row of a request with N tokens runs N-1
        plus its drafts and must stay under ``max_model_len`` with the token it samples, so at most
        ``max_model_len - N - 1`` drafts are verified (vLLM's scheduler trims to this; its proposer
        alone would give one more)."""
        return self.max_model_len - 1

    def lookup(self, tokens: list[int]) -> list[int]:
        return ngram_lookup(
            tokens,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.num_speculative_tokens,
            self.verify_limit,
        )

    def host_proposer(self, ctx: HostDraftContext) -> NgramHostProposer:
        return NgramHostProposer(self)

    def device_proposer(self, ctx: DeviceDraftContext) -> NgramDeviceProposer:
        return NgramDeviceProposer(self, ctx)


class NgramHostProposer:
    """The reference engine's lookup: plain Python over each request's committed tokens."""

    def __init__(self, drafter: NgramDrafter):
        self.drafter = drafter

    def propose(self, outcomes: list, result) -> list[Proposal | None]:
        """Drafts for every row that sampled and still runs, from its committed tokens."""
        return [Proposal(self.drafter.lookup(o.request.all_token_ids), [o.request.all_token_ids[-1]])
                if o.tokens is not None and not o.request.is_finished else None
                for o in outcomes]


class NgramDeviceProposer:
    """The async engine's lookup over the device's committed tokens of every row (no tables of its own)."""

    def __init__(self, drafter: NgramDrafter, ctx: DeviceDraftContext):
        self.drafter = drafter
        self.ctx = ctx

    def stage(self, admitted: list) -> None:
        return None

    def admit(self, idx: torch.Tensor, staged) -> None:
        return None

    def propose(self, d: DraftInputs) -> DraftOutputs:
        """Drafts and their count for the sampling rows (other rows keep theirs); fillers past the count."""
        st, g = self.ctx.state, self.drafter
        r = d.idx
        drafts, counts = ngram_lookup_batch(st.token_ids[r], st.num_tokens[r], g.prompt_lookup_min,
                                            g.prompt_lookup_max, g.num_speculative_tokens, g.verify_limit)
        return DraftOutputs(drafts, None, st.last_sampled[r][:, None], num_drafts=counts)
