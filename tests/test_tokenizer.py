"""Tokenizers: the special-id layout contract, text never becoming a special, safe decoding."""

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrt.config import load_config
from streamrt.errors import CheckpointError, ConfigError
from streamrt.tokenizer import ByteTokenizer, TiktokenTokenizer, load_tokenizer

STRUCTURAL_K3 = {"<|end_of_msg|>": 163586, "<|open|>": 163587, "<|close|>": 163588, "<|sep|>": 163589, "[EOT]": 163593}


def test_k3_specials_are_identity_at_full_vocab():
    tok = ByteTokenizer(163840)
    for name, k3 in STRUCTURAL_K3.items():
        assert tok.special_id(name) == k3
    assert tok.special_id("[PAD]") == 163839 and tok.special_name(163584) == "[BOS]"


@pytest.mark.parametrize("name", ["tiny-k3.1-pro", "slice-k3.1-pro", "kimi-k3"])
def test_specials_move_to_end_of_vocab_and_match_config_ids(name):
    cfg = load_config(name)
    tok = load_tokenizer(None, cfg.vocab_size, cfg.eos_token_id)
    v = cfg.vocab_size
    assert tok.special_id("<|open|>") == v - 256 + 3
    assert tok.eos_id == cfg.eos_token_id == tok.special_id("<|end_of_msg|>")
    assert tok.special_id("[BOS]") == cfg.bos_token_id and tok.special_id("[PAD]") == cfg.pad_token_id
    assert tok.stop_ids == {v - 256 + 1, v - 256 + 2, v - 256 + 9}


def test_eos_that_is_not_end_of_msg_is_a_config_error():
    with pytest.raises(ConfigError, match="eos_token_id 257"):
        load_tokenizer(None, 512, 257)


def test_literal_special_text_is_encoded_as_bytes():
    tok = ByteTokenizer(512)
    ids = tok.encode("a <|open|> b <|end_of_msg|>")
    assert all(i < 256 for i in ids)
    assert tok.decode(ids) == "a <|open|> b <|end_of_msg|>"


def test_decode_invalid_utf8_and_unknown_ids_never_raises():
    tok = ByteTokenizer(1024)
    assert tok.decode([0xFF, 0x41, 0xC3]) == "\ufffdA\ufffd"
    assert tok.decode([300, 0x41]) == "A"  # an unused id between bytes and specials
    assert tok.decode([0x41, tok.special_id("<|sep|>")], show_special=False) == "A"
    assert tok.decode([0x41, tok.special_id("<|sep|>")]) == "A<|sep|>"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_stream_decode_of_split_multibyte_chars_equals_full_decode(text):
    tok = ByteTokenizer(512)
    dec = tok.stream_decoder()
    pieces = [dec.feed(i) for i in tok.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character


def test_stream_decode_flushes_a_dangling_partial_char_at_a_special():
    tok = ByteTokenizer(512)
    dec = tok.stream_decoder()
    assert dec.feed(0xE2) == "" and dec.feed(0x82) == ""
    assert dec.feed(tok.special_id("<|sep|>")) == "\ufffd"
    assert dec.feed(ord("x")) == "x"


def _write_bpe(path, merges):
    ranks = {bytes([b]): b for b in range(256)}
    for m in merges:
        ranks[m] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_tiktoken_tokenizer_from_a_checkpoint_dir(tmp_path):
    ranks = _write_bpe(tmp_path / "tiktoken.model", [b"he", b"ll", b"llo", b"hello"])
    tok = load_tokenizer(tmp_path, 1024, 1024 - 256 + 2)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode("hello") == [ranks[b"hello"]]
    ids = tok.encode("hello <|open|>")
    assert all(not tok.is_special(i) for i in ids)
    assert tok.decode(ids) == "hello <|open|>"
    assert tok.special_id("<|open|>") == 1024 - 256 + 3
    assert tok.decode([ranks[b"he"], 0xFF]) == "he\ufffd"


def test_tokenizer_config_names_override_reserved_names(tmp_path):
    _write_bpe(tmp_path / "tiktoken.model", [])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"163600": {"content": "<|custom|>"}, "5": {"content": "ignored"}}})
    )
    tok = load_tokenizer(tmp_path, 1024)
    assert tok.special_id("<|custom|>") == 1024 - 256 + 16
    assert tok.special_name(1024 - 256 + 16) == "<|custom|>"


def test_bpe_ranks_colliding_with_specials_or_garbage_are_checkpoint_errors(tmp_path):
    _write_bpe(tmp_path / "tiktoken.model", [b"ab", b"cd"])
    with pytest.raises(CheckpointError, match="collides"):
        load_tokenizer(tmp_path, 512)
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(CheckpointError, match="tiktoken.model"):
        load_tokenizer(tmp_path, 1024)
