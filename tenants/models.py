"""Tenants, their API keys and their usage.

* :class:`Tenant`: a team sharing the deployment; its GPU share and limits.
* :class:`ApiKey`: a secret that identifies a tenant; only its SHA-256 and a display
  prefix are stored, the secret itself is shown once, when it is issued.
* :class:`Usage`: what a tenant used of a model in one UTC hour (requests, actual tokens,
  errors by kind).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import secrets

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

DEFAULT_TENANT_SLUG = "default"
KEY_PREFIX = "tsk-"  # every issued key starts with this, so a mistyped or revoked key is recognised as one
DISPLAY_PREFIX_CHARS = 12  # "tsk-" + 8 characters of the secret, shown in lists


class Tenant(models.Model):
    """A team that shares the deployment.

    Limits left empty are not enforced. ``gpu_share`` is the percentage of the engine's
    tokens the tenant is guaranteed while it has work waiting; shares are weights, so a
    tenant alone may use the whole GPU (see ``inference/sched/fair_share.py``).
    """

    slug = models.SlugField(max_length=64, unique=True, help_text="What clients send in X-Tenant-ID.")
    name = models.CharField(max_length=200)
    active = models.BooleanField(default=True, help_text="Inactive tenants are refused (403).")
    gpu_share = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(100)],
        help_text="Percent of the GPU's tokens guaranteed while the tenant has work waiting; 0: no "
                  "guarantee (weighted as 1%). Active tenants' shares add up to at most 100.")
    priority = models.SmallIntegerField(
        default=0, help_text="Lower goes first between tenants that are equally far below their shares.")
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)],
                                                          help_text="Requests in flight at once; empty: no limit.")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)],
                                                      help_text="Empty: no limit.")
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)],
                                                    help_text="Prompt + completion tokens; empty: no limit.")
    daily_token_budget = models.PositiveBigIntegerField(null=True, blank=True, validators=[MinValueValidator(1)],
                                                        help_text="Tokens per UTC day; empty: no limit.")
    allowed_models = models.JSONField(default=list, blank=True,
                                      help_text='Served model names this tenant may use, e.g. ["llama-3-8b"]; '
                                                "empty: all.")
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="tenants",
                                     help_text="Users who may see this tenant's pages (keys and usage).")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def clean(self) -> None:
        if self.allowed_models in (None, ""):  # the admin's empty box: all models, as its help text says
            self.allowed_models = []
        if not isinstance(self.allowed_models, list) or not all(
                isinstance(m, str) and m for m in self.allowed_models):
            raise ValidationError({"allowed_models": "A list of model names (strings), or [] for all models."})
        if self.active:
            others = Tenant.objects.filter(active=True).exclude(pk=self.pk)
            total = sum(others.values_list("gpu_share", flat=True)) + (self.gpu_share or 0)
            if total > 100:
                raise ValidationError({"gpu_share": f"Active tenants' GPU shares would add up to {total}%; "
                                                    "at most 100% can be guaranteed."})

    def allows_model(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


def hash_secret(secret: str) -> str:
    """SHA-256 (hex) of an API key. Keys are 256-bit random, so a fast hash is safe to store."""
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKey(models.Model):
    """A tenant's API key. The secret is never stored: issue one with :meth:`issue`."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True, help_text="What the key is for.")
    prefix = models.CharField(max_length=DISPLAY_PREFIX_CHARS, editable=False,
                              help_text="The first characters of the key, to recognise it.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: never expires.")
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["tenant", "-created"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant.slug})"

    @staticmethod
    def new_secret() -> str:
        return KEY_PREFIX + secrets.token_urlsafe(32)

    def set_secret(self, secret: str) -> None:
        self.prefix = secret[:DISPLAY_PREFIX_CHARS]
        self.key_hash = hash_secret(secret)

    @classmethod
    def issue(cls, tenant: Tenant, name: str = "", expires_at: dt.datetime | None = None) -> tuple["ApiKey", str]:
        """Create a key for ``tenant``; returns it and its secret (the only time the secret exists)."""
        secret = cls.new_secret()
        key = cls(tenant=tenant, name=name, expires_at=expires_at)
        key.set_secret(secret)
        key.save()
        return key, secret

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])

    def clean(self) -> None:
        if self._state.adding and self.expires_at is not None and self.expires_at <= timezone.now():
            raise ValidationError({"expires_at": "A new key must expire in the future (empty: never expires)."})

    def usable(self, now: dt.datetime | None = None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"


ERROR_KINDS = ("invalid_request", "rate_limited", "unavailable", "aborted", "internal")


class Usage(models.Model):
    """What one tenant used of one model in one UTC hour; counts come from actual tokens."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=200, blank=True, help_text="Served model name; empty when not known.")
    hour = models.DateTimeField(help_text="Start of the UTC hour.")
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    errors_invalid_request = models.PositiveBigIntegerField(default=0, help_text="400, 403, 404.")
    errors_rate_limited = models.PositiveBigIntegerField(default=0, help_text="429.")
    errors_unavailable = models.PositiveBigIntegerField(default=0, help_text="503: no worker, worker lost.")
    errors_aborted = models.PositiveBigIntegerField(default=0, help_text="The client left before the end.")
    errors_internal = models.PositiveBigIntegerField(default=0, help_text="500.")

    class Meta:
        ordering = ["-hour", "tenant", "model"]
        constraints = [models.UniqueConstraint(fields=["tenant", "model", "hour"], name="usage_tenant_model_hour")]
        verbose_name_plural = "usage"

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.model} {self.hour:%Y-%m-%d %H}:00"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def errors(self) -> dict[str, int]:
        return {kind: getattr(self, f"errors_{kind}") for kind in ERROR_KINDS}
