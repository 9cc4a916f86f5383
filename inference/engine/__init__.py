"""The engine: arguments, the step loop, and the stats it reports."""
from .arg_utils import EngineArgs
from .llm_engine import LLMEngine
from .stats import EngineStats

__all__ = ["EngineArgs", "EngineStats", "LLMEngine"]
