"""Everything on the device: weights, KV cache tensors, input preparation, forward and sampling."""
from .model_runner import ModelRunner

__all__ = ["ModelRunner"]
