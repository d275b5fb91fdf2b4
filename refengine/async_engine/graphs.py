"""Graph modes: which steps replay a FULL graph, and the padded sizes every replay is built for.

``none``: eager. ``piecewise``: the token axis is padded to a capture size, per-request metadata
stays unpadded; nothing is captured (on CUDA too): it reproduces the padding a piecewise capture
would need, so its effects on the kernels are tested, but it runs eagerly. ``full``: uniform
decode batches (every row a decode of 1+K tokens, no prefill) run the whole step program (target,
verification, commit, drafting) as one graph padded to a capture size *in requests*; other
batches run eager. ``full_and_piecewise``: FULL for uniform decodes, piecewise padding for the rest.
On CPU the same static buffers and padding run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.config import GraphMode


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
    mode: GraphMode  # how this step runs: NONE, PIECEWISE or FULL
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int


class GraphDispatcher:
    def __init__(self, graph_mode: GraphMode, max_num_seqs: int, max_num_batched_tokens: int, num_spec_tokens: int):
        self.graph_mode = GraphMode(graph_mode)
        self.k = num_spec_tokens
        self.request_sizes = capture_sizes(max_num_seqs)
        self.token_sizes = capture_sizes(max_num_batched_tokens)

    def is_uniform_decode(self, query_lens: list[int], is_decode: list[bool]) -> bool:
        """Every row a decode of 1+K tokens; a batch with a real prefill never replays a decode graph."""
        return all(is_decode) and all(q == 1 + self.k for q in query_lens)

    def dispatch(self, query_lens: list[int], is_decode: list[bool]) -> StepShape:
        n, t = len(query_lens), sum(query_lens)
        if self.graph_mode.has_full and self.is_uniform_decode(query_lens, is_decode):
            n_pad = pad_to(self.request_sizes, n)
            if n_pad is not None:
                return StepShape(GraphMode.FULL, n, n_pad, t, n_pad * (1 + self.k))
        if self.graph_mode.has_piecewise:
            t_pad = pad_to(self.token_sizes, t)
            if t_pad is not None:
                return StepShape(GraphMode.PIECEWISE, n, n, t, t_pad)
        return StepShape(GraphMode.NONE, n, n, t, t)


class StepGraphs:
    """FULL steps as one graph per padded request count: target forward, greedy verification, the
    device-side commit and every draft pass, from static input tables to static outputs.

    ``run(key, inputs, program)``: ``inputs`` are the static input buffers the caller has filled,
    ``program()`` reads only them and persistent state and returns a dict of output tensors. On CUDA
    the first call for a key captures ``program`` on inert inputs (every row a padding row, so the
    capture writes no cache entry, state slot or request row) and every call replays it; elsewhere
    ``program`` runs eagerly on the same static buffers.
    """

    def __init__(self, device):
        self.device = device
        self._entries: dict[int, tuple] = {}  # key -> (graph, outputs)

    def run(self, key: int, inputs: dict, inert: dict, program) -> dict:
        if self.device.type != "cuda":
            return program()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._capture(inputs, inert, program)
        graph, outputs = entry
        graph.replay()
        return outputs

    def _capture(self, inputs: dict, inert: dict, program) -> tuple:
        import torch

        real = {name: t.clone() for name, t in inputs.items()}
        for name, t in inputs.items():
            t.copy_(inert[name])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            program()  # warm-up on inert inputs: writes nothing
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = program()
        for name, t in inputs.items():
            t.copy_(real[name])
        return graph, outputs
