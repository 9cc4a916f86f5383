from django.apps import AppConfig


class CatalogConfig(AppConfig):
    """The models this deployment can serve, and the workers that serve them (admin only)."""

    name = "webapp.catalog"
    label = "catalog"
    verbose_name = "Models and workers"
