"""A checkpoint's own tokenizer, loaded as transformers loads it (``AutoTokenizer``, local files only).

Text prompts are encoded with ``tokenizer.encode(text)`` (the tokenizer's own special-token rules)
and outputs decoded with ``decode(ids, skip_special_tokens=True)``, exactly as transformers does.

``write_byte_tokenizer`` writes the embedded default model's byte-level tokenizer in the standard
format (``tokenizer.json`` + ``tokenizer_config.json``): ids 0..255 are the UTF-8 bytes of the text,
the ids above them are special tokens that decoding drops. Text is never split on special-token
strings (``split_special_tokens``), so every text encodes to its bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Files any of which means "this checkpoint ships a tokenizer".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_EOS = "<|endoftext|>"


class Tokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` through a transformers tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none; ValueError names a broken one."""
    root = Path(path)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for unusable files
        raise ValueError(f"{root}: cannot load its tokenizer: {exc}") from exc
    if isinstance(hf, bool) or not hasattr(hf, "encode"):
        raise ValueError(f"{root}: cannot load its tokenizer (got {type(hf).__name__})")
    return Tokenizer(hf)


def byte_level_tokenizer(vocab_size: int, eos_token_id: int):
    """A ``tokenizers.Tokenizer``: ids 0..255 are bytes, ids 256..vocab_size-1 special tokens (EOS among
    them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    if not 256 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id {eos_token_id} must be a special id in [256, {vocab_size})")
    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for the bytes, as GPT-2 maps them
    byte_chars = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(byte_chars.values())
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text is exactly its bytes, one token each.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BYTE_EOS if i == eos_token_id else f"<|reserved_{i}|>" for i in range(256, vocab_size)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for i, s in zip(range(256, vocab_size), specials):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_byte_tokenizer(out: str | os.PathLike, vocab_size: int, eos_token_id: int) -> None:
    """Write the byte-level tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` into ``out``."""
    out = Path(out)
    tok = byte_level_tokenizer(vocab_size, eos_token_id)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.id_to_token(eos_token_id),
        "bos_token": None,
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_max_length": 1_000_000,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    stale = out / "special_tokens_map.json"
    if stale.exists():
        stale.unlink()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
