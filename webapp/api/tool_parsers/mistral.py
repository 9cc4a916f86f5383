"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects.

Format (as vLLM's ``mistral`` parser reads it for Mistral 7B v0.3, Nemo, Small)::

    Some text, which is content.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "SF"}},
    {"name": "get_time", "arguments": {}}]

Mistral's chat template accepts only call ids of 9 ASCII letters and digits, so this
parser makes those. Whitespace after the list is dropped, other text there is content.
"""
from __future__ import annotations

from .base import Mode, random_call_id
from .json_calls import JsonListParser

TOOL_CALLS_TOKEN = "[TOOL_CALLS]"


class MistralToolParser(JsonListParser):
    """Parser for ``[TOOL_CALLS][{...}, ...]``; registered as ``mistral``."""

    name = "mistral"

    @staticmethod
    def _new_call_id() -> str:
        return random_call_id(length=9, prefix="")

    def _initial_mode(self) -> Mode:
        return self._content_mode

    def _accepting_modes(self) -> tuple[Mode, ...]:
        return (self._content_mode, self._between_mode)

    def _content_mode(self, final: bool) -> bool:
        return self._marker_content_mode(TOOL_CALLS_TOKEN, self._list_open_mode, final)
