"""Llama 3.1 / 3.2 JSON tool calls: the output is ``{"name": ..., "parameters": {...}}``.

Format (as vLLM's ``llama3_json`` parser reads it)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}; {"name": "get_time", "parameters": {}}

The ``<|python_tag|>`` is optional (it is a special token, often not detokenized); calls
are separated by ``;``; ``arguments`` is read like ``parameters``. Only an output that
starts (after whitespace) with a call is one: any other output is content. An object
without ``name`` and ``parameters`` (an answer in JSON, say) is content too.
"""
from __future__ import annotations

from .base import Mode
from .json_calls import JsonCallsParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonCallsParser):
    """Parser for Llama 3's JSON calls separated by ``;``; registered as ``llama3_json``."""

    name = "llama3_json"
    require_arguments = True

    def _initial_mode(self) -> Mode:
        return self._start_mode

    def _accepting_modes(self) -> tuple[Mode, ...]:
        return (self._next_mode, self._object_start_mode)

    def _after_object(self) -> Mode:
        return self._next_mode

    def _start_mode(self, final: bool) -> bool:
        """The output's start: whitespace, the optional python tag, then ``{`` or it is content."""
        self._skip_ws()
        if self._buf.startswith(PYTHON_TAG):
            self._consume(len(PYTHON_TAG))
            self._skip_ws()
        if not self._buf:
            if final:
                self._to_plain()
                return True
            return False
        if PYTHON_TAG.startswith(self._buf) and not final:
            return False
        if self._buf[0] == "{":
            self._start_object()
        else:
            self._to_plain()
        return True

    def _next_mode(self, final: bool) -> bool:
        """After a call: ``;`` and the next call; whitespace is dropped, other text is content."""
        self._skip_ws()
        if self._buf.startswith(";"):
            self._consume(1)
            self._mode = self._object_start_mode
            return True
        return self._drop_ws_mode(self._plain_mode)
