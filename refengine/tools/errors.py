"""How the ``refengine`` commands report bad input: one line on stderr, exit status 2, no traceback.

Only errors about what the user gave (settings, checkpoint, device, prompts) are reported this
way; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

from refengine.config import ConfigError
from refengine.core import EngineError
from refengine.model.loader import CheckpointError

USAGE_EXIT = 2
# Errors from building an engine out of the user's settings and checkpoint (a drafter that the
# checkpoint cannot serve and a bad tokenizer file raise plain ValueError; a missing file OSError).
SETUP_ERRORS = (ConfigError, CheckpointError, EngineError, ValueError, OSError, NotImplementedError)
# Errors from running the user's prompts.
REQUEST_ERRORS = (ConfigError, EngineError)


def report(prog: str, exc: BaseException) -> int:
    """Print ``prog: message`` as one line on stderr and return the usage exit status."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: {message}", file=sys.stderr)
    return USAGE_EXIT
