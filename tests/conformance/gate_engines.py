"""Adapters a CI gate must not pass: one that declines most features (so most scenarios skip), one
whose ``step()`` never returns, one interrupted by Ctrl-C in the middle of a step, one whose ``step()``
stays inside torch ops until the process ends (where a Ctrl-C finds it).

    conformance run --engine tests.conformance.gate_engines:declining
"""

from __future__ import annotations

import threading

from conformance.engines import LLMInstance, RefEngineAdapter


class DecliningAdapter(RefEngineAdapter):
    """The reference engine, saying it supports no drafter and no prefix caching."""

    DECLINED = ("mtp", "scripted_drafter", "ngram_drafter", "draft_model", "eagle_drafter", "prefix_caching")

    def __init__(self):
        super().__init__("reference", "none")
        self.name = "declining"

    def supports(self, feature: str) -> bool:
        return feature not in self.DECLINED and super().supports(feature)


class _Hanging(LLMInstance):
    def __init__(self, llm, release: threading.Event):
        super().__init__(llm)
        self.release = release

    def step(self):
        self.release.wait()  # blocks until the test process ends (the daemon thread is abandoned)
        return super().step()


class HangingAdapter(RefEngineAdapter):
    """The reference engine whose ``step()`` blocks forever."""

    def __init__(self):
        super().__init__("reference", "none")
        self.name = "hanging"
        self.release = threading.Event()  # never set: nothing here wakes the blocked step

    def start(self, spec):
        return _Hanging(self.build(spec), self.release)


class _Interrupted(LLMInstance):
    def step(self):
        raise KeyboardInterrupt


class InterruptedAdapter(RefEngineAdapter):
    """The reference engine whose first ``step()`` is interrupted (Ctrl-C arriving during a step)."""

    def __init__(self):
        super().__init__("reference", "none")
        self.name = "interrupted"

    def start(self, spec):
        return _Interrupted(self.build(spec))


class _Busy(LLMInstance):
    def step(self):
        import os
        from pathlib import Path

        import torch

        x = torch.randn(384, 384)
        if os.environ.get(BUSY_MARKER_ENV):  # says when it is inside torch (the run captures its output)
            Path(os.environ[BUSY_MARKER_ENV]).write_text("busy")
        while True:  # torch ops (the GIL released inside each) until the process ends
            x = torch.tanh(x @ x)


BUSY_MARKER_ENV = "CONFORMANCE_TEST_BUSY_MARKER"  # a file the busy step writes once it computes


class BusyAdapter(RefEngineAdapter):
    """The reference engine whose first ``step()`` computes in torch forever (on the watchdog's thread)."""

    def __init__(self):
        super().__init__("reference", "none")
        self.name = "busy"

    def start(self, spec):
        return _Busy(self.build(spec))


declining = DecliningAdapter
hanging = HangingAdapter
interrupted = InterruptedAdapter
busy = BusyAdapter


class _Swapping(LLMInstance):
    """Holds each finished output until the next one finishes, then hands both back with their tokens
    swapped: every output is another request's (its step records still show its own tokens)."""

    def __init__(self, llm):
        super().__init__(llm)
        self.held = None

    def step(self):
        ready = []
        for out in super().step():
            if self.held is None:
                self.held = out
                continue
            self.held.token_ids, out.token_ids = out.token_ids, self.held.token_ids
            ready += [self.held, out]
            self.held = None
        if self.held is not None and not super().has_unfinished():
            ready.append(self.held)
            self.held = None
        return ready

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or self.held is not None


class SwappingAdapter(RefEngineAdapter):
    def __init__(self):
        super().__init__("reference", "none")
        self.name = "swapping"

    def start(self, spec):
        return _Swapping(self.build(spec))


class _Truncating(LLMInstance):
    def step(self):
        outs = super().step()
        for out in outs:
            out.token_ids = out.token_ids[:-1]
        return outs


class TruncatingAdapter(RefEngineAdapter):
    """The reference engine, every output one token short (its records show the token it dropped)."""

    def __init__(self):
        super().__init__("reference", "none")
        self.name = "truncating"

    def start(self, spec):
        return _Truncating(self.build(spec))


swapping = SwappingAdapter
truncating = TruncatingAdapter
