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
        return self._marker_content_mode(TOOL_CALLS_TOKEN, self._list_open_mode, final)

    def _list_open_mode(self, final: bool) -> bool:
        """After ``[TOOL_CALLS]``: whitespace, then ``[``."""
        return self._token_mode({"[": self._object_start_mode})

    def _list_next_mode(self, final: bool) -> bool:
        """After a call object: ``,`` and the next, or ``]``."""
        return self._token_mode({",": self._object_start_mode, "]": self._between_mode})

    def _between_mode(self, final: bool) -> bool:
        """After the list: whitespace is dropped, the rest is content."""
        return self._drop_ws_mode(self._plain_mode)
