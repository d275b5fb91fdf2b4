"""What a drafter is, for both engines.

A ``Drafter`` is the method's configuration (how many tokens it proposes, what it needs from the
model and the caches). Each engine asks it for a proposer of its own kind:

- ``host_proposer``: the reference engine's. After the engine committed a step, it returns the next
  drafts of every request that sampled (a ``Proposal`` per row), reading plain request state; the
  post-step writer (``refengine.postprocess``) writes them.
- ``device_proposer``: the async engine's. It runs on the device timeline right after
  verification, from device-authoritative state only, and returns the next drafts
  (``DraftOutputs.drafts``; the runner writes those of the sampling rows into ``state.draft_tokens``);
  a method that may propose fewer than K (n-gram lookup) reports how many per row
  (``DraftOutputs.num_drafts``) and fills the other columns with ids inside the vocabulary.
  Tables it needs per request (the scripted drafter's truth, say) are its own: staged on the host
  when a request is admitted (``stage``), written on the device (``admit``).

Both proposers see committed tokens only (contract 5: never a placeholder, never -1).
To add a method: one module in this package with its ``Drafter`` class, and one line in
``refengine.drafters.DRAFTERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from refengine.forward_context import AttnMetadata, RecurrentMetadata


class DrafterInputError(ValueError):
    """An id outside the vocabulary was about to reach the drafter (contract 5)."""


@dataclass
class HostDraftContext:
    """What a host proposer may use: the reference runner's model, caches and metadata builder."""

    model: Any
    caches: Any  # ModelCaches
    device: torch.device
    num_speculative_tokens: int
    attn_metadata: Callable[
        [list[tuple[list[int], list[int], int]]], AttnMetadata
    ]  # (blocks, positions, seq_len)
    block_size: int = 0
    recurrent_prefill_chunked: bool = False  # the target's prefill form (a drafter with recurrent layers)


@dataclass
class DeviceDraftContext:
    """What a device proposer may use: the async engine's model, caches and persistent state."""

    model: Any
    caches: Any  # ModelCaches
    state: Any  # DeviceState: num_computed, num_tokens, token_ids, last_sampled, block_table, draft_tokens
    num_speculative_tokens: int
    block_size: int
    vocab_size: int
    device: torch.device
    check_inputs: bool = False  # debug mode: read ids back and refuse bad ones (a device sync)


@dataclass
class DraftInputs:
    """One async step as the device proposer sees it: ``Np`` rows (padded by request count in a FULL
    step), ``Tp`` tokens. Padding rows have request slot -1 (their gathers and scatters hit the
    state's sink row), zero tokens and ``kept`` 0. Nothing here needs a host read, so a proposal
    can be part of a captured step.
    """

    idx: torch.Tensor  # [Np] int64 request slots, -1 for padding rows
    query_start_loc: torch.Tensor  # [Np+1] int32, padding rows repeat the last value
    is_sampling: torch.Tensor  # [Np] bool, rows whose logits picked tokens this step (they get drafts)
    backup_token: torch.Tensor  # [Np] int64, the prompt token after a prompt chunk (host-staged), else -1
    kept: torch.Tensor  # [Np] int64, positions of the row now committed (0 for padding rows)
    input_ids: torch.Tensor  # [Tp] int64
    positions: torch.Tensor  # [Tp] int64
    hidden: torch.Tensor  # [Tp, H] target hidden states (post final norm)
    attn: AttnMetadata  # the target's padded metadata (padding rows inert, contract 6)
    recurrent: RecurrentMetadata | None = None  # the target's padded recurrent metadata of the step
    is_decode: torch.Tensor | None = None  # [Np] bool, rows of the decode group (verify rows)
    recurrent_prefill_chunked: bool = False  # the target's prefill form
    aux_hidden: torch.Tensor | None = None  # [Tp, n*H] the drafter's ``aux_layers`` states, None without
    pieces: object = None  # a piecewise step's piece graphs (``ForwardContext.pieces``); None: eager

    @property
    def num_tokens_padded(self) -> int:
        return self.input_ids.shape[0]

    def last_kept(self) -> torch.Tensor:
        """[Np] the flat index of each row's last kept token; ``Tp`` (one past the end) for rows that
        kept none, so a scatter through it lands outside the real tokens."""
        last = self.query_start_loc[:-1].long() + self.kept - 1
        return torch.where(self.kept > 0, last, torch.full_like(last, self.num_tokens_padded))


@dataclass
class DraftOutputs:
    """What a device proposer returns; the runner writes the drafts of the sampling rows (and their count)
    into ``state.draft_tokens`` / ``state.num_drafts``, so other rows keep theirs."""

    drafts: torch.Tensor  # [Np, K] int64 the next step's drafts per row (filler ids past ``num_drafts``)
    first_pass_ids: torch.Tensor | None  # [Tp] ids fed with the target's hidden states, or None
    chain_ids: torch.Tensor  # [Np, c] ids fed to the chained steps of each row (meaningful for sampling rows)
    metadata_shapes: dict = field(default_factory=dict)  # "group.field" -> shape of per-request metadata
    num_drafts: torch.Tensor | None = None  # [Np] int64 drafts proposed per sampling row (0..K); None: K each


