"""The Mamba2 bug record (vLLM's Nemotron-H / Mamba2 hybrids), re-created in the Mamba2 mixer.

Each mutant wraps ``_run_group`` of every ``Mamba2Mixer`` of one async engine's model (an instance
attribute; the class and the reference engine's model are untouched) and breaks one rule of how a
step's rows reach the Mamba2 kernels. They declare their family: ``run_mutant`` runs them on the
tiny Nemotron-H (``tiny:nemotron_h``, with an MTP head) unless the model given is a Nemotron-H.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from conformance.mutants.base import Mutant
from refengine.forward_context import RecurrentGroup
from refengine.model.nemotron_h.mamba2 import Mamba2Mixer

FAMILY = "nemotron_h"


@dataclass(frozen=True)
class FamilyMutant(Mutant):
    family: str = FAMILY  # the model family it patches; runs on that family's tiny model by default


def _wrap_groups(engine, wrap) -> None:
    """Replace each Mamba2 mixer's ``_run_group`` with ``wrap(run, mixer) -> run``."""
    mixers = [m for m in engine.model.modules() if isinstance(m, Mamba2Mixer)]
    if not mixers:
        raise ValueError("this mutant patches the Mamba2 mixer; the model has none")
    for mixer in mixers:
        mixer._run_group = wrap(mixer._run_group, mixer)


def _lengths(group: RecurrentGroup) -> torch.Tensor:  # [Ng] tokens per row
    qsl = group.query_start_loc
    return qsl[1:] - qsl[:-1]


def _short_prompt_uninitialised(engine) -> None:
    """#32716: a new prompt of at most K+2 tokens is taken for a decode by its length, so its Mamba
    state is never initialised: the prefill starts from whatever its slot last held."""
    limit = engine.config.speculative.num_speculative_tokens + 2

    def wrap(run, mixer):
        def run_group(group, is_prefill, *args):
            if is_prefill and group.has_initial_state is not None:
                group = replace(group, has_initial_state=group.has_initial_state | (_lengths(group) <= limit))
            return run(group, is_prefill, *args)

        return run_group

    _wrap_groups(engine, wrap)


def _decode_through_prefill_kernel(engine) -> None:
    """#55894: the drafter's one-token reorder threshold overrides the target's 1+K, so decode rows
    run the Mamba2 prefill kernels: they read and write only their first state slot and conv window
    column, ignoring the kept count of the last verify step."""

    def wrap(run, mixer):
        def run_group(group, is_prefill, *args):
            if not is_prefill and group.num_valid is not None:
                n = group.query_start_loc.shape[0] - 1
                init = torch.ones(n, dtype=torch.bool, device=group.query_start_loc.device)
                return run(replace(group, has_initial_state=init, num_valid=None), True, *args)
            return run(group, is_prefill, *args)

        return run_group

    _wrap_groups(engine, wrap)


class _StepDrafts:
    """The drafts each decode row verifies in the step being run (``PreparedStep.num_drafts``), taken
    where the runner prepares the step, for the mixer's patch to read."""

    def __init__(self, engine):
        self.num_drafts: torch.Tensor | None = None  # [Np] int64
        runner = engine.runner
        prepare = runner.prepare

        def prepared(shape, rows, num_computed):
            step = prepare(shape, rows, num_computed)
            self.num_drafts = step.num_drafts
            return step

        runner.prepare = prepared

    def of_decode_rows(self, group: RecurrentGroup) -> torch.Tensor:  # [Ng] int64
        n = group.query_start_loc.shape[0] - 1
        return self.num_drafts[:n]


def _no_count_without_drafts(engine) -> None:
    """#39273 / #40738: on a step in which no row verifies a draft (the n-gram drafter found none) the
    accepted counts are not passed to the Mamba2 kernels, so every row reads its state and conv window
    at column 0, not at the slot its last verify step kept; acceptance still looks healthy."""
    drafts = _StepDrafts(engine)

    def wrap(run, mixer):
        def run_group(group, is_prefill, *args):
            none = not is_prefill and group.num_valid is not None
            if none and not bool((drafts.of_decode_rows(group) > 0).any()):
                group = replace(group, num_valid=torch.ones_like(group.num_valid))
            return run(group, is_prefill, *args)

        return run_group

    _wrap_groups(engine, wrap)


