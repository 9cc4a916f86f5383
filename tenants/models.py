"""The tenant model (keys, quotas and usage come with the tenants issue)."""
from __future__ import annotations

from django.db import models

DEFAULT_TENANT_SLUG = "default"


class Tenant(models.Model):
    """A customer of the server; requests pick one by slug in the ``X-Tenant-ID`` header."""

    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    active = models.BooleanField(default=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug
