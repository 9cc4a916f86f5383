"""Admin: tenants (shares, limits, members), API keys (secret shown once; revoke) and usage."""
from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from redis.exceptions import RedisError

from .models import ApiKey, Tenant, Usage


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    can_delete = False
    show_change_link = True
    fields = ("prefix", "name", "state", "created", "expires_at", "revoked_at", "last_used_at")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:  # keys are issued on their own page
        return False


LIMIT_FIELDS = ("max_concurrent_requests", "requests_per_minute", "tokens_per_minute", "daily_token_budget")


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "active", "gpu_share", "priority", "max_concurrent_requests",
                    "requests_per_minute", "tokens_per_minute", "daily_token_budget")
    list_editable = ("active", "gpu_share")
    list_filter = ("active",)
    search_fields = ("slug", "name")
    filter_horizontal = ("members",)
    inlines = [ApiKeyInline]
    fieldsets = (
        (None, {"fields": ("slug", "name", "active", "members")}),
        ("GPU share", {"fields": ("gpu_share", "priority")}),
        ("Limits (empty: none)", {"fields": (*LIMIT_FIELDS, "allowed_models")}),
    )

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        """The limits' form fields say their own minimum (1) for any value below it, not the column's (0)."""
        if db_field.name in LIMIT_FIELDS:
            kwargs["min_value"] = 1
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """The tenant's page also charts its share of the served tokens against its GPU share, live
        (the dashboard's share chart for this tenant)."""
        from dashboard.views import dashboard_context  # noqa: PLC0415 (the dashboard app imports this one's models)

        try:
            live = dashboard_context(request)
        except RedisError:  # the page without its chart
            live = {}
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **live})


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Adding a key generates its secret and shows it on the next page, once; it is never stored."""

    list_display = ("prefix", "tenant", "name", "state", "created", "expires_at", "last_used_at")
    list_filter = ("tenant",)
    search_fields = ("prefix", "name", "tenant__slug")
    readonly_fields = ("prefix", "created", "revoked_at", "last_used_at")
    actions = ["revoke"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("tenant", "name", "expires_at")
        return ("tenant", "name", "prefix", "created", "expires_at", "revoked_at", "last_used_at")

    def get_readonly_fields(self, request, obj=None):
        return self.readonly_fields + (("tenant",) if obj is not None else ())

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if not change:
            secret = ApiKey.new_secret()
            obj.set_secret(secret)
            request._tessera_new_secret = secret  # for response_add only; never in the session or messages
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue=None) -> HttpResponse:
        secret = getattr(request, "_tessera_new_secret", None)
        if secret is None:
            return super().response_add(request, obj, post_url_continue)
        context = {**self.admin_site.each_context(request), "key": obj, "secret": secret,
                   "opts": self.model._meta, "title": "API key created"}
        response = TemplateResponse(request, "admin/tenants/apikey/issued.html", context)
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset) -> None:
        keys = [k for k in queryset if k.revoked_at is None]
        for key in keys:
            key.revoke()
        self.message_user(request, f"Revoked {len(keys)} key(s).", messages.SUCCESS)


@admin.register(Usage)
class UsageAdmin(admin.ModelAdmin):
    list_display = ("hour", "tenant", "model", "requests", "prompt_tokens", "completion_tokens",
                    "errors_invalid_request", "errors_rate_limited", "errors_unavailable", "errors_aborted",
                    "errors_internal")
    list_filter = ("tenant", "model")
    date_hierarchy = "hour"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
