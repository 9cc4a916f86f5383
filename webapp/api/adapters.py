"""LoRA adapters addressed as models: which adapters a tenant may see, and what a ``model`` names.

An adapter is either one of a worker's start-up adapters (``--lora-modules``, public, reported in its
heartbeat) or registered at run time (the database's ``LoRAAdapter`` rows, cached per process and
reloaded whenever :data:`webapp.transport.keys.LORA_VERSION_KEY` moves). A tenant sees the public adapters
and its own; another tenant's adapter is, to it, an unknown model (the same 404, so its existence does
not leak). Seeing one is not using it: the tenant must also be allowed the adapter's base model (else
403, as for the base model).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tenants.identity import TenantRef
from webapp.serving.web_redis import get_redis
from webapp.transport.keys import LORA_VERSION_KEY

from .errors import APIError
from .served import live_models, resolve_served_model, unknown_model
from .tokenization import ServedModel, served_models

CACHE_MAX_AGE = 30.0  # seconds; a safety net in case Redis lost the version counter


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as the API serves it.

    Attributes:
        name: the name clients send as ``model``.
        base_model: the served model it runs on.
        path: its folder, as the workers see it (``root`` in ``/v1/models``).
        tenant_id: the owning tenant's id; None: public.
    """

    name: str
    base_model: str
    path: str
    tenant_id: int | None = None

    def visible_to(self, tenant: TenantRef) -> bool:
        return self.tenant_id is None or self.tenant_id == tenant.id


class _Registered:
    """The database's adapters by name, valid for one adapters version."""

    def __init__(self) -> None:
        self.version: bytes | None = None
        self.loaded = -CACHE_MAX_AGE
        self.adapters: dict[str, Adapter] = {}

    async def get(self) -> dict[str, Adapter]:
        from webapp.catalog.models import LoRAAdapter  # noqa: PLC0415 - the app registry is ready by now

        version = await get_redis().get(LORA_VERSION_KEY)
        now = time.monotonic()
        if version != self.version or now - self.loaded > CACHE_MAX_AGE:
            rows = LoRAAdapter.objects.values_list("name", "base_model", "path", "tenant_id")
            self.adapters = {name: Adapter(name, base, path.strip(), tenant) async for name, base, path, tenant in rows}
            self.version, self.loaded = version, now
        return self.adapters


_registered = _Registered()


def startup_adapters(live: dict[str, tuple[ServedModel, list[dict[str, Any]]]]) -> dict[str, Adapter]:
    """The public start-up adapters (``--lora-modules``) of the live models' workers, by name."""
    found = {}
    for model, (_, workers) in live.items():
        for worker in workers:
            for module in (worker.get("lora") or {}).get("modules", ()):
                found.setdefault(module["name"], Adapter(module["name"], model, module["path"]))
    return found


async def name_clash(name: str) -> str | None:
    """Why ``name`` cannot name a newly registered adapter, or None: it is a served model's name (live,
    configured, or in the admin's catalog) or a live worker's start-up adapter (``--lora-modules``). A
    registered adapter of that name is the caller's check (the database's unique name).

    Raises:
        RedisError: Redis cannot be read.
    """
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    from webapp.catalog.models import ServedModel as CatalogModel  # noqa: PLC0415

    live = await live_models()
    if (name in live or any(m.name == name for m in served_models())
            or await sync_to_async(CatalogModel.objects.filter(name=name).exists)()):
        return f"'{name}' is a served model's name; an adapter needs a name of its own."
    if name in startup_adapters(live):
        return f"'{name}' is a LoRA adapter the workers loaded at start-up (--lora-modules)."
    return None


async def all_adapters(live: dict[str, tuple[ServedModel, list[dict[str, Any]]]] | None = None) -> dict[str, Adapter]:
    """Every adapter by name: the registered ones and the live workers' start-up ones (which win a name clash).

    Raises:
        RedisError: Redis cannot be read.
    """
    live = await live_models() if live is None else live
    return {**await _registered.get(), **startup_adapters(live)}


async def resolve_model(name: str | None, tenant: TenantRef) -> tuple[ServedModel, Adapter | None]:
    """What a request's ``model`` names: a registered adapter, a served model, or a start-up adapter, in that
    order; an adapter only if ``tenant`` may see it, with its base model.

    Raises:
        APIError: as :func:`.served.resolve_served_model` (404 for an unknown name, another tenant's adapter
            included).
        RedisError: Redis cannot be read.
    """
    if not name:
        return await resolve_served_model(name), None
    adapter = (await _registered.get()).get(name)
    if adapter is None:
        try:
            return await resolve_served_model(name), None
        except APIError as error:
            adapter = startup_adapters(await live_models()).get(name) if error.status == 404 else None
            if adapter is None or not adapter.visible_to(tenant):
                raise
    if not adapter.visible_to(tenant):
        raise unknown_model(name)
    return await resolve_served_model(adapter.base_model), adapter
