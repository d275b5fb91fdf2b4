"""Tokenizers are loaded as transformers loads them; the default model's byte tokenizer keeps its ids."""

from __future__ import annotations

import json

import pytest

from refengine.llm import default_model_path
from refengine.tokenizer import load_tokenizer, write_byte_tokenizer

SAMPLES = [
    "Beautiful is better than ugly.",
    "héllo wörld: naïve café, Straße, ελληνικά, русский, 日本語の文章, 한국어, emoji 🙂🚀",
    "  leading and trailing spaces  \n\ttabs\r\nCRLF",
    "<|endoftext|> is only text here, as are <|reserved_257|> and <s>",
    "",
]


def _byte_ids(text: str) -> list[int]:
    """The ids the former private ByteTokenizer gave: the UTF-8 bytes, no BOS."""
    return list(text.encode("utf-8"))


@pytest.mark.parametrize("text", SAMPLES)
def test_default_model_tokenizer_keeps_the_byte_ids(text):
    tok = load_tokenizer(default_model_path())
    ids = tok.encode(text)
    assert ids == _byte_ids(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id]) == text  # special ids are dropped on decode


def test_default_model_tokenizer_is_the_standard_format():
    path = default_model_path()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    with open(path + "/config.json") as f:
        config = json.load(f)
    assert hf.eos_token_id == config["eos_token_id"] == 256
    assert len(hf) == config["vocab_size"]
    # Invalid UTF-8 decodes with replacement characters, as bytes.decode(errors="replace") does.
    bad = [0xE6, 0x97, 65, 0xFF, 66]
    assert load_tokenizer(path).decode(bad) == bytes(bad).decode("utf-8", errors="replace")


def test_written_byte_tokenizer_round_trips(tmp_path):
    write_byte_tokenizer(tmp_path, vocab_size=300, eos_token_id=299)
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_id == 299 and len(tok.hf) == 300
    for text in SAMPLES:
        assert tok.encode(text) == _byte_ids(text)


def write_bpe_tokenizer(directory, vocab_size: int) -> None:
    """A Qwen2-style byte-level BPE tokenizer (merges, regex split, chat special tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))


def test_a_real_bpe_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_bpe_tokenizer(tmp_path, 400)
    ours = load_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in SAMPLES + ["<|im_start|>user\nthe lazy dog<|im_end|>"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert len(ours.encode("the quick brown fox")) < len("the quick brown fox")  # merges are applied


def test_no_tokenizer_files_means_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_broken_tokenizer_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load its tokenizer"):
        load_tokenizer(tmp_path)


def test_text_prompts_through_an_moe_checkpoint_with_its_tokenizer(tmp_path):
    """LLM encodes a text prompt and decodes the output as transformers does, and its greedy tokens
    on the MoE checkpoint are transformers' for the same ids."""
    from transformers import AutoTokenizer

    from refengine import LLM, SamplingParams
    from tests.helpers.checkpoints import get_spec, load_hf_model, replace, write_checkpoint
    from tests.helpers.oracle import hf_greedy_uncached

    path = write_checkpoint(tmp_path / "moe", replace(get_spec("next-moe"), vocab_size=320, with_mtp=False))
    write_bpe_tokenizer(path, 300)
    hf_tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    text = "the quick brown fox, naïve café 🙂"
    out = LLM(str(path)).generate(text, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.prompt_token_ids == hf_tok.encode(text)
    assert out.text == hf_tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.token_ids == hf_greedy_uncached(load_hf_model(path), out.prompt_token_ids, 8)
