"""URLs: the API at the root (as vLLM's), the admin under /admin/, tenant pages under /tenants/,
the operators' dashboard under /dashboard/."""
from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("tenants/", include("tenants.urls")),
    path("dashboard/", include("dashboard.urls")),
    path("", include("webapp.api.urls")),
]

handler404 = "webapp.api.errors.handler404"
handler500 = "webapp.api.errors.handler500"
