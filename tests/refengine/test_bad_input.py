"""Bad input gets a clear error naming the problem; the engine keeps serving everyone else."""

from __future__ import annotations

import json

import pytest

from refengine import LLM, ConfigError, SamplingParams
from refengine.core import EngineError
from refengine.model import CheckpointError

ENGINES = ["reference", "async"]


@pytest.fixture(scope="module")
def expected():
    """The default model's greedy output for two healthy prompts, from an undisturbed engine."""
    llm = LLM(num_speculative_tokens=2)
    return [o.token_ids for o in llm.generate(["one two three", "a b c"], SamplingParams(max_tokens=12))]


def _serve_others(llm, expected):
    """Two healthy requests added around the bad input still finish with their normal output."""
    got = [o.token_ids for o in llm.generate(["one two three", "a b c"], SamplingParams(max_tokens=12))]
    assert got == expected
    assert llm.engine.pools_empty()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("prompt,message", [
    ([], "prompt is empty"),
    ([1, 2, 260], "prompt token 260 at index 2"),
    ([-1, 5], "prompt token -1 at index 0"),
    ([1, 2.5], "prompt token 2.5"),
    (list(range(200)) * 6, "leaves no room under max_model_len"),
])
def test_bad_prompts_are_refused(engine, prompt, message, expected):
    llm = LLM(engine=engine, num_speculative_tokens=2)
    llm.add_request("healthy", "one two three", SamplingParams(max_tokens=12))
    with pytest.raises(EngineError, match=message):
        llm.add_request("bad", prompt, SamplingParams(max_tokens=4))
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert list(done) == ["healthy"] and done["healthy"].token_ids == expected[0]
    _serve_others(llm, expected)


def test_max_tokens_must_be_positive():
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_tokens must be >= 1"):
            SamplingParams(max_tokens=bad)
    with pytest.raises(ConfigError, match="max_tokens must be an int"):
        SamplingParams(max_tokens=2.0)


@pytest.mark.parametrize("engine", ENGINES)
def test_duplicate_and_unknown_request_ids(engine, expected):
    llm = LLM(engine=engine, num_speculative_tokens=2)
    llm.add_request("x", "one two three", SamplingParams(max_tokens=12))
    with pytest.raises(EngineError, match="'x' is already in use"):
        llm.add_request("x", "a b c", SamplingParams(max_tokens=4))
    with pytest.raises(EngineError, match="no live request with id 'nope'"):
        llm.abort("nope")
    aborted = llm.abort("x")
    assert aborted.finish_reason == "abort"
    while llm.has_unfinished():
        llm.step()
    llm.add_request("x", "one two three", SamplingParams(max_tokens=12))  # the id is free again
    while llm.has_unfinished():
        llm.step()
    _serve_others(llm, expected)


def test_generate_refuses_the_whole_call_and_changes_nothing(expected):
    llm = LLM(num_speculative_tokens=2)
    with pytest.raises(EngineError, match="prompt is empty"):
        llm.generate(["one two three", ""], SamplingParams(max_tokens=12))
    assert not llm.has_unfinished()
    _serve_others(llm, expected)


@pytest.mark.parametrize("params,message", [
    ({"max_tokens": 4}, (r"^params must be a SamplingParams or a list of them, got dict \{'max_tokens': 4\} "
                         r"\(pass SamplingParams\(\*\*it\)\)$")),
    ("greedy", r"^params must be a SamplingParams or a list of them, got str 'greedy'$"),
    ([{"max_tokens": 4}], r"^request 'gen-0': params must be SamplingParams, got dict$"),
])
def test_generate_names_params_that_are_not_sampling_params(params, message):
    llm = LLM()
    with pytest.raises(EngineError, match=message):
        llm.generate(["p"], params)
    assert not llm.has_unfinished()


def test_a_missing_model_folder_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=f"^checkpoint folder {tmp_path / 'absent'} does not exist$"):
        LLM(model=str(tmp_path / "absent"))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"engine": "fast"}, "engine must be 'reference' or 'async'"),
        ({"graph_mode": "full"}, "graph_mode: the reference engine runs without graphs"),
        ({"engine": "async", "graph_mode": "sometimes"}, "graph_mode must be one of"),
        (
            {"num_speculative_tokens": 3, "max_num_batched_tokens": 3},
            "max_num_batched_tokens \\(3\\) must be >= 1",
        ),
        ({"num_kv_blocks": 2}, "num_kv_blocks \\(2\\) cannot hold one request"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens must be >= 0"),
        (
            {"drafter": "oracle", "num_speculative_tokens": 1},
            "drafter must be one of \\('mtp', 'scripted', 'ngram', 'eagle', 'eagle3', 'draft_model'\\)",
        ),
        ({"dtype": "float64"}, "dtype must be one of"),
    ],
)
def test_impossible_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)


def test_mtp_drafting_without_mtp_weights_is_a_clear_error(tmp_path):
    from tests.helpers.checkpoints import TinySpec, write_checkpoint

    path = write_checkpoint(tmp_path / "no-mtp", TinySpec(with_mtp=False))
    with pytest.raises(ValueError, match="needs a checkpoint with mtp"):
        LLM(model=str(path), num_speculative_tokens=2)
    assert (
        LLM(model=str(path)).generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].finish_reason == "length"
    )


def test_malformed_checkpoint_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(model=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    with pytest.raises((CheckpointError, ValueError)):
        LLM(model=str(tmp_path))


def test_text_prompt_without_tokenizer(tmp_path):
    from tests.helpers.checkpoints import write_checkpoint

    llm = LLM(model=str(write_checkpoint(tmp_path / "tiny", "next-tiny")))
    with pytest.raises(EngineError, match="text prompts need a tokenizer"):
        llm.generate(["hello"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_thousands_of_requests_leak_nothing(engine):
    """2,000 short requests with aborts and preemption through a small pool: every block and slot returns."""
    import torch

    g = torch.Generator().manual_seed(7)
    llm = LLM(engine=engine, num_speculative_tokens=2, max_num_seqs=8, block_size=4, num_kv_blocks=96,
              max_model_len=64)
    finished = 0
    for i in range(2000):
        prompt = torch.randint(0, 256, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        llm.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=int(torch.randint(1, 6, (1,), generator=g)))
        )
        if i % 97 == 0:
            llm.abort(f"r{i}")
            finished += 1
        if i % 4 == 3:
            finished += len(llm.step())
    while llm.has_unfinished():
        finished += len(llm.step())
    assert finished == 2000
    assert llm.engine.pools_empty()
    assert llm.engine.core.scheduler.kv_pool.num_free == 96


def test_block_size_the_triton_attention_cannot_take_is_refused_at_build(monkeypatch):
    """Where the engine will run the Triton kernels, a block size they cannot serve fails up front."""
    monkeypatch.setenv("KERNELS_BACKEND", "triton")
    with pytest.raises(ValueError, match="block_size=128 cannot be served by the Triton paged attention"):
        LLM(block_size=128)
    monkeypatch.setenv("KERNELS_BACKEND", "torch")
    assert LLM(block_size=128).generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