@dataclass
class Proposal:
    """What a host proposer returns for one row of a committed step (it writes nothing itself)."""

    drafts: list[int] | None  # the request's next drafts; None: it gets none (finished, or did not sample)
    input_ids: list[int]  # ids the drafter was fed for the row (for observer records)


class HostProposer(Protocol):
    def propose(self, outcomes: list, result: Any) -> list[Proposal | None]:
        """After the engine committed a step (``outcomes``: its ``refengine.postprocess.RowOutcome``s, the
        runner's ``StepResult``): one proposal per row, None for a row it has nothing for. It reads the
        committed requests and writes nothing; ``refengine.postprocess`` writes the drafts."""


class DeviceProposer(Protocol):
    def stage(self, admitted: list) -> Any:
        """Host side, at scheduling: per-request tables for newly admitted requests (or None)."""

    def admit(self, idx: torch.Tensor, staged: Any) -> None:
        """Device timeline: write what ``stage`` prepared into the proposer's own tables."""

    def propose(self, d: DraftInputs) -> DraftOutputs:
        """Device timeline: the next drafts of every row and, when fewer than K, their count (those of
        rows that do not sample are ignored); static shapes and no host reads, so a FULL step may
        capture it."""


class Drafter(Protocol):
    method: str  # the name it is registered under
    num_speculative_tokens: int  # K
    uses_kv_cache: bool  # needs the target family's MTP KV cache (ModelCaches key "mtp")
    # Optional: ``drops_last_block`` (a prefix-cache hit drops its last matched block: the drafter keeps KV
    # that depends on the token after a block, vLLM's rule for EAGLE-style drafters); ``aux_layers`` (the
    # target layers whose input the runners capture, ``ForwardContext.aux_layers``, and hand over as
    # ``aux_hidden``); ``cache_specs`` (see ``drafter_cache_specs``).

    def check_model(self, model) -> None:
        """Raise ValueError naming the problem when ``model`` cannot serve this drafter."""

    def host_proposer(self, ctx: HostDraftContext) -> HostProposer: ...

    def device_proposer(self, ctx: DeviceDraftContext) -> DeviceProposer: ...


@dataclass
class FirstPass:
    """A head drafter's first pass on the host (MTP, EAGLE): every position a committed step kept that knows
    its next token, paired with that token."""

    ids: list[int]  # the committed token after each such position
    hidden_rows: list[int]  # each position's row in the step's hidden states
    attn_rows: list[tuple[list[int], list[int], int]]  # per step row: (blocks, positions, seq_len)
    proposals: list[Proposal]  # one per step row, drafts None, input ids the row's ``ids``

    @property
    def positions(self) -> list[int]:
        return [p for _, pos, _ in self.attn_rows for p in pos]


def first_pass(outcomes: list, result: Any) -> FirstPass:
    """The first pass of a committed step (``outcomes``, the reference runner's ``StepResult``). A request
    that finished too takes part (its head KV completes its last blocks); one that stopped inside the step
    knows the next token of the positions before its last token only."""
    out = FirstPass([], [], [], [])
    for i, o in enumerate(outcomes):
        req, nc = o.request, result.num_computed_before[i]
        kept = min(nc + o.num_kept, req.num_tokens - 1) - nc  # positions nc .. nc+kept-1, committed
        nxt = req.all_token_ids[nc + 1: nc + kept + 1]
        out.ids += nxt
        out.hidden_rows += range(result.query_start[i], result.query_start[i] + kept)
        out.attn_rows.append((result.block_ids[i], list(range(nc, nc + kept)), nc + kept))
        out.proposals.append(Proposal(None, list(nxt)))
    return out


def drafter_cache_specs(drafter, target_cfg, num_speculative_tokens: int) -> dict:
    """The caches a drafter keeps of its own, beyond the target family's (``"mtp"``): string key ->
    ``PagedKV`` | ``RecurrentState``, allocated in the engine's ``ModelCaches`` beside the target's (a
    recurrent state there shares the request's slots s_0..s_K and the prefix cache's checkpoints). A
    drafter declares them with ``cache_specs(target_cfg, K)``; {} without a drafter or without one."""
    declare = getattr(drafter, "cache_specs", None)
    return {} if declare is None else dict(declare(target_cfg, num_speculative_tokens))


def attn_shapes(group: str, attn: AttnMetadata) -> dict[str, tuple[int, ...]]:
    """``"group.field" -> shape`` of the per-request attention tensors (for the FULL-graph check)."""
    return {f"{group}.query_start_loc": tuple(attn.query_start_loc.shape),
            f"{group}.seq_lens": tuple(attn.seq_lens.shape),
            f"{group}.block_table": tuple(attn.block_table.shape)}


def check_vocab_ids(
    ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    idx: torch.Tensor,
    positions: torch.Tensor,
    vocab_size: int,
) -> None:
    """Refuse ids [T] outside the vocabulary before they reach a drafter, naming slot and position.

    A debugging check: it reads the ids back to the host (a device sync).
    """
    bad = torch.nonzero((ids < 0) | (ids >= vocab_size)).flatten().tolist()
    if bad:
        t = bad[0]
        row = int(torch.searchsorted(query_start_loc[1:], torch.tensor(t, device=ids.device), right=True))
        raise DrafterInputError(
            f"drafter input id {int(ids[t])} (outside [0, {vocab_size})) for request slot "
            f"{int(idx[row])} at position {int(positions[t])}; {len(bad)} bad id(s) in this step")
