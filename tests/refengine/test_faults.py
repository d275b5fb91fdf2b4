"""Faults inside a step never yield wrong tokens.

A fault is injected once, at one stage of a step (host planning, after the device work was
submitted, while the previous step is processed, in the middle of committing tokens, in the
model, in the drafter, in an observer). The caller sees the exception; the engine recovers by
sending every running request back to recompute from its committed tokens, so every request
still finishes with the tokens a fresh engine gives, and every pool ends empty.
"""

from __future__ import annotations

import itertools

import pytest

from refengine import LLM, SamplingParams
from refengine.core import EngineFaulted

PROMPTS = [
    [1, 2, 3],
    [5],
    [7, 8, 9, 10, 11, 12],
    [3, 3],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8],
]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


class InjectedFault(Exception):
    pass


def fail_once(obj, names: str | tuple[str, ...], at_call: int, *, after: bool = False,
              exc: type[BaseException] = InjectedFault):
    """Make the ``at_call``-th call of any of ``obj``'s methods ``names`` raise (before or after its work)."""
    calls = itertools.count()
    found = [name for name in ((names,) if isinstance(names, str) else names) if hasattr(obj, name)]
    assert found, f"{type(obj).__name__} has none of {names}: the fault would never be injected"
    for name in found:
        setattr(obj, name, _failing(getattr(obj, name), name, calls, at_call, after, exc))


def _failing(original, name, calls, at_call, after, exc):
    def wrapped(*args, **kwargs):
        i = next(calls)
        if i == at_call and not after:
            raise exc(f"injected into {name}")
        result = original(*args, **kwargs)
        if i == at_call and after:
            raise exc(f"injected after {name}")
        return result

    return wrapped


def failing_observer(at_call: int, exc=InjectedFault):
    calls = itertools.count()

    def observe(record):
        if next(calls) == at_call:
            raise exc("injected into an observer")

    return observe


def inject(llm: LLM, stage: str, exc) -> None:
    e = llm.engine
    if stage == "observer":
        e.core.observers[:] = [failing_observer(3, exc)]
    elif stage == "commit":  # in the middle of committing a step's tokens (the stop rule runs per token)
        fail_once(e.core, "stop_reason", 7, exc=exc)
    elif stage == "plan":  # host planning, before anything is submitted
        fail_once(e.planner, "plan", 3, exc=exc)
    elif stage == "submitted":  # right after the device work was submitted
        fail_once(e.runner, "enqueue", 3, after=True, exc=exc)
    elif stage == "process":  # processing the previous step's output
        fail_once(e, "process", 3, exc=exc)
    elif stage == "model":
        fail_once(e.runner, ("run", "execute"), 3, exc=exc)
    elif stage == "drafter":
        target = e.runner.proposer
        if target is None:
            pytest.skip("no drafter without speculation")
        fail_once(target, "propose", 3, exc=exc)
    else:
        raise AssertionError(stage)


def run_with_fault(stage: str, exc=InjectedFault, **kw) -> tuple[list[list[int]], LLM, int]:
    llm = LLM(observer=lambda record: None, **kw)
    inject(llm, stage, exc)
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(f"r{i}", prompt, PARAMS)
    outs, faults = {}, 0
    while llm.has_unfinished():
        try:
            for o in llm.step():
                outs[o.request_id] = o.token_ids
        except (exc, RuntimeError):
            faults += 1
    return [outs[f"r{i}"] for i in range(len(PROMPTS))], llm, faults


@pytest.fixture(scope="module")
def expected():
    cache = {}

    def get(k: int) -> list[list[int]]:
        if k not in cache:
            cache[k] = [o.token_ids for o in LLM(num_speculative_tokens=k).generate(PROMPTS, PARAMS)]
        return cache[k]

    return get


ASYNC_STAGES = ["plan", "submitted", "process", "commit", "model", "drafter", "observer"]
DEFAULT_CASES = [("full_and_piecewise", 3, True), ("none", 0, False)]
SLOW_CASES = [(g, k, d) for g in ("none", "piecewise", "full", "full_and_piecewise") for k in (0, 1, 3)
              for d in (False, True) if (g, k, d) not in DEFAULT_CASES]


