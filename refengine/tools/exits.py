"""How the ``refengine`` and ``conformance`` processes end: with their status, 130 on Ctrl-C, every time.

Why a process interrupted in the middle of engine work cannot simply return 130 and let Python exit:
the async engine runs its device work on a worker thread (``refengine.async_engine.stream``, on CPU),
and the conformance watchdog runs the engine under test on a thread of its own that it may abandon
(``conformance.watchdog``). Both are daemon threads, and when Ctrl-C arrives they may be inside a
torch op, which runs with the GIL released. Once the interpreter finalizes, a daemon thread that
comes back from such an op and asks for the GIL is ended by CPython with ``pthread_exit``; the forced
unwind runs through torch's C++ frames, which do not let it through, and the process aborts with
``terminate called without an active exception`` (exit status 134) instead of 130. A thread inside
an op cannot be stopped from Python, and a hung call (what the watchdog abandons) may never return,
so no amount of joining makes the exit safe.

So a command first finishes what must be written (an interrupted run its JUnit and JSON reports and
its last lines), then :func:`end_process` flushes stdout and stderr and ends the process with
``os._exit``: 130 when interrupted, else the command's status. The interpreter is not finalized, so no
thread can come back into it, and no ``atexit`` callback (which a Ctrl-C could interrupt with a
traceback) runs. A command that finished on its own ends the same way, because a Ctrl-C that arrives
while the interpreter tears torch down (after the command's last line) would otherwise kill the
process by the signal, and an engine thread never closed may still be inside an op (a hung call the
watchdog abandoned). The commands write every file they write before they return, so nothing waits
for ``atexit``.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
REDELIVER_SECONDS = 0.001  # after this, a Ctrl-C Python could not raise is delivered again (_unraisable_hook)


def end_process(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process now with ``code``, without finalizing the interpreter
    (no ``atexit`` callbacks, no daemon thread coming back into it; see the module docstring). Only for
    a process entry point, once every report is written."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut the flush short
    except ValueError:  # not the main thread
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


_received: list[bool] = []  # a Ctrl-C arrived during the work (whatever became of its KeyboardInterrupt)


def _interrupt(signum, frame) -> None:
    """Python's own SIGINT handler (raise KeyboardInterrupt), remembering that the interrupt came: code
    called from a C or Rust extension may turn the KeyboardInterrupt into another error (safetensors,
    interrupted while loading weights, raises a TypeError that the loader reports as a bad checkpoint)."""
    _received.append(True)
    raise KeyboardInterrupt


def _unraisable_hook(default: Callable, main_thread: int) -> Callable:
    """``sys.unraisablehook`` that delivers again a Ctrl-C that landed where Python cannot raise it: in a
    weakref callback (threading's WeakSet of threads drops each finished watchdog thread through one), a
    ``__del__`` or a garbage-collector callback. There its KeyboardInterrupt is printed as "Exception
    ignored" and the work goes on to its end. Signalled again to ``main_thread`` once the hook has returned,
    from a thread of its own (a signal sent in the hook would raise in the hook itself), it is raised in
    the ordinary code the main thread runs next (a wait it is in returns for it), or lands in another such
    place and comes here again. Every other unraisable exception goes to ``default``."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _received:
            _thread.start_new_thread(_deliver_again, (main_thread,))
            return
        default(unraisable)

    return hook


def _deliver_again(main_thread: int) -> None:
    time.sleep(REDELIVER_SECONDS)
    signal.pthread_kill(main_thread, signal.SIGINT)


def process_main(prog: str, body: Callable[[], int]) -> NoReturn:
    """Run ``body`` as the whole work of the process ``prog`` and end the process with its exit status
    (:func:`end_process`: stdout and stderr flushed, the interpreter not finalized). On Ctrl-C the status
    is 130: ``body`` returned it (it reported the interruption itself, its reports written) or let a
    KeyboardInterrupt escape (then ``prog: interrupted`` is printed), or an extension turned the
    interrupt into another error, or it came once the work was done. An exception that is not an
    interrupt keeps its traceback."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where Ctrl-C is ignored
        signal.signal(signal.SIGINT, _interrupt)
        sys.unraisablehook = _unraisable_hook(sys.unraisablehook, _thread.get_ident())
    try:
        try:
            code = body()
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            code = INTERRUPTED
        except Exception:
            if not _received:
                raise
            code = -1  # the interrupt surfaced as this error
        if _received and code != INTERRUPTED:  # the interrupt surfaced as another error: still an interrupt
            print(f"{prog}: interrupted", file=sys.stderr)
            code = INTERRUPTED
    except KeyboardInterrupt:  # a Ctrl-C between the work's end and here
        code = INTERRUPTED
    while True:  # end_process never returns; a Ctrl-C before it set SIGINT aside ends the process with 130
        try:
            end_process(code)
        except KeyboardInterrupt:
            code = INTERRUPTED
