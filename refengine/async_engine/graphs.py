"""Graph modes: which steps replay a FULL graph, and the padded sizes every replay is built for.

``none``: eager. ``piecewise``: the token axis is padded to a capture size, per-request metadata
stays unpadded; on CUDA the model's token-wise pieces (``refengine.model.pieces``: projections, norms,
gates, MLPs, residual adds; everything but attention and the recurrent kernels) replay graphs captured
once per padded token count (``PieceGraphs``), the cores and the rest of the step run eagerly; on CPU
all of it runs eagerly on the same padding. ``full``: uniform
decode batches (every row a decode of 1+K tokens, no prefill) run the whole step program (target,
verification, commit, drafting) as one graph padded to a capture size *in requests*; other
batches run eager. ``full_and_piecewise``: FULL for uniform decodes, piecewise padding for the rest.
On CPU the same static buffers and padding run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.async_engine.inputs import StepRows
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
    """A step's sizes. The step program reads only the padded ones; in a FULL step every padded size
    is fixed by ``num_reqs_padded`` (the graph's key), whatever the real ``num_reqs`` / ``num_tokens``."""

    mode: GraphMode  # how this step runs: NONE, PIECEWISE or FULL
    num_reqs: int  # real rows
    num_reqs_padded: int  # rows of every per-request tensor (contract 6)
    num_tokens: int  # real tokens
    num_tokens_padded: int  # rows of every per-token tensor
    num_decode_rows: int  # leading rows that run the decode form (FULL: every padded row)
    num_decode_tokens: int  # tokens of those rows (FULL: every padded token)
    num_logits: int  # verified logits rows: 1 + draft positions summed over the padded rows
    # What the program computes beyond greedy verification (host facts of the planned rows, so part of a FULL
    # graph's key): a row's request has logits processors; a row's request asks for logprobs; a row's
    # request samples (temperature > 0).
    processors: bool = False
    logprobs: bool = False
    sampling: bool = False  # a row samples (a temperature): the seeded sampler runs in the step
    # a row's request has structured outputs: the program runs in two parts (``AsyncRunner.forward``, then
    # ``finish`` once the host built the step's grammar bitmask), two graphs in a FULL step
    grammar: bool = False

    @property
    def graph_key(self) -> tuple[int, bool, bool, bool, bool]:
        """The captured program a FULL step replays: its padded request count and what it computes."""
        return self.num_reqs_padded, self.processors, self.logprobs, self.sampling, self.grammar


class GraphDispatcher:
    def __init__(self, graph_mode: GraphMode, max_num_seqs: int, max_num_batched_tokens: int,
                 num_speculative_tokens: int):
        self.graph_mode = GraphMode(graph_mode)
        self.num_speculative_tokens = num_speculative_tokens
        self.request_sizes = capture_sizes(max_num_seqs)
        self.token_sizes = capture_sizes(max_num_batched_tokens)

    def dispatch(
        self, query_lens: list[int], is_decode: list[bool], num_draft_positions: list[int]
    ) -> StepShape:
        """Rows come decode rows first. A FULL step is a uniform decode (every row a decode of 1+K
        tokens); a batch with a real prefill never replays a decode graph (contract 6)."""
        n, t, k = len(query_lens), sum(query_lens), self.num_speculative_tokens
        uniform = all(is_decode) and all(q == 1 + k for q in query_lens)
        if self.graph_mode.has_full and uniform:
            n_pad = pad_to(self.request_sizes, n)
            if n_pad is not None:
                t_pad = n_pad * (1 + k)
                return StepShape(GraphMode.FULL, n, n_pad, t, t_pad, n_pad, t_pad, t_pad)
        num_decode = sum(is_decode)
        decode_tokens = sum(query_lens[:num_decode])
        logits = n + sum(num_draft_positions)
        if self.graph_mode.has_piecewise:
            t_pad = pad_to(self.token_sizes, t)
            if t_pad is not None:
                return StepShape(GraphMode.PIECEWISE, n, n, t, t_pad, num_decode, decode_tokens, logits)
        return StepShape(GraphMode.NONE, n, n, t, t, num_decode, decode_tokens, logits)


class StepGraphs:
    """FULL steps as one captured program per padded request count.

    Every step's row table lands in the first rows of one device buffer (``table(rows)``: its view, the
    same tensor for the same rows), so a FULL step's graph reads its Np rows at a fixed address; the host
    copies a FULL step's real rows and its padding rows there in one transfer. ``run`` runs the step
    program: on CUDA a FULL step's first run for a padded size captures the program on an all-padding
    table (so the capture writes no cache entry, state slot or request row) and every run replays it;
    everything else runs eagerly, on CPU FULL steps included (on the same tables and padding).
    """

    def __init__(self, device, max_rows: int = 0, width: int = 0):
        self.device = device
        self._buffer = torch.empty(max_rows, width, dtype=torch.int64, device=device)  # [R, F] row tables
        self._tables: dict[int, torch.Tensor] = {}  # rows -> the buffer's first rows [rows, F]
        self._graphs: dict[tuple, tuple] = {}  # StepShape.graph_key -> (graph, outputs)
        self._rows: dict[int, tuple] = {}  # rows -> (its table, the table's StepRows views)

    def table(self, rows: int) -> torch.Tensor:
        """[rows, F] the device row table of a step of ``rows`` padded rows."""
        view = self._tables.get(rows)
        if view is None:
            view = self._tables[rows] = self._buffer[:rows]
        return view

    def rows(self, table: torch.Tensor) -> StepRows:
        """``StepRows.view(table)`` for a table of ``table(rows)``: made once per padded size (the same
        tensor for the same rows, so the same views), a dozen views fewer per eager step."""
        entry = self._rows.get(table.shape[0])
        if entry is None or entry[0] is not table:
            entry = self._rows[table.shape[0]] = (table, StepRows.view(table))
        return entry[1]

    def pad(self, shape: StepShape, table: torch.Tensor, inert: torch.Tensor) -> torch.Tensor:
        """A row table built elsewhere, ``table`` [n, F], padded to the step's device table [Np, F] with
        ``inert`` [F] rows (the same tensor when the step is not FULL: only FULL steps pad)."""
        n, n_pad = shape.num_reqs, shape.num_reqs_padded
        if shape.mode is not GraphMode.FULL:
            assert n == n_pad, "only FULL steps pad requests"
            return table
        static = self.table(n_pad)
        static[:n] = table
        static[n:] = inert
        return static

    def run(self, shape: StepShape, static: torch.Tensor, inert: torch.Tensor, program, part: int = 0,
            then=None):
        """``part``: which part of a program run in parts this is (each its own graph); ``then(outputs)``:
        the next part's program over this part's outputs, captured with this one (on the padding table, the
        outputs holding what padding left, so no graph ever replays twice for one step)."""
        if shape.mode is not GraphMode.FULL or self.device.type != "cuda":
            return program()
        key = (*shape.graph_key, part)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(static, inert, program)
            if then is not None:
                self._graphs[(*shape.graph_key, part + 1)] = self._capture(static, inert, then(entry[1]))
        graph, outputs = entry
        graph.replay()
        return outputs

    def _capture(self, static: torch.Tensor, inert: torch.Tensor, program) -> tuple:
        real = static.clone()
        static.copy_(inert.expand_as(static))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            program()  # warm-up on padding rows only: writes nothing
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = program()
        static.copy_(real)
        return graph, outputs


# vLLM's default largest capture size: a larger step's pieces run eagerly (its device time dwarfs the host's)
MAX_PIECE_TOKENS = 512


class PieceGraphs:
    """A piecewise step's pieces (``refengine.model.pieces``) as graphs: one per piece key and input
    shapes, so per padded token count, captured at its first use and replayed after.

    A piece's inputs that are another piece's outputs are read where that piece left them (a captured
    output sits at one address); any other input (the step's ids, a core's output) is copied into the
    piece's own input buffer before the replay: one copy each. The outputs are the same tensors on every
    replay, so a piece's outputs hold until its next replay, a later step's. All graphs share one memory
    pool (they replay one after another on one stream). ``emulate`` (tests, on CPU): the same bookkeeping
    with a replay that reruns the piece captured first over its input buffers into its output tensors,
    so a piece that read anything but its inputs reads the first step's and the run goes wrong.
    """

    def __init__(self, device, *, emulate: bool = False, max_tokens: int = MAX_PIECE_TOKENS):
        self.device = device
        self.emulate = emulate
        self.max_tokens = max_tokens  # larger steps run their pieces eagerly (their host cost is small)
        # (key, input shapes, dtypes) -> (graph, inputs, borrowed, outputs)
        self._entries: dict[tuple, tuple] = {}
        self._owned: dict[int, torch.Tensor] = {}  # id -> every tensor a graph returns (kept alive)
        self._pool = None
        self.replays = 0  # pieces replayed so far

    def live(self, num_tokens_padded: int) -> bool:
        return (self.device.type == "cuda" or self.emulate) and num_tokens_padded <= self.max_tokens

    def __len__(self) -> int:
        return len(self._entries)

    def token_counts(self) -> set[int]:
        """The padded token counts pieces were captured for (each piece's first input is [T, ...])."""
        return {shapes[0][0][0] for _, shapes in self._entries}

    def __call__(self, key, fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full = (key, tuple((tuple(t.shape), t.dtype) for t in inputs))
        entry = self._entries.get(full)
        if entry is None:
            entry = self._entries[full] = self._capture(fn, inputs)
        graph, static, borrowed, outputs = entry
        for buffer, t, other in zip(static, inputs, borrowed):
            if buffer is t:
                continue
            if other:
                raise RuntimeError(f"piece {key}: an input captured as another piece's output came from "
                                   "elsewhere this step (the forward's data flow changed between steps)")
            buffer.copy_(t)
        graph.replay()
        self.replays += 1
        return outputs

    def _capture(self, fn, inputs: tuple[torch.Tensor, ...]) -> tuple:
        borrowed = tuple(id(t) in self._owned for t in inputs)  # another piece's outputs, read in place
        static = tuple(t if other else t.clone() for t, other in zip(inputs, borrowed))
        if self.emulate:
            graph = _Replayed(fn, static)
            outputs = graph.outputs
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*static)  # warm-up (kernels compiled outside the capture); a piece writes only its outputs
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = tuple(fn(*static))
        self._owned.update((id(t), t) for t in outputs)
        return graph, static, borrowed, outputs


class _Replayed:
    """A CPU stand-in for a captured piece: ``replay`` reruns the first piece over its input buffers and
    writes the results into the output tensors it made at capture."""

    def __init__(self, fn, static: tuple[torch.Tensor, ...]):
        self.fn, self.static = fn, static
        self.outputs = tuple(t if any(t is s for s in static) else t.clone() for t in fn(*static))

    def replay(self) -> None:
        for out, t in zip(self.outputs, self.fn(*self.static)):
            if out is not t:
                out.copy_(t)
