"""Hermes tool calls (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>`` blocks of JSON.

Format (as vLLM's ``hermes`` parser reads it)::

    Some text, which is content.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "SF"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

Whitespace between and after blocks is dropped; other text after a block is content. The
last block may lack its ``</tool_call>`` (generation stopped there); a block without
``arguments`` calls with ``{}``. An output that ends in the middle of a tag after a call (``max_tokens``
cut ``</tool_`` or ``<tool_``) drops that piece of markup.
"""
from __future__ import annotations

from .base import Mode, partial_suffix
from .json_calls import JsonCallsParser

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(JsonCallsParser):
    """Parser for ``<tool_call>{json}</tool_call>`` blocks; registered as ``hermes``."""

    name = "hermes"

    def _initial_mode(self) -> Mode:
        return self._content_mode

    def _accepting_modes(self) -> tuple[Mode, ...]:
        return (self._content_mode, self._close_mode, self._between_mode)

    def _after_object(self) -> Mode:
        return self._close_mode

    def _content_mode(self, final: bool) -> bool:
        if final and any(call.name is not None for call in self._calls):  # a next call's tag, cut off
            cut = partial_suffix(self._buf, TOOL_CALL_START)
            self._buf = self._buf[:len(self._buf) - cut]
        return self._marker_content_mode(TOOL_CALL_START, self._object_start_mode, final)

    def _close_mode(self, final: bool) -> bool:
        """After an object: whitespace, then ``</tool_call>`` (or nothing, or a piece of it, at the end)."""
        self._skip_ws()
        if self._buf.startswith(TOOL_CALL_END) or (final and self._buf and TOOL_CALL_END.startswith(self._buf)):
            self._consume(min(len(self._buf), len(TOOL_CALL_END)))
            self._mode = self._between_mode
            return True
        if self._buf and (final or not TOOL_CALL_END.startswith(self._buf)):
            self._mode = self._between_mode
            return True
        return False

    def _between_mode(self, final: bool) -> bool:
        """After a block: whitespace is dropped, then content (which may open another block)."""
        return self._drop_ws_mode(self._content_mode)
