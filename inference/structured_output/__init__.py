"""Structured output: constraints (JSON schema, regex, choice, EBNF grammar), compiled with
xgrammar against the model's vocabulary, applied to the logits as token bitmasks."""
from .params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
