"""Tenants: who a request is served for (selected by the ``X-Tenant-ID`` header)."""
