"""The OpenAI-compatible endpoints (and vLLM's tokenize/detokenize, health, version, metrics).

Views only authenticate, admit, translate and stream: parsing is in :mod:`.protocol`,
tokenization in :mod:`.tokenization`, the request's life in :mod:`.generation`.
"""
from __future__ import annotations

import asyncio
import time

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import render

from tenants import counters as tenant_counters
from tenants.identity import Caller
from tenants.metering import Meter
from webapp import metrics as prometheus
from webapp.serving.web_redis import get_redis, model_workers
from webapp.serving.request_queue import queued_counts
from webapp.serving.worker_registry import live_workers, model_totals
from webapp.transport.keys import METRICS_MODELS_KEY
from webapp.version import __version__

from .decorators import api_view
from .errors import APIError, no_worker, not_found, unavailable
from .generation import Generation, Prompt
from .protocol import Body, parse_chat, parse_completion, parse_json_body
from .adapters import Adapter, all_adapters, resolve_model
from .served import live_models
from .tokenization import ServedModel, Tokenizer, cached_tokenizer, get_tokenizer, served_models

_STARTED = int(time.time())


async def _tokenizer(served) -> Tokenizer:
    """The model's tokenizer, loaded off the event loop the first time."""
    return cached_tokenizer(served) or await asyncio.to_thread(get_tokenizer, served)


INLINE_TOKENIZE_CHARS = 4096  # longer texts are tokenized off the event loop, so they never stall other clients


async def _encode(tokenizer: Tokenizer, text: str, max_chars: int | None = None, param: str = "prompt",
                  **kwargs) -> list[int]:
    """Token ids of ``text``; short texts inline (lowest latency), long ones in a worker thread.

    Raises:
        APIError: 400 (``param``) when ``text`` is longer than ``max_chars`` (:func:`_max_chars`).
    """
    _check_chars(len(text), max_chars, param)
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, **kwargs)
    return await asyncio.to_thread(tokenizer.encode, text, **kwargs)


async def _max_chars(served, tokenizer: Tokenizer) -> int | None:
    """The longest text that could fit the context of the model's live workers (None when none is live: the
    request then fails with its 503 after tokenizing, as before)."""
    workers = await model_workers(served.name)
    if not workers:
        return None
    return tokenizer.max_text_chars(min(int(w["max_model_len"]) for w in workers))


def _check_chars(num_chars: int, max_chars: int | None, param: str) -> None:
    if max_chars is not None and num_chars > max_chars:
        verb = "have" if param == "messages" else "has"
        raise APIError(f"The {param} {verb} {num_chars} characters, more than this model's maximum context length "
                       f"(max_model_len) can hold in tokens: at most {max_chars} characters are tokenized.", 400,
                       param=param)


