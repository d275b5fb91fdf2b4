"""An engine under test with a planted, condition-dependent bug, for the fuzzer's shrinking tests.

The reference engine, except that when speculation is on (K > 0), the output of every request whose
prompt has at least ``MIN_PROMPT`` tokens and which produced more than ``POSITION`` tokens has the
token at ``POSITION`` changed. The smallest workload that shows it: one request, a prompt of exactly
``MIN_PROMPT`` tokens, ``POSITION + 1`` output tokens, K = 1.
"""

from __future__ import annotations

from conformance.engines import RunSpec, reference_adapter

MIN_PROMPT = 3
POSITION = 2


class PlantedAdapter:
    name = "planted"

    def __init__(self):
        self.inner = reference_adapter()

    def supports(self, feature: str) -> bool:
        return self.inner.supports(feature)

    def start(self, spec: RunSpec):
        return _Instance(self.inner.start(spec), spec.vocab_size, spec.settings.k > 0)


class _Instance:
    def __init__(self, inner, vocab_size: int, armed: bool):
        self.inner, self.vocab_size, self.armed = inner, vocab_size, armed

    def add_request(self, request_id, prompt, params):
        self.inner.add_request(request_id, prompt, params)

    def step(self):
        outs = self.inner.step()
        for out in outs:
            if self.armed and len(out.prompt_token_ids) >= MIN_PROMPT and len(out.token_ids) > POSITION:
                out.token_ids[POSITION] = (out.token_ids[POSITION] + 1) % self.vocab_size
        return outs

    def has_unfinished(self):
        return self.inner.has_unfinished()

    def pools_empty(self):
        return self.inner.pools_empty()


def factory():
    return PlantedAdapter()
