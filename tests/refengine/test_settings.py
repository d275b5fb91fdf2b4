"""Every setting is checked where it enters: one ConfigError naming the field and the value."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conformance.cli
from conformance import plugin
from refengine import LLM, ConfigError, SamplingParams
from refengine.config import DTYPES, CacheConfig, EngineConfig, GraphMode, SchedulerConfig, SpeculativeConfig
from refengine.core import EngineError
from refengine.tools import bench, cli, report, train_default_model

NO_CUDA = not torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[2]

# (dataclass, field, bad value): one row per bad value; the error must name the field and the value.
BAD = [
    (CacheConfig, "block_size", 16.0),
    (CacheConfig, "block_size", 0),
    (CacheConfig, "block_size", True),
    (CacheConfig, "block_size", "16"),
    (CacheConfig, "num_kv_blocks", 0),
    (CacheConfig, "num_kv_blocks", 8.5),
    (CacheConfig, "enable_prefix_caching", 1),
    (CacheConfig, "mamba_cache_mode", "bogus"),
    (CacheConfig, "mamba_cache_mode", "all"),
    (CacheConfig, "num_state_checkpoints", 0),
    (SchedulerConfig, "max_num_seqs", 2.5),
    (SchedulerConfig, "max_num_seqs", 0),
    (SchedulerConfig, "max_num_seqs", False),
    (SchedulerConfig, "max_num_batched_tokens", 256.0),
    (SchedulerConfig, "max_num_batched_tokens", -1),
    (SchedulerConfig, "max_model_len", 1),
    (SchedulerConfig, "max_model_len", None),
    (SchedulerConfig, "max_model_len", 1e3),
    (SpeculativeConfig, "num_speculative_tokens", -1),
    (SpeculativeConfig, "num_speculative_tokens", 2.0),
    (SpeculativeConfig, "num_speculative_tokens", None),
    (SpeculativeConfig, "drafter", "oracle"),
    (SpeculativeConfig, "drafter", 3),
    (SpeculativeConfig, "prompt_lookup_min", 0),
    (SpeculativeConfig, "prompt_lookup_min", 2.0),
    (SpeculativeConfig, "prompt_lookup_min", 3),
    (SpeculativeConfig, "prompt_lookup_max", -1),
    (SpeculativeConfig, "prompt_lookup_max", "5"),
    (SpeculativeConfig, "draft_model", 5),
    (SpeculativeConfig, "draft_model", "/a/head"),  # with the default drafter, "mtp"
    (EngineConfig, "model", 3),
    (EngineConfig, "engine", "fast"),
    (EngineConfig, "engine", None),
    (EngineConfig, "dtype", "float64"),
    (EngineConfig, "dtype", torch.float32),
    (EngineConfig, "dtype", "auto"),
    (EngineConfig, "device", "tpu"),
    (EngineConfig, "device", 0),
    (EngineConfig, "device", "cuda:99"),
    (EngineConfig, "seed", 1.5),
    (EngineConfig, "seed", -1),
    (EngineConfig, "seed", "0"),
    (EngineConfig, "graph_mode", "sometimes"),
    (EngineConfig, "graph_mode", 1),
    (EngineConfig, "recurrent_prefill_chunked", 1),
    (EngineConfig, "recurrent_prefill_chunked", "no"),
    (EngineConfig, "cache", {"block_size": 16}),
    (EngineConfig, "scheduler", None),
    (EngineConfig, "speculative", 3),
    (SamplingParams, "max_tokens", 0),
    (SamplingParams, "max_tokens", 2.0),
    (SamplingParams, "max_tokens", True),
    (SamplingParams, "ignore_eos", 1),
    (SamplingParams, "ignore_eos", None),
    (SamplingParams, "stop_token_ids", "12"),
    (SamplingParams, "stop_token_ids", 12),
    (SamplingParams, "stop_token_ids", [1, 2.5]),
    (SamplingParams, "stop_token_ids", [-1]),
    (SamplingParams, "min_tokens", -1),
    (SamplingParams, "min_tokens", 2.5),
    (SamplingParams, "presence_penalty", 3.0),
    (SamplingParams, "presence_penalty", "x"),
    (SamplingParams, "frequency_penalty", -2.5),
    (SamplingParams, "repetition_penalty", 0.0),
    (SamplingParams, "repetition_penalty", float("nan")),
    (SamplingParams, "logit_bias", [1, 2]),
    (SamplingParams, "allowed_token_ids", [-1]),
    (SamplingParams, "allowed_token_ids", "12"),
    (SamplingParams, "bad_words", 3),
    (SamplingParams, "stop", 5),
    (SamplingParams, "include_stop_str_in_output", 1),
    (SamplingParams, "logprobs", -1),
    (SamplingParams, "prompt_logprobs", -1),
    (SamplingParams, "prompt_logprobs", 1.5),
    (SamplingParams, "structured_outputs", "[a-c]+"),
    (SamplingParams, "stop_token_ids", [True]),
    (SamplingParams, "temperature", -0.7),
    (SamplingParams, "temperature", "0"),
    (SamplingParams, "top_p", 0.0),
    (SamplingParams, "top_p", None),
    (SamplingParams, "top_k", -3),
    (SamplingParams, "top_k", 1.0),
    (SamplingParams, "top_k", -2),
    (SamplingParams, "min_p", 1.5),
    (SamplingParams, "min_p", -0.1),
    (SamplingParams, "seed", -4),
    (SamplingParams, "seed", 2.0),
]
if NO_CUDA:
    BAD.append((EngineConfig, "device", "cuda"))

GOOD = [
    (CacheConfig, {"block_size": 1, "num_kv_blocks": None}), (CacheConfig, {"num_kv_blocks": 4096}),
    (SchedulerConfig, {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 2}),
    (SpeculativeConfig, {"num_speculative_tokens": 3, "drafter": "scripted"}),
    (SpeculativeConfig, {"num_speculative_tokens": 3, "drafter": "eagle3", "draft_model": "/a/head"}),
    (EngineConfig, {"engine": "async", "graph_mode": "FULL_AND_PIECEWISE", "dtype": "bfloat16", "seed": 7,
                    "device": "cpu", "recurrent_prefill_chunked": True}),
    (EngineConfig, {"engine": "async", "graph_mode": GraphMode.FULL, "model": "/some/where"}),
    (EngineConfig, {"engine": "reference", "graph_mode": "None", "device": torch.device("cpu")}),
    (SamplingParams, {"max_tokens": 1, "ignore_eos": True, "stop_token_ids": None}),
    (SamplingParams, {"stop_token_ids": [3, 4], "temperature": 0.0, "top_p": 1.0, "top_k": -1}),
    (SamplingParams, {"stop_token_ids": (5,), "temperature": 0, "top_k": 0}),
    (SamplingParams, {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 0}),
    (SamplingParams, {"temperature": 2, "top_p": 1, "min_p": 1, "seed": (1 << 63) - 1}),
]


def _id(row):
    return f"{row[0].__name__}-{row[1]}-{row[2]!r}"


@pytest.mark.parametrize("cls,name,value", BAD, ids=[_id(r) for r in BAD])
def test_bad_value_names_the_field_and_the_value(cls, name, value):
    with pytest.raises(ConfigError) as info:
        cls(**{name: value})
    message = str(info.value)
    assert name in message
    assert repr(value) in message or str(value) in message, message


def test_every_field_has_a_bad_row():
    for cls in (CacheConfig, SchedulerConfig, SpeculativeConfig, EngineConfig, SamplingParams):
        covered = {name for c, name, _ in BAD if c is cls}
        assert covered == {f.name for f in dataclasses.fields(cls)}, cls.__name__


@pytest.mark.parametrize("cls,kwargs", GOOD, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(GOOD)])
def test_good_values_pass(cls, kwargs):
    obj = cls(**kwargs)
    for name, value in kwargs.items():
        got = getattr(obj, name)
        if name == "stop_token_ids":
            assert got == tuple(value or ())
        elif name == "graph_mode":
            assert got is GraphMode(str(value).lower())
        elif name == "device":
            assert got == str(value)
        else:
            assert got == value and type(got) is type(value) or isinstance(value, int) and got == value


def test_vllm_spellings():
    assert (
        EngineConfig(engine="async", graph_mode="FULL_AND_PIECEWISE").graph_mode
        is GraphMode.FULL_AND_PIECEWISE
    )
    assert SamplingParams(temperature=0.0).temperature == 0.0
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    with pytest.raises(ConfigError, match="dtype='auto'.*resolved by LLM.*float32"):
        EngineConfig(dtype="auto")


def test_dtype_auto_is_the_checkpoints_dtype():
    from refengine.model.loader import resolve_dtype

    llm = LLM(dtype="auto")
    assert llm.config.dtype == resolve_dtype("auto", llm.config.model)
    assert next(llm.engine.model.parameters()).dtype == DTYPES[llm.config.dtype]


def test_config_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_llm_refuses_cuda_without_cuda():
    with pytest.raises(ConfigError, match="device='cuda' but CUDA is not available"):
        LLM(device="cuda")


@pytest.mark.parametrize("kwargs,name", [
    ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"block_size": 16.0}, "block_size"),
    ({"max_model_len": 10**6}, "max_position_embeddings"),
    ({"observer": "print"}, "observer"),
    ({"delay_copies": "yes"}, "delay_copies"),
    ({"hazard_check": 1}, "hazard_check"),
    ({"allow_non_finite_weights": None}, "allow_non_finite_weights"),
    ({"model": 5}, "model"),
])
def test_llm_settings_name_the_field(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        LLM(**kwargs)


def test_stop_ids_outside_the_vocabulary_are_refused_by_the_engine():
    llm = LLM()
    vocab = llm.model_config.vocab_size
    with pytest.raises(EngineError, match=f"stop_token_ids {vocab} is not an id"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, stop_token_ids=[1, vocab]))
    assert not llm.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, stop_token_ids=None, temperature=0.0))[0]
    assert out.finish_reason in ("length", "stop")


def test_graph_mode_any_case_through_llm():
    llm = LLM(engine="async", graph_mode="FULL_AND_PIECEWISE")
    assert llm.config.graph_mode is GraphMode.FULL_AND_PIECEWISE


# ---- the command-line flags ------------------------------------------------------------------------
# (program, flag, bad value): every flag of every command that takes a number has at least one row
# (test_every_numeric_flag_has_a_bad_row reads the parsers); each bad value is refused before any work
# with one line naming the flag and the value, and exit status 2 (pytest's usage error, 4, for the plugin).
BAD_FLAGS = [
    ("conformance run", "--threads", "0"), ("conformance run", "--threads", "-1"),
    ("conformance calibrate", "--threads", "-1"),
    ("conformance triage", "--max-tokens", "-1"),
    ("conformance triage", "--num-speculative-tokens", "-1"),
    ("conformance triage", "--step-timeout", "-1"),
    ("conformance triage", "--tensor-parallel-size", "-1"),
    ("conformance triage", "--threads", "-1"),
    ("conformance run", "--tensor-parallel-size", "0"),
    ("conformance replay", "--tensor-parallel-size", "-2"),
    ("conformance fuzz", "--tensor-parallel-size", "0"),
    ("conformance replay", "--threads", "0"), ("conformance fuzz", "--threads", "-1"),
    ("conformance fuzz", "--examples", "0"), ("conformance fuzz", "--seed", "-1"),
    ("conformance fuzz", "--budget-seconds", "0"), ("conformance fuzz", "--shrink-seconds", "-5"),
    ("conformance fuzz", "--max-requests", "0"), ("conformance fuzz", "--max-prompt", "0"),
    ("conformance fuzz", "--max-new-tokens", "0"), ("conformance mutate", "--threads", "0"),
    ("refengine generate", "--threads", "0"), ("refengine generate", "--threads", "-1"),
    ("refengine generate", "--max-tokens", "0"), ("refengine generate", "--num-spec-tokens", "-1"),
    ("refengine generate", "--min-tokens", "-1"), ("refengine generate", "--logprobs", "-1"),
    ("refengine generate", "--prompt-logprobs", "-1"), ("refengine generate", "--top-k", "-2"),
    ("refengine generate", "--request-seed", "-1"),
    ("refengine report", "--threads", "0"), ("refengine report", "--samples", "-1"),
    ("refengine report", "--num-spec-tokens", "0"), ("refengine report", "--max-tokens", "0"),
    ("refengine bench", "--threads", "-1"), ("refengine bench", "--num-spec-tokens", "-1"),
    ("refengine bench", "--repeat", "0"), ("refengine bench", "--copies", "0"),
    ("refengine bench", "--max-num-seqs", "0"),
    ("train_default_model", "--threads", "0"), ("train_default_model", "--steps", "0"),
    ("train_default_model", "--seed", "-1"), ("train_default_model", "--max-files", "0"),
    pytest.param("pytest --pyargs conformance.suite", "--conformance-threads", "0", marks=pytest.mark.slow),
    ("pytest --pyargs conformance.suite", "--conformance-threads", "-1"),
    ("conformance run", "--step-timeout", "0"), ("conformance replay", "--step-timeout", "-1"),
    ("conformance fuzz", "--step-timeout", "0"), ("conformance run", "--min-scenarios", "-1"),
    ("refengine generate", "--block-size", "0"), ("refengine generate", "--max-num-seqs", "0"),
    ("refengine generate", "--prompt-lookup-min", "0"), ("refengine generate", "--prompt-lookup-max", "0"),
    ("refengine generate", "--seed", "-1"),
    ("refengine add-eagle-head", "--seed", "-1"), ("refengine add-eagle-head", "--draft-vocab-size", "0"),
    pytest.param("pytest --pyargs conformance.suite", "--conformance-step-timeout", "0",
                 marks=pytest.mark.slow),
    pytest.param("pytest --pyargs conformance.suite", "--conformance-min-scenarios", "-1",
                 marks=pytest.mark.slow),
]
TRAIN = "python -m refengine.tools.train_default_model"


def _parsers() -> dict[str, object]:
    """Every command's argparse parser, by the program name its errors start with."""
    out = {}
    for top in (conformance.cli.build_parser(), cli.build_parser()):
        (sub,) = [a for a in top._actions if a.choices and isinstance(a.choices, dict)]
        out.update({p.prog: p for p in sub.choices.values()})
    out.update({"refengine report": report.build_parser(), "refengine bench": bench.build_parser(),
                "train_default_model": train_default_model.build_parser()})
    return out


