"""Typed errors raised by the engine.

Every error that a caller can cause carries the offending parameter's name, so that
the API layer can translate it into OpenAI's error envelope (``param`` field) without
parsing messages.
"""
from __future__ import annotations


class TesseraError(Exception):
    """Base class of all engine errors."""


class InvalidRequestError(TesseraError, ValueError):
    """A request or sampling parameter is outside its allowed range.

    Attributes:
        param: name of the offending parameter (e.g. ``"max_tokens"``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(TesseraError, ValueError):
    """The model could not be found, is unsupported, or its weights are unreadable."""

    def __init__(self, message: str, param: str = "model") -> None:
        super().__init__(message)
        self.param = param


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one the engine implements."""


class NotSupportedYetError(TesseraError, ValueError):
    """A flag was given whose feature is not implemented yet."""
