"""The scripted drafter: the true greedy continuation, right for a scripted number of tokens.

Given each request's plain greedy output (from a K=0 run; speculation is lossless, so it is also
the output of the run being drafted for), it proposes the next K true tokens, of which only the
first ``c`` are kept and the rest are replaced by wrong tokens. ``c`` comes from a deterministic
schedule keyed by (request id, number of output tokens committed when drafting), so every accepted
count 0..K is reachable on purpose and both engines see exactly the same drafts at the same point
of a request, however their steps (and preemptions) split its history.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from refengine.request import Request

PATTERNS = ("hash", "all-accept", "all-reject", "cycle")


class ScriptedDrafter:
    def __init__(self, num_spec_tokens: int, vocab_size: int, pattern: str | Callable[[str, int], int] = "hash"):
        """``pattern``: a name from PATTERNS, or (request id, committed outputs) -> correct drafts."""
        if isinstance(pattern, str) and pattern not in PATTERNS:
            raise ValueError(f"scripted drafter pattern must be one of {PATTERNS} or a callable, got {pattern!r}")
        self.k = num_spec_tokens
        self.vocab_size = vocab_size
        self.pattern = pattern
        self.truth: dict[str, list[int]] = {}  # request id -> plain greedy output tokens

    def num_correct(self, request_id: str, position: int) -> int:
        """Correct drafts proposed when ``position`` output tokens are committed."""
        k = self.k
        if callable(self.pattern):
            c = int(self.pattern(request_id, position))
        elif self.pattern == "all-accept":
            c = k
        elif self.pattern == "all-reject":
            c = 0
        elif self.pattern == "cycle":
            c = position % (k + 1)
        else:
            digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
            c = int.from_bytes(digest, "little") % (k + 1)
        if not 0 <= c <= k:
            raise ValueError(f"scripted drafter: {c} correct drafts is outside 0..{k}")
        return c

    def propose(self, req: Request) -> list[int]:
        truth = self.truth.get(req.request_id)
        if truth is None:
            raise KeyError(f"scripted drafter has no reference output for request {req.request_id!r}")
        last = req.all_token_ids[-1]
        if not 0 <= last < self.vocab_size:
            raise ValueError(f"drafter input {last} for request {req.request_id!r} is outside the vocabulary")
        m = len(req.output_token_ids)  # drafts stand for outputs m, m+1, ...
        c = self.num_correct(req.request_id, m)
        drafts = []
        for j in range(self.k):
            true = truth[m + j] if m + j < len(truth) else 0
            drafts.append(true if j < c else (true + 1) % self.vocab_size)
        return drafts
