"""Model definitions (decoder-only transformers) and their registry."""
from .registry import SUPPORTED_ARCHITECTURES, build_model

__all__ = ["SUPPORTED_ARCHITECTURES", "build_model"]
