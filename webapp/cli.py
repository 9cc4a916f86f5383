"""Engine flags shared by ``manage.py serve`` and ``manage.py worker`` (vLLM's names)."""
from __future__ import annotations

import argparse
from typing import Any

from inference import EngineArgs
from inference.model_loader.sources import PACKAGED_MODEL_NAMES

DEFAULT_MODEL = "smollm2-135m-instruct"
assert DEFAULT_MODEL in PACKAGED_MODEL_NAMES

# flag -> (EngineArgs field, argparse kwargs)
ENGINE_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--served-model-name": ("served_model_name", {"help": "Name clients send as 'model' (default: MODEL)."}),
    "--tokenizer": ("tokenizer", {"help": "Tokenizer directory, when it is not the model's."}),
    "--load-format": ("load_format", {"default": "auto", "choices": ["auto", "dummy"],
                                      "help": "dummy: random weights (a config-only directory or a benchmark shape)."}),
    "--dtype": ("dtype", {"default": "auto", "choices": ["auto", "float32", "float", "bfloat16", "float16", "half"],
                          "help": "Weight and activation dtype (auto: float32 on CPU)."}),
    "--max-model-len": ("max_model_len", {"type": int, "help": "Context length (prompt + output), in tokens."}),
    "--max-num-seqs": ("max_num_seqs", {"type": int, "default": 256, "help": "Requests in one engine step."}),
    "--max-num-batched-tokens": ("max_num_batched_tokens", {"type": int, "help": "Tokens in one engine step."}),
    "--enable-chunked-prefill": ("enable_chunked_prefill", {"action": argparse.BooleanOptionalAction,
                                                            "default": True, "help": "Split long prefills."}),
    "--enable-prefix-caching": ("enable_prefix_caching", {"action": argparse.BooleanOptionalAction, "default": True,
                                                          "help": "Share KV blocks of common prefixes (on by "
                                                                  "default, as vLLM)."}),
    "--scheduling-policy": ("scheduling_policy", {"default": "fcfs", "choices": ["fcfs", "priority"],
                                                  "help": "fcfs: arrival order; priority: the request's "
                                                          "'priority' (lower first), then arrival."}),
    "--gpu-memory-utilization": ("gpu_memory_utilization", {"type": float, "default": 0.9,
                                                            "help": "Fraction of GPU memory to use."}),
    "--kv-cache-dtype": ("kv_cache_dtype", {"default": "auto", "choices": ["auto", "fp8", "fp8_e4m3"],
                                            "help": "KV cache storage: auto (the model's dtype) or fp8 (e4m3, "
                                                    "per-layer scales: twice the tokens of a 16-bit cache)."}),
    "--calculate-kv-scales": ("calculate_kv_scales", {
        "action": argparse.BooleanOptionalAction, "default": True,
        "help": "FP8 KV cache without scales in the checkpoint: measure them at start-up on a calibration "
                "text (default); --no-calculate-kv-scales uses 1.0, as vLLM's default."}),
    "--swap-space": ("swap_space", {"type": float, "default": 0.0,
                                    "help": "CPU swap space per engine, GiB (with --preemption-mode swap)."}),
    "--preemption-mode": ("preemption_mode", {"default": "recompute", "choices": ["recompute", "swap"],
                                              "help": "What preemption does with a request's KV: recompute it "
                                                      "later, or swap it to the CPU swap space and back."}),
    "--tensor-parallel-size": ("tensor_parallel_size", {"type": int, "default": 1,
                                                        "help": "Ranks (GPUs) per engine: tensor parallelism."}),
    "--quantization": ("quantization", {"help": "Weight quantization method."}),
    "--kv-cache-space": ("kv_cache_space", {"type": float, "default": 4.0,
                                            "help": "GiB of KV cache when running on CPU."}),
    "--block-size": ("block_size", {"type": int, "default": 16, "help": "Tokens per KV block."}),
    "--seed": ("seed", {"type": int, "default": 0, "help": "Engine random seed."}),
    "--enforce-eager": ("enforce_eager", {"action": "store_true", "help": "Never capture CUDA graphs."}),
    "--async-scheduling": ("async_scheduling", {"action": argparse.BooleanOptionalAction, "default": None,
                                                "help": "Schedule decode step N+1 while step N runs (default: on "
                                                        "a GPU)."}),
    "--num-scheduler-steps": ("num_scheduler_steps", {"type": int, "default": None,
                                                      "help": "Decode steps run on the device per host iteration "
                                                              "of a decode-only batch (multi-step scheduling; "
                                                              "default: the engine sizes windows of up to 8 "
                                                              "steps from the measured step time on a GPU)."}),
    "--enable-lora": ("enable_lora", {"action": "store_true", "help": "Serve LoRA adapters (docs/lora_serving.md)."}),
    "--lora-modules": ("lora_modules", {"nargs": "+", "action": "extend", "default": None, "metavar": "NAME=PATH",
                                        "help": "LoRA adapters served from the start, each 'name=path' or JSON "
                                                "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                                                "(several after one flag, or the flag repeated)."}),
    "--max-loras": ("max_loras", {"type": int, "default": 1, "help": "LoRA adapters in one batch."}),
    "--max-lora-rank": ("max_lora_rank", {"type": int, "default": 16, "help": "The largest LoRA rank accepted."}),
    "--max-cpu-loras": ("max_cpu_loras", {"type": int, "default": None,
                                          "help": "LoRA adapters kept in host memory (default: --max-loras)."}),
}
SHORT_FLAGS = {"--tensor-parallel-size": "-tp", "--quantization": "-q"}


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of requests, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0 requests, got {value}")
    return value


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of an engine worker that are not engine flags (``serve`` passes them on)."""
    parser.add_argument(
        "--max-waiting-requests", type=non_negative_int, default=None, metavar="N",
        help="Requests a worker takes from its model's queues beyond --max-num-seqs, to wait in its "
             "engine's scheduler (default: max(2 x max_num_seqs, 64): a whole batch ending at once is "
             "refilled at once, with as many again behind it). Which tenant's request a worker takes "
             "next follows the tenants' GPU shares at any depth; the rest stay in Redis for any worker, "
             "and a waiting request of a worker that dies is requeued.")


def worker_argv(options: dict[str, Any]) -> list[str]:
    """Command-line flags that pass the worker flags of ``options`` on to ``manage.py worker``."""
    value = options.get("max_waiting_requests")
    return [] if value is None else ["--max-waiting-requests", str(value)]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``MODEL`` and the engine flags to ``parser``."""
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"Model: the packaged '{DEFAULT_MODEL}' (default), a Hugging Face directory "
                             "or a .gguf file.")
    for flag, (_, kwargs) in ENGINE_FLAGS.items():
        names = [flag, SHORT_FLAGS[flag]] if flag in SHORT_FLAGS else [flag]
        parser.add_argument(*names, dest=ENGINE_FLAGS[flag][0], **kwargs)


def engine_args_from_options(options: dict[str, Any]) -> EngineArgs:
    """``EngineArgs`` from parsed options (argparse destinations are the field names)."""
    values = {field: options[field] for field, _ in ENGINE_FLAGS.values() if field in options}
    return EngineArgs(model=options["model"], **values)


def engine_argv(args: EngineArgs) -> list[str]:
    """Command-line flags that rebuild ``args`` (to start a worker process with them)."""
    argv = [args.model]
    for flag, (field, kwargs) in ENGINE_FLAGS.items():
        value = getattr(args, field)
        if kwargs.get("action") == "store_true":
            argv += [flag] if value else []
        elif kwargs.get("action") is argparse.BooleanOptionalAction:
            argv += [] if value is None else [flag if value else "--no-" + flag[2:]]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv
