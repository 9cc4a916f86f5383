"""One chat or completions call end to end: admit, enqueue, then stream or collect.

The view has parsed the body and tokenized the prompts; this module checks them against
the live workers' context length, puts them on the model's queue and turns the workers'
delta messages into OpenAI chunks (``stream``) or one response object (``collect``).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from redis.exceptions import RedisError

from inference.errors import InvalidRequestError
from inference.validation import validate_priority, validate_prompt, validate_token_ids
from tenants.metering import Meter, error_kind

from webapp.env import ENV
from webapp.serving.client import EngineRequestSpec, GenerationStream, ServerStopping, WorkerLost
from webapp.serving.web_redis import model_workers

from . import formatting
from .adapters import Adapter
from .errors import APIError, no_worker, queue_unreachable, unavailable
from .protocol import GenerationOptions
from .tools import ToolExtractor, merge_call_deltas, tool_call_delta_json, tool_call_json


@dataclass
class Prompt:
    """One tokenized prompt; ``text`` is used for ``echo``, and ``first_token`` (the first token's UTF-8 bytes,
    given for a prompt of token ids, whose text may not hold its tokens' bytes) for ``echo`` with ``logprobs``."""

    token_ids: list[int]
    text: str = ""
    first_token: bytes | None = None


@dataclass
class ChoiceState:
    """What one choice has produced so far.

    ``pending_ids`` and ``pending_logprobs`` hold the tokens not sent yet when streaming,
    and all tokens when collecting.
    """

    index: int
    prompt_index: int
    text: str = ""
    num_tokens: int = 0
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tools: ToolExtractor | None = None  # chat with tools: splits the output into content and calls
    made_calls: bool = False  # streamed tool calls already


class Generation:
    """A chat (``chat=True``) or completions call over one or more prompts.

    Choice ``i`` of prompt ``p`` has index ``p * n + i``, as in OpenAI's API. With a ``meter``
    the call is admitted against its tenant's limits before anything is enqueued, runs on
    the tenant's GPU share, and its actual tokens are accounted when it ends.
    """

    def __init__(self, chat: bool, model: str, options: GenerationOptions, prompts: list[Prompt],
                 meter: Meter | None = None, vocab_size: int | None = None, lora: Adapter | None = None) -> None:
        """``vocab_size``: the tokenizer's, against which ``logit_bias`` and ``stop_token_ids`` are checked here,
        so that a streamed request gets its 400 too rather than an error event after a 200. ``lora``: the LoRA
        adapter the call runs with on ``model`` (its base model); the responses and the usage name the adapter.

        Raises:
            APIError: 400 naming a sampling parameter out of range (before any per-choice
                state is built, so a huge ``n`` costs nothing).
        """
        self.chat = chat
        self.meter = meter
        self.model = model
        self.lora = lora
        self.model_name = lora.name if lora is not None else model  # what the client called
        self.options = options
        self.prompts = prompts
        self.base_params = options.sampling_params()  # validates every field once
        if vocab_size is not None:
            try:
                validate_token_ids(self.base_params, vocab_size)
            except InvalidRequestError as error:
                raise options.api_error(error) from None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = options.sampling["n"]
        self.top_n = options.sampling.get("logprobs") or 0
        self.want_logprobs = options.sampling.get("logprobs") is not None
        tool_choice = options.tool_choice if chat else None
        self.choices = {p * self.n + i: ChoiceState(p * self.n + i, p,
                                                    tools=tool_choice.extractor() if tool_choice else None)
                        for p in range(len(prompts)) for i in range(self.n)}
        self._cached_tokens: dict[int, int] = {}  # prompt index -> its prompt tokens from the prefix cache
        self.stream: GenerationStream | None = None
        self._prompts_run: set[int] = set()  # prompts the engine has produced something for
        self._prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt logprobs (wire format)

    async def submit(self) -> None:
        """Check every prompt against a live worker's context and enqueue it.

        Raises:
            APIError: 503 when no worker serves the model; 400 when a prompt and its
                ``max_tokens`` do not fit the context, or a parameter is out of range.
            TenantError: 429 when the tenant is over a limit.
        """
        workers = await model_workers(self.model, stale=0)
        if not workers:
            raise no_worker(self.model)
        max_model_len = min(int(w["max_model_len"]) for w in workers)
        if self.lora is not None and not any(w.get("lora") for w in workers):  # a 400 before a stream starts
            raise APIError(f"The model '{self.lora.name}' is a LoRA adapter of '{self.model}', whose workers serve "
                           "no adapters (start them with --enable-lora).", 400, param="model")
        if all(w.get("scheduling_policy") == "fcfs" for w in workers):  # a 400 before a stream starts
            try:
                validate_priority(self.options.priority, "fcfs")
            except InvalidRequestError as error:
                raise self.options.api_error(error) from None
        specs = []
        for p, prompt in enumerate(self.prompts):
            try:
                max_tokens = validate_prompt(prompt.token_ids, self.base_params, max_model_len)
            except InvalidRequestError as error:
                raise self.options.api_error(error) from None
            params = self.base_params.clone(max_tokens=max_tokens)  # valid: validate_prompt checked max_tokens
            specs.append(EngineRequestSpec(f"{self.id}-{p}", prompt.token_ids, params, self._tenant_slug,
                                           self.options.priority, self._cache_salt,
                                           self.lora.name if self.lora else None, self.lora.path if self.lora else None))
        if self.meter is not None:
            cap = await self.meter.admit(self.id, self.model_name, sum(len(p.token_ids) for p in self.prompts),
                                         self.n * sum(spec.params.max_tokens for spec in specs),
                                         self.n * len(specs))
            if cap is not None:  # what is left of the tenant's daily budget (at least 1 token)
                specs = [replace(spec, params=spec.params.clone(max_tokens=min(spec.params.max_tokens, cap),
                                                                min_tokens=min(spec.params.min_tokens, cap)))
                         for spec in specs]
        self.stream = GenerationStream(self.model, specs)
        await self.stream.start()

    # ---- non-streaming -------------------------------------------------------------
    async def collect(self) -> dict[str, Any]:
        """Wait for every choice and return the response object (usage included).

        Raises:
            APIError: the worker's error (400), or 503 when the worker was lost or the server stops.
        """
        try:
            async for message in self.stream:
                if message["type"] == "error":
                    self._end(error_kind(message["status"]))
                    raise APIError(message["message"], message["status"], param=message.get("param"))
                for _ in self._apply(message):
                    pass
        except (WorkerLost, ServerStopping) as error:
            self._end("unavailable")
            await asyncio.shield(self.stream.abort())
            raise unavailable(str(error)) from None
        except BaseException as error:  # the engine requests are aborted when the task ends
            self._end(_kind_of(error))
            raise
        self._end(None)
        choices = [self._full_choice(c) for c in self.choices.values()]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices, "usage": self._usage()}

    def _full_choice(self, c: ChoiceState) -> dict[str, Any]:
        prompt = self.prompts[c.prompt_index]
        text = (prompt.text if self.options.echo else "") + c.text
        prompt_logprobs = self._prompt_logprobs.get(c.prompt_index)
        extra = {}
        if self.options.sampling.get("prompt_logprobs") is not None and not self.options.echo_logprobs:
            extra["prompt_logprobs"] = formatting.vllm_prompt_logprobs(prompt_logprobs)
        if self.chat:
            logprobs = formatting.chat_logprobs(c.pending_logprobs, c.pending_ids, self.top_n) if self.want_logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = c.finish_reason
            if c.tools is not None:
                extracted = c.tools.result(text)
                if extracted.tool_calls:
                    message = {"role": "assistant", "content": extracted.content,
                               "tool_calls": [tool_call_json(call) for call in extracted.tool_calls]}
                finish_reason = c.tools.finish_reason(finish_reason, bool(extracted.tool_calls))
            return {"index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason, **extra}
        if self.options.echo_logprobs:
            logprobs = formatting.echo_logprobs(prompt_logprobs, prompt.token_ids, prompt.text, c.pending_logprobs,
                                                c.pending_ids, self.top_n, prompt.first_token)
        else:
            logprobs = (formatting.completion_logprobs(c.pending_logprobs, c.pending_ids, self.top_n, 0)
                        if self.want_logprobs else None)
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, **extra}

    # ---- streaming -----------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        """Server-sent events: chunks, an optional usage chunk, then ``[DONE]``.

        A worker error, a lost worker or the server shutting down becomes an ``{"error": ...}``
        event (followed by ``[DONE]`` as always). If the client disconnects (Django cancels
        the task), the engine requests are aborted (see :meth:`GenerationStream.start`).
        """
        last: list[bytes] = []  # sent together with [DONE]
        try:  # the events of one worker message go out in one write
            if self.chat:
                yield b"".join(formatting.sse(self._chunk(c, {"role": "assistant", "content": ""}, None))
                               for c in self.choices.values())
            elif self.options.echo:
                yield b"".join(formatting.sse(self._chunk(c, self.prompts[c.prompt_index].text, None))
                               for c in self.choices.values())
            async for message in self.stream:
                if message["type"] == "error":
                    self._end(error_kind(message["status"]))
                    await self.stream.abort()
                    last.append(formatting.sse(APIError(message["message"], message["status"],
                                                        param=message.get("param")).body()))
                    break
                events = [formatting.sse(chunk) for c, new_text in self._apply(message)
                          if (chunk := self._delta_chunk(c, new_text)) is not None]
                if events:
                    yield b"".join(events)
            else:
                self._end(None)
                if self.options.include_usage:
                    last.append(formatting.sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                                                "model": self.model_name, "choices": [], "usage": self._usage()}))
        except (WorkerLost, ServerStopping, RedisError) as error:
            self._end("unavailable")
            if isinstance(error, ServerStopping):  # abort now: the event loop ends soon after
                await asyncio.shield(self.stream.abort())
            failure = queue_unreachable() if isinstance(error, RedisError) else unavailable(str(error))
            last.append(formatting.sse(failure.body()))
        except BaseException as error:  # client gone (CancelledError) or a bug; aborted when the task ends
            self._end(_kind_of(error))
            raise
        yield b"".join([*last, formatting.sse("[DONE]")])

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, c: ChoiceState, delta: Any, logprobs: dict | None, finish_reason: str | None = None,
               stop_reason: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": c.index}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk = {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model_name,
                 "choices": [choice]}
        if self.options.include_usage:
            chunk["usage"] = self._choice_usage(c) if self.options.continuous_usage else None
        return chunk

    def _delta_chunk(self, c: ChoiceState, new_text: str) -> dict[str, Any] | None:
        """The chunk for what ``c`` produced since the last chunk (None if nothing to send:
        text held back by the detokenizer waits, with its log-probabilities, for the next)."""
        delta: Any = {"content": new_text} if self.chat else new_text
        finish_reason = c.finish_reason
        if c.tools is not None:
            delta, finish_reason = self._tool_delta(c, new_text)
            if not delta and c.finish_reason is None:
                return None
        elif not new_text and c.finish_reason is None:
            return None
        logprobs = None
        if self.want_logprobs:
            if self.chat:
                logprobs = formatting.chat_logprobs(c.pending_logprobs, c.pending_ids, self.top_n)
            else:
                logprobs = formatting.completion_logprobs(c.pending_logprobs, c.pending_ids, self.top_n,
                                                          len(c.text) - len(new_text))
        c.pending_ids, c.pending_logprobs = [], []
        if self.chat and not delta.get("content") and "tool_calls" not in delta:
            delta = {}
        return self._chunk(c, delta, logprobs, finish_reason, c.stop_reason)

    @staticmethod
    def _tool_delta(c: ChoiceState, new_text: str) -> tuple[dict[str, Any], str | None]:
        """Chat with tools: the delta of ``new_text`` (content outside the tool-call markup, and
        ``tool_calls`` entries) and the finish reason as the client sees it."""
        content, calls = c.tools.feed(new_text) if new_text else ("", [])
        if c.finish_reason is not None:
            rest, more = c.tools.finish()
            content, calls = content + rest, calls + more
        c.made_calls = c.made_calls or bool(calls)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [tool_call_delta_json(d) for d in merge_call_deltas(calls)]
        return delta, c.tools.finish_reason(c.finish_reason, c.made_calls)

    # ---- shared --------------------------------------------------------------------
    @property
    def _tenant_slug(self) -> str | None:
        return self.meter.caller.tenant.slug if self.meter is not None else None

    @property
    def _cache_salt(self) -> str | None:
        """Each tenant's prompts are cached under its own salt, so that no tenant can hit (or time)
        another's cached prefixes; ``TESSERA_SHARE_PREFIX_CACHE=1`` shares them (trusted deployments)."""
        if ENV.share_prefix_cache or self._tenant_slug is None:
            return None
        return f"tenant:{self._tenant_slug}"

    def _end(self, error: str | None) -> None:
        """Account the call with its tenant: the prompts that ran and the tokens generated; for a client that
        left, also what the engines computed that it never saw (counted once they dropped its requests)."""
        if self.meter is None:
            return
        prompt_tokens = sum(len(self.prompts[p].token_ids) for p in self._prompts_run)
        completion_tokens = sum(c.num_tokens for c in self.choices.values())
        reasons = [c.finish_reason for c in self.choices.values()]
        stream = self.stream
        if error == "aborted" and stream is not None and stream.left_behind is not None and not stream.finished:
            self.meter.finish_later(prompt_tokens, completion_tokens, error, reasons, stream.left_behind)
        else:
            self.meter.finish(prompt_tokens, completion_tokens, error, reasons)

    def _apply(self, message: dict[str, Any]):
        """Fold a delta message into the choices; yields ``(choice, new_text)`` per output."""
        prompt_index = int(message["rid"].rsplit("-", 1)[1])
        self._prompts_run.add(prompt_index)
        if message.get("prompt_logprobs") is not None:
            self._prompt_logprobs[prompt_index] = message["prompt_logprobs"]
        self._cached_tokens[prompt_index] = message.get("num_cached_tokens", 0)  # the last message's is final
        for out in message["outputs"]:
            c = self.choices[prompt_index * self.n + out["index"]]
            if self.options.echo_only:  # the one token the engine ran is not the client's
                out = dict(out, text="", token_ids=[], logprobs=None,
                           finish_reason="length" if out["finish_reason"] is not None else None, stop_reason=None)
            c.text += out["text"]
            c.num_tokens += len(out["token_ids"])
            c.pending_ids.extend(out["token_ids"])
            if out["logprobs"] is not None:
                c.pending_logprobs.extend(out["logprobs"])
            if out["finish_reason"] is not None:
                c.finish_reason, c.stop_reason = out["finish_reason"], out["stop_reason"]
            yield c, out["text"]

    def _usage(self) -> dict[str, Any]:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices.values())
        return formatting.usage(prompt_tokens, completion_tokens, sum(self._cached_tokens.values()))

    def _choice_usage(self, c: ChoiceState) -> dict[str, Any]:
        """Usage so far of one choice (its prompt's tokens and its own), for ``continuous_usage_stats``
        chunks, as vLLM counts them."""
        return formatting.usage(len(self.prompts[c.prompt_index].token_ids), c.num_tokens,
                                self._cached_tokens.get(c.prompt_index, 0))


def _kind_of(error: BaseException) -> str:
    """Usage error kind of an exception that ended a call: the client left, or a bug."""
    return "internal" if isinstance(error, Exception) else "aborted"
