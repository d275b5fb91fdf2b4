"""The edges of both command lines: ``--help`` and usage errors answer before torch loads, an unknown flag is
refused by its subcommand with the closest flag it has, and a refused setting is said in the command's
flags with the fix a user of the command has (the Python API's messages keep the API's names)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refengine.config import CacheConfig, ConfigError

REPO = Path(__file__).resolve().parent.parent

# (module, argv, exit status): every one answered from the parser alone.
PARSER_ONLY = [
    ("conformance.cli", ["--help"], 0),
    ("conformance.cli", ["run", "--help"], 0),
    ("conformance.cli", ["mutate", "--help"], 0),
    ("conformance.cli", ["run", "--fail-on-skp"], 2),
    ("conformance.cli", ["run", "--tier", "weekly"], 2),
    ("refengine.tools.cli", ["--help"], 0),
    ("refengine.tools.cli", ["generate", "--help"], 0),
    ("refengine.tools.cli", ["add-mtp-head", "--help"], 0),
    ("refengine.tools.cli", ["bench", "--help"], 0),
    ("refengine.tools.cli", ["report", "--help"], 0),
    ("refengine.tools.cli", ["generate", "--devcie", "cpu"], 2),
    ("refengine.tools.cli", ["generate", "--threads", "0"], 2),
    ("refengine.tools.cli", ["bench", "--profle", "out"], 2),
]
# One fresh interpreter runs them in turn, saying after each whether torch is loaded (once it is, it stays:
# the first command that loads it is the one named).
PROBE = """
import contextlib, importlib, io, json, sys
for module, argv, _ in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps({"command": [module, *argv], "code": code, "torch": "torch" in sys.modules,
                      "stdout": out.getvalue(), "stderr": err.getvalue()}))
"""


@pytest.fixture(scope="module")
def answered() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(PARSER_ONLY)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    return {" ".join(r["command"][1:]) + f" ({r['command'][0]})": r for r in rows}


def test_help_and_usage_errors_answer_before_torch_loads(answered):
    assert len(answered) == len(PARSER_ONLY)
    for (_, _, code), (name, row) in zip(PARSER_ONLY, answered.items()):
        assert row["code"] == code, (name, row)
        assert not row["torch"], f"{name} imported torch before answering"


def test_an_unknown_flag_points_at_its_subcommands_help_with_the_closest_flag(answered):
    def line(name):
        return answered[name]["stderr"].strip()

    assert line("run --fail-on-skp (conformance.cli)") == (
        "conformance run: unrecognized argument: --fail-on-skp; did you mean --fail-on-skip? "
        "(see conformance run --help)")
    assert line("generate --devcie cpu (refengine.tools.cli)") == (
        "refengine generate: unrecognized arguments: --devcie cpu; did you mean --device? "
        "(see refengine generate --help)")
    assert line("bench --profle out (refengine.tools.cli)") == (
        "refengine bench: unrecognized arguments: --profle out; did you mean --profile? "
        "(see refengine bench --help)")


def test_an_unknown_flag_with_nothing_close_names_no_suggestion(capsys):
    from conformance.cli import main

    with pytest.raises(SystemExit) as e:
        main(["mutate", "--zzz"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "conformance mutate: unrecognized argument: --zzz (see conformance mutate --help)")


def test_the_torch_free_names_are_the_engines_own():
    import refengine.drafters
    from refengine.config import DRAFTER_NAMES, DTYPE_NAMES, DTYPES

    assert DRAFTER_NAMES == tuple(refengine.drafters.DRAFTERS)
    assert DTYPE_NAMES == tuple(DTYPES)


# ---- refused settings in the command's words ---------------------------------------------------------
def _refused(capsys, argv) -> str:
    from refengine.tools.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and not out.strip(), (out, err)
    return lines[0]


@pytest.mark.parametrize("argv,expected", [
    (["--mamba-cache-mode", "all"],
     "refengine generate: --mamba-cache-mode all needs --enable-prefix-caching"),
    (["--prompt-lookup-min", "2"],
     ("refengine generate: --prompt-lookup-min 2: prompt lookup settings apply to --drafter ngram only, got "
     "--drafter mtp")),
    (["--device", "cuda:99"], "refengine generate: --device cuda:99 but "),
])
def test_a_refused_setting_speaks_the_commands_flags(argv, expected, capsys):
    line = _refused(capsys, ["generate", "--prompt-ids", "1,2", *argv])
    assert line.startswith(expected), line
    assert "=" not in line and "_" not in line, line


def test_a_checkpoint_without_an_mtp_head_names_the_fix(capsys, tmp_path):
    from refengine.llm import default_model_path
    from tests.helpers.checkpoints import read_tensors, write_variant

    src = Path(default_model_path())
    headless = write_variant(src, tmp_path / "headless",
                             {k: v for k, v in read_tensors(src).items() if not k.startswith("mtp.")})
    line = _refused(capsys, ["generate", "--prompt-ids", "1,2", "--num-spec-tokens", "2", "--model",
                             str(headless)])
    assert line.startswith("refengine generate: --drafter mtp needs a checkpoint with mtp.* weights"), line
    assert "`refengine add-mtp-head SRC DST`" in line and "--drafter ngram" in line, line
    assert "drafter=" not in line and "num_speculative_tokens" not in line, line


def test_conformance_speaks_its_device_flag_but_not_a_scenario_files_fields(capsys, tmp_path):
    from conformance.cli import main

    assert main(["run", "--device", "cuda:99"], out=io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conformance run: --device cuda:99 but "), err
    from refengine.tools.errors import setting_message

    assert setting_message(ValueError("f.json: mamba_cache_mode='all' needs enable_prefix_caching=True")) == \
        "f.json: mamba_cache_mode='all' needs enable_prefix_caching=True"


def test_the_python_api_keeps_its_own_names():
    with pytest.raises(ConfigError, match=r"^mamba_cache_mode='all' needs enable_prefix_caching=True$"):
        CacheConfig(mamba_cache_mode="all")


@pytest.mark.parametrize("argv,expected", [
    (["--max-tokens", "4", "--min-tokens", "5"],
     "refengine generate: --min-tokens must be <= --max-tokens 4"),
    (["--presence-penalty", "3"], "refengine generate: --presence-penalty must be in [-2, 2]"),
    (["--logit-bias", "9999=1"], "refengine generate: request 'gen-0': --logit-bias: 9999 is not an id"),
    (["--prompt-logprobs", "30"], "refengine generate: request 'gen-0': --prompt-logprobs must be <= 20"),
])
def test_a_refused_request_parameter_names_its_flag(argv, expected, capsys):
    line = _refused(capsys, ["generate", "--prompt-ids", "1,2", *argv])
    assert line.startswith(expected), line


def test_generate_takes_the_request_parameters(capsys):
    from refengine.tools.cli import main

    assert main(["generate", "--prompt", "Hello", "--max-tokens", "6", "--allowed-token-ids", "108,111,32",
                 "--stop", "l", "--logprobs", "1", "--prompt-logprobs", "0", "--repetition-penalty", "1.2",
                 "--logit-bias", "32=0.5"]) == 0
    out = capsys.readouterr().out
    assert "finish_reason: stop" in out and "stop_reason: 'l'" in out, out
    assert "logprobs: [{" in out and "prompt_logprobs: [None, {101: " in out, out
