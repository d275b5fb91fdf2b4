"""Divergences found in outside engines, each shrunk to a scenario file that replays it, with a report beside
it: ``conformance/findings/<engine>/<id>.json`` and ``<id>.md``. An engine's expectations file
(``conformance/expectations/<engine>.toml``) lists each as an expected failure naming its replay, so the
engine's tier stays meaningful; one that starts passing is reported stale."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def finding_files(engine: str | None = None) -> list[Path]:
    """The scenario files of the findings of ``engine`` (None: of every engine), sorted."""
    folders = [ROOT / engine] if engine is not None else sorted(p for p in ROOT.iterdir() if p.is_dir())
    return sorted(f for folder in folders if folder.is_dir() for f in folder.glob("*.json"))


def finding_ids(engine: str | None = None) -> list[str]:
    """Their scenario ids (each file's stem is its id)."""
    return [f.stem for f in finding_files(engine)]
