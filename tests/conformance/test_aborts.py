"""Aborts: how the harness issues them, and what the "aborts" check holds each engine to."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.engines import LLMInstance, RefEngineAdapter
from conformance.harness import run_scenario
from conformance.results import FAIL, NA, PASS
from conformance.session import Selection
from conformance.workloads import EngineSettings, RequestSpec, Scenario


def _scenario(k: int, graph_mode: str | None = None) -> Scenario:
    prompts = [(5, 6, 7, 8), (9, 10), (11,), (12, 13, 14, 15, 16, 17), (18, 19, 20)]
    aborts = [0, 1, 3, None, 40]  # before it is scheduled, in flight, later, never, after it finished
    requests = tuple(RequestSpec(f"r{i:02d}", p, 12, i % 2, True, (), None if a is None else i % 2 + a)
                     for i, (p, a) in enumerate(zip(prompts, aborts)))
    settings = EngineSettings(num_speculative_tokens=k, drafter="scripted" if k else "mtp", pattern="hash")
    return Scenario(
        f"aborts-k{k}",
        "aborts at every point of a request's life",
        "default",
        settings,
        requests,
        (),
        graph_mode,
    )


@pytest.mark.parametrize("engine,k", [("async:full_and_piecewise", 3), ("async:none", 0), ("reference", 3)])
def test_aborted_requests_are_prefixes_of_their_unaborted_output(engine, k):
    case = Selection(engine=engine).open_case()
    result, traces = run_scenario(_scenario(k), case)
    statuses = {c.check: c for c in result.checks}
    assert result.ok, [(c.check, c.summary) for c in result.failures]
    assert statuses["aborts"].status == PASS
    plain = traces["plain"].requests
    for label in ("reference", "test"):
        reqs = traces[label].requests
        assert reqs["r00"].token_ids == [] and reqs["r00"].finish_reason == "abort"
        assert reqs["r03"].token_ids == plain["r03"].token_ids  # never aborted: untouched by the others
        assert reqs["r04"].finish_reason == "length"  # finished before its abort step came
        for rid in ("r01", "r02"):
            assert reqs[rid].finish_reason == "abort"
            assert reqs[rid].token_ids == plain[rid].token_ids[: len(reqs[rid].token_ids)]
        assert "r04" not in traces[label].aborts  # its output came back first: never aborted


class _BadAbortAdapter(RefEngineAdapter):
    """The reference engine whose abort hands back one token more than it committed (a wrong one)."""

    def start(self, spec):
        inner = LLMInstance(self.build(spec))

        class Instance:
            def __getattr__(self, name):
                return getattr(inner, name)

            def abort(self, rid):
                out = inner.llm.abort(rid)
                return dataclasses.replace(out, token_ids=[*out.token_ids, (sum(out.token_ids) + 1) % 7])

        return Instance()


def test_an_aborted_output_that_is_no_prefix_fails_aborts():
    from conformance.harness import Case
    from conformance.model import describe_model

    case = Case("bad-abort", _BadAbortAdapter("reference"), describe_model(None), None)
    result, _ = run_scenario(_scenario(0), case)
    check = {c.check: c for c in result.checks}["aborts"]
    assert check.status == FAIL and check.details["engine"] == "bad-abort"
    assert "not a prefix" in check.summary or "more than" in check.summary
    assert "--request" in check.details["replay"]


def test_scenarios_with_aborts_are_skipped_for_an_engine_that_cannot_abort(monkeypatch):
    monkeypatch.delattr(LLMInstance, "abort", raising=False)
    result, _ = run_scenario(_scenario(0), Selection(engine="reference").open_case())
    assert result.skipped and "abort" in result.skipped and not result.checks


def test_a_workload_without_aborts_has_nothing_for_the_aborts_check():
    sc = _scenario(0).without_aborts()
    result, traces = run_scenario(sc, Selection(engine="reference").open_case())
    assert {c.check: c.status for c in result.checks}["aborts"] == NA and "plain" not in traces


# Every graph mode and every K in the default tier (one K per mode), the whole matrix with -m slow.
ABORT_CASES = [(0, "none"), (3, "full_and_piecewise"), (1, "full"), (3, "piecewise")]


@pytest.mark.parametrize("k,graph_mode", ABORT_CASES + [
    pytest.param(k, m, marks=pytest.mark.slow) for k in (0, 1, 3)
    for m in ("none", "piecewise", "full", "full_and_piecewise") if (k, m) not in ABORT_CASES])
def test_aborts_leave_no_trace_at_every_k_and_graph_mode(k, graph_mode):
    """Aborted while its step is in flight: no row of it in any later record, nothing left queued."""
    case = Selection(engine=f"async:{graph_mode}").open_case()
    result, traces = run_scenario(_scenario(k, graph_mode), case)
    assert result.ok, [(c.check, c.summary) for c in result.failures]
    test = traces["test"]
    in_flight = [rid for rid, a in test.aborts.items() if a.returned and test.rows_of(rid)]
    assert in_flight, "no request was aborted after it had been scheduled"
    assert all(a.queued == a.live for a in test.aborts.values() if a.returned)


class _LeakyAdapter(RefEngineAdapter):
    """The async engine, with an abort that leaves a trace one of two ways."""

    def __init__(self, how: str):
        super().__init__("async", "none")
        self.how = how

    def start(self, spec):
        seen, aborted = {}, []  # request id -> its last row; ids aborted since the last record
        if self.how == "shows-in-flight-row":  # the record of the step in flight keeps the aborted row
            forward = spec.observer

            def observe(record):
                record.rows += [seen[rid] for rid in aborted if rid in seen]
                aborted.clear()
                seen.update({r.request_id: r for r in record.rows})
                forward(record)

            spec = dataclasses.replace(spec, observer=observe)
        inner = LLMInstance(self.build(spec))
        scheduler, lingering = inner.llm.engine.core.scheduler, []

        class Instance:
            def __getattr__(self, name):
                return getattr(inner, name)

            def abort(self, rid):
                req = inner.llm.engine.core.requests.get(rid)
                out = inner.abort(rid)
                aborted.append(rid)
                if self_how == "stays-queued" and out is not None and req is not None:
                    scheduler.running.append(req)  # released only when the next step starts
                    lingering.append(req)
                return out

            def step(self):
                while lingering:
                    scheduler.running.remove(lingering.pop())
                return inner.step()

        self_how = self.how
        return Instance()


@pytest.mark.parametrize("how,words", [("shows-in-flight-row", "after aborting it"),
                                       ("stays-queued", "still queues it")])
def test_the_aborts_check_sees_an_aborted_request_that_left_a_trace(how, words):
    case = dataclasses.replace(Selection(engine="async:none").open_case(), adapter=_LeakyAdapter(how))
    result, _ = run_scenario(_scenario(3), case)
    aborts = {c.check: c for c in result.checks}["aborts"]
    assert aborts.status == FAIL and words in aborts.summary, aborts.summary
