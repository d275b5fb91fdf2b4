"""The Mamba2 bug record (vLLM's Nemotron-H / Mamba2 hybrids), re-created in the Mamba2 mixer.

Each mutant wraps ``_run_group`` of every ``Mamba2Mixer`` of one async engine's model (an instance
attribute; the class and the reference engine's model are untouched) and breaks one rule of how a
step's rows reach the Mamba2 kernels. They declare their family: ``run_mutant`` runs them on the
tiny Nemotron-H (``tiny:nemotron_h``, with an MTP head) unless the model given is a Nemotron-H.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from conformance.mutants import Mutant
from refengine.forward_context import RecurrentGroup
from refengine.model.mamba2 import Mamba2Mixer

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
)
