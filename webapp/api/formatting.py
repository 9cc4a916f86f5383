"""OpenAI response shapes: chat and completions objects, chunks, log-probabilities, usage.

Log-probabilities arrive from workers as, per output position, a list of
``[token_id, logprob, rank, decoded_token]``, plus the token's bytes where it is part of a character (see
:mod:`webapp.serving.messages`).
"""
from __future__ import annotations

import codecs
import json
from typing import Any

Position = list[list]  # [[token_id, logprob, rank, decoded_token], ...]


def _token_text(entry: list) -> str:
    return entry[3] if entry[3] is not None else ""


def _token_bytes(entry: list) -> list[int]:
    # the worker's bytes where the token is part of a character (its text alone is U+FFFD), else its text's
    return entry[4] if len(entry) > 4 and entry[4] else list(_token_text(entry).encode("utf-8"))


def _split(position: Position, token_id: int, top_n: int) -> tuple[list, list[list]]:
    """The sampled token's entry and the top ``top_n`` entries by rank."""
    chosen = next((e for e in position if e[0] == token_id), None) or [token_id, float("-inf"), None, ""]
    top = sorted((e for e in position if e[2] is not None and e[2] <= top_n), key=lambda e: e[2])[:top_n]
    return chosen, top


def _with_sampled(chosen: list, top: list[list]) -> list[list]:
    """``top`` plus the sampled token's entry when it is not among them (last: its rank is lower)."""
    return top if any(e[0] == chosen[0] for e in top) else [*top, chosen]


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf


def chat_logprobs(positions: list[Position] | None, token_ids: list[int], top_n: int) -> dict | None:
    """Chat's ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    if positions is None:
        return None
    content = []
    for position, token_id in zip(positions, token_ids):
        chosen, top = _split(position or [], token_id, top_n)
        text = _token_text(chosen)
        content.append({
            "token": text, "logprob": _logprob(chosen[1]), "bytes": _token_bytes(chosen),
            "top_logprobs": [{"token": _token_text(e), "logprob": _logprob(e[1]), "bytes": _token_bytes(e)}
                             for e in top],
        })
    return {"content": content}


def completion_logprobs(positions: list[Position] | None, token_ids: list[int], top_n: int,
                        text_offset: int) -> dict | None:
    """Legacy completions ``logprobs``: parallel arrays ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token -> logprob) and ``text_offset`` (characters from the start, ``text_offset`` for the
    first token).

    Each ``top_logprobs`` entry holds the ``top_n`` most likely tokens plus the sampled one when it
    is not among them (``top_n + 1`` at most; ``top_n = 0``: the sampled token alone), as vLLM does. A token
    that is part of a character is written as OpenAI writes it, ``bytes:`` and its bytes (:func:`_legacy_token`),
    so that such alternatives keep keys of their own; its offset is its character's.
    """
    if positions is None:
        return None
    body, pieces = _legacy_logprobs(positions, token_ids, top_n)
    body["text_offset"] = _text_offsets(pieces, text_offset)
    return body


def echo_logprobs(prompt_positions: list[Position | None] | None, prompt_ids: list[int], prompt_text: str,
                  positions: list[Position], token_ids: list[int], top_n: int, first_token: bytes | None = None
                  ) -> dict:
    """Legacy ``logprobs`` for ``echo``: the prompt's tokens first (the first has ``null`` logprob
    and top logprobs: nothing precedes it; its bytes are ``first_token``, or else what the prompt's text has
    before the others'), then the output's, text offsets running on through both."""
    if not prompt_ids:
        return completion_logprobs(positions, token_ids, top_n, 0)
    prompt_positions = prompt_positions or [None] * len(prompt_ids)
    rest, rest_pieces = _legacy_logprobs([p or [] for p in prompt_positions[1:]], prompt_ids[1:], top_n)
    whole, rest_bytes = prompt_text.encode("utf-8"), b"".join(rest_pieces)
    first = first_token if first_token is not None else (
        whole[:len(whole) - len(rest_bytes)] if whole.endswith(rest_bytes) else b"")
    tail, tail_pieces = _legacy_logprobs(positions, token_ids, top_n)
    return {"tokens": [_bytes_token(first), *rest["tokens"], *tail["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"], *tail["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"], *tail["top_logprobs"]],
            "text_offset": _text_offsets([first, *rest_pieces, *tail_pieces], 0)}


def _legacy_logprobs(positions: list[Position], token_ids: list[int], top_n: int) -> tuple[dict, list[bytes]]:
    """``tokens``, ``token_logprobs`` and ``top_logprobs`` of legacy completions, and each token's bytes."""
    tokens, token_logprobs, tops, pieces = [], [], [], []
    for position, token_id in zip(positions, token_ids):
        chosen, top = _split(position or [], token_id, top_n)
        tokens.append(_legacy_token(chosen))
        token_logprobs.append(_logprob(chosen[1]))
        tops.append({_legacy_token(e): _logprob(e[1]) for e in _with_sampled(chosen, top)})
        pieces.append(bytes(_token_bytes(chosen)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops}, pieces


def _legacy_token(entry: list) -> str:
    """A token as legacy completions write it: its text, or, for one that is part of a character (its text
    alone is U+FFFD), ``bytes:`` and its bytes, as OpenAI writes them (e.g. ``bytes: \\xf0\\x9f``)."""
    if len(entry) > 4 and entry[4]:
        return _bytes_token(bytes(entry[4]))
    return _token_text(entry)


def _bytes_token(piece: bytes) -> str:
    """``piece`` as text where it is whole UTF-8, else ``bytes:`` and its bytes (printable ASCII as is)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02x}" for b in piece)


def _text_offsets(pieces: list[bytes], start: int) -> list[int]:
    """The character offset of each of the consecutive byte strings ``pieces`` in their joined text, from
    ``start``: the characters completed before it (a piece that continues a character has that character's)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, done = [], start
    for piece in pieces:
        offsets.append(done)
        done += len(decoder.decode(piece))
    return offsets


def vllm_prompt_logprobs(prompt_positions: list[Position | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position ``None`` (the first) or ``{token_id:
    {"logprob", "rank", "decoded_token"}}`` (the prompt's token and the top ones)."""
    if prompt_positions is None:
        return None
    return [None if pos is None else {str(e[0]): {"logprob": _logprob(e[1]), "rank": e[2], "decoded_token": e[3]}
                                      for e in pos} for pos in prompt_positions]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` (prompt tokens served from
    the prefix cache) is always there, 0 without a hit, as OpenAI sends it."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying ``data`` (a JSON object, or ``[DONE]``)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8")
