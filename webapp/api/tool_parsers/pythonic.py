"""Pythonic tool calls (Llama 3.2, Llama 4): a Python list of calls with keyword arguments.

Format (as vLLM's ``pythonic`` parser reads it)::

    [get_weather(city='San Francisco', unit="celsius"), get_time(zone={"name": "PST"})]

optionally inside ``<|python_start|>`` ... ``<|python_end|>``. The whole output (but for
surrounding whitespace) must be the list, else it is content. Each call is read with
Python's ``ast``: only keyword arguments, each a literal (``ast.literal_eval``: strings,
numbers, booleans, None, lists, tuples, dicts), converted to JSON (tuples become arrays;
sets, bytes, complex and non-finite numbers are not calls). A call's arguments are
``json.dumps`` of the keywords (``ensure_ascii=False``), sent in one delta with its name
when its closing parenthesis arrives.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from .base import MalformedToolCall, Mode, StreamingToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_NAME_OPEN = re.compile(r"([A-Za-z_]\w*)\s*\(")
_NAME_PREFIX = re.compile(r"[A-Za-z_]\w*\s*")
_BRACKETS = {"(": ")", "[": "]", "{": "}"}


def call_to_json(call_text: str) -> tuple[str, str]:
    """``(name, arguments JSON)`` of one call written as Python, e.g. ``f(a=1, b='x')``.

    Raises:
        MalformedToolCall: not a call of a plain name with literal keyword arguments only.
    """
    try:
        node = ast.parse(call_text.strip(), mode="eval").body
    except SyntaxError as error:
        raise MalformedToolCall(f"not a Python call: {error}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise MalformedToolCall(f"not a call of a function by name: {call_text!r}")
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        raise MalformedToolCall(f"a tool call takes keyword arguments only: {call_text!r}")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg in arguments:
            raise MalformedToolCall(f"argument {keyword.arg!r} given twice")
        try:
            value = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise MalformedToolCall(f"argument {keyword.arg!r} is not a literal") from None
        arguments[keyword.arg] = _json_value(value)
    return node.func.id, json.dumps(arguments, ensure_ascii=False)


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MalformedToolCall(f"{value} has no JSON form")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise MalformedToolCall("a dict argument with keys that are not strings has no JSON form")
        return {key: _json_value(item) for key, item in value.items()}
    raise MalformedToolCall(f"a {type(value).__name__} argument has no JSON form")


class PythonicToolParser(StreamingToolParser):
    """Parser for ``[f(a=1), g(b='x')]``; registered as ``pythonic``."""

    name = "pythonic"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._call_text = ""
        self._stack: list[str] = []
        self._quote = ""
        self._escaped = False

    def _initial_mode(self) -> Mode:
        return self._start_mode

    def _accepting_modes(self) -> tuple[Mode, ...]:
        return (self._end_mode,)

    def _start_mode(self, final: bool) -> bool:
        """The output's start: whitespace, the optional ``<|python_start|>``, then ``[``."""
        self._skip_ws()
        if self._buf.startswith(PYTHON_START):
            self._consume(len(PYTHON_START))
            self._skip_ws()
        if not self._buf or (PYTHON_START.startswith(self._buf) and not final):
            if final:
                self._to_plain()
                return True
            return False
        if self._buf[0] != "[":
            self._to_plain()
            return True
        self._consume(1)
        self._mode = self._item_mode
        return True

    def _item_mode(self, final: bool) -> bool:
        """Where a call starts: its name and ``(``."""
        self._skip_ws()
        match = _NAME_OPEN.match(self._buf)
        if match:
            self._call_text = self._consume(match.end())
            self._stack = [")"]
            self._open_call()
            self._mode = self._arguments_mode
            return True
        if self._buf and (final or not _NAME_PREFIX.fullmatch(self._buf)):
            self._fail()
            return True
        return False

    def _arguments_mode(self, final: bool) -> bool:
        """Inside a call's parentheses, up to the one that closes it."""
        if not self._buf:
            return False
        end = self._scan_arguments()
        self._call_text += self._consume(end)
        if self._stack:
            return True
        try:
            name, arguments = call_to_json(self._call_text)
        except MalformedToolCall:
            self._fail()
            return True
        self._commit(name, arguments)
        self._mode = self._next_mode
        return True

    def _scan_arguments(self) -> int:
        """How many characters of the buffer belong to the open call (all, or up to its ``)``)."""
        for i, ch in enumerate(self._buf):
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "'\"":
                self._quote = ch
            elif ch in _BRACKETS:
                self._stack.append(_BRACKETS[ch])
            elif ch in ")]}":
                if ch != self._stack.pop():
                    self._stack = []  # unbalanced: let ast say why
                if not self._stack:
                    return i + 1
        return len(self._buf)

    def _next_mode(self, final: bool) -> bool:
        """After a call: ``,`` and the next call, or the list's ``]``."""
        return self._token_mode({",": self._item_mode, "]": self._end_mode})

    def _end_mode(self, final: bool) -> bool:
        """After the list: whitespace and the optional ``<|python_end|>`` only."""
        self._skip_ws()
        if self._buf.startswith(PYTHON_END):
            self._consume(len(PYTHON_END))
            return True
        if self._buf and (final or not PYTHON_END.startswith(self._buf)):
            self._fail()
            return True
        return False

    def _validate(self, calls: list) -> None:
        if not calls:
            raise MalformedToolCall("an empty list of calls")
        super()._validate(calls)
