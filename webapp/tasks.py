"""Celery tasks of the serving stack: thin wrappers over :mod:`webapp.serving.runtime`."""
from __future__ import annotations

from celery import shared_task
from celery.exceptions import Reject

from webapp.serving.runtime import WorkerShuttingDown, get_runtime

GENERATE_TASK = "tessera.generate"


@shared_task(name=GENERATE_TASK, acks_late=True, ignore_result=True)
def generate(payload: dict) -> None:
    """Hand one engine request to this worker's engine (see ``WorkerRuntime.admit``).

    ``payload`` holds ids and plain values only: ``rid``, ``reply``, ``prompt_token_ids``,
    ``params``, ``priority``, ``cache_salt``, ``arrival``. If the worker is stopping, the message goes
    back to the queue.
    """
    try:
        get_runtime().admit(payload)
    except WorkerShuttingDown:
        raise Reject("worker shutting down", requeue=True) from None
