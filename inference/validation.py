"""Request checks shared by the engine and the API layer (which checks before enqueueing)."""
from __future__ import annotations

import numbers

from .errors import InvalidRequestError
from .sampling_params import SamplingParams, shown


def validate_text(text: str, param: str) -> None:
    """Refuse text a tokenizer cannot take: a lone UTF-16 surrogate (``"\\ud800"``) is not UTF-8.

    Raises:
        InvalidRequestError (param ``param``): naming the position of the first one.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(f"{param} holds a lone UTF-16 surrogate at character {error.start}; it is not "
                                  "valid Unicode text.", param=param) from None


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                    vocab_size: int | None = None) -> int:
    """Check a tokenized prompt against the context limit and return its ``max_tokens``.

    When ``params.max_tokens`` is None the request may fill the context:
    ``max_model_len - len(prompt_token_ids)`` tokens.

    Returns:
        The effective max_tokens (int, tokens).
    Raises:
        InvalidRequestError: empty prompt (param ``prompt``), a token id outside the
            vocabulary (``prompt``, ``logit_bias``, ``stop_token_ids``), prompt + max_tokens over ``max_model_len``
            (``max_tokens``, naming both numbers), or, with ``max_tokens`` None, a ``min_tokens`` above what the
            context leaves (``min_tokens``).
    """
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("The prompt is empty; it must contain at least one token.", param="prompt")
    if vocab_size is not None:
        if any(t < 0 or t >= vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"Prompt token ids must be in [0, {vocab_size}).", param="prompt")
        validate_token_ids(params, vocab_size)
    if num_prompt >= max_model_len:
        raise InvalidRequestError(
            f"The prompt has {num_prompt} tokens, but this model's maximum context length is "
            f"{max_model_len} tokens (max_model_len), which must also leave room for at least 1 output token.",
            param="prompt")
    if params.max_tokens is None:
        room = max_model_len - num_prompt
        if params.min_tokens > room:  # SamplingParams checked it against an explicit max_tokens only
            raise InvalidRequestError(f"min_tokens must be at most max_tokens={room} (what the context leaves after "
                                      f"the prompt), got {params.min_tokens}.", param="min_tokens")
        return room
    if num_prompt + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{shown(num_prompt + params.max_tokens)} tokens ({num_prompt} in the prompt, "
            f"{shown(params.max_tokens)} for the completion, max_tokens). Reduce the prompt or max_tokens.",
            param="max_tokens")
    return params.max_tokens


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse ``logit_bias`` keys and ``stop_token_ids`` outside the vocabulary ``[0, vocab_size)``.

    Raises:
        InvalidRequestError (param ``logit_bias`` or ``stop_token_ids``): naming up to 5 of the ids.
    """
    for param, ids in (("logit_bias", list(params.logit_bias or {})), ("stop_token_ids", params.stop_token_ids)):
        wrong = [t for t in ids if not 0 <= t < vocab_size]
        if wrong:
            raise InvalidRequestError(f"{param} token ids must be in [0, {vocab_size}); got "
                                      f"[{', '.join(shown(t) for t in wrong[:5])}].", param=param)


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})  # OpenAI's


def validate_priority(priority: int, scheduling_policy: str) -> None:
    """Refuse a scheduling priority other than 0 unless the engine runs the ``priority`` policy
    (as vLLM does).

    Raises:
        InvalidRequestError (param ``"priority"``): not an integer, or naming the policy to enable.
    """
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer, got {shown(priority)}.", param="priority")
    if priority != 0 and scheduling_policy == "fcfs":
        raise InvalidRequestError(f"Got priority {priority}, but priority scheduling is not enabled "
                                  "(scheduling_policy='priority', --scheduling-policy priority).",
                                  param="priority")


def normalize_chat_messages(messages: list) -> list[dict]:
    """Check a conversation (OpenAI chat messages) and return it with every ``content`` a string: text
    parts joined, and an assistant message's null content (one with tool calls) made empty.

    Raises:
        InvalidRequestError (param ``messages``): not a list of objects with a known ``role`` and a
            string or text-part ``content``, naming the message.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects.",
                                  param="messages")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"'messages[{i}]' must be an object with a 'role'.", param="messages")
        if message["role"] not in CHAT_ROLES:
            raise InvalidRequestError(f"'messages[{i}].role' is {message['role']!r}; expected one of "
                                      f"{', '.join(sorted(CHAT_ROLES))}.", param="messages")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise InvalidRequestError(f"'messages[{i}].name' must be a string.", param="messages")
        content = message.get("content")
        if content is None:  # OpenAI allows it only for an assistant message (one with tool calls)
            if message["role"] != "assistant":
                raise InvalidRequestError(f"'messages[{i}].content' is required for a {message['role']!r} "
                                          "message.", param="messages")
            message = dict(message, content="")
        elif isinstance(content, list):  # content parts: keep the text ones
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(t, str) for t in parts):
                raise InvalidRequestError(f"'messages[{i}].content' may only hold text parts, each with a "
                                          "string 'text'.", param="messages")
            message = dict(message, content="".join(parts))
        elif not isinstance(content, str):
            raise InvalidRequestError(f"'messages[{i}].content' must be a string or an array of parts.",
                                      param="messages")
        normalized.append(message)
    return normalized
