"""Python's cyclic garbage collector and the engine's host loop.

Admitting, stepping and finishing requests builds and drops many short-lived container objects (scheduler
outputs, per-request records, outputs). At Python's default first-generation threshold of 700 live new objects, a
run of W2's shape pauses for a young-generation collection about a hundred times, every tenth one a middle-generation
collection, and they free nothing: the objects die by reference counting. Each pause lands on the host loop, which
on a fast GPU is what bounds the step rate. The engine raises the threshold to :data:`DEFAULT_GEN0_THRESHOLD` when it starts (it
never lowers one already higher); ``TESSERA_GC_GEN0_THRESHOLD`` sets another value, ``0`` leaves Python's.

On the CPU, ``LLM.generate`` of W2's shape (256 requests of 100-1,024 tokens in and out, a one-layer random model,
4-step windows) collected 119 times for 90-100 ms at 700, once for 22 ms at 10,000; none of those collections freed
anything. ``benchmarks/throughput.py`` reports the collections of its timed run (``gc_in_timed_run``). vLLM takes
this cost off another way, freezing the start-up heap (``gc.freeze``) in its own engine process; an engine that runs
inside its caller's process cannot freeze the caller's heap.
"""
from __future__ import annotations

import gc
import logging
import os

logger = logging.getLogger(__name__)

GEN0_THRESHOLD_ENV = "TESSERA_GC_GEN0_THRESHOLD"
DEFAULT_GEN0_THRESHOLD = 10_000  # live new container objects before a young-generation collection


def raise_gc_threshold() -> tuple[int, int, int] | None:
    """Raise the collector's first-generation threshold to ``TESSERA_GC_GEN0_THRESHOLD`` (default
    :data:`DEFAULT_GEN0_THRESHOLD`; ``0`` or less leaves it), keeping the other two thresholds.

    Returns:
        The thresholds before, if they changed; else None.

    Raises:
        ValueError: the variable is set to something other than an integer (its name and value in the message).
    """
    raw = os.environ.get(GEN0_THRESHOLD_ENV, "").strip()
    try:
        wanted = int(raw) if raw else DEFAULT_GEN0_THRESHOLD
    except ValueError:
        raise ValueError(f"{GEN0_THRESHOLD_ENV} must be an integer (0 leaves Python's threshold), got {raw!r}") from None
    before = gc.get_threshold()
    if wanted <= 0 or before[0] >= wanted:
        return None
    gc.set_threshold(wanted, *before[1:])
    logger.info("garbage collector: first-generation threshold %d (was %d; %s=0 leaves it)", wanted, before[0],
                GEN0_THRESHOLD_ENV)
    return before
