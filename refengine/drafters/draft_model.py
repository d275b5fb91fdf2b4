"""Draft models: a separate checkpoint of any registered family, with the target's vocabulary, proposes
K tokens as its own greedy continuation.

The draft model keeps caches of its own beside the target's (``cache_specs``: ModelCaches keys
``"draft.<layer>"``): a paged KV cache per attention layer, in the target's blocks, and for a hybrid
draft model recurrent state in the request's slots s_0..s_K under the target's contract. Per step:

1. **first pass**: the draft model runs over the committed tokens at the positions the step kept (a
   prompt chunk's whole query, a verify row's kept tokens) with the target's own step metadata, so its
   recurrent layers write s_j after token j and, after a verify that kept a tokens, its state is read at
   s_{a-1} like the target's: a rejected draft never leaves state behind (the async engine runs the
   step's whole query, as the target did; the positions past the kept ones are never read);
2. **chain** (rows that sampled): K single-token passes from the state after the last kept token,
   feeding the token just sampled (the bonus) and then each draft; draft i is the argmax after the
   i-th. The chain's recurrent state lives in a scratch slot of the request (``scratch_slots``, rows
   past the S slots of the pool), copied from the live state first, so the chain never writes a slot
   the next verify reads or the prefix cache checkpoints. Its KV writes land at positions past the
   committed ones, which the next step's first pass writes again.

A position's draft KV depends on the tokens up to it only, so the prefix cache keys blocks as without a
drafter (no lookahead: vLLM drops no matched block for ``draft_model`` either).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import PAD_SLOT_ID
from refengine.drafters.base import (
    DeviceDraftContext,
    DraftInputs,
    DraftOutputs,
    HostDraftContext,
    Proposal,
    attn_shapes,
)
from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentGroup, RecurrentMetadata
from refengine.model.cache_specs import WINDOW, PagedKV, RecurrentState

CACHE_PREFIX = "draft."  # ModelCaches key of draft layer i: "draft.<i>"


class ScratchRecurrentState(RecurrentState):
    """A draft layer's recurrent state: the pool's S slots, then S scratch slots (request slot s_0's at
    S + s_0) and a sink scratch slot (2S) for rows that chain nothing."""

    def allocate(self, num_slots: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        return super().allocate(2 * num_slots + 1, dtype, device)


def scratch_slots(states: dict, slot0: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[N] int64 the scratch slot of each row (``slot0`` [N] its request's s_0; the sink scratch where
    ``live`` [N] bool is False); every draft state tensor has 2S+1 rows."""
    first = next(iter(states.values()))[0]
    s = (first.shape[0] - 1) // 2
    return torch.where(live, s + slot0.long(), torch.full_like(slot0.long(), 2 * s))


@dataclass
class DraftModelDrafter:
    num_speculative_tokens: int
    path: str  # the draft checkpoint directory
    vocab_size: int  # the target's
    method: str = "draft_model"
    uses_kv_cache: bool = False  # no KV under the target's drafter key ("mtp"): its caches are its own
    model: object = field(default=None, repr=False)  # the draft model, loaded by check_model
    config: object = field(default=None, repr=False)  # its config view

    def check_model(self, model) -> None:
        """Load the draft model onto the target's device and dtype; refuse another vocabulary size."""
        if self.model is None:
            from refengine.model import load_model

            weight = _embedding_weight(model)
            self.model, self.config = load_model(self.path, dtype=weight.dtype, device=weight.device)
        if self.config.vocab_size != self.vocab_size:
            raise ValueError(f"draft_model {self.path!r} has vocab_size {self.config.vocab_size}, the target "
                             f"model {self.vocab_size}: a draft model needs the target's vocabulary")

    def layer_keys(self, num_speculative_tokens: int) -> dict:
        """Draft layer cache key (the model's own, an int) -> its ModelCaches key."""
        from refengine.model.registry import cache_specs

        keys = cache_specs(self.config, num_speculative_tokens, False)
        return {key: f"{CACHE_PREFIX}{key}" for key in keys}

    def cache_specs(self, target_cfg, num_speculative_tokens: int) -> dict:
        from refengine.model.registry import cache_specs

        out = {}
        for key, spec in cache_specs(self.config, num_speculative_tokens, False).items():
            if isinstance(spec, RecurrentState):
                spec = ScratchRecurrentState(spec.shapes, spec.fp32, spec.checkpoint)
            elif not isinstance(spec, PagedKV):
                raise TypeError(f"draft layer {key!r}: unknown cache declaration {type(spec).__name__}")
            out[f"{CACHE_PREFIX}{key}"] = spec
        return out

    def host_proposer(self, ctx: HostDraftContext) -> DraftModelHostProposer:
        return DraftModelHostProposer(self, ctx)

    def device_proposer(self, ctx: DeviceDraftContext) -> DraftModelDeviceProposer:
        return DraftModelDeviceProposer(self, ctx)


