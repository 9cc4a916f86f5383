"""Paged attention: metadata built by the model runner, and the backends that consume it."""
from .metadata import AttentionMetadata, PrefillSegment
from .torch_ref import paged_attention

__all__ = ["AttentionMetadata", "PrefillSegment", "paged_attention"]
