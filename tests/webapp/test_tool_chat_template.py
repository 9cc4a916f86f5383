"""SmolLM2's tool-use chat template, rendered by the real tokenizer's apply_chat_template."""
from __future__ import annotations

import json
import re

import pytest

from webapp.api.chat_templates import TOOL_USE_TEMPLATES, tool_use_template
from webapp.api.tool_parsers import get_tool_parser

MODEL = "smollm2-135m-instruct"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city <celsius> & 'kelvin'",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLS_TURN = [
    {"role": "user", "content": "Weather in Zürich and Bern?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 12}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 14}'},
]


@pytest.fixture(scope="module")
def tokenizer():
    from inference.model_loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(MODEL).tokenizer_dir)


@pytest.fixture(scope="module")
def template() -> str:
    text = tool_use_template(MODEL)
    assert text is not None
    return text


def render(tokenizer, template, messages, tools=None, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def test_loader_knows_the_packaged_model_only():
    assert set(TOOL_USE_TEMPLATES) == {MODEL}
    assert tool_use_template("no-such-model") is None
    assert "<tool_call>" in tool_use_template(MODEL)


def test_tools_are_listed_in_the_system_turn(tokenizer, template):
    text = render(tokenizer, template, [{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL, TIME_TOOL])
    system = text.split("<|im_end|>\n")[0]
    assert system.startswith("<|im_start|>system\n" + DEFAULT_SYSTEM + "\n\n# Tools\n")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.S).group(1).split("\n")
    assert [json.loads(line) for line in listed] == [WEATHER_TOOL, TIME_TOOL]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert text.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")


def test_a_given_system_message_leads_the_tools_once(tokenizer, template):
    messages = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Weather?"}]
    text = render(tokenizer, template, messages, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou answer in French.\n\n# Tools\n")
    assert text.count("You answer in French.") == 1 and DEFAULT_SYSTEM not in text
    assert text.count("<|im_start|>system") == 1


def test_tool_calls_and_responses_are_rendered_as_blocks(tokenizer, template):
    text = render(tokenizer, template, CALLS_TURN, tools=[WEATHER_TOOL])
    assistant = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>'
                 '<|im_end|>\n')
    responses = ('<|im_start|>user\n<tool_response>\n{"temperature": 12}\n</tool_response>\n<tool_response>\n'
                 '{"temperature": 14}\n</tool_response><|im_end|>\n')
    assert text.endswith("<|im_start|>user\nWeather in Zürich and Bern?<|im_end|>\n" + assistant + responses
                         + "<|im_start|>assistant\n")


def test_rendered_calls_parse_back_with_the_hermes_parser(tokenizer, template):
    messages = CALLS_TURN[:1] + [dict(CALLS_TURN[1], content="Checking both.")]
    text = render(tokenizer, template, messages, tools=[WEATHER_TOOL], add_generation_prompt=False)
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    result = get_tool_parser("hermes")(None).extract(turn)
    assert result.content == "Checking both.\n"
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == \
        [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "Bern"})]


def test_tool_message_between_other_turns_is_its_own_user_turn(tokenizer, template):
    messages = CALLS_TURN[:3] + [{"role": "assistant", "content": "It is 12 degrees."},
                                 {"role": "user", "content": "Thanks"}]
    text = render(tokenizer, template, messages, tools=[WEATHER_TOOL])
    assert ("<|im_start|>user\n<tool_response>\n{\"temperature\": 12}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\nIt is 12 degrees.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n") in text


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_it_renders_as_smollm2s_own_template(tokenizer, template, messages, add_generation_prompt):
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert render(tokenizer, template, messages, add_generation_prompt=add_generation_prompt) == own
    assert render(tokenizer, template, messages, tools=[], add_generation_prompt=add_generation_prompt) == own
    if messages[0]["role"] != "system":
        assert own.startswith("<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n")
