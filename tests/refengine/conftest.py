"""Fixtures shared by the refengine tests: tiny transformers-written checkpoints, one per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(preset) -> Path``: the preset's checkpoint, written once per session."""
    written: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in written:
            written[preset] = write_checkpoint(tmp_path_factory.mktemp(preset), preset)
        return written[preset]

    return get


@pytest.fixture(scope="session")
def tiny_nemotron(tmp_path_factory):
    """``tiny_nemotron(preset) -> Path``: a Nemotron-H checkpoint transformers wrote, once per session."""
    from tests.helpers.nemotron_checkpoints import write_checkpoint as write_nemotron

    written: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in written:
            written[preset] = write_nemotron(tmp_path_factory.mktemp(preset), preset)
        return written[preset]

    return get
