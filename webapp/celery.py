"""The Celery app: Redis is the broker; each model has its own queue (see ``queue_for``)."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("tessera")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["webapp", "tenants"])


def queue_for(served_model_name: str) -> str:
    """Name of the Celery queue that the workers of one model consume."""
    return f"tessera.model.{served_model_name}"
