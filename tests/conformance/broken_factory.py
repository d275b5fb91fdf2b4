"""An engine factory that raises, as a user's adapter does when its engine cannot start.

``--engine tests.conformance.broken_factory:factory`` must end a run once, with one line naming the
engine and the error, whatever route (``conformance run``, the pytest plugin, with or without xdist).
"""

from __future__ import annotations

MESSAGE = "adapter cannot start: no accelerator driver (planted)"


def factory():
    raise RuntimeError(MESSAGE)
