"""Checkpoint folders the tools make once and reuse (tiny presets, suite heads, cut draft models)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_once(root: Path, make: Callable[[Path], None]) -> bool:
    """Make checkpoint folder ``root`` unless it holds a config.json already: ``make(work)`` writes
    ``work / "out"`` (and whatever scratch it needs in ``work``), a fresh folder beside ``root``; ``out`` is
    then renamed into place, so a half-written folder is never picked up and two processes racing keep
    whichever finished first. True when this call wrote it."""
    if (root / "config.json").is_file():
        return False
    work = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=root.parent))
    try:
        make(work)
        try:
            os.rename(work / "out", root)
        except OSError:  # another process finished first: use its copy
            if not (root / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return True