async def _respond(generation: Generation) -> HttpResponse:
    await generation.submit()
    if generation.options.stream:
        response = StreamingHttpResponse(generation.events(), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
    return JsonResponse(await generation.collect())


async def _generation_model(name: str | None, meter: Meter) -> tuple[ServedModel, Adapter | None]:
    """The served model (and LoRA adapter) a generation request names, checked against the caller's tenant.

    Raises:
        APIError: 404 for an unknown model or another tenant's adapter.
        TenantError: 403 when the tenant may not use the (base) model.
    """
    served, lora = await resolve_model(name, meter.caller.tenant)
    meter.use_model(lora.name if lora else served.name, served.name if lora else None)
    return served, lora


@api_view("POST", metered=True)
async def chat_completions(request: HttpRequest, meter: Meter) -> HttpResponse:
    """POST /v1/chat/completions."""
    options, messages, template = parse_chat(Body(parse_json_body(request.body)))
    served, lora = await _generation_model(options.model, meter)
    tokenizer = await _tokenizer(served)
    max_chars = await _max_chars(served, tokenizer)
    _check_chars(sum(len(m["content"]) for m in messages), max_chars, "messages")  # before rendering them
    text = tokenizer.apply_chat_template(messages, **template)
    prompt = Prompt(await _encode(tokenizer, text, max_chars, "messages", add_special_tokens=False), text)
    return await _respond(Generation(True, served.name, options, [prompt], meter, tokenizer.vocab_size, lora))


@api_view("POST", metered=True)
async def completions(request: HttpRequest, meter: Meter) -> HttpResponse:
    """POST /v1/completions (prompt: text, token ids, or a batch of either)."""
    options, prompts = parse_completion(Body(parse_json_body(request.body)))
    served, lora = await _generation_model(options.model, meter)
    tokenizer = await _tokenizer(served)
    max_chars = await _max_chars(served, tokenizer)
    tokenized = []
    for p in prompts:
        if isinstance(p, str):
            tokenized.append(Prompt(await _encode(tokenizer, p, max_chars), p))
        else:
            if any(t < 0 or t >= tokenizer.vocab_size for t in p):
                raise APIError(f"Prompt token ids must be in [0, {tokenizer.vocab_size}).", 400, param="prompt")
            tokenized.append(Prompt(list(p), tokenizer.decode(p), tokenizer.token_bytes(p[0])) if options.echo
                             else Prompt(list(p)))
    return await _respond(Generation(False, served.name, options, tokenized, meter, tokenizer.vocab_size, lora))


def _model_card(name: str, served, workers: list[dict], lora: Adapter | None = None) -> dict:
    """A ``/v1/models`` entry; an adapter's (vLLM's) has its folder as ``root`` and its base model as ``parent``."""
    return {"id": name, "object": "model", "created": int(min(w.get("ready_at") or _STARTED for w in workers)),
            "owned_by": "tessera", "root": lora.path if lora else served.model, "parent": lora.base_model if lora else None,
            "max_model_len": min(w["max_model_len"] for w in workers)}


async def _model_cards(caller: Caller) -> dict[str, dict]:
    """The ``/v1/models`` entries the caller's tenant may use, by id: the live models, then the adapters it may
    see whose base model is live (on a worker serving adapters) and allowed to it."""
    live = await live_models()
    cards = {name: _model_card(name, served, workers) for name, (served, workers) in live.items()
             if caller.tenant.allows_model(name)}
    for adapter in (await all_adapters(live)).values():
        base = live.get(adapter.base_model)
        if (base is not None and adapter.name not in cards and adapter.visible_to(caller.tenant)
                and caller.tenant.allows_model(adapter.base_model) and any(w.get("lora") for w in base[1])):
            cards[adapter.name] = _model_card(adapter.name, *base, lora=adapter)
    return cards


@api_view("GET")
async def list_models(request: HttpRequest, caller: Caller) -> HttpResponse:
    """GET /v1/models: the models live now (a ready worker serves them) and their LoRA adapters that the
    caller's tenant may use; ``created`` is when the first of their workers became ready."""
    return JsonResponse({"object": "list", "data": list((await _model_cards(caller)).values())})


@api_view("GET")
async def retrieve_model(request: HttpRequest, caller: Caller, model: str) -> HttpResponse:
    """GET /v1/models/{model}: one entry of :func:`list_models`, 404 when it is not live (or not
    the tenant's to use)."""
    card = (await _model_cards(caller)).get(model)
    if card is None:
        raise not_found(f"The model '{model[:200]}' does not exist or is not served now.", param="model",
                        code="model_not_found")
    return JsonResponse(card)


async def _tenant_model(caller: Caller, body: Body):
    """The served model ``body`` names (or the default one), refused (403) outside the caller's tenant's."""
    served, _ = await resolve_model(body.get("model", str, ""), caller.tenant)  # an adapter: its base's tokenizer
    caller.check_model(served.name)
    return served


# /tokenize with messages: the chat endpoint's fields that shape the rendered prompt.
_CHAT_TOKENIZE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                         "chat_template", "tools", "tool_choice")


