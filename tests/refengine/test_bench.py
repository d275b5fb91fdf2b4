"""``refengine bench``: both engines on the default workload, side by side, outputs checked equal."""

from __future__ import annotations

import pytest

from refengine.tools import bench


def test_bench_reports_both_engines_and_the_host_share():
    r = bench.run(None, k=3, graph_mode="full_and_piecewise", repeat=1, copies=1, max_num_seqs=16)
    assert r["tokens"] > 0 and set(r["tokens_per_s"]) == {"reference", "async"}
    assert r["ratio"] == pytest.approx(r["tokens_per_s"]["async"] / r["tokens_per_s"]["reference"])
    assert 0.0 < r["async_host_busy"] < 1.0, r["async_host_busy"]
    assert r["async_graph_steps"].get("full", 0) > 0, "the default workload should replay FULL decode steps"
    # The device (the worker thread on CPU) runs almost the whole async run; its share cannot exceed it.
    assert 0.0 < r["async_device_busy"] <= 1.0 + 1e-6, r["async_device_busy"]
    assert r["async_us_per_step"] > r["async_host_us_per_step"] > 0
    assert r["async_launches_per_step"] is None, "kernel launches are counted on CUDA only"


def test_bench_refuses_engines_that_disagree(monkeypatch):
    timed = bench._timed

    def corrupt_async(llm, prompts, params):
        dt, outs = timed(llm, prompts, params)
        if llm.config.engine == "async":
            outs[0].token_ids = outs[0].token_ids[:-1]
        return dt, outs

    monkeypatch.setattr(bench, "_timed", corrupt_async)
    with pytest.raises(SystemExit, match="disagree"):
        bench.run(None, k=0, graph_mode="none", repeat=1, copies=1, max_num_seqs=16)


def test_a_trace_keeps_the_aten_ops_only_when_asked(tmp_path):
    """--profile-ops keeps what the profiler recorded under the ranges; without it only the ranges (the
    engine's run under the profiler: tests/refengine/test_generate_modes.py)."""
    import json

    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "thread 7 (python)"}},
        {"ph": "X", "cat": "user_annotation", "name": "schedule", "pid": 1, "tid": 7, "ts": 0, "dur": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 7, "ts": 0, "dur": 1},
    ]
    path = tmp_path / "trace.json"
    for ops, kept in ((False, ["thread_name", "schedule"]), (True, ["thread_name", "schedule", "aten::mm"])):
        path.write_text(json.dumps({"traceEvents": events}))
        bench.tidy_trace(path, {7: bench.HOST_THREAD}, ops=ops)
        written = json.loads(path.read_text())["traceEvents"]
        assert [e["name"] for e in written] == kept
        assert written[0]["args"]["name"] == bench.HOST_THREAD
    assert bench.build_parser().parse_args(["--profile", "p", "--profile-ops"]).profile_ops
