"""Ctrl-C ends every long command with exit status 130, every time: no abort from a thread still inside
torch when the interpreter finalizes (``terminate called without an active exception``, status 134), no
traceback, no KeyboardInterrupt from an atexit callback; an interrupted run's reports say how far it got.

Each command runs in a process of its own and gets SIGINT at a seeded random moment after its first line
(past its imports: the run is under way). The default tier interrupts a run whose engine under test is
inside torch (the abort every time, before) and each of run, fuzz and mutate once at random; the wide
loop, the refengine commands included, is ``slow``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conformance.test_plugin import OUTER_RUN_SETTINGS, REPO

BUSY = "tests.conformance.gate_engines:busy"
HEADED = ("run", "fuzz", "mutate")  # the commands that print a header before their work


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in OUTER_RUN_SETTINGS:
        env.pop(key, None)
    return env


# Python's arguments run after Ctrl-C's disposition is set back to the default. A test run started in the
# background of a shell without job control (``pytest ... &``) has SIGINT ignored, which every child
# inherits, and a Python started with it ignored installs no KeyboardInterrupt handler: the signal would
# never arrive. An exec keeps a default disposition (an ignored one it would keep too).
WITH_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _popen(args: list[str], cwd, env: dict[str, str]) -> subprocess.Popen:
    """``python *args`` with SIGINT at its default disposition, whatever the test run's is."""
    return subprocess.Popen([sys.executable, "-c", WITH_DEFAULT_SIGINT, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start(argv: list[str], cwd, env: dict[str, str] | None = None) -> subprocess.Popen:
    return _popen(["-m", *argv], cwd, {**_env(), **(env or {})})


def _finish(proc: subprocess.Popen, first: str = "") -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running 120 s after Ctrl-C:\n{first}{out}\n{err}")
    return proc.returncode, first + out, err


def _assert_clean_130(code: int, out: str, err: str, what: str) -> None:
    said = f"{what}: exit {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert code == 130, said
    for crash in ("terminate called", "Traceback", "Exception ignored", "Fatal Python error"):
        assert crash not in err and crash not in out, said
    assert "interrupted" in (out + err).lower(), said  # the command says it was interrupted


def _interrupt_at_random(commands: dict[str, list[str]], times: int, seed: int, tmp_path,
                         longest: float) -> None:
    """``times`` rounds: start every command at once, then interrupt each at its own random moment after
    its first line (a command that prints nothing before its result: after its start). The commands are
    watched side by side, so each gets its signal when its own delay is up, not after the ones before it
    have finished."""
    rng = random.Random(seed)
    for round_ in range(times):
        runs = []
        for name, argv in commands.items():
            cwd = tmp_path / f"{name}-{round_}"
            cwd.mkdir()
            runs.append((name, _start(argv, cwd), rng.uniform(0.0, longest), cwd))
        with ThreadPoolExecutor(len(runs)) as pool:
            ended = list(pool.map(lambda run: _interrupt_after(*run[:3]), runs))
        for (name, _, delay, cwd), result in zip(runs, ended):
            if result is None:  # done before the interrupt: nothing to test
                continue
            _assert_clean_130(*result, f"{name} interrupted {delay:.2f} s after its first line "
                              f"(seed {seed}, round {round_})")
            if name == "run":
                _assert_reports_say_interrupted(cwd)


def _interrupt_after(name: str, proc: subprocess.Popen, delay: float) -> tuple[int, str, str] | None:
    """Ctrl-C ``delay`` s after the command's first line (its start, for one that prints nothing first);
    its exit status and output, or None when it ended before the interrupt."""
    first = proc.stdout.readline() if name in HEADED else ""
    time.sleep(delay)
    if proc.poll() is not None and name not in HEADED:
        _finish(proc)
        return None
    proc.send_signal(signal.SIGINT)
    return _finish(proc, first)


def _assert_reports_say_interrupted(cwd) -> None:
    cases = {c.get("name"): c for c in ET.parse(cwd / "r.xml").getroot().iter("testcase")}
    assert cases["interrupted"].find("error") is not None
    report = json.loads((cwd / "r.json").read_text())
    assert report["interrupted"].startswith("interrupted (KeyboardInterrupt) after ")


def _commands(model: str) -> dict[str, list[str]]:
    return {
        "run": ["conformance", "run", "--engine", "async", "--model", model, "--junit-xml", "r.xml",
                "--report-json", "r.json"],
        "fuzz": ["conformance", "fuzz", "--engine", "async", "--model", model, "--seed", "1", "--out", "."],
        "mutate": ["conformance", "mutate", "--model", model],
    }


def test_ctrl_c_while_the_engine_under_test_is_inside_torch_exits_130(tiny_checkpoint, tmp_path):
    """The engine under test computes in torch on the watchdog's thread when Ctrl-C arrives: before, the
    process aborted at exit (134, ``terminate called without an active exception``), every time."""
    from tests.conformance.gate_engines import BUSY_MARKER_ENV

    marker = tmp_path / "busy"
    proc = _start(["conformance", "run", "--engine", BUSY, "--model", tiny_checkpoint, "--scenario",
                   "short-prompts-k0", "--step-timeout", "120", "--junit-xml", "r.xml", "--report-json",
                   "r.json"], tmp_path, {BUSY_MARKER_ENV: str(marker)})
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), _finish(proc)
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc)
    _assert_clean_130(code, out, err, "conformance run, engine inside torch")
    assert "INTERRUPTED after 0 of 1 scenarios" in out
    _assert_reports_say_interrupted(tmp_path)


