from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class CatalogConfig(AppConfig):
    """The models this deployment can serve, and the workers that serve them (admin only)."""

    name = "webapp.catalog"
    label = "catalog"
    verbose_name = "Models and workers"

    def ready(self) -> None:
        from .lora import publish_on_commit
        from .models import LoRAAdapter

        post_save.connect(publish_on_commit, sender=LoRAAdapter, dispatch_uid="catalog-lora-publish-save")
        post_delete.connect(publish_on_commit, sender=LoRAAdapter, dispatch_uid="catalog-lora-publish-delete")
