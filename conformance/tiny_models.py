"""The tiny checkpoints of the registered families (``tiny:nemotron_h``): made by
``refengine.tools.tiny_models``, which every command taking ``--model`` resolves them with."""

from refengine.tools.tiny_models import (  # noqa: F401 - this module's names, kept where they were
    TINY_PREFIX,
    draw_model,
    family_names,
    makers,
    tiny_model_path,
    tiny_names,
)
