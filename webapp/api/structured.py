"""Structured output in a request body, in every form vLLM accepts, turned into one
``structured_outputs`` value of the engine's ``SamplingParams``.

The forms: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with
``strict``), vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields. One request uses one of them.
"""
from __future__ import annotations

from typing import Any

from .errors import bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
IGNORED_GUIDED_OPTIONS = ("guided_decoding_backend", "guided_whitespace_pattern")  # vLLM's; one backend here


def parse_structured_outputs(data: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The ``structured_outputs`` value the body asks for (None: free text), and for error
    messages the body field each of its engine fields came from.

    Raises:
        APIError: 400 naming the field: a malformed ``response_format``, an unknown
            ``structured_outputs`` key, or more than one form in one request.
    """
    sources = []
    response_format = data.get("response_format")
    if response_format is not None:
        value, names = _response_format(response_format)
        if value is not None:
            sources.append(("response_format", value, names))
    if data.get("structured_outputs") is not None:
        sources.append(("structured_outputs", *_structured_outputs(data["structured_outputs"])))
    guided = {field: data[field] for field in GUIDED_FIELDS if data.get(field) is not None}
    if guided:
        sources.append((next(iter(guided)), {GUIDED_FIELDS[f]: v for f, v in guided.items()},
                        {f"structured_outputs.{GUIDED_FIELDS[f]}": f for f in guided}))
    if data.get("structural_tag") is not None:
        raise bad_request("'structural_tag' is not supported; use 'tools' with 'tool_choice', or 'response_format'.",
                          param="structural_tag")
    if len(sources) > 1:
        names = [s[0] for s in sources]
        raise bad_request(f"Give one form of structured output, not {' and '.join(repr(n) for n in names)}.",
                          param=names[1])
    if not sources:
        return None, {}
    _, value, names = sources[0]
    return value, {"structured_outputs": sources[0][0], **names}


def _response_format(value: Any) -> tuple[dict[str, Any] | None, dict[str, str]]:
    if not isinstance(value, dict):
        raise bad_request("'response_format' must be an object such as {\"type\": \"json_object\"}.",
                          param="response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None, {}
    if kind == "json_object":
        return {"json_object": True}, {"structured_outputs.json_object": "response_format"}
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r:.60}.",
                          param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'.",
                          param="response_format.json_schema")
    schema = spec.get("schema", {"type": "object"}) if "schema" in spec else spec.get("json_schema")
    if not isinstance(schema, dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema (an object).",
                          param="response_format.json_schema.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'response_format.json_schema.strict' must be true or false.",
                          param="response_format.json_schema.strict")
    return ({"json": schema, "strict": bool(strict)},
            {"structured_outputs.json": "response_format.json_schema.schema"})


def _structured_outputs(value: Any) -> tuple[dict[str, Any], dict[str, str]]:
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object such as {\"json\": {...}}.",
                          param="structured_outputs")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_FIELDS) - {"backend", "whitespace_pattern"})
    if unknown:
        raise bad_request(f"'structured_outputs' has unknown field(s) {', '.join(unknown)}; known: "
                          f"{', '.join(STRUCTURED_OUTPUTS_FIELDS)}.", param="structured_outputs")
    kept = {k: v for k, v in value.items() if k in STRUCTURED_OUTPUTS_FIELDS and v is not None}
    return kept, {}
