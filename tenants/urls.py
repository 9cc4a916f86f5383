from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

app_name = "tenants"
urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="tenants/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page="tenants:login"), name="logout"),
    path("", views.tenant_list, name="list"),
    path("<slug:slug>/", views.tenant_detail, name="detail"),
    path("<slug:slug>/keys/", views.key_create, name="key-create"),
    path("<slug:slug>/keys/<int:key_id>/revoke/", views.key_revoke, name="key-revoke"),
]
