"""Tool calls written as JSON objects ``{"name": ..., "arguments": {...}}``, scanned as they stream.

The hermes, llama3_json and mistral formats differ only in what surrounds these objects;
:class:`JsonCallsParser` streams one object at a time with :class:`CallObjectScanner`, and
:class:`JsonListParser` reads a JSON list of them (mistral's, and ``tool_choice: "required"``'s output).
A call's arguments are the object's ``arguments`` (or ``parameters``) value exactly as the
model wrote it, so the streamed fragments are the characters of that value as they arrive;
a value written as a JSON string holding an object is decoded and sent when it ends.
"""
from __future__ import annotations

from abc import abstractmethod

import json

from .base import MalformedToolCall, Mode, StreamingToolParser

ARGUMENT_KEYS = ("arguments", "parameters")

# Scanner states
_OPEN, _KEY_OR_CLOSE, _KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE, _DONE = range(8)


class CallObjectScanner:
    """Reads one tool-call JSON object a character at a time.

    Checks the object's structure (keys, colons, commas, balanced values, strings and their
    escapes); scalars and the insides of values are checked by ``json.loads`` once the object
    ends. Keys other than the name and the arguments are ignored.

    Attributes:
        name: the ``name`` value once it has ended (a non-empty string), else None.
        arguments: the arguments text so far: the raw characters of an object value as they
            arrive, or a string value's decoded text once it ends.
        arguments_started: an arguments value has begun (the name can be committed).
        arguments_seen: an arguments key was given at all.
        done: the closing brace was read.
        raw: every character pushed.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments = ""
        self.arguments_started = False
        self.arguments_seen = False
        self.done = False
        self.raw: list[str] = []
        self._state = _OPEN
        self._key: list[str] = []
        self._current_key: str | None = None
        self._value: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._value_is_arguments = False

    def push(self, ch: str) -> None:
        """Read one character.

        Raises:
            MalformedToolCall: the character cannot continue a tool-call object.
        """
        self.raw.append(ch)
        state = self._state
        if state == _VALUE:
            self._value_char(ch)
        elif state == _KEY:
            self._key_char(ch)
        elif ch.isspace():
            return
        elif state == _OPEN:
            self._expect(ch, "{", _KEY_OR_CLOSE)
        elif state == _KEY_OR_CLOSE:
            if ch == "}":
                self._close()
            else:
                self._expect(ch, '"', _KEY)
                self._key = ['"']
        elif state == _COLON:
            self._expect(ch, ":", _VALUE_START)
        elif state == _VALUE_START:
            self._start_value(ch)
        elif state == _AFTER_VALUE:
            self._after_value(ch)
        else:
            raise MalformedToolCall(f"text after the tool call's closing brace: {ch!r}")

    def _expect(self, ch: str, wanted: str, then: int) -> None:
        if ch != wanted:
            raise MalformedToolCall(f"expected {wanted!r} in a tool call, got {ch!r}")
        self._state = then

    def _key_char(self, ch: str) -> None:
        self._key.append(ch)
        if self._string_ended(ch):
            self._current_key = json.loads("".join(self._key))
            self._state = _COLON

    def _string_ended(self, ch: str) -> bool:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            return True
        return False

    def _start_value(self, ch: str) -> None:
        self._value = [ch]
        self._state = _VALUE
        if ch in "{[":
            self._depth, self._in_string = 1, False
        elif ch == '"':
            self._in_string = True
        if self._current_key in ARGUMENT_KEYS:
            self.arguments_seen = True
        self._value_is_arguments = (ch == "{" and self._current_key in ARGUMENT_KEYS
                                    and not self.arguments_started)
        if self._value_is_arguments:
            self.arguments_started = True
            self.arguments = ch

    def _value_char(self, ch: str) -> None:
        first = self._value[0]
        if first not in '{["' and (ch in ",}" or ch.isspace()):  # a scalar ends before ch
            self._end_value()
            self._after_value(ch)
            return
        self._value.append(ch)
        if self._value_is_arguments:
            self.arguments += ch
        if self._in_string:
            if self._string_ended(ch):
                self._in_string = False
                if first == '"':
                    self._end_value()
        elif first in "{[":
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value()

    def _end_value(self) -> None:
        raw = "".join(self._value)
        self._state = _AFTER_VALUE
        if self._current_key == "name" and self.name is None:
            try:
                name = json.loads(raw)
            except ValueError:
                raise MalformedToolCall(f"the tool call's name is not JSON: {raw}") from None
            if not isinstance(name, str) or not name:
                raise MalformedToolCall(f"the tool call's name is not a non-empty string: {raw}")
            self.name = name
        elif self._current_key in ARGUMENT_KEYS and not self.arguments_started:
            self._string_arguments(raw)

    def _string_arguments(self, raw: str) -> None:
        try:
            value = json.loads(raw)
        except ValueError:
            raise MalformedToolCall(f"the tool call's arguments are not JSON: {raw}") from None
        if not isinstance(value, str):
            raise MalformedToolCall(f"the tool call's arguments are not an object: {raw}")
        self.arguments_started = True
        self.arguments = value.strip()

    def _after_value(self, ch: str) -> None:
        if ch.isspace():
            return
        if ch == ",":
            self._state = _KEY_OR_CLOSE
        elif ch == "}":
            self._close()
        else:
            raise MalformedToolCall(f"expected ',' or '}}' after a value in a tool call, got {ch!r}")

    def _close(self) -> None:
        try:
            json.loads("".join(self.raw))
        except ValueError as error:
            raise MalformedToolCall(f"the tool call is not valid JSON: {error}") from None
        self.done = True
        self._state = _DONE


class JsonCallsParser(StreamingToolParser):
    """Base of the parsers whose calls are :class:`CallObjectScanner` objects.

    Subclasses start an object with :meth:`_start_object` and say in :meth:`_after_object`
    which mode follows a complete one. ``require_arguments``: an object without an
    arguments key is not a call (else its arguments are ``{}``).
    """

    require_arguments = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._scanner: CallObjectScanner | None = None

    @abstractmethod
    def _after_object(self) -> Mode:
        """The mode after a complete call object (each format says what may follow)."""

    def _object_start_mode(self, final: bool) -> bool:
        """After whitespace, a call object's ``{``; any other character fails."""
        self._skip_ws()
        if not self._buf:
            return False
        if self._buf[0] == "{":
            self._start_object()
        else:
            self._fail()
        return True

    def _start_object(self) -> None:
        self._scanner = CallObjectScanner()
        self._open_call()
        self._mode = self._object_mode

    def _object_mode(self, final: bool) -> bool:
        scanner = self._scanner
        assert scanner is not None
        if not self._buf:
            return False
        try:
            for i, ch in enumerate(self._buf):
                scanner.push(ch)
                if scanner.done:
                    break
        except MalformedToolCall:
            self._consume(i + 1)
            self._fail()
            return True
        self._consume(i + 1)
        self._stream_object(scanner)
        if scanner.done:
            if self._calls[-1].name is None:  # ended without a name, or without arguments when required
                self._fail()
            else:
                self._held = ""
                self._mode = self._after_object()
        return True

    def _stream_object(self, scanner: CallObjectScanner) -> None:
        call = self._calls[-1]
        ready = scanner.arguments_started or (scanner.done and not self.require_arguments)
        if call.name is None and scanner.name is not None and ready:
            self._commit(scanner.name)
        if call.name is None:
            return
        arguments = scanner.arguments if scanner.arguments_started else ("{}" if scanner.done else "")
        sent = sum(len(part) for part in call.arguments)
        self._emit_arguments(arguments[sent:])


class JsonListParser(JsonCallsParser):
    """A JSON list of call objects, ``[{"name": ..., "parameters": {...}}, ...]``, from the output's start.

    What ``tool_choice: "required"`` constrains the output to; subclasses start it after other text. Whitespace
    after the list is dropped, other text there is content.
    """

    def _initial_mode(self) -> Mode:
        return self._list_open_mode

    def _accepting_modes(self) -> tuple[Mode, ...]:
        return (self._between_mode,)

    def _after_object(self) -> Mode:
        return self._list_next_mode

    def _list_open_mode(self, final: bool) -> bool:
        """Whitespace, then ``[``."""
        return self._token_mode({"[": self._object_start_mode})

    def _list_next_mode(self, final: bool) -> bool:
        """After a call object: ``,`` and the next, or ``]``."""
        return self._token_mode({",": self._object_start_mode, "]": self._between_mode})

    def _between_mode(self, final: bool) -> bool:
        """After the list: whitespace is dropped, the rest is content."""
        return self._drop_ws_mode(self._plain_mode)
