"""Tool calling on chat completions, as vLLM serves it.

* ``tool_choice: "none"``: the tools are left out of the prompt; the answer is text.
* ``"auto"`` (the default when ``tools`` are given): the tools go into the prompt through the
  chat template and the model decides; its output is split into content and calls by the
  server's ``--tool-call-parser`` (:mod:`.tool_parsers`). Needs ``--enable-auto-tool-choice``.
* ``"required"``: the output is constrained (structured output) to a JSON array of
  ``{"name", "parameters"}`` objects, one of the tools each, whose parameters match that
  tool's schema; at most one call when ``parallel_tool_calls`` is false.
* a named function: the output is constrained to that function's parameters schema and
  returned as one call of it.

Both constrain strictly (OpenAI's ``strict``): no property a tool's schema does not name,
unless the schema allows additional properties itself.

The parsed calls come back as OpenAI's ``message.tool_calls`` with ``finish_reason:
"tool_calls"`` (``"stop"`` for a named function, as OpenAI), or streamed as ``delta.tool_calls`` while they
are written: a call's ``id`` and ``name`` once its name ends, then its arguments as they come.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from .errors import bad_request
from .tool_parsers import ExtractedToolCalls, ToolCall, ToolCallDelta, ToolParser, get_tool_parser, random_call_id
from .tool_parsers.json_calls import JsonListParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request asks of its tools.

    Attributes:
        tools: the request's ``tools`` (validated: each a ``{"type": "function", "function":
            {"name", ...}}``).
        mode: ``none``, ``auto``, ``required`` or ``named``.
        name: the function of a ``named`` choice.
        parallel: ``parallel_tool_calls`` (default true).
        parser: the ``--tool-call-parser`` for ``auto``.
    """

    tools: tuple[dict, ...]
    mode: str
    name: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template lists in the prompt (None for ``none``)."""
        return None if self.mode == "none" else list(self.tools)

    def structured_outputs(self) -> dict[str, Any] | None:
        """The output constraint of ``required`` and ``named``; None otherwise."""
        if self.mode == "named":
            return {"json": self._parameters(self.name), "strict": True}
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": self._parameters(f["name"])},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for f in (t["function"] for t in self.tools)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema, "strict": True}

    def _parameters(self, name: str) -> dict:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or EMPTY_PARAMETERS

    def extractor(self) -> ToolExtractor | None:
        """A new extractor for one choice's output (None for ``none``)."""
        if self.mode == "none":
            return None
        tools = list(self.tools)
        if self.mode == "auto":
            return _ParsedCalls(lambda: get_tool_parser(self.parser)(tools))
        if self.mode == "named":
            return _NamedCall(self.name)
        return _ParsedCalls(lambda: JsonListParser(tools))


def parse_tool_choice(data: dict[str, Any], parser: str | None, auto_enabled: bool) -> ToolChoice | None:
    """The body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (None without tools).

    Raises:
        APIError: 400 naming the field: malformed tools, a ``tool_choice`` without tools or naming
            no tool given, ``auto`` on a server started without ``--enable-auto-tool-choice``.
    """
    tools = data.get("tools")
    choice = data.get("tool_choice")
    parallel = data.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false.", param="parallel_tool_calls")
    if data.get("functions"):  # OpenAI's deprecated form
        raise bad_request("'functions' is deprecated and not supported; send 'tools'.", param="functions")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array.", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and tool.get("type") == "function"
                and isinstance(function.get("name"), str) and function["name"]):
            raise bad_request(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.",
                              param="tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise bad_request(f"'tools[{i}].function.parameters' must be a JSON schema (an object).", param="tools")
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"'tools[{i}]' names the function {name!r:.80} again; each tool needs a name of its own.",
                              param="tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")
        if name not in names:
            raise bad_request(f"'tool_choice' names the function {name!r:.80}, which is not among 'tools'.",
                              param="tool_choice")
        return ToolChoice(tuple(tools), "named", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")
    if choice == "auto" and not (auto_enabled and parser):
        raise bad_request("'tool_choice': 'auto' (the default with 'tools') needs the server started with "
                          "--enable-auto-tool-choice and --tool-call-parser; send 'required', a named function "
                          "or 'none' instead.", param="tool_choice")
    return ToolChoice(tuple(tools), choice, None, parallel, parser if choice == "auto" else None)


class ToolExtractor(ABC):
    """Splits one choice's output into content and tool calls, streamed (:meth:`feed`,
    :meth:`finish`) or whole (:meth:`result`)."""

    finish_with_calls = "tool_calls"  # the finish reason of an output that made calls

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content and tool-call deltas to send for ``text``, the next piece of the output."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left to send once the output ended."""

    @abstractmethod
    def result(self, text: str) -> ExtractedToolCalls:
        """The whole output ``text`` split into content and calls."""

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        """``reason`` as the client sees it: ``tool_calls`` for an output that ended with calls."""
        return self.finish_with_calls if made_calls and reason == "stop" else reason


class _ParsedCalls(ToolExtractor):
    """A streaming tool parser's calls: the server's ``--tool-call-parser`` under ``auto``, the JSON list of
    calls under ``required`` (streamed as it is written, each call's arguments as they come)."""

    def __init__(self, make: Callable[[], ToolParser]) -> None:
        self._make = make
        self._parser = make()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return self._parser.feed(text)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._parser.finish()

    def result(self, text: str) -> ExtractedToolCalls:
        return self._make().extract(text)


class _NamedCall(ToolExtractor):
    """A named function: the whole output is its arguments, streamed as they come."""

    finish_with_calls = "stop"  # as OpenAI, for a function the request named

    def __init__(self, name: str) -> None:
        self.name = name
        self._id: str | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._id is None:
            self._id = random_call_id()
            return "", [ToolCallDelta(0, self._id, self.name, text)]
        return "", [ToolCallDelta(0, None, None, text)] if text else []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []

    def result(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, [ToolCall(random_call_id(), self.name, text)])


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """OpenAI's ``message.tool_calls[i]``."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def merge_call_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """``deltas`` with each run of one call's deltas joined into one, so that a chunk holds one entry per call
    (a call's first delta keeps its ``id`` and ``name``; the arguments are concatenated)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id or delta.id, last.name or delta.name,
                                       last.arguments + delta.arguments)
        else:
            merged.append(delta)
    return merged


def tool_call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's ``delta.tool_calls[i]``: index, then id, type and name on a call's first delta."""
    entry: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        entry.update(id=delta.id, type="function")
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.name is not None:
        function = {"name": delta.name, **function}
    entry["function"] = function
    return entry