def _plugin_options() -> dict[str, dict]:
    """The pytest plugin's options (flag -> addoption keywords), as pytest_addoption declares them."""
    options: dict[str, dict] = {}

    class Group:
        def addoption(self, *names, **kwargs):
            options.update({n: kwargs for n in names})

    class Parser:
        def getgroup(self, *args, **kwargs):
            return Group()

    plugin.pytest_addoption(Parser())
    return options


def test_every_numeric_flag_has_a_bad_row():
    """A flag that takes a number declares its range (int_at_least / float_above) and has a row in
    BAD_FLAGS; a plain ``type=int`` or ``type=float`` is the flag that would skip validation."""
    rows = [row.values if hasattr(row, "values") else row for row in BAD_FLAGS]
    covered = {(prog, flag) for prog, flag, _ in rows}
    numeric = set()
    for prog, parser in _parsers().items():
        if prog in ("refengine report", "refengine bench") and not parser.description:
            continue  # the top-level placeholders; the real parsers are report/bench.build_parser
        for action in parser._actions:
            assert action.type not in (int, float), f"{prog} {action.option_strings}: no declared range"
            if hasattr(action.type, "minimum"):
                numeric.add((prog, action.option_strings[-1]))
    for flag, kwargs in _plugin_options().items():
        if kwargs.get("type") in (int, float):
            numeric.add(("pytest --pyargs conformance.suite", flag))
    assert numeric - covered == set(), "numeric flags without a bad row"
    assert covered - numeric == set(), "rows naming no numeric flag"


