from django.apps import AppConfig
from django.db.models.signals import m2m_changed, post_delete, post_save


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants"

    def ready(self) -> None:
        from .models import ApiKey, Tenant
        from .shares import publish_on_commit

        for model in (Tenant, ApiKey):
            post_save.connect(publish_on_commit, sender=model, dispatch_uid=f"tenants-publish-save-{model.__name__}")
            post_delete.connect(publish_on_commit, sender=model, dispatch_uid=f"tenants-publish-del-{model.__name__}")
        m2m_changed.connect(publish_on_commit, sender=Tenant.members.through, dispatch_uid="tenants-publish-members")
