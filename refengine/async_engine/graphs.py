"""Graph modes: which steps replay a FULL graph, and the padded sizes every replay is built for.

``none``: eager. ``piecewise``: the token axis is padded to a capture size (everything but the
attention/GDN kernels would be captured), per-request metadata stays unpadded. ``full``: uniform
decode batches (every row a decode of 1+K tokens, no prefill) replay a FULL graph padded to a
capture size *in requests*; other batches run eager. ``full_and_piecewise``: FULL for uniform
decodes, piecewise for the rest. On CPU the same static buffers and padding run eagerly.
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


class CudaGraphs:
    """FULL-mode capture and replay on CUDA: one graph per padded request count.

    Everything a replay reads lives in static buffers allocated at capture: the step's input ids
    and positions, the attention metadata and the decode group's GDN metadata; the caches are
    persistent already. Capture runs on inert metadata (every slot ``PAD_SLOT_ID``, every row empty)
    so it writes no cache entry and no state slot; each replay first copies the real metadata in.
    On CPU, or outside FULL steps, the model runs eagerly on the same padded tensors.
    """

    def __init__(self):
        self._entries: dict[int, tuple] = {}  # padded requests -> (graph, static inputs, static output)

    def run(self, model, input_ids, positions, ctx, shape: StepShape):
        if input_ids.device.type != "cuda" or shape.mode is not GraphMode.FULL:
            return model(input_ids, positions, ctx)
        entry = self._entries.get(shape.num_reqs_padded)
        if entry is None:
            entry = self._capture(model, input_ids, positions, ctx)
            self._entries[shape.num_reqs_padded] = entry
        graph, static, output = entry
        for dst, src in zip(static, _graph_inputs(input_ids, positions, ctx)):
            dst.copy_(src)
        graph.replay()
        return output

    def _capture(self, model, input_ids, positions, ctx):
        import torch

        from kernels import PAD_SLOT_ID

        static_ids, static_pos = input_ids.clone(), positions.clone()
        static_ctx = _clone_context(ctx)
        inert = (static_ctx.attn.slot_mapping, static_ctx.recurrent.decode.state_indices)
        for t in inert:
            t.fill_(PAD_SLOT_ID)
        static_ctx.attn.query_start_loc.zero_()
        static_ctx.recurrent.decode.query_start_loc.zero_()
        static_ctx.attn.seq_lens.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static_ids, static_pos, static_ctx)  # warm-up on inert metadata: writes nothing
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = model(static_ids, static_pos, static_ctx)
        return graph, _graph_inputs(static_ids, static_pos, static_ctx), output


def _graph_inputs(input_ids, positions, ctx) -> list:
    a, d = ctx.attn, ctx.recurrent.decode
    tensors = [input_ids, positions, a.query_start_loc, a.seq_lens, a.block_table, a.slot_mapping,
               d.token_indices, d.query_start_loc, d.state_indices]
    if d.num_accepted_tokens is not None:
        tensors.append(d.num_accepted_tokens)
    return tensors


def _clone_context(ctx):
    from dataclasses import replace

    attn = replace(ctx.attn, **{f: getattr(ctx.attn, f).clone()
                                for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")})
    d = ctx.recurrent.decode
    decode = replace(d, token_indices=d.token_indices.clone(), query_start_loc=d.query_start_loc.clone(),
                     state_indices=d.state_indices.clone(),
                     num_accepted_tokens=None if d.num_accepted_tokens is None else d.num_accepted_tokens.clone())
    return replace(ctx, attn=attn, recurrent=replace(ctx.recurrent, decode=decode, prefill=None))