def check_async(expected, stage, graph_mode, k, delay):
    got, llm, faults = run_with_fault(stage, engine="async", graph_mode=graph_mode, num_speculative_tokens=k,
                                      delay_copies=delay, hazard_check=delay)
    assert faults == 1, "the injected fault never reached the caller"
    assert got == expected(k), f"tokens differ after a fault at stage {stage!r}"
    assert llm.engine.pools_empty(), "blocks, slots or request slots leaked after the fault"


@pytest.mark.parametrize("graph_mode,k,delay", DEFAULT_CASES)
@pytest.mark.parametrize("stage", ASYNC_STAGES)
def test_async_engine_recovers_exactly(expected, stage, graph_mode, k, delay):
    check_async(expected, stage, graph_mode, k, delay)


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode,k,delay", SLOW_CASES)
@pytest.mark.parametrize("stage", ASYNC_STAGES)
def test_async_engine_recovers_exactly_matrix(expected, stage, graph_mode, k, delay):
    check_async(expected, stage, graph_mode, k, delay)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("stage", ["model", "commit", "drafter", "observer"])
def test_reference_engine_recovers_exactly(expected, stage, k):
    got, llm, faults = run_with_fault(stage, num_speculative_tokens=k)
    assert faults == 1 and got == expected(k)
    assert llm.engine.pools_empty()


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_keyboard_interrupt_mid_step_is_recovered(expected, engine):
    got, llm, faults = run_with_fault(
        "commit", exc=KeyboardInterrupt, engine=engine, num_speculative_tokens=3
    )
    assert faults == 1 and got == expected(3)
    assert llm.engine.pools_empty()


def test_observer_fault_loses_no_output(expected):
    """The outputs of the step whose observer raised come with the next step."""
    got, llm, faults = run_with_fault("observer", engine="async", num_speculative_tokens=3)
    assert faults == 1 and got == expected(3)
    assert llm.engine.core.num_recovered_faults == 0, "an observer fault needs no recovery"


def test_unrecoverable_fault_refuses_every_later_call():
    llm = LLM(engine="async", num_speculative_tokens=3)
    e = llm.engine
    fail_once(e, "process", 2)

    def broken_reset():
        raise RuntimeError("the device is gone")

    e._reset = broken_reset
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(f"r{i}", prompt, PARAMS)
    with pytest.raises(EngineFaulted, match="recovery from InjectedFault"):
        while True:
            llm.step()
    with pytest.raises(EngineFaulted, match="InjectedFault\\('injected into process'\\)"):
        llm.step()


def test_work_queued_behind_a_device_failure_never_runs():
    """Work submitted before the host learned of a failure depended on the failed work: it is dropped,
    also after the error is reported, and only later submissions run (CPU stream, copies delayed)."""
    from refengine.async_engine.stream import DeviceWorkError, Stream

    stream, ran = Stream("cpu", delay=True), []
    try:
        stream.submit(lambda: 1 / 0)
        failed_at = stream.record_event()
        stream.submit(lambda: ran.append("depends on the failed work"))
        with pytest.raises(DeviceWorkError, match="ZeroDivisionError"):
            failed_at.wait()
        stream.synchronize()
        assert ran == []
        stream.submit(lambda: ran.append("submitted after the report"))
        stream.synchronize()
        assert ran == ["submitted after the report"]
    finally:
        stream.close()


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_an_observer_fault_on_the_last_step_keeps_the_output(engine):
    """The step that finished the last request raises in its observer: the engine still has work (the
    undelivered output) and the next step hands it over."""
    seen, fired = [], []

    def observe(record):
        seen.extend(t for row in record.rows for t in (row.output_token_ids or []))
        if len(seen) >= 5 and not fired:
            fired.append(True)
            raise InjectedFault("injected into the last step's observer")

    llm = LLM(engine=engine, observer=observe)
    llm.add_request("only", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    outs = []
    with pytest.raises(InjectedFault):
        while llm.has_unfinished():
            outs += llm.step()
    assert fired and not outs and llm.has_unfinished(), "the finished output must still be pending"
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == ["only"] and len(outs[0].token_ids) == 5
