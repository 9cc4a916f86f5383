"""Incremental detokenization of one request's output, with stop strings matched on text.

* **No partial characters.** A UTF-8 character may span several byte-level BPE tokens
  (GPT-2/SmolLM2 ``"Ġ"`` vocabularies) or byte-fallback pieces (SentencePiece ``<0xE4>``).
  Text is decoded over a small window of recent tokens: ``ids[prefix_offset:read_offset]``
  is text already emitted, and the delta is ``decode(ids[prefix_offset:])`` minus
  ``decode(ids[prefix_offset:read_offset])``, held back while it ends in U+FFFD (an
  incomplete character). A window rather than single tokens keeps context-dependent spacing
  right (SentencePiece strips the leading space only from the first piece of a decode
  call); it starts in the prompt, so the first output token gets its leading space.
* **Stop strings.** Text is matched after decoding, so a stop string may span tokens or
  start inside one. A tail that is a prefix of some stop string is held back until it
  completes a match or stops being a prefix; on a match the output ends at the match (or
  just after it with ``include_stop_str_in_output``). With ``min_tokens``, a match must end in
  the text of a later token: the first ``min_tokens`` tokens' text is output as is (vLLM's rule).
* **Stop tokens.** A stop token or EOS that ends the output (``stop_terminated``) stays a token
  but adds no text unless ``include_stop_str_in_output`` (vLLM's behaviour).

Decoding uses the tokenizer's Rust backend when it has one (``backend_tokenizer``) and never
applies ``clean_up_tokenization_spaces`` (that clean-up is not stable under appending text).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tokenizers

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output token.
_PROMPT_CONTEXT_TOKENS = 5
# The window slides forward once it holds more tokens than this.
_MAX_WINDOW_TOKENS = 8
# A character spans at most 4 bytes, hence at most 3 extra byte tokens to back up over.
_MAX_CHAR_TOKENS = 4
# Past this many unread tokens a trailing U+FFFD is taken for invalid bytes, not a character
# still being completed, and is emitted; this bounds the window on garbage output.
_MAX_HELD_TOKENS = 16
# Characters in the set of all proper prefixes of the stop strings above which they are scanned instead
# (a 1 MB stop string would otherwise make 5 * 10^11 characters of prefixes).
_MAX_PREFIX_SET_CHARS = 1 << 20


def _make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else getattr(
        tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops.

    This is every added token marked special, which can be more than ``all_special_ids``
    (SmolLM2 marks 17 added tokens special but lists 3). Accepts a Hugging Face tokenizer or
    a ``tokenizers.Tokenizer``.
    """
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None and hasattr(tokenizer, "get_added_tokens_decoder"):
        added = tokenizer.get_added_tokens_decoder()
    ids.update(i for i, token in (added or {}).items() if getattr(token, "special", False))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens; one instance per sample.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow) or a ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt; its last few tokens give the first output token its
            context (only they are read, so passing the full prompt costs nothing extra).
        skip_special_tokens: drop special tokens (every added token marked special) from text.
        spaces_between_special_tokens: when special tokens are kept, join them and the text
            runs between them with single spaces, as Hugging Face slow tokenizers do; each
            run is then decoded on its own. With False, the text equals ``tokenizer.decode``.
        stop: strings that end the output; empty strings are ignored.
        include_stop_str_in_output: keep the matched stop string at the end of the text, and
            the text of a stop token or EOS that ends the output.
        min_tokens: stop strings completed within the text of the first ``min_tokens`` output
            tokens do not end the output (a match may start there and end later).

    Without a stop match, the concatenated deltas equal ``decode(prompt + output)`` minus
    ``decode(prompt)``, which for byte-level vocabularies is ``decode(output)``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self._special_ids = special_token_ids(tokenizer)
        self._skip_special = skip_special_tokens
        # Kept special tokens start a new run only when joined with spaces; otherwise they
        # stay in the window and the tokenizer's decoder places them.
        self._split_at_special = not skip_special_tokens and spaces_between_special_tokens
        self._stop = list(dict.fromkeys(s for s in (stop or []) if s))
        # Proper prefixes of the stop strings, for the held-back tail; a set only while it stays small
        # (its size grows with the square of a string's length), else each string is scanned.
        small = sum(len(s) * (len(s) - 1) // 2 for s in self._stop) <= _MAX_PREFIX_SET_CHARS
        self._stop_prefixes = frozenset(s[:i] for s in self._stop for i in range(1, len(s))) if small else None
        self._max_held_chars = max((len(s) for s in self._stop), default=1) - 1
        self._include_stop = include_stop_str_in_output
        self._pending = ""  # decoded text held back as a possible stop-string prefix
        self._min_tokens = min_tokens
        self._protected = 0  # leading chars of _pending from the first min_tokens tokens: no match ends there
        self._chunks: list[str] = []
        self._num_output_tokens = 0
        self._stop_str: str | None = None
        self._truncate_to: int | None = None
        self._done = False
        self._produced = False  # any output text or special token emitted or held yet
        self._space_next = False  # the next text run follows a special token
        self._init_window(self._prompt_context(prompt_token_ids))

    @property
    def output_text(self) -> str:
        """All text emitted so far: the concatenation of every returned delta."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def truncate_token_ids_to(self) -> int | None:
        """After a stop-string match, the number of output tokens to keep (the last one
        completed the match); None before a match."""
        return self._truncate_to

    def update(self, new_token_ids: Sequence[int], finished: bool = False,
               stop_terminated: bool = False) -> tuple[str, str | None]:
        """Append newly sampled tokens and return ``(delta_text, stop_str)``.

        ``delta_text`` never ends in a partial UTF-8 character and never holds a tail that
        could still grow into a stop string; such text is held until resolved. With
        ``finished=True`` everything held is flushed, except a final character the last
        tokens left incomplete, which is dropped (as vLLM does). ``stop_str`` is the first stop string to complete (if one token completes
        several: the one starting earliest in the text, then the first in ``stop``), or
        None. After a match the tokens after the one that completed it are ignored and the
        request is over. ``stop_terminated`` (with ``finished``): the last new token is a stop
        token or EOS that ended the output; it counts as a token but adds no text unless
        ``include_stop_str_in_output``.

        Raises:
            RuntimeError: if called again after a stop match or after ``finished=True``.
        """
        if self._done:
            raise RuntimeError("update() called after the output finished or hit a stop string")
        if not self._stop and not finished and len(new_token_ids) == 1:  # one streamed token (the hot path)
            self._num_output_tokens += 1
            delta = self._append(new_token_ids[0])  # without stop strings nothing is held back
            if delta:
                self._chunks.append(delta)
            return delta, None
        num_skipped = 0
        if stop_terminated and not self._include_stop and new_token_ids:
            new_token_ids, num_skipped = new_token_ids[:-1], 1
        out: list[str] = []
        stopped = False
        # Several tokens and no stop strings (a multi-step window, or a FINAL_ONLY output at its finish): one
        # decode of the window for all of them when their text is whole, else token by token.
        bulk = None if self._stop or len(new_token_ids) < 2 else self._append_many(new_token_ids)
        if bulk is not None:
            self._num_output_tokens += len(new_token_ids) + num_skipped
            if bulk:
                out.append(self._runs_text(bulk))  # nothing is left unread or held back
        else:
            for token_id in new_token_ids:
                self._num_output_tokens += 1
                text = self._append(token_id)
                if text and self._emit(text, out, final=False):
                    stopped = True  # tokens after the one completing the match are dropped
                    break
            else:
                self._num_output_tokens += num_skipped
                if finished:
                    stopped = self._emit(self._runs_text(self._advance(final=True, at_end=True)), out, final=True)
        if stopped:
            self._truncate_to = self._num_output_tokens
        if stopped or finished:
            self._done, self._ids = True, []
        delta = "".join(out)
        if delta:
            self._chunks.append(delta)
        return delta, self._stop_str

    # -- token ids -> text ---------------------------------------------------------------

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last prompt tokens of the current text run, enough to back up over a split
        character; special tokens the output will not show are left out."""
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(context) == _PROMPT_CONTEXT_TOKENS + _MAX_CHAR_TOKENS - 1:
                break
            if token_id in self._special_ids:
                if self._split_at_special:
                    break
                if self._skip_special:
                    continue
            context.append(token_id)
        context.reverse()
        return context

    def _init_window(self, context: list[int]) -> None:
        start = max(0, len(context) - _PROMPT_CONTEXT_TOKENS)
        text = self._decode(context[start:])  # the window's text, once (a multi-step window's hot path)
        while start > 0 and text.startswith(_REPLACEMENT_CHAR):
            start -= 1  # the window must not begin inside a character
            text = self._decode(context[start:])
        self._ids = context[start:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = text
        for _ in range(_MAX_CHAR_TOKENS - 1):  # a prompt cut inside a character:
            if not self._prefix_text.endswith(_REPLACEMENT_CHAR):  # let the output finish it
                break
            self._read_offset -= 1
            self._prefix_text = self._decode(self._ids[:self._read_offset])

    def _append(self, token_id: int) -> str:
        if token_id in self._special_ids:
            if self._skip_special:
                return ""
            if self._split_at_special:
                return self._special_run(token_id)
        self._ids.append(token_id)
        return self._runs_text(self._advance(final=False))

    def _append_many(self, token_ids: Sequence[int]) -> str | None:
        """Append ``token_ids`` with one decode of the window and return their text, or return None and
        change nothing when the token-by-token path must decide: a special token that starts a run of its
        own, or new text that is empty or holds U+FFFD (a partial character, or invalid bytes, which that
        path emits at its own pace). Whole text is what the token-by-token path returns over the same
        tokens: the window's decode minus the text already emitted. The next window starts at the last
        tokens, where the token-by-token path's could start earlier: the text of later updates is the same,
        except that invalid bytes of a byte-fallback (SentencePiece) vocabulary may then show as another
        number of U+FFFD (its decoder replaces a whole run of byte pieces at once, and the run starts in the
        window)."""
        special = self._special_ids
        if self._skip_special:
            token_ids = [t for t in token_ids if t not in special]
        elif self._split_at_special and any(t in special for t in token_ids):
            return None
        ids = self._ids + list(token_ids)
        new_text = self._decode(ids[self._prefix_offset:])
        delta = new_text[len(self._prefix_text):]
        if not delta or _REPLACEMENT_CHAR in delta:
            return None
        self._init_window(ids)  # a fresh window over the last tokens, all read
        return delta

    def _advance(self, final: bool, at_end: bool = False) -> str:
        """Text that the window's unread tokens add; "" while it ends in a partial character
        (unless ``final``). ``at_end`` (the output finished): a character its last tokens left
        incomplete is dropped, not shown as U+FFFD (vLLM's behaviour when ``max_tokens`` cuts
        an emoji); invalid bytes held past ``_MAX_HELD_TOKENS`` were already emitted as U+FFFD."""
        ids = self._ids
        new_text = self._decode(ids[self._prefix_offset:])
        incomplete = (len(new_text) <= len(self._prefix_text)
                      or new_text.endswith(_REPLACEMENT_CHAR))
        if incomplete and not final and len(ids) - self._read_offset < _MAX_HELD_TOKENS:
            return ""
        if incomplete and at_end and len(ids) - self._read_offset < _MAX_HELD_TOKENS:
            new_text = new_text.rstrip(_REPLACEMENT_CHAR)
        delta = new_text[len(self._prefix_text):]
        if len(ids) - self._prefix_offset > _MAX_WINDOW_TOKENS:
            del ids[:self._read_offset]  # the old read offset is a character boundary
            self._prefix_offset = 0
            self._prefix_text = self._decode(ids)
        else:
            self._prefix_text = new_text
        self._read_offset = len(ids)
        return delta

    def _special_run(self, token_id: int) -> str:
        """Close the current text run, then the special token, joined with spaces."""
        text = self._runs_text(self._advance(final=True))
        text += (" " if self._produced else "") + self._decode([token_id])
        self._produced = self._space_next = True
        self._ids, self._prefix_offset, self._read_offset, self._prefix_text = [], 0, 0, ""
        return text

    def _runs_text(self, text: str) -> str:
        if text:
            if self._space_next:
                text, self._space_next = " " + text, False
            self._produced = True
        return text

    # -- text -> deltas, stop strings ----------------------------------------------------

    def _emit(self, text: str, out: list[str], final: bool) -> bool:
        """Move ``text`` into ``out`` except a possible stop-string prefix; True on a match."""
        if not self._stop:
            out.append(text)
            return False
        pending = self._pending + text
        if self._num_output_tokens <= self._min_tokens:  # within min_tokens: no match ends here
            self._protected = len(pending)
        else:
            match = self._find_stop(pending, self._protected)
            if match is not None:
                start, stop = match
                out.append(pending[:start + len(stop) if self._include_stop else start])
                self._pending, self._stop_str = "", stop
                return True
        held = 0 if final else self._held_suffix_len(pending)
        out.append(pending[:len(pending) - held])
        self._pending = pending[len(pending) - held:]
        self._protected = max(0, self._protected - (len(pending) - held))
        return False

    def _find_stop(self, text: str, min_end: int) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` that ends after ``min_end`` characters."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = text.find(stop, max(0, min_end - len(stop) + 1))
            if start >= 0 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
        if self._stop_prefixes is not None:
            for length in range(min(len(text), self._max_held_chars), 0, -1):
                if text[-length:] in self._stop_prefixes:
                    return length
            return 0
        tail, best = text[max(0, len(text) - self._max_held_chars):], 0
        for stop in self._stop:  # candidate starts: the stop string's first character, longest first
            i = tail.find(stop[0], max(0, len(tail) - len(stop) + 1))
            while i != -1 and len(tail) - i > best:
                if stop.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(stop[0], i + 1)
        return best
