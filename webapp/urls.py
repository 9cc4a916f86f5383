"""URLs: the API at the root (as vLLM's), the admin under /admin/, tenant pages under /tenants/,
the operators' dashboard under /dashboard/."""
from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("tenants/", include("tenants.urls")),
    path("dashboard/", include("dashboard.urls")),
    # browsers ask for /favicon.ico on pages that name no icon (the admin's)
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"))),
    path("", include("webapp.api.urls")),
]

handler404 = "webapp.api.errors.handler404"
handler500 = "webapp.api.errors.handler500"
