"""App config: ``webapp`` is also an app, for its management commands (serve, worker)."""
from django.apps import AppConfig


class WebappConfig(AppConfig):
    name = "webapp"
    verbose_name = "Tessera serving"
