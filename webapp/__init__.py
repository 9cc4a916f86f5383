"""Tessera's Django project: settings, URLs, the ASGI app, the Celery app and the OpenAI-compatible API."""
from .celery import app as celery_app

__all__ = ["celery_app"]