SWALLOWING = """
import sys, time
from refengine.tools.exits import process_main

def body():
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:  # as safetensors does when interrupted while loading weights
        raise TypeError("could not determine the shape of object type 'torch.storage.UntypedStorage'")
    return 0

sys.exit(process_main("swallowing", body))
"""


def test_an_interrupt_an_extension_turns_into_another_error_still_exits_130(tmp_path):
    """Found by the wide loop: ``mutate`` interrupted while loading weights exited 2, the checkpoint
    "cannot be used", because the KeyboardInterrupt came back from safetensors as a TypeError."""
    proc = _popen(["-c", SWALLOWING], tmp_path, _env())
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc, first)
    _assert_clean_130(code, out, err, "an interrupt turned into a TypeError")


IN_A_CALLBACK = """
import sys, time, weakref
from refengine.tools.exits import process_main

class Thread:
    pass

def body():
    def forget(_):  # a weakref callback, as threading's WeakSet of threads runs when a finished thread goes
        print("ready", flush=True)
        time.sleep(60)  # Ctrl-C arrives here, inside the callback
    thread = Thread()
    ref = weakref.ref(thread, forget)
    del thread
    time.sleep(10)  # the work after the callback: what an interrupt ends
    print("carried on after the interrupt", flush=True)
    return 1

sys.exit(process_main("in-a-callback", body))
"""


def test_an_interrupt_inside_a_weakref_callback_stops_the_work_and_exits_130(tmp_path):
    """Found by interrupting ``fuzz`` at many moments (0.75 s after its first line, twice in 32): a Ctrl-C
    that landed in a weakref callback (a finished watchdog thread leaving threading's WeakSet) is an
    exception Python cannot raise there. It printed "Exception ignored" and the search went on to its end:
    exit 1 with the failing check it found, or 130 only after the whole search since an interrupt that
    surfaced elsewhere counts as one."""
    proc = _popen(["-c", IN_A_CALLBACK], tmp_path, _env())
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc, first)
    _assert_clean_130(code, out, err, "an interrupt inside a weakref callback")
    assert "carried on" not in out


def test_ctrl_c_at_random_moments_exits_130(tiny_checkpoint, tmp_path):
    _interrupt_at_random(_commands(tiny_checkpoint), times=1, seed=38, tmp_path=tmp_path, longest=1.5)


@pytest.mark.slow  # 48 interrupted processes, 6 at a time
@pytest.mark.parametrize("seed", [0, 1])
def test_ctrl_c_at_random_moments_exits_130_every_time(seed, tiny_checkpoint, tmp_path):
    commands = _commands(tiny_checkpoint)
    commands["generate"] = ["refengine.tools.cli", "generate", "--engine", "async", "--model",
                            tiny_checkpoint, "--prompt-ids", "1,2,3,4,5", "--max-tokens", "200",
                            "--num-spec-tokens", "3"]
    commands["bench"] = ["refengine.tools.cli", "bench"]
    commands["report"] = ["refengine.tools.cli", "report"]
    _interrupt_at_random(commands, times=4, seed=seed, tmp_path=tmp_path, longest=6.0)
