"""EAGLE heads the suite makes for the model under test, so its ``eagle`` / ``eagle3`` scenarios run on any
checkpoint: ``refengine.tools.eagle_head`` with a fixed seed (EAGLE-3: a draft vocabulary of 3/4 of the
target's, so ``d2t`` maps every draft), written once per model, method and head-maker version into the temp
folder (beside, then renamed: a half-written head is never picked up) and reused.

Such a head is untrained: its drafts are mostly rejected, which is what the checks need (every rejection
rewinds the head's KV positions), and a few are accepted.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

SEED = 0
DRAFT_VOCAB_FRACTION = 0.75  # EAGLE-3: the draft vocabulary's share of the target's


def head_for(model: str | None, method: str) -> str:
    """The folder of the suite's ``method`` head for checkpoint ``model`` (None: the embedded default)."""
    from refengine.llm import default_model_path
    from refengine.model.loader import read_config
    from refengine.tools import eagle_head
    from refengine.tools.folders import write_once
    from refengine.tools.tiny_models import resolve_model

    path = Path(resolve_model(model) if model is not None else default_model_path())
    digest = hashlib.sha256(method.encode())
    digest.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    digest.update(Path(eagle_head.__file__).read_bytes())
    name = f"conformance-{method}-head-{digest.hexdigest()[:12]}-uid{os.getuid()}"
    root = Path(tempfile.gettempdir()) / name
    vocab = read_config(path).vocab_size
    draft_vocab = max(int(vocab * DRAFT_VOCAB_FRACTION), 1) if method == "eagle3" else None
    write_once(root, lambda work: eagle_head.add_eagle_head(path, work / "out", method,
                                                            draft_vocab_size=draft_vocab, seed=SEED))
    return str(root)
