"""Prefix caching for hybrid models: shared KV blocks and recurrent-state checkpoints.

``pools``: block keys, the reference-counted KV block pool, the checkpoint pool. ``geometry``: which
block boundaries a step reaches and which column of its output holds each (pure arithmetic).
``cache``: ``PrefixCache``, the lookups at admission and the step protocol both engines follow
(restore, hold, publish, release).
"""

from refengine.prefix_cache.cache import Checkpoint, Hit, PrefixCache, Restore, Span
from refengine.prefix_cache.pools import ROOT_KEY, BlockPool, CheckpointPool, extend_keys, next_key

__all__ = ["ROOT_KEY", "BlockPool", "Checkpoint", "CheckpointPool", "Hit", "PrefixCache", "Restore", "Span",
           "extend_keys", "next_key"]
