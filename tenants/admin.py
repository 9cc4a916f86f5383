from django.contrib import admin

from .models import Tenant


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "active", "created")
    list_filter = ("active",)
    search_fields = ("slug", "name")
