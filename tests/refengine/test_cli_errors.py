"""The ``refengine`` commands report a bad checkpoint, setting or device once: one line on stderr,
exit status 2, no traceback, before any work."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from refengine.llm import default_model_path
from refengine.tools.cli import main

COMMANDS = {
    "generate": ["generate", "--prompt", "hi", "--max-tokens", "2"],
    "report": ["report", "--max-tokens", "2"],
    "bench": ["bench", "--repeat", "1", "--num-spec-tokens", "0"],
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    """Checkpoint folders, each broken in one way."""
    src = Path(default_model_path())
    root = tmp_path_factory.mktemp("broken")
    out = {}

    def copy(name: str) -> Path:
        dst = root / name
        shutil.copytree(src, dst)
        return dst

    truncated = copy("truncated")
    data = (src / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    out["truncated"] = truncated
    no_config = copy("no-config")
    (no_config / "config.json").unlink()
    out["no-config"] = no_config
    pickled = copy("pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"pickled weights")
    out["pickled"] = pickled
    nan = copy("nan")
    tensors = load_file(str(src / "model.safetensors"))
    name = min(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(nan / "model.safetensors"), metadata={"format": "pt"})
    out["nan"] = nan
    tokenizer = copy("bad-tokenizer")
    (tokenizer / "tokenizer.json").write_text("{not json")
    out["bad-tokenizer"] = tokenizer
    return out


CASES = [
    ("truncated", "cannot read .*model.safetensors"),
    ("no-config", "missing config.json"),
    ("pickled", "only .bin/pickle weights found; convert to safetensors"),
    ("nan", "holds non-finite values"),
    ("bad-tokenizer", "cannot load its tokenizer"),
]


def _one_line_error(capsys, code: int, prog: str, pattern: str) -> None:
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"refengine {prog}: ")
    assert "Traceback" not in err and not out.strip()
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case,pattern", CASES)
def test_bad_checkpoint(command, case, pattern, broken, capsys):
    code = main([*COMMANDS[command], "--model", str(broken[case])])
    _one_line_error(capsys, code, command, pattern)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("device,pattern", [
    ("tpu", "--device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    pytest.param("cuda", "--device cuda but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
    ("cuda:99", "--device cuda:99 but"),
])
def test_bad_device(command, device, pattern, capsys):
    code = main([*COMMANDS[command], "--device", device])
    _one_line_error(capsys, code, command, pattern)


@pytest.mark.parametrize("argv,prog", [
    (["generate", "--prompt", "hi", "--engine", "async", "--graph-mode", "sometimes"], "generate"),
    (["bench", "--graph-mode", "sometimes"], "bench"),
    (["bench", "--fake-cuda", "--graph-mode", "sometimes"], "bench"),
])
def test_unknown_graph_mode(argv, prog, capsys):
    _one_line_error(capsys, main(argv), prog, "--graph-mode must be one of .*got 'sometimes'")


def test_bad_prompts(capsys):
    """(Flags out of range are tests/refengine/test_settings.py's BAD_FLAGS table.)"""
    _one_line_error(capsys, main(["generate", "--prompt-ids", "1,2,99999"]), "generate",
                    "prompt token 99999 at index 2")


def test_the_console_command_prints_no_traceback(broken):
    """The same through a fresh interpreter, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "refengine.tools.cli", "generate", "--prompt", "hi",
                           "--model", str(broken["pickled"])], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    expected = (
        f"refengine generate: only .bin/pickle weights found; convert to safetensors (only safetensors "
        f"checkpoints are supported, found pytorch_model.bin in {broken['pickled']})"
    )
    assert proc.stderr.strip().splitlines() == [expected]