def test_every_ranged_flag_takes_its_minimum_and_refuses_below():
    """The declared range is the one enforced: the bound itself parses, the number below it is refused."""
    for prog, parser in _parsers().items():
        for action in parser._actions:
            minimum = getattr(action.type, "minimum", None)
            if minimum is None:
                continue
            inclusive = action.type.__qualname__.startswith("int_at_least")
            lowest = minimum if inclusive else minimum + 0.001
            assert action.type(str(lowest)) == lowest, (prog, action.option_strings)
            refused = minimum - 1 if inclusive else minimum
            with pytest.raises(argparse.ArgumentTypeError, match=f"got {refused}$"):
                action.type(str(refused))


def _run_with_flag(prog: str, flag: str, value: str) -> int:
    try:
        if prog.startswith("conformance "):
            return conformance.cli.main([prog.split()[1], flag, value])
        if prog.startswith("refengine "):
            return cli.main([prog.split()[1], flag, value])
        return train_default_model.main(["--out", "unused", flag, value])
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("prog,flag,value", BAD_FLAGS,
                         ids=[f"{p}-{f}={v}" for p, f, v in (getattr(r, "values", r) for r in BAD_FLAGS)])
def test_bad_flag_is_one_line_naming_the_flag_and_the_value(prog, flag, value, capsys, tmp_path):
    if prog.startswith("pytest"):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *prog.split()[1:], flag, value],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        code, out, err = proc.returncode, "", proc.stdout + proc.stderr
        wanted_code, prefix = pytest.ExitCode.USAGE_ERROR, "ERROR: conformance: "
    else:
        code = _run_with_flag(prog, flag, value)
        out, err = capsys.readouterr()
        wanted_code, prefix = 2, f"{TRAIN if prog == 'train_default_model' else prog}: "
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == wanted_code, (code, out, err)
    assert len(lines) == 1 and not out.strip(), (out, err)
    assert lines[0].startswith(prefix), lines[0]
    assert flag in lines[0] and f"got {value}" in lines[0], lines[0]
