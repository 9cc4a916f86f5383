"""The worker's periodic engine-stats log line, in vLLM's words (``LoggingStatLogger``).

Every ``LOG_INTERVAL`` seconds a worker with a model logs, e.g.::

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 12 reqs,
    Waiting: 3 reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 63.0%

Throughputs and the prefix-cache hit rate are over the interval since the previous line
(hit rate = cached tokens / looked-up tokens, 0 when nothing was looked up); the running
and waiting requests and the KV-cache usage are the engine's at the time of the line. As in vLLM,
an idle engine (no token in the interval, nothing running or waiting) logs one such line at INFO,
then at DEBUG until it works again (``StatLogger.quiet``).
"""
from __future__ import annotations

from typing import Any

LOG_INTERVAL = 5.0  # seconds


class StatLogger:
    """Turns successive engine stats (``EngineStats`` fields as a dict) into log lines."""

    def __init__(self) -> None:
        self._last: tuple[float, dict[str, Any]] | None = None
        self.quiet = False  # the last line and the one before it were both of an idle engine
        self._idle = False

    def reset(self) -> None:
        """Forget the previous stats (a new engine's counters start from 0)."""
        self._last = None
        self.quiet = self._idle = False

    def line(self, stats: dict[str, Any], now: float) -> str | None:
        """The log line for ``stats`` taken at ``now`` (monotonic seconds), or None when it is
        the first stats seen since the start or a reset (nothing to average over yet)."""
        last, self._last = self._last, (now, dict(stats))
        if last is None or now <= last[0]:
            return None
        elapsed, before = now - last[0], last[1]

        def grew(name: str) -> float:
            return max(0.0, stats.get(name, 0) - before.get(name, 0))

        idle = not (grew("prompt_tokens_total") or grew("generation_tokens_total") or stats.get("num_running")
                    or stats.get("num_waiting"))
        self.quiet, self._idle = idle and self._idle, idle
        queries = grew("prefix_cache_queries_total")
        hit_rate = grew("prefix_cache_hits_total") / queries if queries else 0.0
        return (f"Avg prompt throughput: {grew('prompt_tokens_total') / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {grew('generation_tokens_total') / elapsed:.1f} tokens/s, "
                f"Running: {stats.get('num_running', 0)} reqs, Waiting: {stats.get('num_waiting', 0)} reqs, "
                f"GPU KV cache usage: {100 * stats.get('kv_cache_usage', 0.0):.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
