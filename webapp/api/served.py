"""Which models this server answers for, and where their tokenizers come from.

A model is *live* while at least one worker serving it is ``ready`` (its heartbeat says so,
see :mod:`webapp.serving.registry`): ``/v1/models`` lists exactly those. A request may also
name a model that is not live but known, configured with ``manage.py serve`` or registered
in the admin's catalog (``webapp.catalog``): it then gets 503 (no worker serves it now)
rather than 404. The tokenizer of a live model is loaded from the source its workers
report, so that a model loaded from the admin tokenizes exactly as it runs.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.conf import settings

from webapp.serving.client import get_redis, model_workers
from webapp.serving.registry import live_workers

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
    """The model a request names (the configured one when ``name`` is empty).

    Raises:
        APIError: 404 ``model_not_found`` when no worker serves ``name`` and it is neither
            configured nor in the catalog.
        RedisError: Redis cannot be read.
    """
    configured = served_models()
    if not name:
        return configured[0]
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
    raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")
