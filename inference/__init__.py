"""Tessera's inference engine: paged KV cache, continuous batching, offline ``LLM`` API.

This package never imports Django; the web application drives it through ``LLMEngine``.
"""
from .engine import EngineArgs, EngineStats, LLMEngine
from .errors import InvalidRequestError, ModelLoadError, NotSupportedYetError, UnsupportedArchitectureError
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "EngineStats", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "InvalidRequestError", "ModelLoadError", "NotSupportedYetError",
           "UnsupportedArchitectureError"]
