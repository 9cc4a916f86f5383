"""The Celery app: Redis is the broker; each model has its queues, one per tenant (see ``queue_for``)."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("tessera")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["webapp", "tenants"])


def queue_for(served_model_name: str, tenant: str | None = None) -> str:
    """Name of the Celery queue of one model's requests of ``tenant`` (its slug; None: requests of no
    tenant). A worker consumes every queue of its model, and Celery's Redis transport takes from
    them in turn (round robin), so one tenant's backlog in Redis (a batch of thousands of prompts)
    never holds up another tenant's requests behind it; the engine's scheduler then applies the
    tenants' GPU shares."""
    base = f"tessera.model.{served_model_name}"
    return f"{base}.tenant.{tenant}" if tenant else base
