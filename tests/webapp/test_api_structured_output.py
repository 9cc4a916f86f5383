"""Structured output and tool calling through the serving stack (Daphne -> Redis -> worker ->
engine) with the packaged SmolLM2, driven by the clients users have: the openai SDK (``.parse()``
with a Pydantic model, ``json_schema``, ``json_object``, tools, streamed tool calls the SDK
reassembles) and LangChain (``with_structured_output``, ``bind_tools``). Every constrained output
is validated with ``jsonschema``; the model alone does not write these formats (see
``tests/inference/test_structured_output.py``)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.webapp.serving_stack import MODEL, Stack, http

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# The hermes markup, forced by a regex so that the parser's path is tested on a model too small to
# choose tools by itself.
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
               r'"unit": "celsius"\}\}\n</tool_call>')


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def _schema_of(tool: dict) -> dict:
    return tool["function"]["parameters"]


@pytest.fixture(scope="module")
def tool_web(stack, tmp_path_factory):
    """A web process started as with ``--enable-auto-tool-choice --tool-call-parser hermes``, on the
    shared stack's Redis and worker."""
    web = Stack(tmp_path_factory.mktemp("tool-web"), 0, redis_url=stack.redis_url,
                TESSERA_TOOL_CALL_PARSER="hermes", TESSERA_ENABLE_AUTO_TOOL_CHOICE="1")
    yield web
    web.stop()


def test_sdk_parse_with_a_pydantic_model(stack):
    reply = stack.openai().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                                  response_format=Person, max_tokens=48, temperature=0)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_json_schema_strict_and_json_object_with_n4(stack):
    client = stack.openai()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Which city is the capital of France?"}], n=4,
        temperature=1.0, seed=7, max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    assert len(reply.choices) == 4
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Return a JSON object with a key "ok" set to true.'}],
        response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}, lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t) or 1 / 0),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no") or 1 / 0),
    ({"guided_grammar": 'root ::= "SELECT " ("name" | "age") " FROM users"'},
     lambda t: re.fullmatch(r"SELECT (name|age) FROM users", t) or 1 / 0),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green") or 1 / 0),
])
def test_vllm_fields_on_completions_and_chat(stack, extra, check):
    client = stack.openai()
    text = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=48, temperature=0,
                                     extra_body=extra).choices[0].text
    check(text)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer."}],
                                          max_tokens=48, temperature=0, extra_body=extra)
    check(chat.choices[0].message.content)


def test_32_concurrent_requests_with_mixed_schemas_and_prefix_hits(stack):
    client = stack.openai()
    schemas = [PERSON, CITY, _schema_of(WEATHER)]
    system = {"role": "system", "content": "You answer in JSON. " * 20}  # a shared prefix: prefix-cache hits

    def ask(i: int):
        schema = schemas[i % 3]
        reply = client.chat.completions.create(
            model=MODEL, messages=[system, {"role": "user", "content": f"Question {i}: fill the form."}],
            temperature=1.0, seed=i, max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i % 3}", "schema": schema,
                                                                    "strict": True}})
        return reply.choices[0], schema

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(ask, range(32)))
    for choice, schema in results:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_tool_choice_required_and_named_give_valid_arguments(stack):
    client = stack.openai()
    runs = [dict(temperature=0, max_tokens=160)] + [dict(temperature=1.0, seed=seed, parallel_tool_calls=False,
                                                       max_tokens=64) for seed in range(3)]
    for kwargs in runs:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               **kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert kwargs.get("parallel_tool_calls", True) or len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), _schema_of(tool))
            assert call.id.startswith("call_") and call.type == "function"
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), _schema_of(TIME))


def test_streamed_tool_calls_are_reassembled_by_the_sdk(stack):
    client = stack.openai()
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=64, temperature=0) as stream:
            final = stream.get_final_completion()
        (call,) = final.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(WEATHER))
        if isinstance(choice, dict):  # the same arguments as the non-streamed call
            assert call.function.arguments == whole.choices[0].message.tool_calls[0].function.arguments


def test_required_tool_calls_stream_while_they_are_written(stack):
    client = stack.openai()
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0,
                  parallel_tool_calls=False)
    (whole,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    with_calls = [i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls]
    # the name comes as soon as it is written, the arguments piece by piece, not all in the last chunk
    assert len(with_calls) >= 3 and with_calls[0] < len(chunks) - 2, with_calls
    for c in chunks:  # one entry per call in a chunk
        indexes = [d.index for d in c.choices[0].delta.tool_calls or []]
        assert len(indexes) == len(set(indexes)), c
    deltas = [d for i in with_calls for d in chunks[i].choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == whole.function.name
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_needs_the_server_flags(stack):
    status, _, body = http("POST", stack.base_url + "/v1/chat/completions",
                           {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


def test_auto_with_the_hermes_parser(tool_web):
    client = tool_web.openai()
    forced = {"structured_outputs": {"regex": HERMES_CALL}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                                           extra_body=forced)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _schema_of(WEATHER))
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                                 temperature=0, extra_body=forced, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in content and not content.strip()
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # free text under "auto": content, no calls
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                           tools=TOOLS, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_a_tool_result_in_the_conversation_is_rendered(stack):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    _, _, raw = http("POST", stack.base_url + "/tokenize", {"model": MODEL, "messages": messages, "tools": TOOLS,
                                                            "tool_choice": "required"})
    tokens = json.loads(raw)["tokens"]
    _, _, raw = http("POST", stack.base_url + "/detokenize", {"model": MODEL, "tokens": tokens})
    prompt = json.loads(raw)["prompt"]
    assert "<tool_response>\n22 degrees, sunny\n</tool_response>" in prompt and "<tools>" in prompt
    assert '"name": "get_weather"' in prompt
    reply = stack.openai().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                                   max_tokens=16, temperature=0)
    assert reply.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "guided_json": PERSON}, "guided_json"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_constraints_are_400_naming_the_field_and_others_go_on(stack, extra, param):
    status, _, body = http("POST", stack.base_url + "/v1/chat/completions",
                           {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == param, body
    assert "/project/" not in error["message"]
    assert http("POST", stack.base_url + "/v1/chat/completions",
                {"model": MODEL, "messages": ASK, "max_tokens": 2})[0] == 200


def test_langchain_structured_output_and_bind_tools(stack):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=stack.base_url + "/v1", api_key="unused",
                                      temperature=0, max_tokens=48)
    person = llm.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke(ASK[0]["content"])
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], _schema_of(WEATHER))
