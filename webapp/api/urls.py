from django.urls import path

from . import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/models", views.list_models, name="models"),
    path("v1/models/<path:model>", views.retrieve_model, name="model"),
    path("tokenize", views.tokenize, name="tokenize"),
    path("detokenize", views.detokenize, name="detokenize"),
    path("health", views.health, name="health"),
    path("ping", views.ping, name="ping"),  # vLLM's (SageMaker's) liveness path
    path("version", views.version, name="version"),
    path("metrics", views.metrics, name="metrics"),
    path("", views.index, name="index"),
]
