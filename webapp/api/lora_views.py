"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

Served only with ``TESSERA_ALLOW_RUNTIME_LORA_UPDATING=1`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``;
otherwise 404, as in vLLM where the routes do not exist), and only to the operator: a request with the
deployment key (``--api-key``), or, on a server without a deployment key, a request without a key while no
tenant has a key (a development server). A tenant key is refused (403), and so is a request without a key once
tenants have keys but the server has no deployment key: a tenant's adapters are registered in the admin or with
``manage.py lora_adapter``.

A load is checked before anything is registered: the body, the name (not taken by an adapter or a
model), the folder and its ``adapter_config.json`` (here), then the rank, the files and the shapes by a
ready worker of the base model loading it (``LLMEngine.add_lora``). Only then is the adapter written to the
database, from which every worker of the base model loads it (:mod:`webapp.catalog.lora`).
"""
from __future__ import annotations

import asyncio
import os

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError
from django.http import HttpRequest, HttpResponse

from inference import LoRARequest
from inference.errors import InvalidRequestError
from inference.lora.checkpoint import read_adapter_config
from tenants.identity import Caller
from tenants.models import ApiKey
from webapp.catalog.lora import check_on_ready_worker
from webapp.catalog.models import NAME_MAX_LENGTH, NAME_RULE, LoRAAdapter
from webapp.env import ENV
from webapp.serving.web_redis import model_workers

from .adapters import name_clash, startup_adapters
from .decorators import api_view
from .errors import APIError, bad_request, no_worker, not_found
from .protocol import Body, parse_json_body
from .served import live_models, resolve_served_model


async def _check_allowed(caller: Caller) -> None:
    """Raises: APIError 404 while runtime updating is off; 403 for a tenant key, or for a request without a key
    when tenants have keys and the server has no deployment key."""
    if not ENV.allow_runtime_lora_updating:
        raise not_found("Runtime LoRA adapter loading is off: the operator turns it on with "
                        "TESSERA_ALLOW_RUNTIME_LORA_UPDATING=1.", code="not_found")
    if caller.key_id is not None:
        raise APIError("Only the operator (the deployment's --api-key, or a server without keys) may load or unload "
                       "LoRA adapters; a tenant's adapters are added in the admin.", 403, code="permission_denied")
    if not settings.TESSERA.get("API_KEY") and await _tenants_have_keys():
        raise APIError("Tenants have API keys: loading and unloading LoRA adapters at run time needs the deployment "
                       "key (start the server with --api-key and send it as the Bearer key).", 403,
                       code="permission_denied")


@sync_to_async
def _tenants_have_keys() -> bool:
    return ApiKey.objects.filter(revoked_at__isnull=True).exists()


LOAD_FIELDS = frozenset({"lora_name", "lora_path", "base_model_name"})
UNLOAD_FIELDS = frozenset({"lora_name", "lora_int_id"})


def _body(request: HttpRequest, fields: frozenset[str]) -> Body:
    """The JSON body, refusing fields the endpoint does not know (a ``tenant`` would otherwise be dropped
    silently, registering a public adapter)."""
    data = parse_json_body(request.body)
    unknown = sorted(set(data) - fields) if isinstance(data, dict) else []
    if unknown:
        raise bad_request(f"Unknown field(s) {', '.join(map(repr, unknown))}; this endpoint takes "
                          f"{', '.join(sorted(fields))}. A tenant's adapters are added in the admin or with "
                          "manage.py lora_adapter.", param=unknown[0])
    return Body(data)


def _name(body: Body) -> str:
    name = body.get("lora_name", str, None)
    if not name:
        raise bad_request("'lora_name' (a non-empty string) is required.", param="lora_name")
    if len(name) > NAME_MAX_LENGTH:
        raise bad_request(f"'lora_name' is {len(name)} characters long; at most {NAME_MAX_LENGTH}.", param="lora_name")
    if not NAME_RULE.regex.match(name):
        raise bad_request(f"'lora_name' {name!r}: {NAME_RULE.message}", param="lora_name")
    return name


@api_view("POST")
async def load_lora_adapter(request: HttpRequest, caller: Caller) -> HttpResponse:
    """POST /v1/load_lora_adapter ``{"lora_name", "lora_path"}`` (optional ``base_model_name``: which served
    model; needed when several are live). 200 with vLLM's text once registered; 400 naming the field or limit."""
    await _check_allowed(caller)
    body = _body(request, LOAD_FIELDS)
    name = _name(body)
    path = body.get("lora_path", str, None)
    if not path or not path.strip():
        raise bad_request("'lora_path' (the adapter's folder, as the workers see it) is required.", param="lora_path")
    if not os.path.isabs(path.strip()):  # relative to which worker's folder? It would differ from host to host
        raise bad_request(f"'lora_path' must be an absolute path (the adapter's folder as the workers see it), "
                          f"got {path!r}.", param="lora_path")
    if await sync_to_async(LoRAAdapter.objects.filter(name=name).exists)():
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    clash = await name_clash(name)
    if clash:
        raise bad_request(clash, param="lora_name")
    base = (await resolve_served_model(body.get("base_model_name", str, None))).name
    workers = await model_workers(base, stale=0)
    if not workers:
        raise no_worker(base)
    if not any(w.get("lora") for w in workers):
        raise bad_request(f"The workers of '{base}' serve no LoRA adapters: start them with --enable-lora.",
                          param="base_model_name")
    try:  # cheap and local: the folder and its config; the rest needs the model
        await asyncio.to_thread(read_adapter_config, LoRARequest(name, 1, path.strip()))
    except InvalidRequestError as error:
        raise APIError.from_engine(error) from None
    result = await check_on_ready_worker(name, base, path.strip())
    if result is None:
        raise no_worker(base)
    if not result.ok:
        raise APIError(result.message, result.status, param=result.param)
    try:
        await sync_to_async(LoRAAdapter.objects.create)(name=name, base_model=base, path=path.strip())
    except IntegrityError:  # registered by another request meanwhile
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name") from None
    return HttpResponse(f"Success: LoRA adapter '{name}' added successfully.", content_type="text/plain")


@api_view("POST")
async def unload_lora_adapter(request: HttpRequest, caller: Caller) -> HttpResponse:
    """POST /v1/unload_lora_adapter ``{"lora_name"}``: unregistered, and unloaded by every worker (requests
    already queued with it still run). 404 for an adapter that was not loaded at run time."""
    await _check_allowed(caller)
    name = _name(_body(request, UNLOAD_FIELDS))
    deleted, _ = await sync_to_async(LoRAAdapter.objects.filter(name=name).delete)()
    if not deleted and name in startup_adapters(await live_models()):
        raise bad_request(f"The lora adapter '{name}' was loaded at start-up (--lora-modules): restart its workers "
                          "without it to unload it.", param="lora_name")
    if not deleted:
        raise not_found(f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found")
    return HttpResponse(f"Success: LoRA adapter '{name}' removed successfully.", content_type="text/plain")
