"""Tool-call parsers: split a model's output into content and OpenAI tool calls.

Usage, non-streaming::

    parser = get_tool_parser("hermes")(tools)
    result = parser.extract(text)          # ExtractedToolCalls(content, tool_calls)

streaming (one parser per choice)::

    parser = get_tool_parser("hermes")(tools)
    for piece in pieces:
        content, deltas = parser.feed(piece)   # send content and delta.tool_calls now
    content, deltas = parser.finish()

Formats, named as vLLM's ``--tool-call-parser`` names them: ``hermes``, ``llama3_json``,
``mistral``, ``pythonic``.
"""
from __future__ import annotations

from .base import (ExtractedToolCalls, MalformedToolCall, StreamingToolParser, ToolCall, ToolCallDelta,
                   ToolParser, random_call_id)
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


class UnknownToolParser(KeyError, ValueError):
    """No tool parser has the name asked for (both a ``KeyError`` and a ``ValueError``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under ``name``.

    Raises:
        UnknownToolParser: no parser has that name; the message lists the known names.
    """
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(TOOL_PARSERS))
        raise UnknownToolParser(f"Unknown tool parser {name!r}; known parsers: {known}.") from None


__all__ = [
    "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "MalformedToolCall", "MistralToolParser",
    "PythonicToolParser", "StreamingToolParser", "TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolParser",
    "UnknownToolParser", "get_tool_parser", "random_call_id",
]
