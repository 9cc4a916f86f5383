from django.urls import path

from . import lora_views, views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/models", views.list_models, name="models"),
    path("v1/models/<path:model>", views.retrieve_model, name="model"),
    path("v1/load_lora_adapter", lora_views.load_lora_adapter, name="load-lora-adapter"),
    path("v1/unload_lora_adapter", lora_views.unload_lora_adapter, name="unload-lora-adapter"),
    path("tokenize", views.tokenize, name="tokenize"),
    path("detokenize", views.detokenize, name="detokenize"),
    path("health", views.health, name="health"),
    path("ping", views.ping, name="ping"),  # vLLM's (SageMaker's) liveness path
    path("version", views.version, name="version"),
    path("metrics", views.metrics, name="metrics"),
    path("", views.index, name="index"),
]
