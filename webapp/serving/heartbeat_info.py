"""What a worker's heartbeat says about it (:func:`heartbeat_info`): its state and model, the engine's settings and stats, the process and its devices. The I/O
thread (:mod:`.io_loop`) asks for it at every heartbeat and writes it to Redis
(:mod:`.worker_registry`).
"""
from __future__ import annotations

import os
from typing import Any

from .devices import describe_device, gpu_stats
from .model_lifecycle import LOADING, READY, UNLOADING, ModelHost


def heartbeat_info(host: ModelHost, started: float, closing: bool) -> dict[str, Any]:
    """The heartbeat's info of a worker whose model is ``host``'s, started at ``started``
    (``time.time()``); ``closing``: the worker is shutting down (it admits no request)."""
    loop, spec, state = host.loop, host.spec, host.state
    serving = state in (READY, UNLOADING) and loop is not None and spec is not None
    stats = loop.stats if serving else None
    engine = host.engine
    return {
        "model": spec.name if serving else None,
        "source": spec.source if serving else None,
        "state": state,
        "loading": spec.name if state == LOADING and spec is not None else None,
        "error": host.error,
        "ready_at": host.ready_at if serving else None,
        "pid": os.getpid(),
        "started": started,
        **describe_device(),
        "gpus": gpu_stats(),
        "max_model_len": int(engine.max_model_len) if serving else None,
        "cache_config": _cache_config(engine) if serving else None,
        "scheduling_policy": engine.config.scheduler.scheduling_policy if serving else None,
        "stats": (dict(vars(stats)) if not isinstance(stats, dict) else stats) if stats is not None else {},
        "num_steps": loop.num_steps if serving else 0,
        "tenant_shares": loop.tenant_shares.shares if serving and loop.tenant_shares else None,
        "live": serving and state == READY and loop.is_alive() and not closing,
        "lora": _lora_info(loop.adapters) if serving and loop.adapters is not None else None,
    }


def _lora_info(adapters) -> dict[str, Any] | None:
    """The engine's LoRA limits, its start-up adapters (``--lora-modules``: the web processes list them as
    models) and the names of the adapters it has loaded; None when LoRA is off."""
    if not adapters.enabled:
        return None
    return {"max_loras": adapters.max_loras, "max_lora_rank": adapters.max_lora_rank,
            "modules": [{"name": m.lora_name, "path": m.lora_path} for m in adapters.startup.values()],
            "loaded": list(adapters.loaded)}


def _cache_config(engine) -> dict[str, Any]:
    """The engine's KV-cache settings, as vLLM's ``vllm:cache_config_info`` labels them."""
    cache, kv = engine.config.cache, engine.kv_cache_manager
    return {"block_size": cache.block_size, "cache_dtype": cache.cache_dtype,
            "enable_prefix_caching": cache.enable_prefix_caching, "gpu_memory_utilization": cache.gpu_memory_utilization, "num_gpu_blocks": kv.num_blocks,
            "num_cpu_blocks": kv.num_cpu_blocks, "swap_space": cache.swap_space}
