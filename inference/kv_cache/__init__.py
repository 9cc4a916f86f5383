"""Paged KV cache bookkeeping: block ids only, never tensors (those live in the model runner)."""
from .block_pool import BlockPool
from .manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