def _embedding_weight(model) -> torch.Tensor:
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            return module.weight
    raise ValueError("draft_model: the target model has no input embedding to take the device and dtype "
                     "from")


class DraftCaches:
    """The draft model's view of the engine's caches: its layers' own keys -> the ModelCaches entries."""

    def __init__(self, drafter: DraftModelDrafter, caches, num_speculative_tokens: int):
        keys = drafter.layer_keys(num_speculative_tokens)
        self.kv = {i: caches.kv[k] for i, k in keys.items() if k in caches.kv}
        self.states = {i: caches.states[k] for i, k in keys.items() if k in caches.states}
        self.kinds = {i: caches.checkpoint_kinds[k] for i, k in keys.items() if k in caches.states}
        self.num_speculative_tokens = num_speculative_tokens

    def context(self, attn: AttnMetadata, recurrent: RecurrentMetadata, chunked: bool) -> ForwardContext:
        return ForwardContext(attn=attn, recurrent=recurrent, kv_caches=self.kv, states=self.states,
                              recurrent_prefill_chunked=chunked)

    def to_scratch(self, slot0: torch.Tensor, column: torch.Tensor, src: torch.Tensor,
                   dst: torch.Tensor) -> None:
        """Copy the state after each row's token ``column`` into its scratch slot ``dst``: a window's
        columns ``column ..`` of ``slot0``, a slot tensor of ``src`` (the row's s_column). All [N] int64."""
        for layer, tensors in self.states.items():
            for t, kind in zip(tensors, self.kinds[layer]):
                if kind == WINDOW:
                    width = t.shape[-1] - self.num_speculative_tokens  # W-1
                    cols = column[:, None] + torch.arange(width, device=column.device)  # [N, W-1]
                    rows = t[slot0]  # [N, ..., W-1+K]
                    index = cols.view(cols.shape[0], *([1] * (rows.dim() - 2)), width)
                    t[dst, ..., :width] = rows.gather(-1, index.expand(*rows.shape[:-1], width))
                else:
                    t[dst] = t[src]


def chain_metadata(live: torch.Tensor, positions: torch.Tensor, scratch: torch.Tensor,
                   block_table: torch.Tensor, sink_block: int, block_size: int,
                   k: int) -> tuple[torch.Tensor, AttnMetadata, RecurrentMetadata]:
    """One chained pass: a token per live row (``live`` [N] bool), live rows first on the token axis.

    ``positions`` [N] int64 the position each row feeds, ``scratch`` [N] int64 its scratch slot,
    ``block_table`` [N, B] int32 its blocks. Returns (order [N]: token t -> row, attention and
    recurrent metadata); rows not live run zero tokens and touch nothing (NULL slot, sink blocks).
    """
    n, dev = live.shape[0], live.device
    qsl = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    qsl[1:] = live.to(torch.int32).cumsum(0)
    order = torch.argsort((~live).to(torch.int32), stable=True)  # [N] token t -> row
    table = torch.where(live[:, None], block_table, torch.full_like(block_table, sink_block))
    column = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table.gather(1, column[:, None])[:, 0]
    slots = torch.where(live, blocks.long() * block_size + positions % block_size,
                        torch.full_like(positions, PAD_SLOT_ID))
    seq_lens = torch.where(live, positions + 1, torch.zeros_like(positions)).to(torch.int32)
    attn = AttnMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots[order])
    state = torch.where(live, scratch, torch.full_like(scratch, PAD_SLOT_ID)).to(torch.int32)
    recurrent = RecurrentMetadata(decode=RecurrentGroup(
        token_indices=torch.arange(n, dtype=torch.int64, device=dev), query_start_loc=qsl,
        state_indices=state[:, None].expand(n, k + 1).contiguous(),
        num_valid=torch.ones(n, dtype=torch.int32, device=dev), token_range=(0, n)))
    return order, attn, recurrent


