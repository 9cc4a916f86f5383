"""Which models this server answers for, and where their tokenizers come from.

A model is *live* while at least one worker serving it is ``ready`` (its heartbeat says so,
see :mod:`webapp.serving.worker_registry`): ``/v1/models`` lists exactly those. A request may also
name a model that is not live but known, configured with ``manage.py serve`` or registered
in the admin's catalog (``webapp.catalog``): it then gets 503 (no worker serves it now)
rather than 404. The tokenizer of a live model is loaded from the source its workers
report, so that a model loaded from the admin tokenizes exactly as it runs.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.conf import settings

from webapp.serving.web_redis import get_redis, model_workers
from webapp.serving.worker_registry import live_workers

from .errors import APIError
from .tokenization import ServedModel, served_models


def _from_worker(name: str, worker: dict[str, Any]) -> ServedModel:
    cfg = settings.TESSERA
    configured = name == cfg["SERVED_MODEL_NAME"]  # the flags of `serve` still apply to its own model
    return ServedModel(name, worker.get("source") or name, cfg["TOKENIZER"] if configured else None,
                       cfg["CHAT_TEMPLATE"] if configured else None)


async def live_models() -> dict[str, tuple[ServedModel, list[dict[str, Any]]]]:
    """``name -> (model, its ready workers' heartbeats)`` of every live model, read from Redis now.

    Raises:
        RedisError: Redis cannot be read.
    """
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for worker in await live_workers(get_redis()):
        if worker.get("live"):
            by_name[worker["model"]].append(worker)
    return {name: (_from_worker(name, workers[0]), workers) for name, workers in sorted(by_name.items())}


async def resolve_served_model(name: str | None) -> ServedModel:
    """The model a request names. Without a name: the one live model, or the configured one when
    it is live or nothing is (a request then waits for a worker of it, as a named one does).

    Raises:
        APIError: 404 ``model_not_found`` when no worker serves ``name`` and it is neither
            configured nor in the catalog; 400 naming ``model`` when there is no name and several
            models other than the configured one are live.
        RedisError: Redis cannot be read.
    """
    configured = served_models()
    if not name:
        live = await live_models()
        if len(live) == 1:
            return next(iter(live.values()))[0]
        if not live or configured[0].name in live:
            return configured[0]
        raise APIError(f"`model` is required: this server serves {', '.join(live)}.", 400, param="model")
    workers = await model_workers(name)
    if workers:
        return _from_worker(name, workers[0])
    for model in configured:
        if model.name == name:
            return model
    from webapp.catalog.models import ServedModel as CatalogModel  # the app registry is ready by now

    entry = await CatalogModel.objects.filter(name=name).afirst()
    if entry is not None:
        return ServedModel(entry.name, entry.source)
    raise unknown_model(name)


def unknown_model(name: str) -> APIError:
    """The 404 of a model that does not exist (or is another tenant's adapter: the same answer)."""
    return APIError(f"The model `{name[:200]}` does not exist.", 404, param="model", code="model_not_found")
