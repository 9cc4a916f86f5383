"""Per-tenant Prometheus counters, kept in Redis so that they add up over every web process.

``/metrics`` exports them (:mod:`webapp.metrics`) as

* ``tessera:tenant_prompt_tokens_total{tenant,model_name}``
* ``tessera:tenant_generation_tokens_total{tenant,model_name}``
* ``tessera:tenant_requests_total{tenant,model_name,finished_reason}``

fed by :class:`tenants.metering.Meter` when a request ends, from the same token counts as
the tenant's usage records and the response's ``usage`` (prompts that ran, tokens
generated). ``finished_reason`` is per API request, in vLLM's words: ``stop`` (every choice
ended on EOS or a stop condition), ``length`` (a choice hit ``max_tokens`` or the context),
``abort`` (the client left) or ``error`` (the request failed, e.g. rate limited or no worker).
A request refused before its model was known (bad JSON, unknown tenant) is not counted here.
"""
from __future__ import annotations

import json
from typing import Iterable

from webapp.transport.keys import TENANT_METRICS_KEY

PROMPT, GENERATION, REQUESTS = "prompt_tokens", "generation_tokens", "requests"


def finished_reason(error: str | None, finish_reasons: Iterable[str | None]) -> str:
    """The request's ``finished_reason`` label from its usage error kind (``models.ERROR_KINDS``)
    and its choices' finish reasons."""
    if error == "aborted":
        return "abort"
    if error is not None:
        return "error"
    return "length" if "length" in set(finish_reasons) else "stop"


async def add(redis, tenant: str, model: str, prompt_tokens: int, generation_tokens: int, reason: str) -> None:
    """Count one finished request (``redis``: a ``redis.asyncio.Redis``), in one MULTI/EXEC."""
    pipe = redis.pipeline(transaction=True)
    pipe.hincrby(TENANT_METRICS_KEY, json.dumps([REQUESTS, tenant, model, reason]), 1)
    if prompt_tokens:
        pipe.hincrby(TENANT_METRICS_KEY, json.dumps([PROMPT, tenant, model, ""]), prompt_tokens)
    if generation_tokens:
        pipe.hincrby(TENANT_METRICS_KEY, json.dumps([GENERATION, tenant, model, ""]), generation_tokens)
    await pipe.execute()


async def read(redis) -> list[tuple[str, str, str, str, float]]:
    """Every counter as ``(counter, tenant, model, reason, value)``; ``reason`` is empty for tokens."""
    rows = []
    for field, value in (await redis.hgetall(TENANT_METRICS_KEY)).items():
        counter, tenant, model, reason = json.loads(field)
        rows.append((counter, tenant, model, reason, float(value)))
    return rows
