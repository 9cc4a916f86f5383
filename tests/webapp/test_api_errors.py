"""Every error in OpenAI's envelope, with the right status, never a 500 or an HTML page."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.webapp.serving_stack import MODEL, Stack, http

CHAT = [{"role": "user", "content": "Hi"}]


def _error(status_headers_body, status: int) -> dict:
    got, headers, body = status_headers_body
    assert got == status, body
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_malformed_json(stack):
    error = _error(http("POST", stack.base_url + "/v1/chat/completions", b"{not json"), 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    _error(http("POST", stack.base_url + "/v1/completions", b"[1, 2]"), 400)
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000  # beyond the JSON parser's recursion limit
    error = _error(http("POST", stack.base_url + "/v1/completions", deep), 400)
    assert error["code"] == "invalid_json" and "deeply" in error["message"]


def test_a_body_over_the_upload_limit_is_a_413_not_a_500(stack):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * (32 * 1024 * 1024) + b'"}'
    for path in ("/v1/completions", "/tokenize"):
        error = _error(http("POST", stack.base_url + path, body), 413)
        assert error["code"] == "request_too_large" and "33554432 bytes" in error["message"], error


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("max_tokens", 1.5), ("n", True), ("stop", [1, 2]), ("stream", "yes"),
    ("logit_bias", {"x": 1}), ("seed", "1"), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
    ("logit_bias", {"5_000": 1}), ("logit_bias", {"\u0665": 1}), ("logit_bias", {" 7 ": 1}),
    ("logit_bias", {"5": "7"}), ("logit_bias", {"5": True}),
])
def test_wrong_types_and_ranges_name_the_param(stack, field, value):
    body = {"model": MODEL, "messages": CHAT, field: value}
    error = _error(http("POST", stack.base_url + "/v1/chat/completions", body), 400)
    assert error["param"] == field, error


@pytest.mark.parametrize("extra, field", [
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"), ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"seed": 2**70}, "seed"), ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens"),  # past the context: checked against max_model_len
    ({"temperature": 1e308}, "temperature"),  # finite, but not in the sampler's float32
    ({"user": 5}, "user"),
    ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),  # as vLLM without --trust-request-chat-template
])
def test_errors_name_the_field_the_client_sent(stack, extra, field):
    body = {"model": MODEL, "messages": CHAT, **extra}
    error = _error(http("POST", stack.base_url + "/v1/chat/completions", body), 400)
    assert error["param"] == field and field in error["message"], error


@pytest.mark.parametrize("path, field", [
    ("/v1/completions", "temperature"), ("/v1/chat/completions", "top_p"), ("/v1/completions", "presence_penalty"),
    ("/v1/chat/completions", "repetition_penalty"), ("/v1/completions", "logit_bias"),
])
def test_integers_beyond_a_double_are_a_400_not_a_500(stack, path, field):
    """JSON integers have no size limit: 10**400 does not fit a float (Python raises OverflowError)."""
    huge = b"1" + b"0" * 400
    value = b'{"5": ' + huge + b"}" if field == "logit_bias" else huge
    prompt = b'"messages": [{"role": "user", "content": "Hi"}]' if "chat" in path else b'"prompt": "Hi"'
    raw = b"{" + prompt + b', "max_tokens": 1, "' + field.encode() + b'": ' + value + b"}"
    error = _error(http("POST", stack.base_url + path, raw), 400)
    assert error["param"] == field and len(error["message"]) < 300, error


def test_a_huge_whole_number_max_tokens_is_quoted_briefly(stack):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1e308}
    error = _error(http("POST", stack.base_url + "/v1/completions", body), 400)
    assert error["param"] == "max_tokens" and len(error["message"]) < 300, error


@pytest.mark.parametrize("path, raw, field", [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "stop": ["\\udc00"]}', "stop"),
    ("/tokenize", b'{"prompt": "Hi \\ud800"}', "prompt"),
    # The raw UTF-8 bytes of a surrogate (ED A0 80), no escape: json.loads decodes them too.
    ("/v1/completions", b'{"prompt": "a\xed\xa0\x80", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 1}',
     "messages"),
    ("/tokenize", b'{"prompt": "\xed\xbf\xbf"}', "prompt"),
    ("/v1/completions", b'{"model": "m\xed\xa0\x80", "prompt": "Hi", "max_tokens": 1}', "model"),
])
def test_lone_surrogates_are_a_400_naming_the_field(stack, path, raw, field):
    """JSON allows ``"\\ud800"``, but a lone surrogate is no character: a 400, not a 500."""
    error = _error(http("POST", stack.base_url + path, raw), 400)
    assert error["param"] == field and "surrogate" in error["message"], error


def test_a_body_that_is_not_utf8_is_a_400(stack):
    """JSON over HTTP is UTF-8: a body in UTF-16 (json.loads alone would take it) is refused."""
    raw = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode("utf-16")
    error = _error(http("POST", stack.base_url + "/v1/completions", raw), 400)
    assert error["code"] == "invalid_json", error


def test_surrogate_pairs_are_text(stack):
    body = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'  # one emoji, written as a pair of escapes
    status, _, raw = http("POST", stack.base_url + "/v1/completions", body)
    assert status == 200, raw


def test_unknown_chat_role_is_refused(stack):
    body = {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]}
    error = _error(http("POST", stack.base_url + "/v1/chat/completions", body), 400)
    assert error["param"] == "messages" and "wizard" in error["message"] and "assistant" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": ["a", "b"]}),
])
def test_n_above_the_limit_names_n_and_the_limit(stack, path, body):
    body = {"model": MODEL, "n": 129, "max_tokens": 1, **body}
    error = _error(http("POST", stack.base_url + path, body), 400)
    assert error["param"] == "n" and "128" in error["message"], error


@pytest.mark.parametrize("path, extra, field", [
    ("/v1/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"stop_token_ids": [70000]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [5] * 2040, "max_tokens": None, "min_tokens": 100}, "min_tokens"),
])
def test_streamed_requests_get_their_400_before_the_stream(stack, path, extra, field):
    """Not a 200 whose stream holds an error event: the web process checks what the engine would refuse."""
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
    body = {"model": MODEL, "max_tokens": 2, "stream": True, **prompt, **extra}
    error = _error(http("POST", stack.base_url + path, body), 400)
    assert error["param"] == field, error


@pytest.mark.parametrize("num_prompts, n, field", [(4097, 1, "prompt"), (33, 128, "n")])
def test_prompts_times_n_over_the_limit_is_a_400_before_any_work(stack, num_prompts, n, field):
    body = {"model": MODEL, "prompt": ["a"] * num_prompts, "n": n, "max_tokens": 1}
    error = _error(http("POST", stack.base_url + "/v1/completions", body), 400)
    assert error["param"] == field and "4096" in error["message"] and str(num_prompts * n) in error["message"]


def test_best_of_other_than_n_is_refused_by_sampling_params(stack):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2}
    error = _error(http("POST", stack.base_url + "/v1/completions", {**body, "best_of": 3}), 400)
    assert error["param"] == "best_of" and "n=2" in error["message"], error
    status, _, answer = http("POST", stack.base_url + "/v1/completions", {**body, "best_of": 2})
    assert status == 200 and len(json.loads(answer)["choices"]) == 2, answer


@pytest.mark.parametrize("prompt", [[[True, 5]], [[5, False]], ["Hi", [1, True]], [True, 5], [[]], [[1.5]],
                                    ["Hi", [1, 2]]])  # the last: texts and token ids mixed, as OpenAI refuses
def test_booleans_and_non_integers_are_not_token_ids(stack, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    assert _error(http("POST", stack.base_url + "/v1/completions", body), 400)["param"] == "prompt"


def test_missing_messages_and_prompt(stack):
    assert _error(http("POST", stack.base_url + "/v1/chat/completions", {"model": MODEL}), 400)["param"] == "messages"
    assert _error(http("POST", stack.base_url + "/v1/completions", {"model": MODEL}), 400)["param"] == "prompt"
    null_content = {"model": MODEL, "messages": [{"role": "user", "content": None}]}
    error = _error(http("POST", stack.base_url + "/v1/chat/completions", null_content), 400)
    assert error["param"] == "messages" and "messages[0].content" in error["message"]
    for part in ({"type": "text", "text": None}, {"type": "text", "text": 5}, {"type": "text"}):
        bad_part = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
        error = _error(http("POST", stack.base_url + "/v1/chat/completions", bad_part), 400)
        assert error["param"] == "messages" and "string 'text'" in error["message"], part


def test_unknown_model_is_404(stack):
    error = _error(http("POST", stack.base_url + "/v1/chat/completions", {"model": "gpt-17", "messages": CHAT}), 404)
    assert error["code"] == "model_not_found" and "gpt-17" in error["message"]


def test_prompt_plus_max_tokens_beyond_context_names_both_numbers(stack):
    prompt = "hello " * 100
    error = _error(http("POST", stack.base_url + "/v1/completions",
                        {"model": MODEL, "prompt": prompt, "max_tokens": 2000}), 400)
    assert "2048" in error["message"] and "2000" in error["message"] and error["param"] == "max_tokens"
    error = _error(http("POST", stack.base_url + "/v1/completions", {"model": MODEL, "prompt": "hi " * 3000}), 400)
    assert "2048" in error["message"]
    error = _error(http("POST", stack.base_url + "/v1/chat/completions",  # chat has no "prompt" field
                        {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 3000}]}), 400)
    assert "2048" in error["message"] and error["param"] == "messages", error


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(stack):
    """30 MB of text cannot fit 2,048 tokens however it is tokenized: a 400 at once. Tokenizing it first
    took a web process to 6 GB and 20 s (and slowed every other request meanwhile)."""
    import time
    huge = "hello " * 5_000_000
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
                              ("/tokenize", {"prompt": huge}, "prompt")):
        started = time.monotonic()
        error = _error(http("POST", stack.base_url + path, {"model": MODEL, "max_tokens": 2, **body}), 400)
        assert error["param"] == param and "30000000 characters" in error["message"], error
        assert time.monotonic() - started < 5, "the prompt was tokenized before it was refused"
    ok = http("POST", stack.base_url + "/tokenize", {"model": MODEL, "prompt": "hello " * 1000})
    assert ok[0] == 200 and json.loads(ok[2])["count"] >= 1000  # long, but within reach: tokenized


def test_tokenize_takes_a_prompt_or_messages_not_both(stack):
    error = _error(http("POST", stack.base_url + "/tokenize", {"model": MODEL, "prompt": "Hi", "messages": CHAT}), 400)
    assert error["param"] == "messages" and "not both" in error["message"], error


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default, which needs --enable-auto-tool-choice
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [5], "tool_choice": "none"}, "tools"),  # still a list of function tools
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "tools"),
    ({"tools": TOOLS * 2, "tool_choice": "required"}, "tools"),  # two functions of one name
    ({"functions": [{"name": "f"}], "tool_choice": "none"}, "functions"),  # the deprecated form: function_call's
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"messages": [{"role": "user", "content": "Hi", "name": 5}]}, "messages"),
])
def test_chat_fields_vllm_refuses_are_refused(stack, extra, param):
    error = _error(http("POST", stack.base_url + "/v1/chat/completions",
                        {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}), 400)
    assert error["param"] == param, error


def test_tools_with_tool_choice_none_are_accepted_and_left_out_of_the_prompt(stack):
    """Agent frameworks send their tools with tool_choice "none" on turns that call none: served as vLLM does
    with --exclude-tools-when-tool-choice-none (the prompt is the one without tools)."""
    usage = []
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        status, _, body = http("POST", stack.base_url + "/v1/chat/completions",
                               {"model": MODEL, "messages": CHAT, "max_tokens": 1, **extra})
        assert status == 200, body
        usage.append(json.loads(body)["usage"]["prompt_tokens"])
    assert usage[0] == usage[1]


def test_chat_continues_the_final_message_without_a_generation_prompt(stack):
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2,"}]
    for extra in ({"tool_choice": "none"}, {"continue_final_message": True, "add_generation_prompt": False}):
        got = http("POST", stack.base_url + "/v1/chat/completions",
                   {"model": MODEL, "messages": messages, "max_tokens": 2, **extra})
        assert got[0] == 200, got


@pytest.mark.parametrize("path, extra, field", [
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": CHAT, "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    # vLLM's extras that would change the output: refused, not dropped
    ("/v1/completions", {"prompt": "The capital of France is", "bad_words": [" Paris"]}, "bad_words"),
    ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [28, 29]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a b c d e f", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
])
def test_unsupported_options_are_refused_not_ignored(stack, path, extra, field):
    error = _error(http("POST", stack.base_url + path, {"model": MODEL, "max_tokens": 2, **extra}), 400)
    assert error["param"] == field and "not supported" in error["message"], error


def test_stream_options_without_stream(stack):
    error = _error(http("POST", stack.base_url + "/v1/chat/completions",
                        {"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}}), 400)
    assert error["param"] == "stream_options"


def test_unknown_tenant_is_404(stack):
    error = _error(http("GET", stack.base_url + "/v1/models", headers={"X-Tenant-ID": "nobody"}), 404)
    assert "Tenant not found" in error["message"]


def test_unknown_url_and_wrong_method(stack):
    _error(http("GET", stack.base_url + "/v1/nothing-here"), 404)
    _error(http("GET", stack.base_url + "/v1/chat/completions"), 405)


def test_priority_needs_the_priority_policy(stack):
    error = _error(http("POST", stack.base_url + "/v1/chat/completions",
                        {"model": MODEL, "messages": CHAT, "priority": 5}), 400)
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    error = _error(http("POST", stack.base_url + "/v1/chat/completions",
                        {"model": MODEL, "messages": CHAT, "priority": "high"}), 400)
    assert error["param"] == "priority"
    # streamed too: a 400 before the stream starts (it was a 200 with an SSE error event)
    error = _error(http("POST", stack.base_url + "/v1/completions",
                        {"model": MODEL, "prompt": "Hi", "priority": -1, "stream": True}), 400)
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


@pytest.fixture(scope="module")
def side_web(stack, tmp_path_factory):
    """Extra Daphne processes on the shared Redis: a served name no worker serves, a
    tokenizer without chat template, and an API key."""
    from inference.model_loader import resolve_model

    tokenizer_dir = tmp_path_factory.mktemp("no-template")
    for f in resolve_model(MODEL).tokenizer_dir.iterdir():
        if f.is_file() and f.name != "chat_template.jinja" and not f.name.endswith(".safetensors"):
            shutil.copy(f, tokenizer_dir / f.name)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    stacks = {
        "orphan": Stack(tmp_path_factory.mktemp("orphan"), 0, redis_url=stack.redis_url,
                        TESSERA_SERVED_MODEL_NAME="orphan-model"),
        "no_template": Stack(tmp_path_factory.mktemp("no-template-web"), 0, redis_url=stack.redis_url,
                             TESSERA_TOKENIZER=str(tokenizer_dir)),
        "keyed": Stack(tmp_path_factory.mktemp("keyed"), 0, redis_url=stack.redis_url, TESSERA_API_KEY="s3cret"),
    }
    yield stacks
    for s in stacks.values():
        s.stop()


def test_no_live_worker_is_503(side_web):
    s = side_web["orphan"]
    error = _error(http("POST", s.base_url + "/v1/chat/completions", {"model": "orphan-model", "messages": CHAT}), 503)
    assert "orphan-model" in error["message"]


def test_chat_without_template_names_the_option(side_web):
    s = side_web["no_template"]
    error = _error(http("POST", s.base_url + "/v1/chat/completions", {"model": MODEL, "messages": CHAT}), 400)
    assert "--chat-template" in error["message"]


def test_api_key(side_web):
    s = side_web["keyed"]
    error = _error(http("GET", s.base_url + "/v1/models"), 401)
    assert error["code"] == "invalid_api_key"
    status, _, body = http("GET", s.base_url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


def test_whole_number_floats_count_as_integers_as_in_vllm(stack):
    status, _, body = http("POST", stack.base_url + "/v1/completions",
                           {"model": MODEL, "prompt": "hi", "max_tokens": 2.0, "n": 2.0, "seed": 1.0})
    assert status == 200, body
    choices = json.loads(body)["choices"]
    assert len(choices) == 2 and all(c["finish_reason"] == "length" for c in choices)
    error = _error(http("POST", stack.base_url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}),
                   400)
    assert error["param"] == "max_tokens"


def test_an_unknown_model_of_20000_characters_is_quoted_briefly(stack):
    body = {"model": "m" * 20000, "prompt": "Hi", "max_tokens": 1}
    error = _error(http("POST", stack.base_url + "/v1/completions", body), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found" and len(error["message"]) < 400
