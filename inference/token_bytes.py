"""The UTF-8 bytes of one token, for the ``bytes`` of OpenAI's log-probabilities.

A token that holds part of a character (byte-level BPE splits most CJK characters and emoji over two or three
tokens) decodes alone to U+FFFD, so the decoded text's UTF-8 is not the token's bytes. OpenAI's ``bytes`` exist
so that a client can join such tokens back into the character; this module reads the bytes from the token
itself: GPT-2's byte-to-character table for byte-level BPE (SmolLM2, Qwen2, Llama 3; Radford et al., 2019), and
``<0xNN>`` pieces for SentencePiece's byte fallback (Llama 2, Mistral).
"""
from __future__ import annotations

import re

from .model_loader.tiktoken_convert import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}
REPLACEMENT = "\ufffd"


def partial_token_bytes(tokenizer, token_id: int, text: str) -> list[int] | None:
    """The bytes of token ``token_id`` where ``text`` (its decoding alone) is not them, else None.

    ``tokenizer``: a Hugging Face tokenizer. Only a ``text`` holding U+FFFD is looked at; a token whose piece is
    neither byte-level nor a byte-fallback piece also gives None (its text's UTF-8 stands)."""
    if REPLACEMENT not in text:
        return None
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, bytes):  # tokenizers whose pieces are the bytes themselves
        return list(piece)
    if not isinstance(piece, str) or not piece:
        return None
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return [int(fallback.group(1), 16)]
    if all(char in _BYTE_OF_CHAR for char in piece):
        return [_BYTE_OF_CHAR[char] for char in piece]
    return None
