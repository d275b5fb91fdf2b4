"""config.json fields nothing reads are warned about by name (a misspelt ``eos_token_id`` would otherwise
be ignored and generation run past EOS); the fields transformers' own configuration class defines, the
standard PretrainedConfig ones and those the family reads itself are not."""

from __future__ import annotations

import json
import warnings

import pytest

from refengine.model.config_fields import UnknownConfigFieldWarning
from refengine.model.loader import read_config


def _misspelt(src, dst):
    from tests.helpers.checkpoints import write_variant

    cfg = json.loads((src / "config.json").read_text())
    cfg["eos_token_ids"] = cfg.pop("eos_token_id")
    return write_variant(src, dst, config=cfg)


def test_a_misspelt_field_is_warned_about_by_name(tiny_checkpoint, tmp_path):
    path = _misspelt(tiny_checkpoint("next-tiny"), tmp_path / "misspelt")
    with pytest.warns(UnknownConfigFieldWarning, match=r"unknown field 'eos_token_ids'.*did you mean "
                      r"'eos_token_id'\?"):
        read_config(path)


@pytest.mark.parametrize("preset", ["next-tiny", "qwen35-mm"])
def test_a_clean_checkpoint_warns_nothing(preset, tiny_checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigFieldWarning)
        read_config(tiny_checkpoint(preset))


def test_a_clean_nemotron_checkpoint_warns_nothing(tiny_nemotron):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigFieldWarning)
        read_config(tiny_nemotron("nemotron-dense"))


def test_the_command_line_prints_it_as_one_line(tiny_checkpoint, tmp_path, capsys):
    from refengine.tools.cli import main

    path = _misspelt(tiny_checkpoint("next-tiny"), tmp_path / "misspelt")
    with warnings.catch_warnings():
        warnings.simplefilter("always", UnknownConfigFieldWarning)
        assert main(["generate", "--prompt-ids", "1,2", "--max-tokens", "1", "--model", str(path)]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "eos_token_ids" in line]
    assert warned and all(line.startswith("refengine generate: warning: ") for line in warned), warned
