"""A byte-level tokenizer: ids 0..255 are bytes; special ids come from tokenizer_config.json."""

from __future__ import annotations

import json
import os


class ByteTokenizer:
    def __init__(self, eos_token_id: int | None = None, bos_token_id: int | None = None):
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")


def load_tokenizer(path: str) -> ByteTokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none."""
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        cfg = json.load(f)
    kind = cfg.get("tokenizer_class")
    if kind != "ByteTokenizer":
        raise ValueError(f"{cfg_path}: unsupported tokenizer_class {kind!r} (only ByteTokenizer)")
    return ByteTokenizer(cfg.get("eos_token_id"), cfg.get("bos_token_id"))
