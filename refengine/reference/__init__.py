"""The reference engine: synchronous, readable, rebuilt from request state every step."""

from refengine.reference.engine import ReferenceEngine

__all__ = ["ReferenceEngine"]
