"""Tessera's inference engine: paged KV cache, continuous batching, offline ``LLM`` API.

This package never imports Django; the web application drives it through ``LLMEngine``.
"""
from .logger import configure_default_logging

configure_default_logging()

from .engine import EngineArgs, EngineStats, LLMEngine  # noqa: E402
from .errors import InvalidRequestError, ModelLoadError, NotSupportedYetError, UnsupportedArchitectureError  # noqa: E402
from .llm import LLM  # noqa: E402
from .lora.request import LoRARequest  # noqa: E402
from .outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineArgs", "LoRARequest", "EngineStats", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "InvalidRequestError", "ModelLoadError", "NotSupportedYetError",
           "UnsupportedArchitectureError"]
