"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects.

Format (as vLLM's ``mistral`` parser reads it for Mistral 7B v0.3, Nemo, Small)::

    Some text, which is content.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "SF"}},
    {"name": "get_time", "arguments": {}}]

Mistral's chat template accepts only call ids of 9 ASCII letters and digits, so this
parser makes those. Whitespace after the list is dropped, other text there is content.
"""
from __future__ import annotations

from .base import Mode, random_call_id
from .json_calls import JsonCallsParser

TOOL_CALLS_TOKEN = "[TOOL_CALLS]"


class MistralToolParser(JsonCallsParser):
    """Parser for ``[TOOL_CALLS][{...}, ...]``; registered as ``mistral``."""

    name = "mistral"

    @staticmethod
    def _new_call_id() -> str:
        return random_call_id(length=9, prefix="")

    def _initial_mode(self) -> Mode:
        return self._content_mode

    def _accepting_modes(self) -> tuple[Mode, ...]:
        return (self._content_mode, self._between_mode)

    def _after_object(self) -> Mode:
        return self._list_next_mode

    def _content_mode(self, final: bool) -> bool:
        found = self._marker_content_mode(TOOL_CALLS_TOKEN, final)
        if found is True or found is False:
            return found
        self._mode = self._list_open_mode
        return True

    def _list_open_mode(self, final: bool) -> bool:
        """After ``[TOOL_CALLS]``: whitespace, then ``[``."""
        self._skip_ws()
        if not self._buf:
            return False
        if self._buf[0] != "[":
            self._fail()
            return True
        self._consume(1)
        self._mode = self._list_item_mode
        return True

    def _list_item_mode(self, final: bool) -> bool:
        """Inside the list where a call object starts."""
        self._skip_ws()
        if not self._buf:
            return False
        if self._buf[0] != "{":
            self._fail()
            return True
        self._start_object()
        return True

    def _list_next_mode(self, final: bool) -> bool:
        """After a call object: ``,`` and the next, or ``]``."""
        self._skip_ws()
        if not self._buf:
            return False
        if self._buf[0] == ",":
            self._consume(1)
            self._mode = self._list_item_mode
        elif self._buf[0] == "]":
            self._consume(1)
            self._mode = self._between_mode
        else:
            self._fail()
        return True

    def _between_mode(self, final: bool) -> bool:
        """After the list: whitespace is dropped, the rest is content."""
        self._skip_ws()
        if not self._buf:
            return False
        self._held = ""
        self._mode = self._plain_mode
        return True
