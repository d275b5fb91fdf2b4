"""``--dtype`` on the ``refengine`` commands: the engines are built in it ("auto": the checkpoint's own
dtype) and every command prints the dtype it ran in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import refengine
import refengine.llm
from refengine.llm import default_model_path
from refengine.tools import bench
from refengine.tools.cli import main


def stored_in(src: str | Path, dst: Path, dtype: torch.dtype) -> Path:
    """A copy of checkpoint ``src`` with every floating-point tensor stored in ``dtype`` and config.json
    saying so (what ``dtype="auto"`` reads)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def bf16_default_model(tmp_path_factory) -> str:
    return str(stored_in(default_model_path(), tmp_path_factory.mktemp("bf16") / "model", torch.bfloat16))


@pytest.fixture
def built(monkeypatch) -> list[tuple[str, torch.dtype]]:
    """(engine, parameter dtype) of every LLM the commands build, in build order."""
    seen = []

    class RecordingLLM(refengine.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append((self.config.engine, next(self.engine.model.parameters()).dtype))

    monkeypatch.setattr(refengine, "LLM", RecordingLLM)
    monkeypatch.setattr(refengine.llm, "LLM", RecordingLLM)
    return seen


def _last_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert not err, err
    return out.strip().splitlines()[-1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generate_runs_in_the_dtype_and_says_so(dtype, built, capsys):
    assert main(["generate", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--dtype", dtype]) == 0
    assert built == [("reference", getattr(torch, dtype))]
    assert f"dtype {dtype}" in _last_line(capsys)


def test_auto_is_the_checkpoints_own_dtype(bf16_default_model, built, capsys):
    assert main(["generate", "--model", bf16_default_model, "--prompt-ids", "1,2,3", "--max-tokens", "3",
                 "--engine", "async", "--dtype", "auto"]) == 0
    assert built == [("async", torch.bfloat16)]
    assert "engine async, dtype bfloat16" in _last_line(capsys)
    assert main(["generate", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--dtype", "auto"]) == 0
    # float32 on disk
    assert built[-1] == ("reference", torch.float32) and "dtype float32" in _last_line(capsys)


def test_report_runs_every_workload_in_the_dtype_and_says_so(built, capsys):
    assert main(["report", "--max-tokens", "2", "--samples", "0", "--dtype", "bfloat16"]) == 0
    assert len(built) == 3 and {d for _, d in built} == {torch.bfloat16}  # warm-up, K=0 and K=3
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("generated tokens (greedy), dtype bfloat16"), out


def test_bench_builds_both_engines_in_the_dtype(bf16_default_model, built):
    bench.engines(None, 0, "none", 4, dtype="bfloat16")
    bench.engines(bf16_default_model, 0, "none", 4, dtype="auto")
    assert built == [("reference", torch.bfloat16), ("async", torch.bfloat16)] * 2


def test_bench_says_the_dtype_it_ran_in(capsys):
    assert main(["bench", "--repeat", "1", "--num-spec-tokens", "0", "--graph-mode", "none", "--dtype",
                 "bfloat16"]) == 0
    assert "device cpu, dtype bfloat16 (both engines)" in capsys.readouterr().out.splitlines()[0]


def test_an_unknown_dtype_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--dtype", "float64"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("refengine generate: argument --dtype: invalid choice: 'float64'"), line