def _spec_and_nonspec_not_split(engine) -> None:
    """#35447: spec and non-spec decodes of one step are not split: the step's decode rows run as one
    kernel call whose layout its first row decides, so when that row has no drafts every row reads its
    state at column 0 (the non-spec layout), the rows that accepted drafts included."""
    drafts = _StepDrafts(engine)

    def wrap(run, mixer):
        def run_group(group, is_prefill, *args):
            if not is_prefill and group.num_valid is not None and group.num_valid.numel():
                num = drafts.of_decode_rows(group)
                if int(num[0]) == 0 and bool((num > 0).any()):
                    group = replace(group, num_valid=torch.ones_like(group.num_valid))
            return run(group, is_prefill, *args)

        return run_group

    _wrap_groups(engine, wrap)


def _rows(group: RecurrentGroup, keep: torch.Tensor, keep_tokens: torch.Tensor) -> RecurrentGroup:
    """The sub-group of ``group``'s rows where ``keep`` [Ng] (tokens ``keep_tokens`` [Tg])."""
    lengths = _lengths(group)[keep]
    qsl = group.query_start_loc.new_zeros(lengths.shape[0] + 1)
    qsl[1:] = lengths.cumsum(0)
    return replace(
        group, token_indices=group.token_indices[keep_tokens], query_start_loc=qsl,
        state_indices=group.state_indices[keep],
        has_initial_state=None if group.has_initial_state is None else group.has_initial_state[keep],
    )


def _one_token_prefill_as_decode(engine) -> None:
    """#46424: a one-token prefill after a cached prefix is classified as a decode: it runs the Mamba2
    update path with no previous-step index, its count defaulting to 1+K, so it reads its conv window
    at the last of the K+1 columns instead of the restored window at the first."""
    k = engine.config.speculative.num_speculative_tokens

    def wrap(run, mixer):
        def run_group(group, is_prefill, *args):
            if not is_prefill or k == 0 or group.has_initial_state is None:
                return run(group, is_prefill, *args)
            lengths = _lengths(group)
            one = (lengths == 1) & group.has_initial_state
            if not bool(one.any()):
                return run(group, is_prefill, *args)
            slots = group.state_indices
            slots = slots[:, :1] if slots.dim() == 2 else slots[:, None]  # [Ng, 1]
            token_one = torch.repeat_interleave(one, lengths.long())  # [Tg]
            rest = _rows(group, ~one, token_one.logical_not())
            as_decode = replace(_rows(group, one, token_one), has_initial_state=None,
                                state_indices=slots[one].expand(-1, k + 1).contiguous(),
                                num_valid=slots.new_full((int(one.sum()),), k + 1, dtype=torch.int32))
            out = args[2].new_empty(token_one.shape[0], mixer.inner)  # [Tg, I], dtype of xbc
            if bool((~one).any()):
                out[~token_one] = run(rest, True, *args)
            out[token_one] = run(as_decode, False, *args)
            return out

        return run_group

    _wrap_groups(engine, wrap)


def _padded_tail_saves_placeholder(engine) -> None:
    """#55178: a one-token prompt tail padded to 1+K is run as a prefill over the padding too, so the
    state it saves has advanced over K placeholder tokens (zero input: each decays the SSM state by
    exp(dt A), dt from dt_bias alone)."""
    k = engine.config.speculative.num_speculative_tokens

    def wrap(run, mixer):
        def run_group(group, is_prefill, chunked, positions, xbc, dt_raw, conv_state, ssm_state):
            out = run(group, is_prefill, chunked, positions, xbc, dt_raw, conv_state, ssm_state)
            if is_prefill and k > 0:
                one = _lengths(group) == 1
                if bool(one.any()):
                    slots = group.state_indices
                    slots = (slots[:, 0] if slots.dim() == 2 else slots)[one].long()
                    dt = torch.nn.functional.softplus(mixer.dt_bias.float())  # [Hm]
                    decay = torch.exp(k * dt * -torch.exp(mixer.A_log.float()))  # [Hm]
                    ssm_state[slots] = ssm_state[slots] * decay[None, :, None, None]
            return out

        return run_group

    _wrap_groups(engine, wrap)


