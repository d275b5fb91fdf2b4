"""``refengine generate`` shows what the engine does: prompts one after another or as a chat (prefix-cache
hits visible), the engine settings as flags, the async graph mode named, a capped --max-tokens said,
Ctrl-C one line; ``refengine bench --profile`` writes a trace with a range per stage."""

from __future__ import annotations

import json
import re

import pytest

from refengine.tools.cli import DEFAULT_ASYNC_GRAPH_MODE, main

PROMPT = ",".join(str(i) for i in range(1, 41))  # 40 tokens: two full blocks of 16


def test_sequential_prompts_hit_the_cache_the_earlier_ones_left(capsys):
    argv = ["generate", "--prompt-ids", PROMPT, "--prompt-ids", PROMPT + ",50,51", "--max-tokens", "2",
            "--enable-prefix-caching", "--mamba-cache-mode", "all"]
    assert main([*argv, "--mode", "sequential"]) == 0
    cached = re.findall(r"cached_tokens: (\d+) of (\d+)", capsys.readouterr().out)
    assert cached == [("0", "40"), ("32", "42")]  # the second prompt found the first one's two blocks
    assert main(argv) == 0  # at once (the default): nothing is cached yet when both are looked up
    assert re.findall(r"cached_tokens: (\d+)", capsys.readouterr().out) == ["0", "0"]


def test_a_chat_sends_each_turn_with_the_earlier_turns_and_hits_them(capsys):
    argv = ["generate", "--mode", "chat", "--prompt-ids", PROMPT, "--prompt-ids", "60,61,62", "--max-tokens",
            "4", "--ignore-eos", "--enable-prefix-caching", "--block-size", "8", "--seed", "3",
            "--max-num-seqs", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "turn 1: [60, 61, 62] (prompt of 47 tokens, the earlier turns included)" in out  # 40 + 4 + 3
    assert re.findall(r"cached_tokens: (\d+)", out)[1] == "40"  # five blocks of 8 from turn 0
    assert "mode chat" in out and "seed 3" in out


def test_the_summary_names_the_async_graph_mode_and_ngram_flags_reach_the_engine(capsys):
    argv = ["generate", "--prompt-ids", "1,2,3,1,2,3,1,2", "--max-tokens", "3", "--engine", "async",
            "--num-spec-tokens", "2", "--drafter", "ngram", "--prompt-lookup-min", "2",
            "--prompt-lookup-max", "3"]
    assert main(argv) == 0
    assert f"engine async, dtype float32, device cpu, graph mode {DEFAULT_ASYNC_GRAPH_MODE}, mode batch" in \
        capsys.readouterr().out
    assert main([*argv[:-4], "--prompt-lookup-min", "4", "--prompt-lookup-max", "3"]) == 2
    assert "--prompt-lookup-min (4) must be <= --prompt-lookup-max (3)" in capsys.readouterr().err


def test_a_capped_max_tokens_is_said(capsys):
    prompt = ",".join(str(1 + i % 200) for i in range(1019))  # 5 tokens short of the model length
    assert main(["generate", "--prompt-ids", prompt, "--max-tokens", "100000000"]) == 0
    out = capsys.readouterr().out
    assert ("note: --max-tokens 100000000 is capped at the model length: this prompt of 1019 tokens can "
            "generate at most 5 (max_model_len 1024)") in out


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    import refengine

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(refengine.LLM, "generate", interrupted)
    assert main(["generate", "--prompt-ids", "1,2,3"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "refengine generate: interrupted\n" and "Traceback" not in captured.out


def test_bench_profile_writes_a_trace_with_a_range_per_stage(tmp_path):
    from refengine import LLM
    from refengine.tools import bench

    llm = LLM(engine="async", graph_mode=DEFAULT_ASYNC_GRAPH_MODE, num_speculative_tokens=1)
    path = bench.profile_async(llm, 1, tmp_path / "prof")
    events = json.loads(path.read_text())["traceEvents"]  # Chrome-trace JSON, what Perfetto opens
    threads = {name: {e["tid"] for e in events if e.get("name") == name} for name, _, _ in bench.STAGE_RANGES}
    assert all(threads.values()), threads  # every stage is a named range
    assert threads["program"].isdisjoint(threads["schedule"])  # the device timeline is its own thread on CPU
    assert "process" not in vars(llm.engine)  # the ranges were this run's only
    # The threads are named for what they do, and the aten ops under the ranges are left out (--profile-ops).
    named = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert named[next(iter(threads["schedule"]))] == bench.HOST_THREAD, named
    assert named[next(iter(threads["program"]))] == bench.DEVICE_THREAD, named
    assert not [e for e in events if e.get("cat") == "cpu_op"], "aten ops without --profile-ops"


@pytest.mark.parametrize("argv", [["bench", "--profile", __file__]])
def test_bench_profile_into_a_file_is_refused_up_front(argv, capsys):
    assert main(argv) == 2
    assert "is a file; name a folder" in capsys.readouterr().err
