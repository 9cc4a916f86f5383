"""Data migration: the ``default`` tenant, used when a request names none."""
from django.db import migrations


def create_default(apps, schema_editor):
    Tenant = apps.get_model("tenants", "Tenant")
    Tenant.objects.get_or_create(slug="default", defaults={"name": "Default tenant", "active": True})


def remove_default(apps, schema_editor):
    apps.get_model("tenants", "Tenant").objects.filter(slug="default").delete()


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]
    operations = [migrations.RunPython(create_default, remove_default)]
