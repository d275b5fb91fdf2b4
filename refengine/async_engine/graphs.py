"""Graph modes: which steps replay a FULL graph, and the padded sizes every replay is built for.

``none``: eager. ``piecewise``: the token axis is padded to a capture size (everything but the
attention/GDN kernels would be captured), per-request metadata stays unpadded. ``full``: uniform
decode batches (every row a decode of 1+K tokens, no prefill) replay a FULL graph padded to a
capture size *in requests*; other batches run eager. ``full_and_piecewise``: FULL for uniform
decodes, piecewise for the rest. On CPU the same static buffers and padding run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass


def capture_sizes(limit: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if not sizes or sizes[-1] != limit:
        sizes.append(limit)
    return sorted(set(sizes))


def pad_to(sizes: list[int], n: int) -> int | None:
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass(frozen=True)
class StepShape:
    mode: str  # runtime mode: "none" | "piecewise" | "full"
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int


class GraphDispatcher:
    def __init__(self, graph_mode: str, max_num_seqs: int, max_num_batched_tokens: int, num_spec_tokens: int):
        self.graph_mode = graph_mode
        self.k = num_spec_tokens
        self.request_sizes = capture_sizes(max_num_seqs)
        self.token_sizes = capture_sizes(max_num_batched_tokens)

    def is_uniform_decode(self, query_lens: list[int], is_decode: list[bool]) -> bool:
        """Every row a decode of 1+K tokens; a batch with a real prefill never replays a decode graph."""
        return all(is_decode) and all(q == 1 + self.k for q in query_lens)

    def dispatch(self, query_lens: list[int], is_decode: list[bool]) -> StepShape:
        n, t = len(query_lens), sum(query_lens)
        if self.graph_mode in ("full", "full_and_piecewise") and self.is_uniform_decode(query_lens, is_decode):
            n_pad = pad_to(self.request_sizes, n)
            if n_pad is not None:
                return StepShape("full", n, n_pad, t, n_pad * (1 + self.k))
        if self.graph_mode in ("piecewise", "full_and_piecewise"):
            t_pad = pad_to(self.token_sizes, t)
            if t_pad is not None:
                return StepShape("piecewise", n, n, t, t_pad)
        return StepShape("none", n, n, t, t)
