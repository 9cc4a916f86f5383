"""Tessera's version, reported by ``GET /version``."""
__version__ = "0.1.0"
