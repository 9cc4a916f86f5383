"""Parse and type-check OpenAI request bodies into engine sampling parameters.

Field names and meanings follow OpenAI's API; vLLM's extra sampling fields are accepted
too. Every type error is a 400 naming the field (``param``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from inference.errors import InvalidRequestError
from inference.sampling_params import MAX_N, SamplingParams
from inference.validation import normalize_chat_messages

from .errors import APIError, bad_request
from .structured import parse_structured_outputs
from .tools import ToolChoice, parse_tool_choice

_MISSING = object()
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default)
# Answers one completions request may ask for (prompts x n): each is tokenized and tracked by the web process
# that serves it, so a body of 50,000 one-letter prompts with n=128 held a process for 30 s (3 GB).
MAX_COMPLETION_CHOICES = 4096
_TOKEN_ID_KEY = re.compile("-?[0-9]{1,18}")  # no vocabulary is near 10**18 tokens
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs the valid ones into one character


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        APIError: 400 when the body is not JSON or not an object.
    """
    try:  # UTF-8 only, as JSON over HTTP is (json.loads would also take UTF-16 and UTF-32 bytes)
        body = json.loads((raw or b"").decode("utf-8-sig", "surrogatepass"))
    except (ValueError, UnicodeDecodeError) as error:
        raise bad_request(f"The request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("The request body nests JSON arrays or objects too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    # Only an escape, or the bytes of a surrogate (ED A0-BF ..; json.loads decodes bytes with
    # "surrogatepass"), can make a lone surrogate: valid UTF-8 never holds one.
    if b"\\u" in (raw or b"") or b"\xed" in (raw or b""):
        _reject_lone_surrogates(body)
    return body


def _surrogate_path(value: Any, path: str) -> str | None:
    """Where in ``value`` a string (or object key) holds a lone UTF-16 surrogate, e.g. ``messages[0].content``."""
    if isinstance(value, str):
        return path if _LONE_SURROGATE.search(value) else None
    if isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _surrogate_path(v, f"{path}[{i}]"))), None)
    if isinstance(value, dict):
        for key, v in value.items():
            where = f"{path}.{key}" if path else key
            found = _surrogate_path(key, where) or _surrogate_path(v, where)
            if found is not None:
                return found
    return None


def _reject_lone_surrogates(body: dict[str, Any]) -> None:
    """Raises APIError (400, ``param``: the top-level field) when a string holds a lone surrogate
    (``"\\ud800"``): JSON allows the escape, but it is no Unicode character and cannot be tokenized."""
    where = _surrogate_path(body, "")
    if where is not None:
        where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate itself
        field_name = where.split(".", 1)[0].split("[", 1)[0]
        raise bad_request(f"'{where}' contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not "
                          "a Unicode character; send valid text (surrogates only as pairs).", param=field_name)


# vLLM's guided-decoding request fields (and its newer structured_outputs object)