@api_view("POST")
async def tokenize(request: HttpRequest, caller: Caller) -> HttpResponse:
    """POST /tokenize: ``{"prompt"}`` or ``{"messages"}`` -> ``{"count", "max_model_len", "tokens"}``. Keys as on
    ``/v1`` (a key-only server refuses a request without one), and only the tenant's models."""
    body = Body(parse_json_body(request.body))
    served = await _tenant_model(caller, body)
    tokenizer = await _tokenizer(served)
    workers = await model_workers(served.name)
    if not workers:  # its max_model_len is a worker's setting: without one there is no answer to give
        raise no_worker(served.name)
    max_model_len = min(int(w["max_model_len"]) for w in workers)
    max_chars = tokenizer.max_text_chars(max_model_len)
    if "messages" in body.data and "prompt" in body.data:
        raise APIError("Send either 'prompt' or 'messages', not both.", 400, param="messages")
    if "messages" in body.data:
        # The chat endpoint's checks and template options, e.g. tools and continue_final_message as there.
        _, messages, template = parse_chat(Body({k: v for k, v in body.data.items() if k in _CHAT_TOKENIZE_FIELDS}))
        _check_chars(sum(len(m["content"]) for m in messages), max_chars, "messages")
        text = tokenizer.apply_chat_template(messages, **template)
        tokens = await _encode(tokenizer, text, max_chars, "messages",
                               add_special_tokens=body.get("add_special_tokens", bool, False))
    else:
        prompt = body.get("prompt", str, None)
        if prompt is None:
            raise APIError("'prompt' (a string) or 'messages' is required.", 400, param="prompt")
        tokens = await _encode(tokenizer, prompt, max_chars,
                               add_special_tokens=body.get("add_special_tokens", bool, True))
    result = {"count": len(tokens), "max_model_len": max_model_len,
              "tokens": tokens, "token_strs": None}
    if body.get("return_token_strs", bool, False):
        result["token_strs"] = tokenizer.hf.convert_ids_to_tokens(tokens)
    return JsonResponse(result)


@api_view("POST")
async def detokenize(request: HttpRequest, caller: Caller) -> HttpResponse:
    """POST /detokenize: ``{"tokens": [int]}`` -> ``{"prompt": str}``. Keys and models as on ``/v1``."""
    body = Body(parse_json_body(request.body))
    served = await _tenant_model(caller, body)
    tokenizer = await _tokenizer(served)
    tokens = body.get("tokens", list, None)
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError("'tokens' must be an array of integers.", 400, param="tokens")
    if any(t < 0 or t >= tokenizer.vocab_size for t in tokens):
        raise APIError(f"Token ids must be in [0, {tokenizer.vocab_size}).", 400, param="tokens")
    return JsonResponse({"prompt": tokenizer.decode(tokens)})


@api_view("GET", authenticate=False)
async def health(request: HttpRequest, tenant) -> HttpResponse:
    """GET /health: 200 ``{"status": "ok", "num_workers": N}`` when at least one engine worker is
    live, else 503 in OpenAI's error envelope; HEAD: the same status and content type, no body.

    vLLM answers 200 with an empty body; probes read only the status, so they work unchanged,
    while a person or a script gets JSON like every other endpoint (not an empty text/html).
    """
    return await _health(request)


@api_view("GET", "POST", authenticate=False)
async def ping(request: HttpRequest, tenant) -> HttpResponse:
    """vLLM's (SageMaker's) liveness path, GET or POST: as ``GET /health``."""
    return await _health(request)


async def _health(request: HttpRequest) -> HttpResponse:
    workers = [w for w in await live_workers(get_redis()) if w.get("live")]
    if not workers:
        raise unavailable("No engine worker with a loaded model is live (a worker without a model does not serve; "
                          "load one in the admin's Workers page).")
    return JsonResponse({"status": "ok", "num_workers": len(workers)})


@api_view("GET", authenticate=False)
async def version(request: HttpRequest, tenant) -> HttpResponse:
    """GET /version."""
    return JsonResponse({"version": __version__})


@api_view("GET", authenticate=False)
async def metrics(request: HttpRequest, tenant) -> HttpResponse:
    """GET /metrics: Prometheus text format, labelled by ``model_name`` (see :mod:`webapp.metrics`)."""
    redis = get_redis()
    workers = await live_workers(redis, include_idle=True)
    models = sorted({s.name for s in served_models()} | {w["model"] for w in workers if w.get("model")}
                    | {m.decode() for m in await redis.smembers(METRICS_MODELS_KEY)})
    body = prometheus.render(workers, await model_totals(redis, models), await tenant_counters.read(redis),
                             await queued_counts(redis, models))
    return HttpResponse(body, content_type="text/plain; version=0.0.4; charset=utf-8")


def index(request: HttpRequest) -> HttpResponse:
    """GET /: a page that says what this server is and how to call it."""
    return render(request, "index.html", {"models": served_models(), "version": __version__})