def run_chain(model, caches: DraftCaches, first: torch.Tensor, live: torch.Tensor, base: torch.Tensor,
              scratch: torch.Tensor, block_table: torch.Tensor, sink_block: int, block_size: int, k: int,
              chunked: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """K chained passes: row r feeds ``first[r]`` at position ``base[r]``, then each draft (all [N] int64).
    Returns (drafts [N, K], ids fed [N, K], the chain's metadata shapes)."""
    fed, drafts, shapes = [first], [], {}
    rank = None
    for step in range(k):
        pos = base + step
        order, attn, recurrent = chain_metadata(live, pos, scratch, block_table, sink_block, block_size, k)
        rank = torch.argsort(order) if rank is None else rank
        shapes.update(attn_shapes("drafter_chain", attn))
        shapes.update({f"drafter_chain.{f}": s for f, s in recurrent.shapes().items()})
        hidden = model(fed[-1][order], pos[order], caches.context(attn, recurrent, chunked))[rank]
        drafts.append(model.compute_logits(hidden).argmax(dim=-1))
        if step + 1 < k:
            fed.append(drafts[-1])
    return torch.stack(drafts, dim=1), torch.stack(fed, dim=1), shapes


class DraftModelHostProposer:
    """The reference engine's draft-model drafting, with plain loops over request state."""

    def __init__(self, drafter: DraftModelDrafter, ctx: HostDraftContext):
        self.drafter, self.ctx = drafter, ctx
        self.caches = DraftCaches(drafter, ctx.caches, ctx.num_speculative_tokens)

    def propose(self, outcomes: list, result) -> list[Proposal]:
        ctx, model, dev = self.ctx, self.drafter.model, self.ctx.device
        k = ctx.num_speculative_tokens
        ids, positions, attn_rows, proposals = [], [], [], []
        prefill = {"tokens": [], "qsl": [0], "slots": [], "init": []}
        decode = {"tokens": [], "qsl": [0], "slots": [], "valid": []}
        for i, o in enumerate(outcomes):  # first pass: every row, over the positions it kept
            rec, nc = result.records[i], result.num_computed_before[i]
            kept, slots = o.num_kept, result.state_slots[i]
            toks = rec.input_ids[:kept]
            group = prefill if rec.kind == "prefill" else decode
            group["tokens"] += range(len(ids), len(ids) + kept)
            group["qsl"].append(len(group["tokens"]))
            if rec.kind == "prefill":
                group["slots"].append(slots[0])
                group["init"].append(rec.has_initial_state)
            else:
                group["slots"].append(slots)
                group["valid"].append(rec.state_offset + 1)
            ids += toks
            positions += range(nc, nc + kept)
            attn_rows.append((result.block_ids[i], list(range(nc, nc + kept)), nc + kept))
            proposals.append(Proposal(None, list(toks)))
        if not outcomes:
            return proposals
        i32, i64 = {"dtype": torch.int32, "device": dev}, {"dtype": torch.int64, "device": dev}
        recurrent = RecurrentMetadata()
        if prefill["slots"]:
            recurrent.prefill = RecurrentGroup(
                torch.tensor(prefill["tokens"], **i64), torch.tensor(prefill["qsl"], **i32),
                torch.tensor(prefill["slots"], **i32),
                has_initial_state=torch.tensor(prefill["init"], dtype=torch.bool, device=dev))
        if decode["slots"]:
            recurrent.decode = RecurrentGroup(
                torch.tensor(decode["tokens"], **i64), torch.tensor(decode["qsl"], **i32),
                torch.tensor(decode["slots"], **i32), num_valid=torch.tensor(decode["valid"], **i32))
        model(torch.tensor(ids, **i64), torch.tensor(positions, **i64),
              self.caches.context(ctx.attn_metadata(attn_rows), recurrent, ctx.recurrent_prefill_chunked))

        sampling = [i for i, o in enumerate(outcomes) if o.tokens is not None and not o.request.is_finished]
        if not sampling:
            return proposals
        outs = [outcomes[i] for i in sampling]
        kept = [o.num_kept for o in outs]
        recs = [result.records[i] for i in sampling]
        slots = [result.state_slots[i] for i in sampling]
        column = [kc - 1 if r.kind == "decode" else 0 for kc, r in zip(kept, recs)]  # the live state's
        base = [result.num_computed_before[i] + kc for i, kc in zip(sampling, kept)]  # the bonus's position
        first = [o.request.all_token_ids[b] for o, b in zip(outs, base)]
        live = torch.ones(len(sampling), dtype=torch.bool, device=dev)
        slot0 = torch.tensor([s[0] for s in slots], **i64)
        scratch = scratch_slots(self.caches.states, slot0, live) if self.caches.states else slot0
        if self.caches.states:
            self.caches.to_scratch(slot0, torch.tensor(column, **i64),
                                   torch.tensor([s[c] for s, c in zip(slots, column)], **i64), scratch)
        width = max(len(result.block_ids[i]) for i in sampling)
        sink = ctx.caches.sink_block
        table = torch.tensor([result.block_ids[i] + [sink] * (width - len(result.block_ids[i]))
                              for i in sampling], **i32)
        drafts, fed, _ = run_chain(model, self.caches, torch.tensor(first, **i64), live,
                                   torch.tensor(base, **i64), scratch, table, sink, ctx.block_size, k,
                                   ctx.recurrent_prefill_chunked)
        for i, d, f in zip(sampling, drafts.tolist(), fed.tolist()):
            proposals[i].drafts = d
            proposals[i].input_ids += f
        return proposals


class DraftModelDeviceProposer:
    """The async engine's draft-model drafting: on the device, part of the step program, static shapes."""

    def __init__(self, drafter: DraftModelDrafter, ctx: DeviceDraftContext):
        self.drafter, self.ctx = drafter, ctx
        self.caches = DraftCaches(drafter, ctx.caches, ctx.num_speculative_tokens)

    def stage(self, admitted: list) -> None:
        return None

    def admit(self, idx: torch.Tensor, staged) -> None:
        return None

    def propose(self, d: DraftInputs) -> DraftOutputs:
        ctx, model, st = self.ctx, self.drafter.model, self.ctx.state
        k, chunked = ctx.num_speculative_tokens, d.recurrent_prefill_chunked
        # First pass: the step's query as the target ran it, with the target's metadata (positions past a
        # row's kept ones write KV that later steps overwrite and state slots nothing reads).
        fed = d.input_ids.clamp(0, ctx.vocab_size - 1) if ctx.check_inputs else d.input_ids
        model(fed, d.positions, self.caches.context(d.attn, d.recurrent, chunked))
        live = d.is_sampling
        real = d.idx >= 0
        slots = torch.where(real[:, None], st.state_slots[d.idx].long(), 0)  # [Np, K+1]
        column = torch.where(d.is_decode & live, d.kept - 1, torch.zeros_like(d.kept)).clamp(0, k)  # [Np]
        live_slot = slots.gather(1, column[:, None])[:, 0]  # [Np] s_column: after the last kept token
        scratch = self.chain_slots(slots[:, 0], live_slot, live) if self.caches.states else slots[:, 0]
        if self.caches.states:
            self.caches.to_scratch(slots[:, 0], column, live_slot, scratch)
        base = self.chain_base(d)
        first = torch.where(live, st.last_sampled[d.idx], torch.zeros_like(st.last_sampled[d.idx]))
        table = st.block_table[d.idx]
        drafts, chain_fed, shapes = run_chain(model, self.caches, first, live, base, scratch, table,
                                              st.sink_block, ctx.block_size, k, chunked)
        return DraftOutputs(drafts, d.input_ids, chain_fed, {**attn_shapes("drafter", d.attn), **shapes})

    def chain_slots(self, slot0: torch.Tensor, live_slot: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """[Np] int64 the slot each row's chain runs in: its scratch slot, never ``live_slot`` (the state
        the next verify reads) nor any other of s_0..s_K (``slot0`` [Np] its s_0; ``live`` [Np] bool)."""
        return scratch_slots(self.caches.states, slot0, live)

    def chain_base(self, d: DraftInputs) -> torch.Tensor:
        """[Np] int64 the position of each row's first chained token: the committed count after this step's
        post-update (the bonus token's position)."""
        return self.ctx.state.num_computed[d.idx].long()