class Body:
    """Typed access to a JSON object's fields: ``get("n", int, 1)``."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """The value of ``name`` if it has type ``kind`` (``None`` gives ``default``).

        Integers count as numbers; booleans count only as booleans; a whole-number float (``2.0``) counts as
        an integer, as vLLM's request models take it.
        """
        value = self.data.get(name, None)
        if value is None:
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = any(isinstance(value, k) and not (isinstance(value, bool) and k is not bool) for k in kinds)
        if not ok and float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok and int in kinds and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok:
            expected = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise bad_request(f"'{self.prefix}{name}' must be {expected}, got {json.dumps(value)[:80]}.",
                              param=self.prefix + name)
        if kinds != (float,):
            return value
        try:
            return float(value)
        except OverflowError:  # a JSON integer beyond a double's range (10**400)
            raise bad_request(f"'{self.prefix}{name}' must be a finite number, got {json.dumps(value)[:80]}.",
                              param=self.prefix + name) from None


def _stop_list(body: Body) -> list[str]:
    stop = body.get("stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or an array of strings.", param="stop")
    return stop


def _is_token_ids(value: Any) -> bool:
    """A non-empty JSON array of integers (booleans are not token ids)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _int_list(body: Body, name: str) -> list[int]:
    values = body.get(name, list, [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise bad_request(f"'{name}' must be an array of integers.", param=name)
    return values


def _logit_bias(body: Body) -> dict[int, float] | None:
    bias = body.get("logit_bias", dict, None)
    if not bias:
        return None
    # JSON object keys are strings: token ids written in ASCII digits ("5_000", " 7" or Arabic-Indic digits are
    # not token ids, though int() takes them); values are JSON numbers (not "7" or true).
    if not all(_TOKEN_ID_KEY.fullmatch(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
               for k, v in bias.items()):
        raise bad_request("'logit_bias' must map token ids (strings of digits) to numbers.", param="logit_bias")
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except OverflowError:  # a JSON integer beyond a double; SamplingParams refuses values outside [-100, 100]
        raise bad_request("'logit_bias' values must be numbers in [-100, 100].", param="logit_bias") from None


@dataclass
class GenerationOptions:
    """What a chat or completions body asks for, besides the prompt.

    Attributes:
        model: the requested model name ("" for the default).
        stream: answer with server-sent events.
        include_usage: add a final usage chunk to the stream.
        continuous_usage: with ``include_usage``, every chunk carries the usage so far too
            (vLLM's ``stream_options.continuous_usage_stats``).
        sampling: keyword arguments of ``SamplingParams`` (``max_tokens`` None = fill the context).
        echo: completions only: prepend the prompt to the output.
        echo_logprobs: completions only, with ``echo`` and ``logprobs``: the prompt's tokens lead the
            legacy ``logprobs`` arrays (the first with ``null`` logprobs), as vLLM and OpenAI do.
        echo_only: completions only, ``echo`` with ``max_tokens: 0``: answer the prompt (and its
            logprobs) alone, no generated token; the engine runs one token, which is dropped.
        priority: vLLM's scheduling priority (lower runs earlier); the engine refuses values other
            than 0 unless it runs the ``priority`` scheduling policy.
        tool_choice: chat only: the request's tools and how they may be called (:mod:`.tools`).
    """

    model: str
    stream: bool
    include_usage: bool
    sampling: dict[str, Any] = field(default_factory=dict)
    echo: bool = False
    echo_logprobs: bool = False
    echo_only: bool = False
    continuous_usage: bool = False
    priority: int = 0
    tool_choice: ToolChoice | None = None
    # engine parameter name -> the body field the client sent it as (for error messages)
    field_names: dict[str, str] = field(default_factory=dict)

    def sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        """Build (and so validate) the sampling parameters.

        Raises:
            APIError: 400 naming the parameter out of range.
        """
        values = dict(self.sampling)
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        try:
            return SamplingParams(**values)
        except InvalidRequestError as error:
            raise self.api_error(error) from None

    def api_error(self, error: InvalidRequestError) -> APIError:
        """The engine's error as a 400, naming the body field the client sent (``max_completion_tokens``
        rather than ``max_tokens``, say)."""
        sent_as = self.field_names.get(error.param or "")
        if sent_as == "messages":  # chat: "The prompt has N tokens" stays true of the rendered conversation
            error = InvalidRequestError(str(error), param=sent_as)
        elif sent_as:
            error = InvalidRequestError(str(error).replace(error.param, sent_as), param=sent_as)
        return APIError.from_engine(error)


# vLLM's extra fields that change the output and that Tessera does not apply yet, with what they would have done.
_UNAPPLIED_EXTRAS = {
    "bad_words": "the output would not avoid these words",
    "allowed_token_ids": "the output would not be limited to these token ids",
    "truncate_prompt_tokens": "the prompt would not be cut to its last tokens",
    "logits_processors": "these processors would not run",
}


def parse_common(body: Body, chat: bool) -> GenerationOptions:
    """Fields shared by chat and completions: streaming, sampling, vLLM's extras.

    Raises:
        APIError: 400 for a wrong type, a field without its prerequisite, or a feature
            that is not supported yet.
    """
    stream = body.get("stream", bool, False)
    stream_options = body.get("stream_options", dict, None)
    body.get("user", str, None)  # OpenAI's end-user id: accepted and not used, but a string
    if stream_options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    stream_options = Body(stream_options or {}, "stream_options.")
    include_usage = bool(stream_options.get("include_usage", bool, False))
    continuous_usage = include_usage and bool(stream_options.get("continuous_usage_stats", bool, False))
    max_tokens = body.get("max_tokens", int, None)
    field_names = {}
    if chat and body.get("max_completion_tokens", int, None) is not None:
        max_tokens = body.get("max_completion_tokens", int, None)
        field_names["max_tokens"] = "max_completion_tokens"
    if not chat and body.data.get("tools") and body.data.get("tool_choice") != "none":
        raise bad_request("'tools' (tool calling) is for /v1/chat/completions.", param="tools")
    if body.get("use_beam_search", bool, False):  # vLLM's extra: refused, not sampled instead
        raise bad_request("'use_beam_search' (beam search) is not supported yet.", param="use_beam_search")
    if chat and body.get("echo", bool, False):  # vLLM's chat extra (prepend the last message)
        raise bad_request("'echo' is not supported on chat completions yet.", param="echo")
    for name, effect in _UNAPPLIED_EXTRAS.items():  # refused, not silently ignored: the output would differ
        if body.data.get(name) not in (None, []):
            raise bad_request(f"'{name}' is not supported yet: {effect}.", param=name)
    structured, structured_fields = parse_structured_outputs(body.data)
    field_names.update(structured_fields)
    sampling = {
        "n": body.get("n", int, 1),
        "best_of": body.get("best_of", int, None),  # SamplingParams refuses one other than n
        "temperature": body.get("temperature", float, 1.0),
        "top_p": body.get("top_p", float, 1.0),
        "top_k": body.get("top_k", int, -1),
        "min_p": body.get("min_p", float, 0.0),
        "presence_penalty": body.get("presence_penalty", float, 0.0),
        "frequency_penalty": body.get("frequency_penalty", float, 0.0),
        "repetition_penalty": body.get("repetition_penalty", float, 1.0),
        "seed": body.get("seed", int, None),
        "logit_bias": _logit_bias(body),
        "stop": _stop_list(body),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "include_stop_str_in_output": body.get("include_stop_str_in_output", bool, False),
        "ignore_eos": body.get("ignore_eos", bool, False),
        "min_tokens": body.get("min_tokens", int, 0),
        "max_tokens": max_tokens,
        "skip_special_tokens": body.get("skip_special_tokens", bool, True),
        "spaces_between_special_tokens": body.get("spaces_between_special_tokens", bool, True),
        "prompt_logprobs": body.get("prompt_logprobs", int, None),  # vLLM's extra
    }
    if structured is not None:
        sampling["structured_outputs"] = structured
    if sampling["prompt_logprobs"] is not None and stream:
        raise bad_request("'prompt_logprobs' with 'stream' is not supported yet.", param="prompt_logprobs")
    if sampling["top_k"] == 0:
        sampling["top_k"] = -1
    return GenerationOptions(model=body.get("model", str, ""), stream=stream, include_usage=include_usage,
                             continuous_usage=continuous_usage, sampling=sampling,
                             priority=body.get("priority", int, 0), field_names=field_names)


def parse_chat(body: Body) -> tuple[GenerationOptions, list[dict[str, Any]], dict[str, Any]]:
    """A chat completions body: options, messages, chat-template options.

    Raises:
        APIError: 400 for malformed messages or fields.
    """
    options = parse_common(body, chat=True)
    messages = body.get("messages", list, None)
    if not messages:
        raise bad_request("'messages' is required and must be a non-empty array.", param="messages")
    try:
        messages = normalize_chat_messages(messages)
    except InvalidRequestError as error:
        raise APIError.from_engine(error) from None
    logprobs = body.get("logprobs", bool, False)
    top_logprobs = body.get("top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    options.sampling["logprobs"] = (top_logprobs or 0) if logprobs else None
    if top_logprobs is not None:
        options.field_names["logprobs"] = "top_logprobs"
    options.field_names["prompt"] = "messages"  # the prompt is the rendered conversation
    if body.data.get("chat_template") is not None:  # as vLLM without --trust-request-chat-template
        raise bad_request("'chat_template' in a request is not accepted: the server renders the model's chat "
                          "template (start it with --chat-template to use another).", param="chat_template")
    _apply_tool_choice(options, body)
    template = {
        "add_generation_prompt": body.get("add_generation_prompt", bool, True),
        "continue_final_message": body.get("continue_final_message", bool, False),
        "chat_template_kwargs": body.get("chat_template_kwargs", dict, None),
        "tools": options.tool_choice.template_tools if options.tool_choice else None,
    }
    if template["add_generation_prompt"] and template["continue_final_message"]:  # as vLLM
        raise bad_request("Cannot set both 'continue_final_message' and 'add_generation_prompt' to true: "
                          "send 'add_generation_prompt': false to continue the final message.",
                          param="continue_final_message")
    return options, messages, template


def _apply_tool_choice(options: GenerationOptions, body: Body) -> None:
    """Chat's ``tools`` / ``tool_choice``: kept on ``options``; ``required`` and a named function
    constrain the output (structured output), so they exclude ``response_format`` and its kin.

    Raises:
        APIError: 400 from :func:`.tools.parse_tool_choice`, or a constrained tool choice together
            with another form of structured output.
    """
    from django.conf import settings  # noqa: PLC0415 - the server's --tool-call-parser

    config = settings.TESSERA
    options.tool_choice = parse_tool_choice(body.data, config.get("TOOL_CALL_PARSER"),
                                            bool(config.get("ENABLE_AUTO_TOOL_CHOICE")))
    constraint = options.tool_choice.structured_outputs() if options.tool_choice else None
    if constraint is None:
        return
    if "structured_outputs" in options.sampling:
        raise bad_request(f"'tool_choice' {options.tool_choice.mode!r} constrains the output already; send it "
                          f"without {options.field_names['structured_outputs']!r}.", param="tool_choice")
    options.sampling["structured_outputs"] = constraint
    options.field_names.update({"structured_outputs": "tool_choice", "structured_outputs.json": "tools"})


def parse_completion(body: Body) -> tuple[GenerationOptions, list[str | list[int]]]:
    """A (legacy) completions body: options and the prompts (texts or token id lists).

    Raises:
        APIError: 400 for a missing or malformed prompt or field.
    """
    options = parse_common(body, chat=False)
    if "max_tokens" not in body.data:  # absent: OpenAI's and vLLM's default; null: fill the context
        options.sampling["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    prompt = body.data.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                 or all(_is_token_ids(p) for p in prompt)):
        prompts = list(prompt)  # texts, or token id arrays: not a mix (as OpenAI's and vLLM's schemas)
    else:
        raise bad_request("'prompt' must be a string, an array of strings, an array of token ids, "
                          "or an array of token id arrays.", param="prompt")
    n = options.sampling["n"]
    if 1 <= n <= MAX_N and len(prompts) * n > MAX_COMPLETION_CHOICES:  # SamplingParams names n's own limit
        raise bad_request(f"The request asks for {len(prompts)} prompts x n={n} = {len(prompts) * n} answers, more "
                          f"than the {MAX_COMPLETION_CHOICES} one request may ask for (prompts x n); split the batch.",
                          param="prompt" if len(prompts) > MAX_COMPLETION_CHOICES else "n")
    if body.get("suffix", str, None):
        raise bad_request("'suffix' is not supported.", param="suffix")
    options.sampling["logprobs"] = body.get("logprobs", int, None)
    options.echo = body.get("echo", bool, False)
    if options.echo and options.sampling["max_tokens"] == 0:
        _echo_only(options)
    if options.echo and options.sampling["logprobs"] is not None:  # the prompt's logprobs come first
        if options.stream:
            raise bad_request("'echo' with 'logprobs' and 'stream' is not supported yet.", param="echo")
        options.echo_logprobs = True
        options.sampling["prompt_logprobs"] = max(options.sampling["logprobs"],
                                                  options.sampling["prompt_logprobs"] or 0)
    return options, prompts


def _echo_only(options: GenerationOptions) -> None:
    """``echo`` with ``max_tokens: 0`` (vLLM allows it, for scoring a text): the prompt alone.

    Raises:
        APIError: 400 naming ``min_tokens`` when it asks for generated tokens all the same.
    """
    if options.sampling["min_tokens"] > 0:
        raise bad_request(f"'min_tokens' ({options.sampling['min_tokens']}) must be 0 with 'echo' and "
                          "'max_tokens' 0: no token is generated.", param="min_tokens")
    options.echo_only = True
    options.sampling["max_tokens"] = 1  # the engine runs at least one token; it is not returned
