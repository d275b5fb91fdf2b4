"""One recorded async run shared by the default-tier fake-CUDA tests (the recording is the costly part)."""

from __future__ import annotations

import pytest

from tests.helpers.fake_engines import GRAMMAR_PARAMS, REQUEST_PARAMS, SETTINGS, WAVES, record_async


@pytest.fixture(scope="session")
def default_run():
    """The default model, ``full_and_piecewise``, K=3 MTP drafts, prefix caching, preemption, every other
    request with logits processors and logprobs, some of the others with structured outputs: every kind of
    step (tests/helpers/fake_engines.py)."""
    return record_async(WAVES, max_tokens=10, graph_mode="full_and_piecewise", num_speculative_tokens=3,
                        drafter="mtp", request_params=REQUEST_PARAMS, grammar_params=GRAMMAR_PARAMS,
                        **SETTINGS)