def _align_reads_neighbour_count(engine) -> None:
    """#53919: with prefix caching in align mode and asynchronous scheduling, the accepted counts'
    copy lands before the rows move, so each decode row takes the count (conv shift and state
    column) of the row before it."""
    cache = engine.config.cache
    align = cache.enable_prefix_caching and cache.mamba_cache_mode == "align"

    def wrap(run, mixer):
        def run_group(group, is_prefill, *args):
            if align and not is_prefill and group.num_valid is not None and group.num_valid.numel() > 1:
                group = replace(group, num_valid=group.num_valid.roll(1))
            return run(group, is_prefill, *args)

        return run_group

    _wrap_groups(engine, wrap)


MAMBA2_MUTANTS: tuple[Mutant, ...] = (
    FamilyMutant(
        "mamba2-short-prompt-uninitialised",
        "vLLM #32716 (3-token prompt at decode threshold 4)",
        "contract 2: a new prompt is a prefill with zero state",
        "a new prompt of at most K+2 tokens starts its Mamba2 state from what its slot last held",
        _short_prompt_uninitialised,
        scenarios=("recycled-slots-k3", "short-prompts-k3"),
    ),
    FamilyMutant(
        "mamba2-decode-through-prefill",
        "vLLM #55894 (drafter reorder threshold 1 overrides 1+K)",
        "contract 1: the state after the last kept token",
        "decode rows run the Mamba2 prefill kernels, reading their first state slot whatever was kept",
        _decode_through_prefill_kernel,
        scenarios=("mtp-k3", "short-prompts-k3"),
    ),
    FamilyMutant(
        "mamba2-no-count-without-drafts",
        "vLLM #39273 / #40738 (n-gram on nemotron_h)",
        "contract 1: the state after the last kept token",
        "a decode step in which no row has drafts does not pass the accepted counts: Mamba2 rows read "
        "their state at column 0",
        _no_count_without_drafts,
        scenarios=("scripted-zero-draft-k3", "ngram-k3", "ngram-k1"),
    ),
    FamilyMutant(
        "mamba2-spec-nonspec-not-split",
        "vLLM #35447 (MTP + chunked prefill)",
        "contract 2: rows split by classification",
        "a step's spec and non-spec decodes are not split: a first row without drafts makes every row "
        "read its Mamba2 state at column 0",
        _spec_and_nonspec_not_split,
        scenarios=("scripted-zero-draft-k3", "ngram-k3", "scripted-ragged-k3"),
    ),
    FamilyMutant(
        "mamba2-one-token-prefill-as-decode",
        "vLLM #46424 (prompt = n blocks + 1 after a cached prefix)",
        "contract 2: a prefill from the restored state, however short",
        "a one-token prefill after a hit runs the Mamba2 update path with its count at 1+K",
        _one_token_prefill_as_decode,
        scenarios=("prefix-short-tail-k3", "prefix-block-edges-k3"),
    ),
    FamilyMutant(
        "mamba2-padded-tail-saves-placeholders",
        "vLLM #55178 (one-token tail padded to K+1)",
        "contract 1: the state after the last computed token",
        "a one-token prefill saves a Mamba2 state advanced over K placeholder tokens",
        _padded_tail_saves_placeholder,
        scenarios=("prefix-short-tail-k3", "chunk-tails-k3"),
    ),
    FamilyMutant(
        "mamba2-align-neighbour-count",
        "vLLM #53919 (align + async: counts copied before rows move)",
        "contracts 3 and 9: kept counts keyed by request",
        "with prefix caching in align mode each Mamba2 decode row reads the previous row's accepted count",
        _align_reads_neighbour_count,
        scenarios=("prefix-shared-preemption-k3", "pc-shared-prompt-k3-align", "prefix-system-prompt-k3"),
    ),
)
