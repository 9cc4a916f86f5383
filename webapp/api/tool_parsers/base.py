"""Records and base classes shared by the tool-call parsers.

A parser turns a model's raw output into OpenAI's ``message.tool_calls`` (non-streaming,
:meth:`ToolParser.extract`) or ``delta.tool_calls`` (streaming, :meth:`ToolParser.feed` and
:meth:`ToolParser.finish`). The formats follow vLLM's parsers of the same names.

Call ids are ``call_`` followed by 24 random ASCII letters and digits (OpenAI's shape);
Mistral's parser makes 9 letters and digits, the only ids Mistral's chat template accepts.
"""
from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

_ID_ALPHABET = string.ascii_letters + string.digits


def random_call_id(length: int = 24, prefix: str = "call_") -> str:
    """``prefix`` followed by ``length`` random ASCII letters and digits (from ``secrets``)."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's ``message.tool_calls[i]`` (``type`` is always ``"function"``).

    Attributes:
        id: the call's id, which the client echoes back as ``tool_call_id``.
        name: the function's name.
        arguments: the arguments, a JSON object as a string (as OpenAI sends them).
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole output split into text for ``message.content`` and the calls it made.

    Attributes:
        content: the text outside the tool-call markup; None when that is empty or whitespace.
        tool_calls: the calls in the order the model wrote them; empty when it made none.
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of OpenAI's streamed ``delta.tool_calls``.

    The first delta of a call carries its ``index``, ``id`` and ``name`` (and possibly the
    start of ``arguments``, else ``""``); the later ones carry ``index`` and a fragment of
    ``arguments`` only, with ``id`` and ``name`` None. The fragments of one index, joined,
    equal the arguments that :meth:`ToolParser.extract` gives for the same output.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


class MalformedToolCall(ValueError):
    """The tool-call markup in an output does not parse as calls."""


class ToolParser(ABC):
    """Splits a model's output into content and tool calls; one instance per output (choice).

    Args:
        tools: the request's ``tools`` (OpenAI's list of ``{"type": "function", "function": ...}``),
            or None. The parsers here do not need them; they are kept for parsers that do.
    """

    name: str = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = list(tools or [])

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """Split the whole output ``text``; markup that does not parse makes the whole text content."""

    @abstractmethod
    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Take the next piece of output; return the content to send now and the tool-call deltas.

        Text that may still turn out to be markup (a partial ``<tool_`` for example) is held
        back until it is clear, so no markup reaches the content.
        """

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: flush what was held back (content, or the last arguments)."""


@dataclass
class _StreamedCall:
    id: str
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


Mode = Callable[[bool], bool]


class StreamingToolParser(ToolParser):
    """A parser written as a streaming state machine; :meth:`extract` runs the same machine.

    Subclasses give the modes: each is a method ``mode(final) -> bool`` that consumes a
    prefix of ``self._buf`` (with :meth:`_consume`, :meth:`_emit_content`, :meth:`_skip_ws`)
    and returns whether it made progress; ``final`` is True once the output has ended, when a
    mode must decide on whatever it holds. Markup consumed since the last content or call
    is held in ``_held``: when the markup turns out not to be a call (:meth:`_fail`), it is
    sent as content with the rest of the output, so the streamed content equals the text
    :meth:`extract` gives. A call is committed (its first delta sent) by :meth:`_commit`; a
    failure after that cannot take the call back, and the rest of the output becomes content.
    """

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._buf = ""
        self._held = ""
        self._mode: Mode = self._initial_mode()
        self._failed = False
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._calls: list[_StreamedCall] = []
        self._all_content: list[str] = []

    # Subclass hooks
    @abstractmethod
    def _initial_mode(self) -> Mode:
        """The mode the output starts in."""

    def _accepting_modes(self) -> tuple[Mode, ...]:
        """Modes besides plain content in which the output may end without markup cut off."""
        return ()

    def _validate(self, calls: list[ToolCall]) -> None:
        """Raise :class:`MalformedToolCall` if ``calls`` are not what the format allows."""
        for call in calls:
            _require_json_object(call.arguments)

    @staticmethod
    def _new_call_id() -> str:
        return random_call_id()

    # Public API
    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta_text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._run(final=True)
        if self._mode not in (self._plain_mode, self._discard_mode, *self._accepting_modes()):
            self._fail()
            self._run(final=True)
        return self._take()

    def extract(self, text: str) -> ExtractedToolCalls:
        """Run the streaming machine over ``text``: the content and calls a stream of it sends. Where the
        markup breaks or is cut off (``max_tokens``) after whole calls, those calls are the result and the
        broken rest is dropped, as in a stream; a call cut inside its arguments (a stream has sent its start)
        is dropped too. Where no call is whole, the whole text is content."""
        parser = type(self)(self.tools)
        parser.feed(text)
        parser.finish()
        calls = [ToolCall(c.id, c.name, "".join(c.arguments)) for c in parser._calls if c.name is not None]
        if parser._failed:
            calls = [call for call in calls if _is_json_object(call.arguments)]
        try:
            if not calls and parser._failed:
                raise MalformedToolCall("the tool-call markup does not parse")
            self._validate(calls)
        except MalformedToolCall:
            return ExtractedToolCalls(_content_or_none(text), [])
        return ExtractedToolCalls(_content_or_none("".join(parser._all_content)), calls)

    # Machinery for the modes
    def _run(self, final: bool) -> None:
        while self._mode(final):
            pass

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _consume(self, n: int) -> str:
        """Take ``n`` characters of markup off the buffer (held until a call or a failure)."""
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._held += taken
        return taken

    def _skip_ws(self) -> bool:
        n = len(self._buf) - len(self._buf.lstrip())
        if n:
            self._consume(n)
        return n > 0

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._all_content.append(text)

    def _plain_mode(self, final: bool) -> bool:
        """Everything from here on is content."""
        if not self._buf:
            return False
        self._emit_content(self._buf)
        self._buf = ""
        return True

    def _marker_content_mode(self, marker: str, then: Mode, final: bool) -> bool:
        """Send content up to ``marker``; consume the marker and go to mode ``then``.

        A tail of the buffer that could be the start of ``marker`` is held back unless ``final``.
        """
        found = self._buf.find(marker)
        if found >= 0:
            self._emit_content(self._buf[:found])
            self._buf = self._buf[found:]
            self._held = ""
            self._consume(len(marker))
            self._mode = then
            return True
        keep = 0 if final else partial_suffix(self._buf, marker)
        text = self._buf[:len(self._buf) - keep]
        self._emit_content(text)
        self._buf = self._buf[len(text):]
        return False

    def _token_mode(self, next_modes: dict[str, Mode]) -> bool:
        """After whitespace, a one-character token leads to its mode; any other character fails."""
        self._skip_ws()
        if not self._buf:
            return False
        then = next_modes.get(self._buf[0])
        if then is None:
            self._fail()
        else:
            self._consume(1)
            self._mode = then
        return True

    def _drop_ws_mode(self, then: Mode) -> bool:
        """Whitespace is dropped; the next other character starts mode ``then``."""
        self._skip_ws()
        if not self._buf:
            return False
        self._held = ""
        self._mode = then
        return True

    def _open_call(self) -> int:
        self._calls.append(_StreamedCall(self._new_call_id()))
        return len(self._calls) - 1

    def _commit(self, name: str, arguments: str = "") -> None:
        """Send the first delta of the last opened call."""
        call = self._calls[-1]
        call.name = name
        call.arguments.append(arguments)
        self._deltas.append(ToolCallDelta(len(self._calls) - 1, call.id, name, arguments))
        self._held = ""

    def _emit_arguments(self, fragment: str) -> None:
        if fragment:
            self._calls[-1].arguments.append(fragment)
            self._deltas.append(ToolCallDelta(len(self._calls) - 1, None, None, fragment))

    def _fail(self) -> None:
        """The markup is not a call: what was held and all that follows is content.

        Once a call has been sent it cannot be taken back: then the broken markup and the
        rest of the output are dropped rather than sent as content (:meth:`extract` likewise keeps the
        whole calls and drops the rest).
        """
        self._failed = True
        if any(call.name is not None for call in self._calls):
            self._held, self._buf = "", ""
            self._mode = self._discard_mode
            return
        self._to_plain()

    def _discard_mode(self, final: bool) -> bool:
        self._buf = ""
        return False

    def _to_plain(self) -> None:
        """What was held and all that follows is content (text that never was markup)."""
        if self._calls and self._calls[-1].name is None:
            self._calls.pop()
        self._emit_content(self._held)
        self._held = ""
        self._mode = self._plain_mode


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _content_or_none(text: str) -> str | None:
    return text if text.strip() else None


def _is_json_object(arguments: str) -> bool:
    try:
        _require_json_object(arguments)
    except MalformedToolCall:
        return False
    return True


def _require_json_object(arguments: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        raise MalformedToolCall(f"arguments are not JSON: {arguments!r}") from None
    if not isinstance(value, dict):
        raise MalformedToolCall(f"arguments are not a JSON object: {arguments!r}")
