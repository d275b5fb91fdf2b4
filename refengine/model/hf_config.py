"""transformers' configuration classes, built as the families need them (no torch imported here)."""

from __future__ import annotations

from typing import Any


def transformers_config(config_class: type, d: dict[str, Any]) -> Any:
    """transformers' configuration class ``config_class`` built from a parsed config.json as its
    ``from_dict`` builds it (``config_class(**d)``), without ``from_dict``'s log line: that line formats
    the whole config as JSON on every call, logged or not. ValueError names the class that refused it."""
    try:
        return config_class(**d)
    except Exception as exc:  # ValueError, TypeError, KeyError, or huggingface_hub's strict-dataclass errors
        raise ValueError(f"transformers' {config_class.__name__} refused it: {exc}") from exc
