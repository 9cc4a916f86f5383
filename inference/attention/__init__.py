"""Paged attention: metadata built by the model runner, and the backends that consume it."""
from .backend import paged_attention, resolve_backend
from .metadata import AttentionMetadata, PrefillSegment

__all__ = ["AttentionMetadata", "PrefillSegment", "paged_attention", "resolve_backend"]
