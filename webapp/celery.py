"""The Celery app: the process that hosts a worker's engine (``manage.py worker``), with Redis as
its broker for the worker's own control queue. Requests do not travel as Celery tasks: each
model has one queue per tenant in Redis, which the worker's dispatcher takes from in the order
of the tenants' GPU shares (:mod:`webapp.serving.request_queue`)."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("tessera")
app.config_from_object("django.conf:settings", namespace="CELERY")
