"""The UTF-8 bytes of each token (``inference.token_bytes``), as log-probabilities' ``bytes`` report them."""
from __future__ import annotations

import pytest

from inference.token_bytes import partial_token_bytes
from tests.inference.tokenizer_samples import TEXTS, encode, sentencepiece, smollm2, split_characters  # noqa: F401


def _token_by_token_bytes(tokenizer, ids: list[int]) -> bytes:
    out = b""
    for token_id in ids:
        text = tokenizer.decode([token_id])
        out += bytes(partial_token_bytes(tokenizer, token_id, text) or text.encode("utf-8"))
    return out


@pytest.mark.parametrize("name", ["chinese", "emoji", "mixed"])
def test_each_tokens_bytes_join_into_the_text(smollm2, sentencepiece, name):
    """Log-probabilities' ``bytes``: a token that holds part of a character decodes alone to U+FFFD, but its own
    bytes, joined with its neighbours', give the character back (byte-level BPE and SentencePiece's byte
    fallback; a SentencePiece token decoded alone loses its leading space, so spaces are not compared there)."""
    text = TEXTS[name]
    ids = encode(smollm2, text)
    assert split_characters(smollm2, ids)
    assert _token_by_token_bytes(smollm2, ids) == text.encode("utf-8")
    ids = sentencepiece.encode(text, add_special_tokens=False)
    assert split_characters(sentencepiece, ids)
    joined = _token_by_token_bytes(sentencepiece, ids)
    assert joined.replace(b" ", b"") == text.encode("utf-8").replace(b" ", b"")


def test_whole_characters_keep_their_texts_bytes(smollm2):
    ids = encode(smollm2, TEXTS["english"])
    assert all(partial_token_bytes(smollm2, i, smollm2.decode([i])) is None for i in ids)
