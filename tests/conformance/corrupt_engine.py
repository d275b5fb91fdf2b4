"""An engine under test that is wrong on purpose: the reference engine with one output token flipped.

Loaded by import path (``--engine tests.conformance.corrupt_engine:factory``) to show that a broken
engine fails the suite, and what the failure report looks like.
"""

from __future__ import annotations

from conformance.engines import RunSpec, reference_adapter

POSITION = 2  # output position of the flipped token, in the first request finishing with more tokens


class CorruptingAdapter:
    name = "corrupting"

    def __init__(self, position: int = POSITION):
        self.inner = reference_adapter()
        self.position = position

    def supports(self, feature: str) -> bool:
        return self.inner.supports(feature)

    def start(self, spec: RunSpec):
        return _CorruptingInstance(self.inner.start(spec), spec.vocab_size, self.position)


class _CorruptingInstance:
    def __init__(self, inner, vocab_size: int, position: int):
        self.inner, self.vocab_size, self.position = inner, vocab_size, position
        self.done = False

    def add_request(self, request_id, prompt, params):
        self.inner.add_request(request_id, prompt, params)

    def step(self):
        outs = self.inner.step()
        for out in outs:
            if not self.done and len(out.token_ids) > self.position:
                out.token_ids[self.position] = (out.token_ids[self.position] + 1) % self.vocab_size
                self.done = True
        return outs

    def has_unfinished(self):
        return self.inner.has_unfinished()

    def pools_empty(self):
        return self.inner.pools_empty()


def factory() -> CorruptingAdapter:
    return CorruptingAdapter()
