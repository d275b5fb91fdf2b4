"""A wall-clock limit on every call into an engine under test.

A workload's engine calls run on a worker thread of their own while the calling thread watches the
call in progress. A call that has not returned after ``limit`` seconds is *abandoned*: the caller gets
``EngineHang`` naming the call and the engine step, and the worker thread (a daemon) is left behind,
blocked or still running. Python cannot stop a blocked call, so the abandoned engine is cut off
instead: from that moment nothing it does reaches the caller's state (its observer callbacks are
dropped, and the worker raises ``Abandoned`` as soon as the hung call returns), and the next
workload builds a fresh engine instance. An exception of any kind raised on the worker (a
``KeyboardInterrupt`` included) is raised again in the caller.

A Ctrl-C reaches the calling thread, never the worker: the worker is then abandoned as a hung call is
(it stops at its next engine call instead of driving the rest of the workload) and given
``INTERRUPT_GRACE`` seconds to get there, and the interrupt goes on up. A worker still running after
that (a call inside torch, or a hung one) is why the command's process ends without finalizing the
interpreter (refengine.tools.exits): a thread coming back from a torch op into a finalized interpreter
aborts the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

DEFAULT_STEP_TIMEOUT = 600.0  # seconds one engine call may take: generous for a first step that compiles
POLL_SECONDS = 0.05
INTERRUPT_GRACE = 2.0  # seconds an interrupted workload's worker gets to reach its next engine call


class EngineHang(RuntimeError):
    """An engine call did not return within the limit; the engine was abandoned."""


class Abandoned(BaseException):
    """Raised on an abandoned worker when its hung call returns: it must touch nothing more (a BaseException,
    so that no ``except Exception`` of the harness records anything for it)."""


class Watch:
    """The engine call in progress on the worker, and whether the caller gave up on it."""

    def __init__(self, limit: float | None):
        if limit is not None and limit <= 0:
            raise ValueError(f"step timeout must be > 0 seconds, got {limit}")
        self.limit = limit
        self.what: str | None = None  # the call in progress, e.g. "step() at engine step 12"
        self.since: float | None = None  # monotonic start of that call; None between calls
        self.abandoned = False
        self.lock = threading.Lock()

    def call(self, what: str, fn: Callable[..., Any], *args):
        """``fn(*args)`` as the engine call ``what``; raises Abandoned if the caller gave up meanwhile."""
        with self.lock:
            if self.abandoned:
                raise Abandoned
            self.what, self.since = what, time.monotonic()
        try:
            return fn(*args)
        finally:
            with self.lock:
                self.since = None
                if self.abandoned:
                    raise Abandoned  # the result must not reach the caller's state

    def guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` that does nothing once the call was abandoned (for callbacks made inside a call)."""

        def guarded(*args):
            with self.lock:
                if not self.abandoned:
                    fn(*args)

        return guarded

    def _expired(self) -> str | None:
        """Abandon the call in progress if it has run past the limit; returns what it was."""
        if self.limit is None:
            return None
        with self.lock:
            if self.since is None or time.monotonic() - self.since <= self.limit:
                return None
            self.abandoned = True
            return self.what


def run_watched(body: Callable[[], Any], watch: Watch, name: str) -> Any:
    """Run ``body`` (which makes its engine calls through ``watch.call``) on a daemon thread and return
    its result; raises EngineHang when one call outruns ``watch.limit``, or what ``body`` raised."""
    box: dict[str, Any] = {}

    def worker():
        try:
            box["result"] = body()
        except Abandoned:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it again
            box["error"] = e

    thread = threading.Thread(target=worker, name=f"conformance-engine-{name}", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(POLL_SECONDS if watch.limit is None else min(POLL_SECONDS, watch.limit))
            what = watch._expired()
            if what is not None:
                raise EngineHang(f"{what} did not return within {watch.limit:g} s (--step-timeout); the "
                                 "engine instance was abandoned")
    except KeyboardInterrupt:  # Ctrl-C: the worker stops at its next engine call, the interrupt goes on
        with watch.lock:
            watch.abandoned = True
        thread.join(INTERRUPT_GRACE)
        raise
    if "error" in box:
        raise box["error"]
    return box.get("result")

