"""The async engine: one step in flight, device-authoritative state, persistent batch, graph modes."""

from refengine.async_engine.engine import AsyncEngine

__all__ = ["AsyncEngine"]
